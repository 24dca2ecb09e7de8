"""The plain-PyTorch API: prepare a model, build its optimizer, step, merge.

model = prepare_model(model, GaLoreConfig.preset("qgalore_adamw_8bit", rank=128))
optimizer = create_optimizer(model, lr=1e-3, weight_decay=0.01)
for batch in data:
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    after_step(model, optimizer)   # runs a basis refresh when one is due
    optimizer.zero_grad()
model = merge_and_unload(model)    # plain nn.Linear layers, merged weights
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import warnings
import weakref
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from .config import GaLoreConfig
from .engines.capabilities import check_moment_handling
from .engines.collectives import is_dtensor, world_size
from .engines.contract import gathers_parameters, unwrap_optimizer
from .engines.fsdp1 import (
    check_fsdp1_layers,
    fsdp1_units,
    group_by_unit,
    had_gradient,
    register_fsdp1_fragments,
    summon_unit,
)
from .inject import galore_state_per_layer, iter_galore_layers, iter_galore_layers_by_key, replace_targets, unload
from .layers import GaLoreLinear
from .layers.experts import GaLoreExpertStack
from .layers import rank as layer_rank
from .layers.linear import scale_bases
from .layers.schedule import StepClock
from .loss import disable_chunked_loss, enable_chunked_loss
from .ranks import LayerSpectrum, allocate_ranks, budget_values, captured_share
from .state import forget_state, record_state, state_of

_logger = logging.getLogger(__name__)

__all__ = [
    "prepare_model",
    "create_optimizer",
    "galore_param_groups",
    "install_base_decay_hook",
    "after_step",
    "merge_and_unload",
    "merged_state_dict",
    "galore_layers",
    "galore_state_dict",
    "load_galore_state_dict",
    "galore_stats",
    "rank_report",
    "save_rank_report",
]


def prepare_model(model: nn.Module, config: GaLoreConfig) -> nn.Module:
    """Replace the targeted nn.Linear layers of `model` by GaLore layers, in place; returns `model`.

    With ``config.chunked_loss`` the model's training loss is also computed chunk by chunk
    (:func:`hf_galore_plugin.loss.enable_chunked_loss`)."""
    if not isinstance(config, GaLoreConfig):
        raise TypeError(
            f"config must be a hf_galore_plugin.GaLoreConfig, got {type(config).__name__}; "
            "use GaLoreConfig.preset('galore_adamw') or GaLoreConfig(rank=..., ...)"
        )
    existing = state_of(model)
    if existing is not None:
        if existing.config == config:
            return model
        raise ValueError("model was already prepared with a different GaLoreConfig; merge_and_unload(model) first")
    if config.rank_allocation == "auto" and world_size() > 1:
        raise ValueError(
            f"GaLoreConfig.rank_allocation='auto' runs in one process, and this is one of {world_size()} ranks: the "
            "layers' factors change shape when they take their ranks, which DDP's gradient buckets, FSDP's shards "
            "and ZeRO's partitions cannot follow. Use rank_allocation='uniform' (an int rank) here, or allocate "
            "in one process."
        )
    if config.chunked_loss:
        # First: a model the chunked loss cannot serve is refused before any layer is replaced.
        enable_chunked_loss(model, chunk_tokens=config.chunked_loss_tokens)
    try:
        report = replace_targets(model, config)
    except BaseException:
        disable_chunked_loss(model)
        raise
    _start_within_budget(list(iter_galore_layers(model)))
    record_state(model, config, report)
    return model


def _start_within_budget(layers: list[tuple[str, GaLoreLinear]]) -> None:
    """rank_allocation='auto' with a rank_budget: the adaptive layers' uniform ranks (``rank``; ``expert_rank`` for
    expert stacks) scaled by one factor, the largest whose values fit the budget (each rank rounded down, within
    its bounds), so the factors hold no more than the budget before the allocation either. Without expert stacks
    that is the one rank whose values fit."""
    adaptive = [(layer, layer._adaptive) for _, layer in layers if layer._adaptive is not None]
    if not adaptive or adaptive[0][0].config.rank_budget is None:
        return
    budget = rank_budget(layers)
    uniform = sum(state.cost * state.start for _, state in adaptive)
    for layer, state in adaptive:
        state.start = min(max(budget * state.start // uniform, state.low), state.high)
        if state.start != layer_rank.current_rank(layer):
            layer_rank.resize(layer, state.start)


def galore_layers(model: nn.Module) -> list[tuple[str, GaLoreLinear]]:
    return list(iter_galore_layers(model))


def galore_param_groups(
    model: nn.Module, param_groups: Iterable[dict[str, Any]], config: GaLoreConfig, *, eps: float = 1e-8
) -> list[dict[str, Any]]:
    """Split every GaLore factor out of `param_groups` into groups tagged ``"galore": True``.

    The factor's true gradient is ``scale * R`` (R = the projected gradient GaLore's Adam sees), so
    the group's eps is multiplied by its layers' ``scale`` (one group per scale):
    Adam(scale * R, eps * scale) == Adam(R, eps) exactly, and the weight moves by ``lr * scale * update`` as in GaLore. Each GaLore group also records the
    names of its layers (``"galore_layers"``), for engines that replace its parameters by flat
    partitions (DeepSpeed ZeRO).
    """
    layers = {id(layer.galore_factor): (name, layer) for name, layer in iter_galore_layers(model)}
    result = []
    for group in param_groups:
        params = list(group["params"])
        plain = [p for p in params if id(p) not in layers]
        if plain:
            result.append({**group, "params": plain})
        # One group per scale (scale='auto' gives layers of different shapes their own): the eps of a group
        # is the eps of its layers' scale. A layer of rank_allocation='auto' has a group of its own, whose eps
        # follows its scale when it takes its rank (contract.factor_rescaled).
        by_scale: dict[Any, list[torch.nn.Parameter]] = {}
        for p in params:
            if id(p) in layers:
                name, layer = layers[id(p)]
                key = (name, layer.scale) if layer._adaptive is not None else layer.scale
                by_scale.setdefault(key, []).append(p)
        group_eps = group.get("eps", eps)
        for key, lowrank in by_scale.items():
            scale = key[1] if isinstance(key, tuple) else key
            if isinstance(group_eps, (tuple, list)):
                # Adafactor's (eps1, eps2): eps1 is added to the squared gradient, so it scales by scale**2 for
                # Adafactor(scale * R, eps1 * scale**2) == Adafactor(R, eps1); eps2 bounds the parameter's RMS.
                result.append(
                    {
                        **group,
                        "params": lowrank,
                        "eps": (group_eps[0] * scale**2, group_eps[1]),
                        "galore": True,
                        "galore_layers": [layers[id(p)][0] for p in lowrank],
                    }
                )
                continue
            if group_eps > 0 and not group_eps * scale >= sys.float_info.min:
                raise ValueError(
                    f"GaLoreConfig.scale={config.scale!r} is too small: the GaLore groups' Adam eps is eps * scale "
                    f"= {group_eps!r} * {scale!r}, which underflows to {group_eps * scale!r} in float64. Use "
                    "scale='auto' (each layer's norm-matched scale) or a scale around 0.25 (the GaLore paper's; "
                    "weights move at about lr * scale)."
                )
            result.append(
                {
                    **group,
                    "params": lowrank,
                    "eps": group_eps * scale,
                    "galore": True,
                    "galore_layers": [layers[id(p)][0] for p in lowrank],
                }
            )
    return result


def install_base_decay_hook(optimizer: torch.optim.Optimizer, model: nn.Module):
    """Apply each GaLore group's decoupled weight decay to the frozen base through its scalar multiplier.

    AdamW decays the factor itself; the base W0 is not a parameter of the optimizer, so after every step
    ``alpha *= 1 - lr * weight_decay`` with the group's lr of that step (a post-hook runs before any LR
    scheduler step). Together the whole effective weight decays, as GaLore's AdamW does.

    Layers are looked up at every step, not when the hook is installed: FSDP2 replaces parameters
    by DTensors and accelerate swaps them into an optimizer built before wrapping. A layer decays when
    its factor had a gradient this step (as AdamW skips parameters without one; under FSDP1, when the
    factor's unit had one: a rank whose shard holds none of the factor sees no gradient of its own, and
    the multiplier, a replicated buffer, must move on every rank alike). When an engine has
    replaced a group's parameters by its own flat partitions (DeepSpeed ZeRO), every layer recorded
    in the group's ``"galore_layers"`` decays on each step the engine takes (ZeRO steps the whole
    partition, unused factors included; a step it skips on fp16 overflow never reaches this hook;
    ZeRO-3 must keep each GaLore group in one sub-group: its default ``sub_group_size`` of 1e9 does).
    """

    # The step-driver check runs once, in the second training step: the first time a parameter that was
    # stepped before is stepped again. Calls of optimizer.step() are no count of training steps: ZeRO steps
    # its inner optimizer once per parameter group (ZeRO-1/2) or sub-group (ZeRO-3) in every training step,
    # each call with other parameters (its flat fp32 partitions). A group's first parameter stands for the
    # group; the set is dropped once the check has run, so later steps pay nothing for it.
    stepped: Optional[set[int]] = set()

    def hook(opt: torch.optim.Optimizer, args, kwargs) -> None:
        nonlocal stepped
        if stepped is not None:
            firsts = {id(group["params"][0]) for group in opt.param_groups if group["params"]}
            if firsts & stepped:
                stepped = None
                _check_step_driver(model)
            else:
                stepped |= firsts
        layers: Optional[dict[str, GaLoreLinear]] = None
        units: Optional[dict[int, nn.Module]] = None
        for group in opt.param_groups:
            wd = group.get("weight_decay", 0.0)
            # ZeRO-3 steps one sub-group at a time and leaves the other groups' "params" empty meanwhile.
            if not group.get("galore") or not group["params"]:
                continue
            # merge_and_unload records every factor of the model; the group's first one tells
            if _was_unloaded(group["params"][0]):
                raise RuntimeError(_STEP_AFTER_UNLOAD)
            if not wd:
                continue
            if layers is None:
                # The step driver's list when it has one (no walk over the model's modules at every step).
                driver = _DRIVERS.get(model)
                fresh = driver is not None and driver.generation == StepClock.generation
                layers = dict(driver.layers if fresh else iter_galore_layers(model))  # type: ignore[union-attr]
                by_factor = {id(layer.galore_factor): layer for layer in layers.values()}
            factor = 1.0 - float(group["lr"]) * wd
            owned = [(p, by_factor.get(id(p))) for p in group["params"]]
            decayed: list[GaLoreLinear] = []
            if any(layer is not None for _, layer in owned):
                for p, layer in owned:
                    if layer is None:
                        continue
                    if p.grad is None:
                        # Only then can FSDP1 matter (an empty local view of a factor that did take part):
                        # its units are looked up at most once per step, never when every factor has a grad.
                        if units is None:
                            units = fsdp1_units(model)
                        if not had_gradient(p, units):
                            continue
                    decayed.append(layer)
            else:
                for name in group.get("galore_layers", ()):
                    if name not in layers:
                        raise RuntimeError(f"{_STEP_AFTER_UNLOAD} (GaLore layer {name!r} is no longer in the model)")
                    decayed.append(layers[name])
            scale_bases(decayed, factor)

    return optimizer.register_step_post_hook(hook)


def _check_step_driver(model: nn.Module) -> None:
    """Warn when the optimizer has stepped twice and ``after_step`` never ran: without it no layer leaves its
    calibration step (no basis, the factor's update is zero, the effective weight never changes) and
    every layer keeps a dense fp32 gradient."""

    layers = list(iter_galore_layers(model))
    if layers and not any(layer in _DRIVEN for _, layer in layers):
        warnings.warn(
            f"the GaLore optimizer has stepped twice but hf_galore_plugin.after_step(model, optimizer) was never "
            f"called: its {len(layers)} GaLore layers never get a projection basis, so their weights do not "
            "train (and each keeps a dense gradient). Call after_step(model, optimizer) after every "
            "optimizer.step(); with transformers' Trainer pass callbacks=[GaLoreCallback()] (the plugin "
            "attaches it itself for its optim names).",
            RuntimeWarning,
            stacklevel=3,
        )


def _initialise_materialised_layers(model: nn.Module, engine_managed: set[int]) -> None:
    """Layers prepared on the meta device and materialised with ``to_empty()`` hold uninitialised memory
    until something writes it. Their W0 must have been initialised or loaded since (``initialize_base``:
    transformers' ``init_weights()`` or ``reset_parameters()``; ``load_state_dict`` of the weights): a
    layer whose W0 was not is refused, since it would train on whatever the allocator left (NaN losses).
    Their own state (factor, bases, multiplier, counters), unless loaded with them, becomes a new layer's.
    Layers in `engine_managed` (FSDP1 units, whose ``sync_module_states`` broadcasts W0 from rank 0 after
    materialising it) are trusted to hold rank 0's W0."""
    import logging

    reset = []
    for name, layer in iter_galore_layers(model):
        if not getattr(layer, "_built_on_meta", False) or layer.galore_factor.is_meta:
            continue
        if not layer._base_initialised and id(layer) not in engine_managed:
            quantized = (
                f" (weight_storage={layer.config.weight_storage!r}: a quantized W0 is written by init_weights() or "
                "reset_parameters(), or loaded from a galore_state_dict, never from plain weights)"
                if layer.weight is None
                else ""
            )
            raise ValueError(
                f"GaLore layer {name!r} was prepared on the meta device and materialised with to_empty(), but its "
                f"W0 (the base weight) was never initialised or loaded since: it holds uninitialised memory and "
                f"would train NaN{quantized}. After to_empty(), call model.init_weights() (a transformers model, "
                "with hf_galore_plugin's patches: not under HF_GALORE_PLUGIN_NO_PATCH=1), reset_parameters() on "
                "every module, or model.load_state_dict(weights); or call prepare_model on the materialised model."
            )
        layer.reset_galore_state()
        reset.append(name)
    if reset:
        logging.getLogger(__name__).info(
            "%d GaLore layer(s) prepared on the meta device got a new layer's GaLore state (factor, bases, "
            "counters); their W0 is the weight loaded after to_empty()",
            len(reset),
        )


def create_optimizer(
    model: nn.Module,
    config: Optional[GaLoreConfig] = None,
    *,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    param_groups: Optional[list[dict[str, Any]]] = None,
):
    """AdamW (fp32 or 8-bit state per `config`) over every trainable parameter of a prepared model, or
    Adafactor with ``config.inner_optimizer='adafactor'`` (the ``galore_adafactor`` preset: `lr` is its fixed
    step size, relative_step and scale_parameter off as transformers' galore_adafactor passes them; `betas` and
    `eps` are Adam's and are not used, Adafactor's options are the config's ``adafactor_*`` fields), or Muon on
    the factors and AdamW (`betas`, `eps`) on the other parameters with ``config.inner_optimizer='muon'`` (the
    ``galore_muon`` preset: `lr` is an AdamW rate, Muon's step is RMS-matched to AdamW's; its options are the
    config's ``muon_*`` fields).

    `param_groups` (e.g. a decay / no-decay split) replaces the default single group of all
    trainable parameters with ``weight_decay``.
    """
    from .optim import Adafactor, AdamW

    state = state_of(model)
    config = config or (state.config if state is not None else None)
    if config is None:
        raise ValueError("model is not prepared: call prepare_model(model, config) first, or pass config")
    if not galore_layers(model):
        raise ValueError("model has no GaLore layers: call prepare_model(model, config) before create_optimizer")
    # FSDP1 (use_orig_params) and ZeRO-3 keep 1-D slices of the factor; their refreshes gather it
    # (engines.fsdp1, DeepSpeedGaLoreOptimizer). Anything else must hold the 2-D factor.
    fsdp1_managed = check_fsdp1_layers(galore_layers(model), fsdp1_units(model))
    _check_rank_budget(galore_layers(model))
    _initialise_materialised_layers(model, fsdp1_managed)
    if config.inner_optimizer != "adamw" and fsdp1_managed:
        # Muon and Adafactor step FSDP1's 1-D views as fragments of their matrices (engines.fsdp1); under ZeRO,
        # DeepSpeedGaLoreOptimizer registers the fragments of its flat partitions.
        register_fsdp1_fragments(model)
    for name, layer in galore_layers(model):
        if id(layer) not in fsdp1_managed and not hasattr(layer.galore_factor, "ds_id"):
            layer._check_factor_layout()
        if is_dtensor(layer.galore_factor):
            # An expert stack is sharded by expert: each rank holds whole factors (and moments) of its experts,
            # so transporting them needs no other rank's rows, whatever the side of the basis.
            check_moment_handling(
                "fsdp2",
                moment_handling=config.moment_handling,
                left_basis=(layer.left_rank is not None and not layer.left_identity)
                and not isinstance(layer, GaLoreExpertStack),
                layer=name,
            )
    if param_groups is None:
        param_groups = [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": weight_decay}]
    optimizer: torch.optim.Optimizer
    if config.inner_optimizer == "adafactor":
        adafactor_eps = (1e-30, 1e-3)  # Adafactor's (transformers') defaults: eps1 of g^2, eps2 of the RMS
        groups = galore_param_groups(
            model, [{**group, "eps": adafactor_eps} for group in param_groups], config, eps=adafactor_eps[0]
        )
        optimizer = Adafactor(
            groups,
            lr=lr,
            eps=adafactor_eps,
            clip_threshold=config.adafactor_clip_threshold,
            decay_rate=config.adafactor_decay_rate,
            beta1=config.adafactor_beta1,
            weight_decay=weight_decay,
            scale_parameter=False,
            relative_step=False,
        )
    elif config.inner_optimizer == "muon":
        from .optim.muon import Muon

        optimizer = Muon(
            galore_param_groups(model, param_groups, config, eps=eps),
            lr=lr,
            weight_decay=weight_decay,
            momentum=config.muon_momentum,
            nesterov=config.muon_nesterov,
            ns_steps=config.muon_ns_steps,
            betas=betas,
            eps=eps,
        )
    else:
        optimizer = AdamW(
            galore_param_groups(model, param_groups, config, eps=eps),
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            state_bits=config.state_bits,
            block_size=config.state_block_size,
            error_feedback=config.error_feedback,
            state_offload=config.state_offload,
        )
    install_base_decay_hook(optimizer, model)
    return optimizer


# Optimizers whose GaLore groups' lr GaLoreCallback scales (its step hooks): optimizer -> the callback.
LR_SCALED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, Any]" = weakref.WeakKeyDictionary()
# Optimizers already warned that nothing applies lr_scale to them.
_LR_WARNED: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()


def _warn_lr_scale_not_applied(config: GaLoreConfig, optimizer: torch.optim.Optimizer) -> None:
    """Once per optimizer: a non-default ``lr_scale`` / ``lr_recovery_fraction`` is applied by GaLoreCallback
    (a Trainer run) only; outside it the GaLore groups step at the rate they were given."""
    inner = unwrap_optimizer(optimizer)
    if inner in LR_SCALED or inner in _LR_WARNED:
        return
    default = GaLoreConfig.__dataclass_fields__["lr_scale"].default
    if config.lr_scale == default and config.lr_recovery_fraction == 0.0:
        return
    _LR_WARNED.add(inner)
    warnings.warn(
        f"lr_scale={config.lr_scale} and lr_recovery_fraction={config.lr_recovery_fraction} are applied by "
        "GaLoreCallback in a Trainer run; this optimizer steps its GaLore groups at the rate they were given. "
        "Outside a Trainer, set the GaLore groups' lr yourself (param_groups with 'galore': True), or attach "
        "GaLoreCallback to the Trainer that steps this optimizer",
        UserWarning,
        stacklevel=3,
    )


def after_step(
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    root: Optional[nn.Module] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> dict[str, Any]:
    """Call once after every ``optimizer.step()``: counts the step and refreshes bases that are due.

    Under FSDP1 pass the wrapped model (or `model` and its wrapper as `root`): a refresh gathers the
    layers' FSDP units, one at a time. `progress`, if given, is called with each due layer's name once
    that layer is done (a progress bar over a long refresh).
    Returns ``{"refreshed": [layer names], "similarity": mean similarity or None, "ranks_allocated": whether
    this step allocated the ranks of rank_allocation='auto'}``.
    """
    driver = _driver_of(model)
    clock = driver.clock
    if clock.step + 1 < driver.next_due and clock.edits == driver.edits:
        # An ordinary step, followed by another: no layer is due now or at the next step (the earliest due
        # step is known), so nothing but the clock moves and every layer's refresh_due stays False.
        clock.step += 1
        return {"refreshed": [], "similarity": None, "ranks_allocated": False}
    layers = driver.layers
    if layers and optimizer is not None:
        _warn_lr_scale_not_applied(layers[0][1].config, optimizer)
    stepped: dict[str, tuple[bool, Optional[float]]] = {}
    due_layers = [(name, layer) for name, layer in layers if layer.refresh_due]
    if due_layers and not gathers_parameters(optimizer):
        units = fsdp1_units(root if root is not None else model)
        # FSDP1: W0 and the factor are 1-D shards; each unit with refreshing layers is gathered once
        # (a collective: the refresh schedule, a function of the shared counters, is the same on all ranks).
        for unit, members in group_by_unit(due_layers, units) if units else ():
            if unit is not None:
                with summon_unit(unit, writeback=True):
                    for name, layer in members:
                        stepped[name] = (True, layer.after_optimizer_step(optimizer))
                        if progress is not None:
                            progress(name)
    refreshed, similarities = [], []
    for name, layer in layers:
        if name in stepped:
            due, similarity = stepped[name]
        else:
            due = layer.refresh_due
            similarity = layer.after_optimizer_step(optimizer)
            if due and progress is not None:
                progress(name)
        if due and similarity is not None:
            refreshed.append(name)
            if not math.isnan(similarity):
                similarities.append(similarity)
    allocated = False
    if driver.allocating:
        driver.allocating = _allocate_when_measured(layers)
        allocated = not driver.allocating
    clock.step += 1
    recording = False
    for _, layer in layers:
        layer._update_refresh_due()  # for the new step, here rather than in the (possibly compiled) forward
        recording = recording or bool(layer._refresh_due_cache)
    for _, layer in layers:
        # One value for the whole model: a compiled forward guards on it (two graphs, whatever the phases).
        layer.compiled_record = recording
    driver.schedule()
    return {
        "refreshed": refreshed,
        "similarity": sum(similarities) / len(similarities) if similarities else None,
        "ranks_allocated": allocated,
    }


def refreshes_due(model: nn.Module) -> int:
    """How many GaLore layers of `model` refresh at the coming :func:`after_step` (no per-layer work on an
    ordinary step)."""
    driver = _driver_of(model)
    if driver.clock.step < driver.next_due and driver.clock.edits == driver.edits:
        return 0
    return sum(1 for _, layer in driver.layers if layer.refresh_due)


class _Driver:
    """What :func:`after_step` keeps of a model between steps: its GaLore layers, the clock they share, and
    the clock step at which the next of them is due."""

    __slots__ = ("allocating", "clock", "edits", "generation", "layers", "next_due", "__weakref__")

    def __init__(self, layers: list[tuple[str, GaLoreLinear]]) -> None:
        self.layers = layers
        # rank_allocation='auto' and the ranks not allocated yet: after_step allocates once every layer measured
        adaptive = [layer._adaptive for _, layer in layers if layer._adaptive is not None]
        self.allocating = bool(adaptive) and not any(state.target for state in adaptive)
        self.generation = StepClock.generation
        self.clock = StepClock(shared=True)
        for _, layer in layers:
            layer.use_clock(self.clock)
            _DRIVEN.add(layer)
        self.schedule()

    def schedule(self) -> None:
        """The clock step at which the first layer is due (far away when none ever is), as of now."""
        clock = self.clock
        soonest = 1 << 62
        for _, layer in self.layers:
            due = layer.next_refresh_step()
            if due is not None:
                soonest = min(soonest, clock.step + due - layer.counter("galore_step"))
        self.next_due, self.edits = soonest, clock.edits


def _spectra(layers: list[tuple[str, GaLoreLinear]]) -> dict[str, LayerSpectrum]:
    """The spectrum (:class:`LayerSpectrum`) of every measured adaptive layer of `layers`, their buffers read in
    one transfer (one host sync, not two a layer)."""
    measured = [(name, layer) for name, layer in layers if layer._adaptive is not None and layer._adaptive.measured]
    if not measured:
        return {}
    device = measured[0][1].galore_spectrum.device
    parts = [torch.cat((layer.galore_spectrum, layer.galore_spectrum_total.reshape(1))) for _, layer in measured]
    flat = torch.cat([part.to(device) for part in parts]).tolist()
    spectra: dict[str, LayerSpectrum] = {}
    start = 0
    for name, layer in measured:
        state = layer._adaptive
        assert state is not None
        stop = start + layer.galore_spectrum.numel()
        spectra[name] = LayerSpectrum(flat[start:stop], flat[stop], state.cost, state.low, state.high)
        start = stop + 1
    return spectra


def rank_budget(layers: list[tuple[str, GaLoreLinear]]) -> int:
    """The factor values `layers` (the adaptive ones of a model) may hold together: GaLoreConfig.rank_budget, or
    the values of `rank` in every one of them."""
    adaptive = [(layer, layer._adaptive) for _, layer in layers if layer._adaptive is not None]
    if not adaptive:
        return 0
    config = adaptive[0][0].config
    if config.rank_budget is None:
        return sum(state.cost * state.start for _, state in adaptive)
    return budget_values(config.rank_budget, element_size=adaptive[0][0].galore_factor.element_size())


def _check_rank_budget(layers: list[tuple[str, GaLoreLinear]]) -> None:
    """Refuse, before training, a rank budget below what the adaptive layers' minimum ranks hold."""
    states = [layer._adaptive for _, layer in layers if layer._adaptive is not None]
    needed = sum(state.cost * state.low for state in states)
    if states and rank_budget(layers) < needed:
        raise ValueError(
            f"GaLoreConfig.rank_budget: {rank_budget(layers)} factor values is below the {needed} values every "
            f"layer's minimum rank needs (rank_min={layers[0][1].config.effective_rank_bounds[0]}); raise rank_budget "
            "or lower rank_min"
        )


def _allocate_when_measured(layers: list[tuple[str, GaLoreLinear]]) -> bool:
    """Allocate the adaptive layers' ranks once each has measured its spectrum (one sync: the spectra are read);
    returns whether the allocation is still to come."""
    adaptive = [(name, layer) for name, layer in layers if layer._adaptive is not None]
    if not all(layer._adaptive.measured for _, layer in adaptive):  # type: ignore[union-attr]
        return True
    if any(layer.galore_spectrum.is_meta or is_fake(layer.galore_spectrum) for _, layer in adaptive):
        return True  # a traced step (the memory planner): no values to allocate from
    spectra = _spectra(adaptive)
    budget = rank_budget(layers)
    ranks = allocate_ranks(spectra, budget)
    for name, layer in adaptive:
        layer_rank.set_target(layer, ranks[name])
    report = _rank_rows(layers, spectra)
    values = sorted(ranks.values())
    uniform = sum(row["share_at_start"] for row in report) / len(report)
    chosen = sum(row["share"] for row in report) / len(report)
    spent = sum(row["factor_values"] for row in report)
    _logger.warning(
        f"GaLore rank_allocation='auto': ranks of {len(ranks)} layers from their calibration gradients, "
        f"{values[0]}..{values[-1]} (median {values[len(values) // 2]}), {spent} of {budget} factor values; "
        f"mean share of gradient energy captured {chosen:.3f} (at the starting ranks {uniform:.3f}). Each layer "
        "takes its rank at its next refresh; save_rank_report(model, folder) writes the table and a plot."
    )
    return False


def rank_report(model_or_layers: Any) -> list[dict[str, Any]]:
    """Per adaptive layer (rank_allocation='auto'): its name, starting, current and allocated rank, bounds, the
    share of its calibration gradient's energy the allocated and the starting ranks capture, and the factor
    values and bytes of the allocated rank. Empty before the spectra are measured (and without 'auto')."""
    layers = model_or_layers if isinstance(model_or_layers, list) else list(iter_galore_layers(model_or_layers))
    return _rank_rows(layers, _spectra(layers))


def _rank_rows(layers: list[tuple[str, GaLoreLinear]], spectra: dict[str, LayerSpectrum]) -> list[dict[str, Any]]:
    """:func:`rank_report`'s rows from the measured layers' `spectra` (:func:`_spectra`)."""
    rows = []
    for index, (name, layer) in enumerate(layers):
        state = layer._adaptive
        if state is None or not state.measured:
            continue
        spectrum = spectra[name]
        rank = state.target or layer_rank.current_rank(layer)
        rows.append(
            {
                "layer": name,
                "index": index,
                "shape": [*layer.stack_shape, layer.out_features, layer.in_features],  # an expert stack: E first
                "start_rank": state.start,
                "rank": rank,
                "current_rank": layer_rank.current_rank(layer),
                "min_rank": state.low,
                "max_rank": state.high,
                "share": captured_share(spectrum, rank),
                "share_at_start": captured_share(spectrum, min(state.start, state.high)),
                "factor_values": state.cost * rank,
                "factor_bytes": state.cost * rank * layer.galore_factor.element_size(),
            }
        )
    return rows


def save_rank_report(model: nn.Module, folder: str) -> Optional[str]:
    """Write :func:`rank_report` to ``folder/galore_ranks.json`` and, where matplotlib is installed, a plot of the
    rank per layer by depth to ``galore_ranks.png``. Returns the JSON path (None: no ranks allocated yet)."""
    rows = rank_report(model)
    if not rows:
        return None
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "galore_ranks.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(rows, f, indent=1)
    os.replace(tmp, path)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return path
    fig, ax = plt.subplots(figsize=(9, 3.5))
    kinds = sorted({row["layer"].rsplit(".", 1)[-1] for row in rows})
    for kind in kinds:
        mine = [row for row in rows if row["layer"].rsplit(".", 1)[-1] == kind]
        ax.plot([row["index"] for row in mine], [row["rank"] for row in mine], marker="o", ms=3, label=kind)
    ax.axhline(rows[0]["start_rank"], color="grey", lw=0.8, ls="--", label="uniform rank")
    ax.set_xlabel("GaLore layer (by depth)")
    ax.set_ylabel("rank")
    ax.set_title("rank_allocation='auto': rank per layer")
    ax.legend(fontsize=7, ncol=min(len(kinds) + 1, 4))
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "galore_ranks.png"), dpi=110)
    plt.close(fig)
    return path


# model -> its _Driver; weak, so a dropped model takes its entry with it. Rebuilt when a GaLore layer was
# built or a module swapped anywhere since (StepClock.generation), or when a layer of the cached list has
# left the shared clock (a layer moved between models).
_DRIVERS: "weakref.WeakKeyDictionary[nn.Module, _Driver]" = weakref.WeakKeyDictionary()


def _driver_of(model: nn.Module) -> _Driver:
    driver = _DRIVERS.get(model)
    if (
        driver is None
        or driver.generation != StepClock.generation
        or any(layer._clock is not driver.clock for _, layer in driver.layers[:1])
    ):
        driver = _DRIVERS[model] = _Driver(list(iter_galore_layers(model)))
    return driver


# Layers an after_step driver has stepped (the check that after_step runs at all).
_DRIVEN: "weakref.WeakSet[GaLoreLinear]" = weakref.WeakSet()
# The factors of layers merge_and_unload folded, by id (a tensor is no key of a weak dict: its == is
# elementwise), each with a weak reference that removes its entry when the factor is freed.
_UNLOADED: dict[int, "weakref.ref[torch.Tensor]"] = {}


def _record_unloaded(factor: torch.Tensor) -> None:
    key = id(factor)

    def forget(_: object) -> None:
        _UNLOADED.pop(key, None)

    _UNLOADED[key] = weakref.ref(factor, forget)


def _was_unloaded(param: torch.Tensor) -> bool:
    ref = _UNLOADED.get(id(param))
    return ref is not None and ref() is param


_STEP_AFTER_UNLOAD = (
    "optimizer.step() after merge_and_unload(model): the GaLore layers were folded into plain nn.Linear layers "
    "and this optimizer still holds their old factors, which the model no longer uses (the step would change "
    "nothing). Call merge_and_unload after the last step, or build a new optimizer over the merged model's "
    "parameters (e.g. torch.optim.AdamW(model.parameters()))"
)


def merge_and_unload(model: nn.Module) -> nn.Module:
    """Fold every GaLore layer back into a plain nn.Linear with the merged weight; returns `model`.

    An optimizer built for the GaLore layers refuses to step afterwards (its factors are gone)."""
    for _, layer in iter_galore_layers(model):
        _record_unloaded(layer.galore_factor)
    unload(model)
    state = forget_state(model)
    if state is not None and state.config.chunked_loss:
        disable_chunked_loss(model)
    return model


@torch.no_grad()
def merged_state_dict(
    model: nn.Module, state_dict: Optional[dict[str, torch.Tensor]] = None
) -> dict[str, torch.Tensor]:
    """The state dict the merged model would have (plain nn.Linear keys), without changing `model`."""
    state_dict = dict(model.state_dict() if state_dict is None else state_dict)
    for name, layer in iter_galore_layers_by_key(model):
        prefix = f"{name}." if name else ""
        for key in layer.state_dict(keep_vars=True):
            state_dict.pop(prefix + key, None)
        state_dict[layer.merged_weight_key(name)] = layer.effective_weight(layer.weight_dtype)
        if layer.bias is not None:
            state_dict[prefix + "bias"] = layer.bias.detach()
    return state_dict


def galore_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of every GaLore layer (W0 incl. quantized parts, factor, bases, counters), detached."""
    state = {}
    for name, layer in iter_galore_layers_by_key(model):
        for key, value in layer.state_dict().items():
            state[f"{name}.{key}"] = value.detach().clone()
    return state


def load_galore_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Restore what :func:`galore_state_dict` saved, exactly (strict: every layer, every key)."""
    layers = {id(layer): name for name, layer in iter_galore_layers_by_key(model)}
    for layer, layer_state in galore_state_per_layer(model, state):
        with torch.no_grad():
            try:
                layer.load_state_dict(layer_state, strict=True)
            except RuntimeError as exc:
                raise RuntimeError(layer_state_mismatch(layers[id(layer)], layer, layer_state, exc)) from None


def layer_state_mismatch(name: str, layer: GaLoreLinear, layer_state: dict[str, torch.Tensor], exc: Exception) -> str:
    """What a failed strict load of one GaLore layer means, in the user's terms (not size lists)."""
    own = layer.state_dict()
    shapes = [
        f"{key}: saved {tuple(layer_state[key].shape)}, this layer {tuple(own[key].shape)}"
        for key in own
        if key in layer_state and layer_state[key].shape != own[key].shape
    ]
    missing = sorted(set(own) - set(layer_state))
    extra = sorted(set(layer_state) - set(own))
    details = "; ".join(
        shapes[:3] + ([f"missing {missing}"] if missing else []) + ([f"unexpected {extra}"] if extra else [])
    )
    return (
        f"GaLore state of layer {name!r} does not fit the layer ({details or str(exc).splitlines()[0]}): it was "
        f"saved with other GaLore settings (rank, proj_type, weight_storage or basis_storage; this layer has "
        f"{layer.extra_repr()}). Prepare the model with the settings the state was saved with."
    )


def galore_stats(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, float]:
    """Numbers worth logging: refreshes, subspace similarity, gaps, state bytes, quantization error."""
    layers = galore_layers(model)
    if not layers:
        return {}
    similarities = [float(l.get_buffer("galore_last_similarity")) for _, l in layers]
    similarities = [s for s in similarities if not math.isnan(s)]
    gaps = [l.counter("galore_gap") for _, l in layers]
    stats: dict[str, float] = {
        "galore/layers": float(len(layers)),
        "galore/refreshes": float(sum(l.counter("galore_num_refreshes") for _, l in layers)),
        "galore/gap_mean": sum(gaps) / len(gaps),
        "galore/gap_max": float(max(gaps)),
    }
    if similarities:
        stats["galore/similarity"] = sum(similarities) / len(similarities)
    nbytes: dict[str, int] = {}
    for _, layer in layers:
        for role, n in layer.state_nbytes().items():
            nbytes[role] = nbytes.get(role, 0) + n
    for role, n in nbytes.items():
        stats[f"galore/bytes_{role}"] = float(n)
    if optimizer is not None and hasattr(optimizer, "state_nbytes"):
        stats["galore/bytes_optimizer_state"] = float(optimizer.state_nbytes())
    errors: dict[str, list[float]] = {}
    for _, layer in layers:
        for role, error in layer.quantization_error().items():
            errors.setdefault(role, []).append(error)
    for role, values in errors.items():
        stats[f"galore/{role}_quant_error"] = sum(values) / len(values)
    return stats

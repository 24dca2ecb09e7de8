"""The plain-PyTorch API: prepare a model, build its optimizer, step, merge.

model = prepare_model(model, GaLoreConfig.preset("qgalore_adamw_8bit", rank=128))
optimizer = create_optimizer(model, model.galore_config, lr=1e-3, weight_decay=0.01)
for batch in data:
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    after_step(model, optimizer)   # runs a basis refresh when one is due
    optimizer.zero_grad()
model = merge_and_unload(model)    # plain nn.Linear layers, merged weights
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from .config import GaLoreConfig, kept_on_resume
from .engines.capabilities import check_moment_handling
from .engines.collectives import is_dtensor
from .engines.contract import gathers_parameters
from .engines.fsdp1 import check_fsdp1_layers, fsdp1_units, group_by_unit, had_gradient, summon_unit
from .inject import galore_state_per_layer, iter_galore_layers, iter_galore_layers_by_key, replace_targets, unload
from .layers import GaLoreLinear, assign_refresh_phases

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
    "GaLoreCheckpointError",
    "save_galore_checkpoint",
    "read_galore_checkpoint",
    "compare_galore_config",
]


def prepare_model(model: nn.Module, config: GaLoreConfig) -> nn.Module:
    """Replace the targeted nn.Linear layers of `model` by GaLore layers, in place; returns `model`."""
    if not isinstance(config, GaLoreConfig):
        raise TypeError(
            f"config must be a hf_galore_plugin.GaLoreConfig, got {type(config).__name__}; "
            "use GaLoreConfig.preset('galore_adamw') or GaLoreConfig(rank=..., ...)"
        )
    existing = getattr(model, "galore_config", None)
    if existing is not None:
        if existing == config:
            return model
        raise ValueError("model was already prepared with a different GaLoreConfig; merge_and_unload(model) first")
    report = replace_targets(model, config)
    model.galore_config = config
    model.galore_report = report
    return model


def galore_layers(model: nn.Module) -> list[tuple[str, GaLoreLinear]]:
    return list(iter_galore_layers(model))


def galore_param_groups(
    model: nn.Module, param_groups: Iterable[dict[str, Any]], config: GaLoreConfig, *, eps: float = 1e-8
) -> list[dict[str, Any]]:
    """Split every GaLore factor out of `param_groups` into groups tagged ``"galore": True``.

    The factor's true gradient is ``scale * R`` (R = the projected gradient GaLore's Adam sees), so
    the group's eps is multiplied by ``scale``: Adam(scale * R, eps * scale) == Adam(R, eps) exactly,
    and the weight moves by ``lr * scale * update`` as in GaLore. Each GaLore group also records the
    names of its layers (``"galore_layers"``), for engines that replace its parameters by flat
    partitions (DeepSpeed ZeRO).
    """
    owners = {id(layer.galore_factor): name for name, layer in iter_galore_layers(model)}
    result = []
    for group in param_groups:
        params = list(group["params"])
        plain = [p for p in params if id(p) not in owners]
        lowrank = [p for p in params if id(p) in owners]
        if plain:
            result.append({**group, "params": plain})
        if lowrank:
            result.append(
                {
                    **group,
                    "params": lowrank,
                    "eps": group.get("eps", eps) * config.scale,
                    "galore": True,
                    "galore_layers": [owners[id(p)] for p in lowrank],
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

    steps = [0]

    def hook(opt: torch.optim.Optimizer, args, kwargs) -> None:
        steps[0] += 1
        if steps[0] == 2:
            _check_step_driver(model)
        layers: Optional[dict[str, GaLoreLinear]] = None
        units: Optional[dict[int, nn.Module]] = None
        for group in opt.param_groups:
            wd = group.get("weight_decay", 0.0)
            # ZeRO-3 steps one sub-group at a time and leaves the other groups' "params" empty meanwhile.
            if not group.get("galore") or not group["params"]:
                continue
            # merge_and_unload marks every factor of the model; the group's first one tells
            if getattr(group["params"][0], "_galore_unloaded", False):
                raise RuntimeError(_STEP_AFTER_UNLOAD)
            if not wd:
                continue
            if layers is None:
                layers = dict(iter_galore_layers(model))
                by_factor = {id(layer.galore_factor): layer for layer in layers.values()}
            factor = 1.0 - float(group["lr"]) * wd
            owned = [(p, by_factor.get(id(p))) for p in group["params"]]
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
                    layer.base_multiplier.mul_(factor)
            else:
                for name in group.get("galore_layers", ()):
                    if name not in layers:
                        raise RuntimeError(f"{_STEP_AFTER_UNLOAD} (GaLore layer {name!r} is no longer in the model)")
                    layers[name].base_multiplier.mul_(factor)

    return optimizer.register_step_post_hook(hook)


def _check_step_driver(model: nn.Module) -> None:
    """Warn when the optimizer has stepped twice and ``after_step`` never ran: without it no layer leaves its
    calibration step (no basis, the factor's update is zero, the effective weight never changes) and
    every layer keeps a dense fp32 gradient."""

    layers = list(iter_galore_layers(model))
    if layers and not any(getattr(layer, "_galore_driven", False) for _, layer in layers):
        warnings.warn(
            f"the GaLore optimizer has stepped twice but hf_galore_plugin.after_step(model, optimizer) was never "
            f"called: its {len(layers)} GaLore layers never get a projection basis, so their weights do not "
            "train (and each keeps a dense gradient). Call after_step(model, optimizer) after every "
            "optimizer.step(); with transformers' Trainer pass callbacks=[GaLoreCallback()] (the plugin "
            "attaches it itself for its optim names).",
            RuntimeWarning,
            stacklevel=3,
        )


def _initialise_materialised_layers(model: nn.Module) -> None:
    """Layers prepared on the meta device and materialised with ``to_empty()`` hold uninitialised memory in
    their own state (factor, bases, multiplier, counters) unless it was loaded or reset since: give them
    a new layer's state. W0 must have been loaded: a quantized W0 cannot be (it is built from the weight
    when the layer is prepared), so that case is refused."""
    import logging

    reset = []
    for name, layer in iter_galore_layers(model):
        if not getattr(layer, "_built_on_meta", False) or layer.galore_factor.is_meta:
            continue
        if layer.weight is None:
            raise ValueError(
                f"GaLore layer {name!r} was prepared on the meta device with weight_storage="
                f"{layer.config.weight_storage!r} and then materialised: its quantized W0 holds uninitialised "
                "memory and cannot be loaded from plain weights. Load the weights first and call prepare_model "
                "on the materialised model, or load a galore_state_dict saved from a prepared model."
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
    """AdamW (fp32 or 8-bit state per `config`) over every trainable parameter of a prepared model.

    `param_groups` (e.g. a decay / no-decay split) replaces the default single group of all
    trainable parameters with ``weight_decay``.
    """
    from .optim import AdamW

    config = config or getattr(model, "galore_config", None)
    if config is None:
        raise ValueError("model is not prepared: call prepare_model(model, config) first, or pass config")
    if not galore_layers(model):
        raise ValueError("model has no GaLore layers: call prepare_model(model, config) before create_optimizer")
    # FSDP1 (use_orig_params) and ZeRO-3 keep 1-D slices of the factor; their refreshes gather it
    # (engines.fsdp1, DeepSpeedGaLoreOptimizer). Anything else must hold the 2-D factor.
    _initialise_materialised_layers(model)
    fsdp1_managed = check_fsdp1_layers(galore_layers(model), fsdp1_units(model))
    for name, layer in galore_layers(model):
        if id(layer) not in fsdp1_managed and not hasattr(layer.galore_factor, "ds_id"):
            layer._check_factor_layout()
        if is_dtensor(layer.galore_factor):
            check_moment_handling(
                "fsdp2",
                moment_handling=config.moment_handling,
                left_basis=layer.left_rank is not None and not layer.left_identity,
                layer=name,
            )
    if param_groups is None:
        param_groups = [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": weight_decay}]
    groups = galore_param_groups(model, param_groups, config, eps=eps)
    optimizer = AdamW(
        groups,
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


def _warn_lr_scale_not_applied(config: GaLoreConfig, optimizer: torch.optim.Optimizer) -> None:
    """Once per optimizer: a non-default ``lr_scale`` / ``lr_recovery_fraction`` is applied by GaLoreCallback
    (a Trainer run) only; outside it the GaLore groups step at the rate they were given."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the optimizer
    if getattr(inner, "_galore_lr_hooks_installed", None) is not None or getattr(inner, "_galore_lr_warned", False):
        return
    default = GaLoreConfig.__dataclass_fields__["lr_scale"].default
    if config.lr_scale == default and config.lr_recovery_fraction == 0.0:
        return
    inner._galore_lr_warned = True
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
    Returns ``{"refreshed": [layer names], "similarity": mean similarity or None}``.
    """
    layers = list(iter_galore_layers(model))
    for _, layer in layers:
        layer._galore_driven = True
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
    return {
        "refreshed": refreshed,
        "similarity": sum(similarities) / len(similarities) if similarities else None,
    }


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
        layer.galore_factor._galore_unloaded = True
    unload(model)
    for attr in ("galore_config", "galore_report"):
        if hasattr(model, attr):
            delattr(model, attr)
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
        state_dict[prefix + "weight"] = layer.effective_weight(layer.weight_dtype)
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
    similarities = [float(l.galore_last_similarity) for _, l in layers]
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


# ---------------------------------------------------------------------- checkpoint files
# galore_state.pt is a dict of plain values and tensors (loads with weights_only=True):
#   {"format": GALORE_STATE_FORMAT, "global_step": int | None, "optimizer": str | None,
#    "config": GaLoreConfig.to_dict(), "state": galore_state_dict(model)}
# The step and the config bind the file to its checkpoint; the merged weights of the checkpoint's own
# model file are compared with the ones this state gives when the Trainer loads both.
GALORE_STATE_FORMAT = "hf_galore_plugin.galore_state.v2"

# Fields the saved tensors depend on: the factor's shape (rank, proj_type), the meaning of the factor
# (scale), the layout of W0, of the bases and of the optimizer state, the set of layers. A resume
# with another value would change the model or fail deep inside load_state_dict: refused.
FIXED_FIELDS = (
    "rank",
    "scale",
    "proj_type",
    "weight_storage",
    "weight_group_size",
    "basis_storage",
    "basis_group_size",
    "state_bits",
    "state_block_size",
    "error_feedback",
    "target_modules",
    "exclude_modules",
)
# Fields that only steer what happens from now on (refresh schedule, learning-rate scale, how the next
# basis is computed): a resume takes the new value and logs it.
MUTABLE_FIELDS = tuple(name for name in GaLoreConfig.field_names() if name not in FIXED_FIELDS)
# The settings the staggered phases are packed from (assign_refresh_phases: the schedule, the budget, the
# record sizes, which basis_method decides, and the number of phases, at most update_proj_gap): a resume
# that changes one repacks them.
REPACKED_ON_RESUME = frozenset({"refresh_schedule", "refresh_budget_mb", "basis_method", "update_proj_gap"})


class GaLoreCheckpointError(ValueError):
    """A ``galore_state.pt`` that cannot be used for this resume: unreadable, from another step or model,
    or saved with settings this run cannot take over exactly."""


def _normalized(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def compare_galore_config(saved: dict[str, Any], current: GaLoreConfig, *, where: str) -> dict[str, tuple[Any, Any]]:
    """Check a saved config against the current one, field by field.

    A difference in a :data:`FIXED_FIELDS` field raises :class:`GaLoreCheckpointError` naming the field,
    both values and `where`; returns {field: (saved, current)} for the :data:`MUTABLE_FIELDS` that changed.
    """
    now = current.to_dict()
    fixed = [
        (name, saved[name], now[name])
        for name in FIXED_FIELDS
        if name in saved and _normalized(saved[name]) != _normalized(now[name])
    ]
    if fixed:
        listed = "; ".join(f"{name}: saved {old!r}, now {new!r}" for name, old, new in fixed)
        raise GaLoreCheckpointError(
            f"{where} was saved with other GaLore settings that its tensors depend on ({listed}). Resume with "
            "the saved values (optim_args / GaLoreConfig), or start a new run from the merged model "
            "(from_pretrained of the checkpoint folder) to use the new ones."
        )
    return {
        name: (saved[name], now[name])
        for name in MUTABLE_FIELDS
        if name in saved and _normalized(saved[name]) != _normalized(now[name])
    }


def apply_mutable_changes(model: nn.Module, changed: dict[str, tuple[Any, Any]], *, where: str) -> None:
    """Make changed schedule settings take effect on loaded layers (their counters hold the saved ones).

    Settings that only a changed default moved (:func:`~hf_galore_plugin.config.kept_on_resume`) keep the
    checkpoint's value instead, so a run started before the default changed continues as it started.
    """
    import logging

    log = logging.getLogger(__name__)
    layers = [layer for _, layer in iter_galore_layers(model)]
    if not changed or not layers:
        return
    config = layers[0].config  # one object, shared by the layers, the model and GaLoreCallback
    kept = kept_on_resume(changed, config)
    if kept:
        for name, value in kept.items():
            setattr(config, name, value)
        log.warning(
            "%s was written with %s, the defaults before the bounded refresh: this run keeps them and continues "
            "as it started (runs started now use %s)",
            where,
            ", ".join(f"{name}={value!r}" for name, value in kept.items()),
            ", ".join(f"{name}={changed[name][1]!r}" for name in kept),
        )
        changed = {name: pair for name, pair in changed.items() if name not in kept}
    if "update_proj_gap" in changed or "max_proj_gap" in changed:
        for layer in layers:
            # a lazily grown gap restarts from the new base gap (its growth was measured with the old one)
            layer._set_counter("galore_gap", config.update_proj_gap)
            layer._set_counter("galore_agree_count", 0)
    if config.refresh_schedule == "staggered" and changed.keys() & REPACKED_ON_RESUME:
        # The phases are checkpoint state, packed for the saved settings (all 0 when it was aligned):
        # repacked, so that the new schedule, budget, record size or gap takes effect. A calibrated layer
        # then refreshes at its new phase once its gap has passed.
        assign_refresh_phases(layers)
    for layer in layers:
        layer._update_refresh_due()
    if changed:
        log.warning(
            "%s: GaLore settings changed since the checkpoint and take effect from now on: %s",
            where,
            "; ".join(f"{name} {old!r} -> {new!r}" for name, (old, new) in changed.items()),
        )


def save_galore_checkpoint(
    path: str,
    state: dict[str, torch.Tensor],
    config: GaLoreConfig,
    *,
    global_step: Optional[int] = None,
    optimizer_name: Optional[str] = None,
) -> None:
    """Write ``galore_state.pt`` atomically: a temporary file in the same folder, fsync, rename, fsync
    of the folder. A reader sees the previous file or the complete new one, never a partial one."""
    import os

    payload = {
        "format": GALORE_STATE_FORMAT,
        "global_step": None if global_step is None else int(global_step),
        "optimizer": optimizer_name,
        "config": config.to_dict(),
        "state": state,
    }
    folder = os.path.dirname(os.path.abspath(path))
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_folder(folder)


def fsync_path(path: str) -> None:
    """Flush a file, or a folder's entries (renames, new files), to disk; a no-op where the path cannot
    be opened or the file system does not sync it."""
    import os

    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_folder(folder: str) -> None:
    """Make renames and new files in `folder` durable (no-op where folders cannot be opened)."""
    fsync_path(folder)


def read_galore_checkpoint(path: str, *, checkpoint: Optional[str] = None) -> dict[str, Any]:
    """Read ``galore_state.pt``; returns the dict :func:`save_galore_checkpoint` wrote.

    A file written before the format carried its step and config is returned with those set to None.
    An unreadable file raises :class:`GaLoreCheckpointError` naming the file and its checkpoint.
    """
    import os

    where = f"checkpoint {checkpoint}" if checkpoint else f"file {path}"
    try:
        size = os.path.getsize(path)
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as exc:  # noqa: BLE001 - every reader failure means the same to the user
        # The loader's own text may recommend weights_only=False (running arbitrary pickled code):
        # never pass that on. Its first line without that advice is enough to tell the cause.
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "weights_only" in cause:
            cause = "it does not hold plain tensors and values (GaLore's own format)"
        raise GaLoreCheckpointError(
            f"GaLore state {path} ({size if 'size' in locals() else '?'} bytes) of {where} cannot be read: "
            f"{type(exc).__name__}: {cause[:300]}. The file is truncated or damaged (a crash while it was "
            "written by a version without atomic saves, a copy that did not finish, a full disk). Resume "
            "from an earlier complete checkpoint of this run, or restore this file."
        ) from None
    if isinstance(loaded, dict) and loaded.get("format") == GALORE_STATE_FORMAT:
        return loaded
    if isinstance(loaded, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()):
        return {"format": None, "global_step": None, "optimizer": None, "config": None, "state": loaded}
    raise GaLoreCheckpointError(
        f"GaLore state {path} of {where} is not a galore_state.pt written by hf_galore_plugin "
        f"(found a {type(loaded).__name__} with keys {sorted(loaded)[:5] if isinstance(loaded, dict) else '-'})."
    )

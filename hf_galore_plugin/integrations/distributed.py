"""Engine-specific glue for GaLore layers under DeepSpeed ZeRO (FSDP2 and DDP need none).

A refresh folds the factor B into W0 and restarts B at zero. ZeRO keeps its own fp32 master
partition of every trainable parameter and copies it back into the model after each step, so a
zeroed B in the model alone would be overwritten by the stale master (the fold would then count
B twice). :class:`DeepSpeedGaLoreOptimizer` is what the layers talk to instead of the bare
optimizer: it writes the folded factor into the master copy and resets optimizer state on ZeRO's
flat partitions.

    engine, *_ = deepspeed.initialize(model=model, optimizer=create_optimizer(model, lr=...), config=...)
    galore_optimizer = DeepSpeedGaLoreOptimizer(engine)
    ...
    engine.backward(loss); engine.step()
    if <gradient-accumulation boundary>:
        after_step(model, galore_optimizer)

ZeRO-3 partitions every parameter, W0 and the factor included (``from_pretrained`` under a stage-3
config already does, through ``zero.Init``). :func:`prepare_zero3_model` replaces such a model's
layers one at a time; :func:`gathered_galore_state_dict` and :func:`load_gathered_galore_state_dict`
save and restore the layers' exact state (``galore_state.pt``) with whole tensors;
:func:`merged_state_dict_from` merges a state dict that an engine gathered (what ``Trainer.save_model``
gets from ``_zero3_consolidated_16bit_state_dict``). Without ZeRO-3 they are the plain versions.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

import hf_galore_plugin as hgp

from ..api import _galore_state_per_layer
from ..config import GaLoreConfig
from ..inject import iter_galore_layers, iter_galore_layers_by_key, select_targets
from ..layers import GaLoreLinear, assign_refresh_phases
from .fsdp1 import fsdp1_units, group_by_unit, summon_unit

__all__ = [
    "DeepSpeedGaLoreOptimizer",
    "is_zero3_partitioned",
    "zero3_gathered",
    "prepare_zero3_model",
    "gathered_galore_state_dict",
    "load_gathered_galore_state_dict",
    "merged_state_dict_from",
]


def is_zero3_partitioned(module: nn.Module) -> bool:
    """True when DeepSpeed ZeRO-3 manages `module`'s parameters (``ds_id`` is set by zero.Init / the engine)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def zero3_gathered(params: Iterable[torch.Tensor], *, modifier_rank: Optional[int] = None):
    """Context in which the ZeRO-3 parameters among `params` are whole (a collective: every rank enters).

    With ``modifier_rank=0`` rank 0's values are partitioned again on exit (changes of the other
    ranks are dropped); with None every change is dropped. A no-op for parameters ZeRO-3 does not own.
    """
    partitioned = [p for p in params if p is not None and hasattr(p, "ds_id")]
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=modifier_rank)


def prepare_zero3_model(model: nn.Module, config: GaLoreConfig, ds_config: Any) -> nn.Module:
    """``prepare_model`` for a model whose parameters ZeRO-3 has partitioned (``from_pretrained`` under a
    stage-3 DeepSpeed config), one layer at a time.

    Each targeted ``nn.Linear`` is gathered (the whole weight, on every rank), its GaLore layer is built
    from it, and the new layer's parameters are partitioned at once with ``zero.Init(module=...)`` and
    `ds_config` (the config the model was loaded under), so no rank ever holds more than one whole layer.
    """
    import deepspeed

    if getattr(model, "galore_config", None) is not None:
        return hgp.prepare_model(model, config)  # already prepared: the core checks the config
    selected, report = select_targets(model, config)
    layers = []
    for index, (name, linear) in enumerate(selected):
        with zero3_gathered(linear.parameters()):
            layer = GaLoreLinear(linear, config, layer_index=index)
            if layer.weight is not None:
                # W0 is a view of the gathered buffer, which DeepSpeed frees on exit: keep a copy.
                layer.weight.data = layer.weight.data.clone()
        deepspeed.zero.Init(module=layer, config_dict_or_path=ds_config)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
        layers.append(layer)
    assign_refresh_phases(layers)
    model.galore_config = config
    model.galore_report = report
    return model


def gathered_galore_state_dict(model: nn.Module, *, root: Optional[nn.Module] = None) -> dict[str, torch.Tensor]:
    """:func:`hf_galore_plugin.galore_state_dict` as whole CPU tensors: ZeRO-3 parameters are gathered one
    layer at a time, FSDP2 DTensors are all-gathered, each FSDP1 unit is summoned once for its layers.

    A collective under ZeRO-3 and FSDP1/2: every rank must call it (every rank gets the whole state).
    `root`: the outermost (engine-wrapped) model, when `model` is a module inside it (FSDP1's root
    unit may own layers of `model`).
    """
    state = {}
    units = fsdp1_units(root if root is not None else model)
    for unit, members in group_by_unit(iter_galore_layers_by_key(model), units):
        with summon_unit(unit, writeback=False):
            for name, layer in members:
                with zero3_gathered(layer.parameters(recurse=False)):
                    for key, value in layer.state_dict().items():
                        if isinstance(value, DTensor):
                            value = value.full_tensor()
                        state[f"{name}.{key}"] = value.detach().to("cpu", copy=True)
    return state


def load_gathered_galore_state_dict(
    model: nn.Module, state: dict[str, torch.Tensor], *, root: Optional[nn.Module] = None
) -> None:
    """Load what :func:`gathered_galore_state_dict` saved into ZeRO-3-partitioned or FSDP2-sharded layers.

    Every rank calls it with the same whole tensors. Strict as the core's loader: every layer, every
    key. ZeRO-3: each layer is gathered, loaded and partitioned again from rank 0's copy. FSDP2: each
    rank keeps its own shard of the whole tensor (no communication). An engine's fp32 master of the
    factor is not touched: the engine restores it from its own checkpoint (the factor saved here is
    the master's model-dtype copy). FSDP1: each unit is summoned once and written back. `root` as in
    :func:`gathered_galore_state_dict`.
    """
    units = fsdp1_units(root if root is not None else model)
    pairs = [(layer_state, layer) for layer, layer_state in _galore_state_per_layer(model, state)]
    for unit, members in group_by_unit(pairs, units):
        with summon_unit(unit, writeback=True):
            for layer_state, layer in members:
                _load_layer_state(layer, layer_state)


def _load_layer_state(layer: GaLoreLinear, layer_state: dict[str, torch.Tensor]) -> None:
    with zero3_gathered(layer.parameters(recurse=False), modifier_rank=0), torch.no_grad():
        current = layer.state_dict(keep_vars=True)
        sharded = {key: _shard_like(current[key], value) if key in current else value
                   for key, value in layer_state.items()}
        layer.load_state_dict(sharded, strict=True)


def _shard_like(current: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    if isinstance(current, DTensor) and not isinstance(value, DTensor):
        # src_data_rank=None: every rank holds the whole tensor and cuts its own shard
        return distribute_tensor(value, current.device_mesh, current.placements, src_data_rank=None)
    return value


@contextlib.contextmanager
def _layer_tensors_from(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> Iterator[None]:
    # Every GaLore-layer parameter and buffer that `state_dict` holds temporarily replaces the layer's
    # own (partitioned) one; references only, nothing is copied.
    swapped = []
    for name, layer in iter_galore_layers_by_key(model):
        for registry in (layer._parameters, layer._buffers):
            for key, current in list(registry.items()):
                given = state_dict.get(f"{name}.{key}")
                if current is not None and given is not None:
                    swapped.append((registry, key, current))
                    registry[key] = nn.Parameter(given, requires_grad=False) if registry is layer._parameters else given
    try:
        yield
    finally:
        for registry, key, current in swapped:
            registry[key] = current


def merged_state_dict_from(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The merged (plain ``nn.Linear``) form of `state_dict`, a full state dict of the prepared `model`.

    For state dicts an engine gathered while the model's own parameters are partitioned (ZeRO-3's
    consolidated state dict on rank 0): the merge reads W0, factor and bases from `state_dict`, not
    from the model, which must hold every GaLore layer's tensors.
    """
    missing = [name for name, _ in iter_galore_layers_by_key(model) if f"{name}.galore_factor" not in state_dict]
    if missing:
        raise ValueError(
            f"cannot merge a state dict without the GaLore tensors of {missing[:4]}"
            f"{' ...' if len(missing) > 4 else ''}: pass the full state dict of the prepared model "
            "(e.g. exclude_frozen_parameters=False)"
        )
    with _layer_tensors_from(model, state_dict):
        return hgp.merged_state_dict(model, state_dict)


class DeepSpeedGaLoreOptimizer:
    """The optimizer protocol GaLore layers use (``param_changed``, ``reset_state``), for a DeepSpeed engine.

    Supported: ZeRO stages 1, 2 and 3, fp32 / bf16 / fp16 (the master copy is updated with
    ``deepspeed.utils.safe_set_full_fp32_param``). ZeRO-3 partitions W0 and B themselves: a refresh
    gathers the two parameters of that one layer (``gathered_parameters``) and partitions them again.

    Optimizer-state resets (the calibration refresh, ``moment_handling='reset'``) are applied just
    before the engine's next optimizer step. ZeRO steps a whole group as one flat partition with
    one step counter: when every factor of a group is reset together (the calibration step of all
    layers) the whole state restarts exactly as in one process; when only some are, their fp32
    moments are zeroed and the shared step counter (Adam's bias correction) keeps running.
    """

    def __init__(self, engine: Any) -> None:
        self.zero_stage = engine.zero_optimization_stage()
        if self.zero_stage not in (1, 2, 3):
            raise NotImplementedError(
                f"DeepSpeedGaLoreOptimizer needs ZeRO stage 1, 2 or 3 (got {self.zero_stage}); without ZeRO pass "
                "the engine's optimizer to after_step directly"
            )
        model = engine.module
        config = getattr(model, "galore_config", None)
        if config is None:
            raise ValueError("the engine's model has no GaLore layers: call prepare_model(model, config) first")
        if config.moment_handling == "project":
            raise NotImplementedError(
                "moment_handling='project' is not supported under DeepSpeed ZeRO (the moments of one factor are "
                "spread over flat partitions); use moment_handling='keep' or 'reset'"
            )
        if config.state_bits == 8 and any(int(layer.galore_phase) > 0 for _, layer in iter_galore_layers(model)):
            # Checked here rather than at the first late calibration, many steps into the run.
            raise NotImplementedError(
                "refresh_schedule='staggered' under DeepSpeed ZeRO with 8-bit state: a layer calibrated after step 0 "
                "needs its 8-bit moments reset inside a ZeRO flat partition, which is not supported; use "
                "refresh_schedule='aligned' (with basis_method='sketch' the calibration step stays small) or state_bits=32"
            )
        self.engine = engine
        self.model = model
        self.zero_optimizer = engine.optimizer
        self.optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)  # the client optimizer
        self._pending_resets: set[int] = set()
        self._warned_partial = False
        self.optimizer.register_step_pre_hook(self._apply_pending_resets)

    # ------------------------------------------------------------------ protocol used by GaLoreLinear
    def gathered_parameters(self, layer: torch.nn.Module):
        """Context in which `layer`'s parameters are whole on every rank (ZeRO-3); rank 0's result is kept."""
        # Every rank computes the same fold from the same all-reduced gradient; modifier_rank=0 makes
        # DeepSpeed re-partition rank 0's copy on exit.
        return zero3_gathered((layer.weight, layer.galore_factor), modifier_rank=0)

    def param_changed(self, param: torch.Tensor) -> None:
        """The layer changed `param` in the model (in place): make the engine's fp32 master follow."""
        from deepspeed.utils import safe_set_full_fp32_param

        safe_set_full_fp32_param(param, param.detach().float())

    def reset_state(self, param: torch.Tensor) -> None:
        """Forget `param`'s optimizer state, at the engine's next optimizer step."""
        self._pending_resets.add(id(param))

    # ------------------------------------------------------------------ internals
    def _apply_pending_resets(self, optimizer, args, kwargs) -> None:
        # ZeRO steps the client optimizer one group at a time (ZeRO-1/2: param_groups holds just that
        # group; ZeRO-3: the other groups' "params" are empty), so resets apply when their group steps.
        if not self._pending_resets:
            return
        factors = {name: layer.galore_factor for name, layer in iter_galore_layers(self.model)}
        for group in optimizer.param_groups:
            names = group.get("galore_layers")
            if not group.get("galore") or not names or not group["params"]:
                continue
            pending = [factors[n] for n in names if id(factors[n]) in self._pending_resets]
            if not pending:
                continue
            if len(pending) == len(names):
                for flat in group["params"]:
                    _zero_state(optimizer.state.get(flat))
            else:
                for param in pending:
                    self._zero_moments_of(param)
            for param in pending:
                self._pending_resets.discard(id(param))

    def _zero_moments_of(self, param: torch.Tensor) -> None:
        from deepspeed.utils import safe_get_full_optimizer_state, safe_set_full_optimizer_state

        if not self._warned_partial:
            warnings.warn(
                "GaLore under ZeRO: resetting the moments of some factors of a parameter group; the group's "
                "shared step counter (Adam bias correction) is not reset",
                stacklevel=2,
            )
            self._warned_partial = True
        for key in ("exp_avg", "exp_avg_sq"):
            if safe_get_full_optimizer_state(param, key) is None:
                raise NotImplementedError(
                    f"cannot reset the 8-bit optimizer state of one factor inside a ZeRO flat partition (no {key!r}); "
                    "use state_bits=32, or moment_handling='keep' with all layers calibrated at the first step"
                )
            safe_set_full_optimizer_state(param, torch.zeros(param.shape, dtype=torch.float32), key)


def _zero_state(state: dict[str, Any] | None) -> None:
    # In place, not a fresh dict: DeepSpeed links views of these tensors (hp fragments) for its
    # checkpoints. All-zero state (step 0, zero moments / zero codes and scales) is AdamW's fresh state.
    for value in (state or {}).values():
        if isinstance(value, torch.Tensor):
            value.zero_()

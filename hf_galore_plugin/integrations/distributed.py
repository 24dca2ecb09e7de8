"""Checkpoint and preparation helpers for engines that shard GaLore layers (ZeRO-3, FSDP1, FSDP2).

They compose the public API with the engine glue of :mod:`hf_galore_plugin.engines`: ZeRO-3
partitions every parameter, W0 and the factor included (``from_pretrained`` under a stage-3 config
already does, through ``zero.Init``). :func:`prepare_zero3_model` prepares such a model through the
target replacement of ``prepare_model``, one gathered module at a time; :func:`gathered_galore_state_dict` and :func:`load_gathered_galore_state_dict` save and restore
the layers' exact state (``galore_state.pt``) with whole tensors; :func:`merged_state_dict_from` merges
a state dict that an engine gathered (what ``Trainer.save_model`` gets from
``_zero3_consolidated_16bit_state_dict``). Without ZeRO-3 they are the plain versions.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, TypeVar

import torch
from torch import nn

from ..api import merged_state_dict, prepare_model
from ..config import GaLoreConfig
from ..engines.collectives import full_tensor, shard_like
from ..engines.deepspeed import import_deepspeed, zero3_gathered
from ..engines.fsdp1 import fsdp1_units, group_by_unit, summon_unit
from ..inject import galore_state_per_layer, iter_galore_layers_by_key, replace_targets
from ..layers import GaLoreLinear
from ..state import record_state, state_of

__all__ = [
    "prepare_zero3_model",
    "gathered_galore_state_dict",
    "load_gathered_galore_state_dict",
    "merged_state_dict_from",
]

_Module = TypeVar("_Module", bound=nn.Module)


def prepare_zero3_model(model: nn.Module, config: GaLoreConfig, ds_config: Any) -> nn.Module:
    """``prepare_model`` for a model whose parameters ZeRO-3 has partitioned (``from_pretrained`` under a
    stage-3 DeepSpeed config), one module at a time.

    The same target replacement as ``prepare_model`` (``inject.replace_targets``: the same layers and expert
    modules, seeds, refresh phases and report), with a builder that gathers each targeted ``nn.Linear`` or
    experts module (its whole weights, on every rank), builds its GaLore module from them, and partitions
    the new module's parameters at once with ``zero.Init(module=...)`` and `ds_config` (the config the model
    was loaded under), so no rank ever holds more than one whole module.
    """
    deepspeed = import_deepspeed("prepare_zero3_model")
    if state_of(model) is not None:
        return prepare_model(model, config)  # already prepared: the core checks the config

    def build(original: nn.Module, make: Callable[[], _Module]) -> _Module:
        with zero3_gathered(original.parameters()):
            module = make()
            for layer in module.modules():
                if isinstance(layer, GaLoreLinear) and layer.weight is not None:
                    # W0 is a view of the gathered buffer, which DeepSpeed frees on exit: keep a copy.
                    layer.weight.data = layer.weight.data.clone()
        deepspeed.zero.Init(module=module, config_dict_or_path=ds_config)
        return module

    report = replace_targets(model, config, build=build)
    record_state(model, config, report)
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
                        state[f"{name}.{key}"] = full_tensor(value).detach().to("cpu", copy=True)
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
    pairs = [(layer_state, layer) for layer, layer_state in galore_state_per_layer(model, state)]
    for unit, members in group_by_unit(pairs, units):
        with summon_unit(unit, writeback=True):
            for layer_state, layer in members:
                _load_layer_state(layer, layer_state)


def _load_layer_state(layer: GaLoreLinear, layer_state: dict[str, torch.Tensor]) -> None:
    with zero3_gathered(layer.parameters(recurse=False), modifier_rank=0), torch.no_grad():
        current = layer.state_dict(keep_vars=True)
        sharded = {
            key: shard_like(current[key], value) if key in current else value for key, value in layer_state.items()
        }
        layer.load_state_dict(sharded, strict=True)


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
        return merged_state_dict(model, state_dict)

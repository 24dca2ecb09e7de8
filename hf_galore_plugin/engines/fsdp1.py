"""GaLore layers under FSDP1 (``FullyShardedDataParallel(use_orig_params=True)``).

FSDP1 concatenates a unit's parameters into one flat tensor and keeps 1/world of it per rank; with
``use_orig_params=True`` each original parameter (W0, the factor B, the bias) stays a Parameter whose
data is a 1-D view of its elements in the local shard (possibly empty). The optimizer steps those views
elementwise, which is all AdamW (fp32 or 8-bit) needs. A refresh needs the 2-D tensors (fold B into
W0, zero B): :func:`hf_galore_plugin.after_step` refreshes inside
``summon_full_params(unit, recurse=False, writeback=True)`` of the unit whose flat parameter holds the
layer, in which W0 and B are whole and after which each rank keeps its slice of what changed. The
refreshing layers are grouped by unit (:func:`group_by_unit`): one all-gather per unit, however many
GaLore layers it holds (~7 per decoder layer), once per gap. The Adam moments stay 1-D shards, so
``moment_handling='project'`` (a 2-D change of coordinates) is refused before the first step
(:mod:`hf_galore_plugin.engines.capabilities`).

Muon and Adafactor (``galore_muon``, ``galore_adafactor``) compute over each matrix's rows and columns:
:func:`register_fsdp1_fragments` registers on every trainable original parameter of every sharded unit which
elements of its matrix the rank's view holds (elements [start, stop) of the parameter flattened row-major,
possibly none; :mod:`hf_galore_plugin.engines.fragments`), with the unit's process group. The registration
is keyed by the Parameter object, which FSDP1 keeps while it re-points its ``.data``. The optimizers
step each view in parameter order, the same on every rank, with collectives over the unit's group: Muon
all-reduces the matrix it orthogonalises (zeros outside each rank's elements: one all-reduce of the factor's
size per factor and step), runs Newton-Schulz on it on every rank and keeps its elements; Adafactor
all-reduces the partial row and column sums of the squared gradient (the factor's m + r values) and the
update's sum of squares, two small all-reduces per matrix and step; whether a view steps is one all-reduced
flag per view and step (a rank without elements has no gradient). Elementwise state
(Muon's momentum, Adafactor's first moment, a vector's second moment) is sharded as the view is; Adafactor's
row and column statistics are whole on every rank holding elements of the matrix. Every parameter, not only
the factors: Adafactor factors every matrix and clips each update by its whole RMS, as one process does.

:func:`hf_galore_plugin.after_step` and :func:`hf_galore_plugin.create_optimizer` find FSDP1 units in
the model they are given and use this module on their own; nothing changes in a training loop.
"""

from __future__ import annotations

import contextlib
from typing import Optional

from torch import nn

from .capabilities import check_moment_handling
from .fragments import Fragment, set_fragments

__all__ = [
    "fsdp1_units",
    "summon_unit",
    "group_by_unit",
    "had_gradient",
    "check_fsdp1_layers",
    "register_fsdp1_fragments",
]


def fsdp1_units(model: nn.Module) -> dict[int, nn.Module]:
    """``id(original parameter)`` -> the FSDP1 unit whose flat parameter holds it; empty without FSDP1.

    Raises ValueError for FSDP1 without ``use_orig_params=True`` (the layers' own parameters are gone then).
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    units: dict[int, nn.Module] = {}
    for unit in FullyShardedDataParallel.fsdp_modules(model):
        flat = getattr(getattr(unit, "_handle", None), "flat_param", None)
        if flat is None:
            continue
        originals = getattr(flat, "_params", None)
        if originals is None:
            raise ValueError(
                "GaLore under FSDP1 needs FullyShardedDataParallel(use_orig_params=True) (accelerate: "
                "fsdp_use_orig_params: true): without it the layers' factor and W0 are not parameters of their "
                "own and cannot be refreshed. Or use FSDP2 (fully_shard / accelerate fsdp_version: 2)."
            )
        for param in list(originals) + list(getattr(flat, "_shared_params", None) or []):
            units[id(param)] = unit
    return units


def summon_unit(unit: Optional[nn.Module], *, writeback: bool):
    """Context in which every parameter of one FSDP1 unit is whole on every rank (a collective: every
    rank enters it); with `writeback` changes go back to each rank's shard. None: a no-op."""
    if unit is None:
        return contextlib.nullcontext()
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel.summon_full_params(unit, recurse=False, writeback=writeback)


def group_by_unit(layers, units: dict[int, nn.Module]) -> list[tuple[Optional[nn.Module], list]]:
    """`layers` ((anything, layer) pairs) grouped by the FSDP1 unit that holds each, in order of first
    appearance (the same on every rank), so each unit is gathered once however many of its layers need
    it; layers FSDP1 does not manage form groups with unit None."""
    groups: list[tuple[Optional[nn.Module], list]] = []
    index: dict[int, int] = {}
    for tag, layer in layers:
        unit = units.get(id(layer.galore_factor))
        key = id(unit) if unit is not None else -1
        if key not in index:
            index[key] = len(groups)
            groups.append((unit, []))
        groups[index[key]][1].append((tag, layer))
    return groups


def had_gradient(param, units: dict[int, nn.Module]) -> bool:
    """Whether `param` took part in this step on any rank: its own gradient or, under FSDP1, its unit's
    (the rank-local view of a parameter is empty, and has no gradient, where the shard holds none of it)."""
    if param.grad is not None:
        return True
    unit = units.get(id(param))
    if unit is None:
        return False
    flat_param = unit._handle.flat_param  # type: ignore[union-attr]  # FSDP1's handle is untyped
    return getattr(flat_param, "grad", None) is not None


def check_fsdp1_layers(layers, units: dict[int, nn.Module]) -> set[int]:
    """Refuse what cannot work on FSDP1's 1-D shards; returns the ids of layers FSDP1 manages."""
    managed = set()
    for name, layer in layers:
        if id(layer.galore_factor) not in units:
            continue
        managed.add(id(layer))
        check_moment_handling("fsdp1", moment_handling=layer.config.moment_handling, layer=name)
    return managed


def register_fsdp1_fragments(model: nn.Module) -> int:
    """Register (:func:`~hf_galore_plugin.engines.fragments.set_fragments`) on every trainable original parameter
    of every sharded FSDP1 unit in `model` the fragment of its matrix that this rank's 1-D view holds (module
    docstring); returns how many. Call it between steps, where the views are sharded (not inside
    ``summon_full_params``). Units that do not shard (``NO_SHARD``) hand the optimizer whole parameters."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    count = 0
    for unit in FullyShardedDataParallel.fsdp_modules(model):
        handle = getattr(unit, "_handle", None)
        flat = getattr(handle, "flat_param", None)
        if flat is None or not handle.uses_sharded_strategy:  # type: ignore[union-attr]  # untyped handle
            continue
        params = getattr(flat, "_params", None)
        if params is None:
            fsdp1_units(unit)  # raises: FSDP1 without use_orig_params
            continue
        infos = zip(params, flat._shard_param_infos, flat._shapes, flat._fqns)
        for param, info, shape, name in infos:
            if not param.requires_grad:
                continue
            # intra_param_end_idx is inclusive; a view without elements of the parameter holds [0, 0).
            start, stop = (info.intra_param_start_idx, info.intra_param_end_idx + 1) if info.in_shard else (0, 0)
            fragment = Fragment(shape=shape, start=start, stop=stop, offset=0, group=unit.process_group, name=name)
            set_fragments(param, [fragment])
            count += 1
    return count

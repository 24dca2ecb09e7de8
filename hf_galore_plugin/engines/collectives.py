"""DTensor and collective helpers: the only place the core touches ``torch.distributed`` directly.

Every function is a no-op (returns its input, or 1) in a single process and for plain tensors, so
the layers call them unconditionally. Functions marked *collective* must be reached by every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, TypeGuard

import torch

from .fragments import fragments_of

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

_DTensor: Any
try:
    from torch.distributed.tensor import DTensor as _DTensor
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
except ImportError:  # torch built without distributed support
    _DTensor = None

__all__ = [
    "all_reduce_mean",
    "check_matrix_layout",
    "from_local",
    "full_tensor",
    "gather_rows",
    "is_dtensor",
    "local_rows",
    "local_shard",
    "one_row_per_shard",
    "placed_like",
    "rows_sharded",
    "same_layout",
    "shard_like",
    "sum_over_shards",
    "world_size",
]


def is_dtensor(t: Optional[torch.Tensor]) -> TypeGuard["DTensor"]:
    """Whether `t` is a DTensor (an FSDP2 / tensor-parallel shard); False without torch.distributed."""
    return _DTensor is not None and isinstance(t, _DTensor)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the storage the engine owns), any other tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor. *Collective* for a DTensor (all-gather over its mesh)."""
    return t.full_tensor() if is_dtensor(t) else t


def shard_like(current: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` (a whole tensor held by every rank) cut as the DTensor `current` is; `value` itself otherwise.

    No communication: ``src_data_rank=None`` makes each rank cut its own shard from its own copy.
    """
    if is_dtensor(current) and not is_dtensor(value):
        return distribute_tensor(value, current.device_mesh, current.placements, src_data_rank=None)
    return value


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` are DTensors on the same mesh with the same placements (cut the same way)."""
    return (
        is_dtensor(a)
        and is_dtensor(b)
        and a.device_mesh == b.device_mesh
        and tuple(a.placements) == tuple(b.placements)
    )


def from_local(local: torch.Tensor, like: "DTensor", placements: Any = None, **shape_and_stride: Any) -> "DTensor":
    """The DTensor whose local shard on this rank is `local`, on `like`'s mesh (with `like`'s placements, its
    shape and stride unless given). No communication and no check across ranks."""
    if not shape_and_stride:
        shape_and_stride = dict(shape=like.shape, stride=like.stride())
    placements = like.placements if placements is None else placements
    return _DTensor.from_local(local, like.device_mesh, placements, run_check=False, **shape_and_stride)


def placed_like(local: torch.Tensor, like: "DTensor", shape: torch.Size, *, replicated: bool = False) -> "DTensor":
    """The DTensor of global `shape` (contiguous) whose local part on this rank is `local`, on `like`'s mesh:
    sharded on dimension 0 as `like` is (per-row data of a row-sharded parameter: an optimizer's statistics),
    or with ``replicated`` the same whole tensor on every rank. No communication."""
    placements = [Replicate() for _ in like.placements] if replicated else like.placements
    stride: list[int] = []
    size = 1
    for dim in reversed(shape):
        stride.insert(0, size)
        size *= dim
    return from_local(local, like, placements, shape=torch.Size(shape), stride=tuple(stride))


def _to_mesh_device(tensor: torch.Tensor, like: "DTensor") -> torch.Tensor:
    """`tensor` on the device type `like`'s mesh communicates on: FSDP2's CPUOffloadPolicy keeps shards on the
    host while the mesh's process group may reach devices only."""
    device_type = like.device_mesh.device_type
    return tensor if tensor.device.type == device_type else tensor.to(device_type)


def sum_over_shards(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """In-place sum of `tensor`, a partial result over this rank's shard of `like`, over the ranks that hold
    `like`'s other shards (each mesh dimension `like` is sharded on; not those it is replicated on), returned.
    *Collective* over those ranks for a DTensor `like`; a no-op for any other tensor."""
    if not is_dtensor(like):
        return tensor
    moved = _to_mesh_device(tensor, like)
    for mesh_dim, placement in enumerate(like.placements):
        if isinstance(placement, Shard):
            torch.distributed.all_reduce(moved, group=like.device_mesh.get_group(mesh_dim))
    if moved is not tensor:
        tensor.copy_(moved)
    return tensor


def gather_rows(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The whole tensor whose part on this rank is `local`, cut as `like` (a DTensor, e.g. a parameter of which
    `local` is a function of the local shard) is: all-gathered over `like`'s mesh, on `local`'s device.
    *Collective* for a DTensor `like`; `local` itself otherwise."""
    if not is_dtensor(like):
        return local
    return from_local(_to_mesh_device(local, like), like).full_tensor().to(local.device)


def one_row_per_shard(t: "DTensor") -> tuple[int, list[int], list[Any]]:
    """How `t` is cut, for per-shard data (an 8-bit state's block scales): (number of shards, the shape of the
    largest shard, the placements of a tensor with one row per shard). torch.chunk-style sharding gives the
    first rank of a dimension ceil(dim / mesh size) entries: every rank can size its data for that."""
    mesh, largest, shards = t.device_mesh, list(t.shape), 1
    placements: list[Any] = []
    for mesh_dim, placement in enumerate(t.placements):
        if isinstance(placement, Shard):
            size = mesh.size(mesh_dim)
            largest[placement.dim] = -(-largest[placement.dim] // size)
            shards *= size
            placements.append(Shard(0))
        elif isinstance(placement, Replicate):
            placements.append(Replicate())
        else:
            raise NotImplementedError(f"DTensor placement {placement} is not supported (Shard and Replicate are)")
    return shards, largest, placements


def rows_sharded(t: torch.Tensor) -> bool:
    """Whether `t` is a DTensor that holds whole rows: every placement is ``Shard(0)`` (FSDP2's default) or
    ``Replicate`` (HSDP's other mesh dimension), so a rank's shard is rows [start, stop) (:func:`local_rows`)."""
    return is_dtensor(t) and all(
        isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0) for p in t.placements
    )


def check_matrix_layout(
    param: torch.Tensor, *, optimizer: str, needs: str, preset: str, building: bool = False
) -> None:
    """Raise ``RuntimeError`` when `param` reaches `optimizer`'s step in a layout without whole rows and columns
    to work on: a DTensor sharded on another dimension than its rows, or an engine's 1-D flat partition
    (FSDP1, DeepSpeed ZeRO). `needs`: what the optimizer computes over the matrix; `preset`: the optimizer name
    a user chose (galore_muon, galore_adafactor); `building`: called from the optimizer's constructor, where a
    matrix ZeRO-3 has partitioned is accepted (its flat partitions are registered before the first step)."""
    if is_dtensor(param):
        if rows_sharded(param):
            return
        raise RuntimeError(
            f"{optimizer}: a parameter it steps as a matrix is a DTensor placed {tuple(param.placements)}: a shard of "
            "another dimension than the rows holds parts of every row. Shard it on dimension 0 (FSDP2's default)."
        )
    # An engine's 1-D slice whose fragments the engine registered (engines.fragments): the optimizer steps each
    # fragment as part of its matrix.
    if fragments_of(param) is not None:
        return
    if building and hasattr(param, "ds_id") and len(getattr(param, "ds_shape", ())) >= 2:
        # `building` (the optimizer's constructor): a matrix ZeRO-3 partitioned before the optimizer was built
        # (the Trainer's order). deepspeed.initialize replaces it by flat partitions, on which
        # DeepSpeedGaLoreOptimizer registers the fragments before the first step; the step checks again.
        return
    if param.dim() < 2 or hasattr(param, "ds_id"):
        raise RuntimeError(
            f"{optimizer}: a parameter it steps as a matrix reaches the step as a flat partition of shape "
            f"{tuple(param.shape)}: {needs}. {preset} runs in one process, under DDP and FSDP2, and on an engine's "
            "1-D slices only where the engine registered which elements of which matrix each holds "
            "(hf_galore_plugin.engines.fragments): this one has none. Under FSDP1 build the optimizer with "
            "hf_galore_plugin.create_optimizer; under DeepSpeed ZeRO build DeepSpeedGaLoreOptimizer(engine) before "
            "the first engine.step() (the Trainer does both); or use galore_adamw."
        )


def local_rows(t: torch.Tensor) -> tuple[int, int]:
    """The rows [start, stop) of dimension 0 that this rank holds of `t`: all of them for a plain tensor, the
    rank's chunk for a DTensor sharded on dimension 0 (FSDP2's default ``Shard(0)``; replicated over any other
    mesh dimension, as in HSDP). torch.chunk-style sharding: each chunk holds ceil(rows / mesh size) rows, the
    last ones fewer or none. Raises for any other placement (a shard of another dimension, a partial sum)."""
    if not is_dtensor(t):
        return 0, int(t.shape[0])
    start, length = 0, int(t.shape[0])
    for mesh_dim, placement in enumerate(t.placements):
        if isinstance(placement, Replicate):
            continue
        if not (isinstance(placement, Shard) and placement.dim == 0):
            raise NotImplementedError(
                f"a DTensor placed {tuple(t.placements)} holds parts of every row; GaLore expert layers need their "
                "expert dimension (0) sharded (Shard(0), FSDP2's default) or replicated"
            )
        size = -(-length // t.device_mesh.size(mesh_dim))
        offset = min(t.device_mesh.get_local_rank(mesh_dim) * size, length)
        start, length = start + offset, min(size, length - offset)
    local = int(t.to_local().shape[0])
    if local != length:
        raise RuntimeError(f"a DTensor's local shard holds {local} rows where chunking predicts {length}")
    return start, start + length


def world_size() -> int:
    """Ranks of the default process group; 1 when torch.distributed is not initialized."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def all_reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    """In-place mean of `tensor` over the default group, returned. *Collective* when world_size() > 1.

    Data-parallel ranks see different micro-batches; averaging makes every rank compute the same
    basis from the same global gradient (the one DDP/FSDP/ZeRO average for the parameters).
    """
    world = world_size()
    if world > 1:
        torch.distributed.all_reduce(tensor)
        tensor /= world
    return tensor

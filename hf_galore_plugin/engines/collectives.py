"""DTensor and collective helpers: the only place the core touches ``torch.distributed`` directly.

Every function is a no-op (returns its input, or 1) in a single process and for plain tensors, so
the layers call them unconditionally. Functions marked *collective* must be reached by every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, TypeGuard

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

_DTensor: Any
try:
    from torch.distributed.tensor import DTensor as _DTensor
    from torch.distributed.tensor import distribute_tensor
except ImportError:  # torch built without distributed support
    _DTensor = None

__all__ = ["is_dtensor", "local_shard", "full_tensor", "shard_like", "world_size", "all_reduce_mean"]


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

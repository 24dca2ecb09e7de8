"""Matrices that reach an optimizer as 1-D slices of an engine's flat partition (FSDP1, DeepSpeed ZeRO).

FSDP1 (``use_orig_params=True``) hands the optimizer each parameter as a 1-D view of this rank's part of its
unit's flat shard; ZeRO-1/2/3 hand the client optimizer one flat fp32 partition per parameter group, cut across
parameter boundaries. An elementwise rule (AdamW) steps such slices as they are. A rule over a matrix's rows and
columns (Muon's orthogonalisation, Adafactor's row and column statistics) needs to know which elements of which
matrix a slice holds: a :class:`Fragment` says it, and the engine registers the fragments of every 1-D tensor it
hands the optimizer (:func:`set_fragments`), in the same order on every rank, so that the optimizer, stepping
them in that order, reaches the same collectives on every rank.

The collectives here sum over the fragment's process group: a matrix is whole on every rank after
:func:`gather_fragment` (an all-reduce of the matrix with zeros outside each rank's elements: one matrix per
factor and step, the factor's size), and per-row or per-column partial sums become whole with
:func:`sum_over_fragment`. Every rank must call them for every fragment, also one with no local elements.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import torch

__all__ = ["Fragment", "fragments_of", "set_fragments", "gather_fragment", "sum_over_fragment", "fragment_index"]


@dataclasses.dataclass(frozen=True)
class Fragment:
    """This rank's part of one matrix (or stack of matrices) held as a 1-D slice.

    ``shape``: the whole parameter's shape (a 2-D factor, or an E x m x r expert stack). ``start`` / ``stop``:
    the elements [start, stop) of the parameter flattened row-major that this rank holds (start == stop: none).
    ``offset``: where they begin in the 1-D tensor the optimizer steps (and in its gradient and its state of the
    same shape). ``group``: the process group of the ranks holding the other fragments (None: the default
    group). ``name``: the parameter's name, for messages."""

    shape: torch.Size
    start: int
    stop: int
    offset: int
    group: Any = None
    name: str = ""

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def local(self, flat: torch.Tensor) -> torch.Tensor:
        """The fragment's elements in `flat` (the 1-D tensor the optimizer steps, its gradient, or a state
        tensor of its shape): a view."""
        return flat.narrow(0, self.offset, self.numel)


# The attribute of a registered 1-D tensor that holds its fragments (as DeepSpeed marks its parameters with
# ``ds_id``): it lives and dies with the tensor.
_ATTRIBUTE = "galore_fragments"


def set_fragments(flat: torch.Tensor, fragments: list[Fragment]) -> None:
    """Register the matrices that the 1-D tensor `flat` (a parameter the optimizer steps) holds slices of, in
    an order every rank shares; fragments with no local elements included."""
    if flat.dim() != 1:
        raise ValueError(f"fragments describe a 1-D tensor; got shape {tuple(flat.shape)}")
    for fragment in fragments:
        if not 0 <= fragment.start <= fragment.stop <= math.prod(fragment.shape):
            raise ValueError(f"fragment {fragment} lies outside its parameter of shape {tuple(fragment.shape)}")
        if fragment.offset < 0 or fragment.offset + fragment.numel > flat.numel():
            raise ValueError(f"fragment {fragment} lies outside the 1-D tensor of {flat.numel()} elements")
    setattr(flat, _ATTRIBUTE, tuple(fragments))


def fragments_of(param: torch.Tensor) -> Optional[tuple[Fragment, ...]]:
    """The fragments registered for `param` by its engine, None for a tensor that holds whole matrices."""
    return getattr(param, _ATTRIBUTE, None)


def _all_reduce(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(tensor, group=group)
    return tensor


def gather_fragment(values: torch.Tensor, fragment: Fragment) -> torch.Tensor:
    """The whole matrix of `fragment.shape` whose elements [start, stop) on this rank are `values` (1-D, the
    fragment's length): every rank's elements summed into zeros. *Collective* over the fragment's group."""
    whole = torch.zeros(math.prod(fragment.shape), dtype=values.dtype, device=values.device)
    whole[fragment.start : fragment.stop] = values
    return _all_reduce(whole, fragment.group).view(fragment.shape)


def sum_over_fragment(partial: torch.Tensor, fragment: Fragment) -> torch.Tensor:
    """In-place sum of `partial` (a result over this rank's elements of the fragment's matrix, e.g. per-row
    sums) over the ranks that hold its other elements, returned. *Collective* over the fragment's group."""
    return _all_reduce(partial, fragment.group)


def fragment_index(fragment: Fragment, device: Optional[torch.device] = None) -> torch.Tensor:
    """The multi-index of each local element of the fragment's matrix: a (numel, ndim) int64 tensor whose
    column d is the element's index along dimension d of ``fragment.shape`` (for scatter sums over rows and
    columns)."""
    flat = torch.arange(fragment.start, fragment.stop, device=device)
    index = []
    for size in reversed(fragment.shape):
        index.append(flat % size)
        flat = flat // size
    return torch.stack(index[::-1], dim=1) if index else flat[:, None]

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
import weakref
from typing import Any, Optional

import torch

__all__ = [
    "Fragment",
    "fragments_of",
    "set_fragments",
    "gather_fragment",
    "sum_over_fragment",
    "expert_elements",
    "any_rank",
    "matrix_indices",
    "uniform_elementwise_state",
    "is_placeholder",
]


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


# Registered tensors by id, each with a weak reference that removes its entry when the tensor dies. Not an
# attribute of the tensor: torch pickles and deep-copies a tensor's attributes (ZeRO-3 saves its flat partitions
# in its checkpoints), where the fragments' process groups cannot go, nor do they belong (a loaded flat is
# copied into the live one, which keeps its own registration).
_REGISTRY: dict[int, tuple["weakref.ref[torch.Tensor]", tuple[Fragment, ...]]] = {}


def set_fragments(flat: torch.Tensor, fragments: list[Fragment]) -> None:
    """Register the matrices that the 1-D tensor `flat` (a parameter the optimizer steps) holds slices of, in
    an order every rank shares; fragments with no local elements included. A later call replaces them."""
    if flat.dim() != 1:
        raise ValueError(f"fragments describe a 1-D tensor; got shape {tuple(flat.shape)}")
    for fragment in fragments:
        if not 0 <= fragment.start <= fragment.stop <= math.prod(fragment.shape):
            raise ValueError(f"fragment {fragment} lies outside its parameter of shape {tuple(fragment.shape)}")
        if fragment.offset < 0 or fragment.offset + fragment.numel > flat.numel():
            raise ValueError(f"fragment {fragment} lies outside the 1-D tensor of {flat.numel()} elements")
    key = id(flat)

    def forget(ref: "weakref.ref[torch.Tensor]", key: int = key) -> None:
        entry = _REGISTRY.get(key)
        if entry is not None and entry[0] is ref:
            del _REGISTRY[key]

    _REGISTRY[key] = (weakref.ref(flat, forget), tuple(fragments))


def fragments_of(param: torch.Tensor) -> Optional[tuple[Fragment, ...]]:
    """The fragments registered for `param` by its engine, None for a tensor that holds whole matrices."""
    entry = _REGISTRY.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]


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


def any_rank(flag: bool, fragments: tuple[Fragment, ...], device: Optional[torch.device] = None) -> bool:
    """Whether any rank of the fragments' group (they share one) set `flag` (its "I have a gradient"): one
    all-reduce of one value and a host sync, once per parameter and step. *Collective*.

    Under FSDP1 a rank that holds none of a parameter's elements sees no gradient while the others have one:
    whether a parameter steps must be decided by what every rank agrees on, never by a local None, or the ranks
    would reach different collectives."""
    if not fragments:
        return flag
    groups = {id(fragment.group) for fragment in fragments}
    if len(groups) != 1:
        raise ValueError(f"the fragments of one tensor span {len(groups)} process groups; register one per tensor")
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    return float(_all_reduce(value, fragments[0].group)[0]) > 0.0


def matrix_indices(fragment: Fragment, device: Optional[torch.device] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """For each local element of a fragment of a matrix (or stack of matrices, ``shape[:-2]`` leading): the index
    of its row in ``shape[:-1]`` flattened, and of its column in ``shape[:-2] + shape[-1:]`` flattened (the
    layouts of a row and a column statistic), as two int64 tensors (for index_add / gather)."""
    if len(fragment.shape) < 2:
        raise ValueError(f"fragment {fragment.name!r} of shape {tuple(fragment.shape)} is not a matrix")
    flat = torch.arange(fragment.start, fragment.stop, device=device)
    cols = int(fragment.shape[-1])
    rows = int(fragment.shape[-2])
    row = flat // cols
    col = (row // rows) * cols + flat % cols
    return row, col


def uniform_elementwise_state(packed: dict[Any, dict[str, Any]], params: dict[Any, torch.Tensor]) -> None:
    """Give every registered parameter's state in `packed` (``optimizer.state_dict()["state"]``; `params` maps its
    keys to the parameters) every elementwise key (a tensor of more than 0 dimensions) that some registered
    parameter's state has, as zeros of its shape that take no memory (a stride-0 view of one zero), in place.

    FSDP1's ``optim_state_dict`` gathers each elementwise key over all parameters of a unit's flat parameter and
    fails when one of them lacks it (Muon's momentum beside AdamW's moments, Adafactor's factored matrices
    beside its 1-D second moments); the optimizer's loader drops what its own rule does not keep."""
    registered = [key for key, param in params.items() if key in packed and fragments_of(param) is not None]
    keys: dict[str, torch.dtype] = {}
    for key in registered:
        for name, value in packed[key].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                keys.setdefault(name, value.dtype)
    for key in registered:
        state, param = packed[key], params[key]
        if not state:
            continue
        missing = {name: dtype for name, dtype in keys.items() if name not in state}
        if missing:
            state = packed[key] = dict(state)
            for name, dtype in missing.items():
                state[name] = torch.zeros((), dtype=dtype, device=param.device).expand(param.shape)


def expert_elements(fragment: Fragment, experts: torch.Tensor) -> torch.Tensor:
    """Which local elements of a fragment of an expert stack (E x m x r) belong to the experts in the boolean
    mask `experts` (E): a boolean tensor of the fragment's length, on the mask's device."""
    if len(fragment.shape) < 3:
        raise ValueError(f"fragment {fragment.name!r} of shape {tuple(fragment.shape)} is not an expert stack")
    per_expert = math.prod(fragment.shape[1:])
    expert = torch.arange(fragment.start, fragment.stop, device=experts.device) // per_expert
    return experts.to(torch.bool)[expert]


def is_placeholder(value: Any) -> bool:
    """Whether a loaded state value is a zero that :func:`uniform_elementwise_state` added for FSDP1 (a stride-0
    view of one element, as saved): an optimizer's loader drops it. (FSDP1's own optimizer state dict gathers
    such a value into real zeros; the loaders drop those by the parameter's registered keys.)"""
    return isinstance(value, torch.Tensor) and value.numel() > 1 and 0 in value.stride()

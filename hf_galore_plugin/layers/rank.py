"""A layer's own rank under ``GaLoreConfig.rank_allocation='auto'`` (the allocation: :mod:`hf_galore_plugin.ranks`).

A layer with one computed basis (the default ``proj_type='std'``) is *adaptive*: it starts at the config's rank,
and its first refresh (the calibration) measures the spectrum of the recorded gradient, as many singular values as
its largest allowed rank (``rank_max``, capped at its projected side minus one); so that the calibration sketch
holds them, an adaptive layer sketches ``rank_max + oversampling`` columns until then. The spectrum is taken from
the whole sketch (the eigenvalues of its small Gram matrix), the calibration's basis from its first ``rank +
oversampling`` columns, as a uniform layer's (:func:`basis_columns`), so that the wider record costs the recording
and the spectrum, not a wider basis computation. Once every adaptive layer of the model has its spectrum, the step
driver allocates the ranks (``api.after_step``) and gives each layer its target; a layer takes it at its next
refresh, which already folds the factor into W0: the factor and the basis take the new shape there (the optimizer's
state of the factor restarts, as at a calibration), and the record of that refresh is sketched wide enough for the
new rank.

An expert stack (:class:`~.experts.GaLoreExpertStack`, ``experts=True``) is adaptive the same way, with one rank
shared by its E experts: its calibration sketches each expert's record ``rank_max + oversampling`` wide, and its
spectrum for the allocator is the experts' spectra summed value by value (entry i: the sum over experts of each
one's i-th squared singular value), its total the stack's whole gradient energy, so that the share captured at
rank k is the energy the experts' top-k subspaces capture together over the stack's energy; a unit of its rank
costs E x (its kept side) factor values. Its starting rank and default bounds come from ``expert_rank``.

State (buffers, so checkpoints carry it; registered on adaptive layers only): ``galore_spectrum`` (the measured
squared singular values, NaN until measured), ``galore_spectrum_total`` (the gradient's whole energy) and
``galore_rank_target`` (0 until allocated). The factor's shape is the rank: a load of a state with another rank
reshapes the layer first (:func:`before_load`), so a resume continues at the saved ranks.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from ..config import GaLoreConfig

__all__ = ["AdaptiveRank", "basis_columns", "init_adaptive", "measure_spectrum", "record_rank", "resize", "set_target"]


class AdaptiveRank:
    """The host side of one adaptive layer's rank state: its bounds and what the buffers hold (read at
    construction and load, written with the buffers, so the driver reads no buffer)."""

    __slots__ = ("side", "dim", "cost", "start", "low", "high", "measured", "target")

    def __init__(self, side: str, dim: int, cost: int, start: int, low: int, high: int) -> None:
        self.side, self.dim, self.cost = side, dim, cost
        self.start, self.low, self.high = start, low, high
        self.measured = False
        self.target = 0


def init_adaptive(
    layer: Any, config: GaLoreConfig, sides: list[tuple[str, int]], device: torch.device
) -> Optional[AdaptiveRank]:
    """The rank state of `layer` (its buffers registered) when the config asks for one and the layer has exactly
    one computed basis (`sides`: its (side, rank) list); None: the layer's rank is fixed. An expert stack (a
    layer with leading dimensions, ``stack_shape``) takes its bounds from ``expert_rank``, and a unit of its rank
    costs every expert's values."""
    if config.rank_allocation != "auto" or len(sides) != 1:
        return None
    side, start = sides[0]
    dim = layer.in_features if side == "right" else layer.out_features
    kept = layer.out_features if side == "right" else layer.in_features
    experts = math.prod(layer.stack_shape)
    low, high = config.rank_bounds(config.expert_rank) if layer.stack_shape else config.effective_rank_bounds
    high = min(high, dim - 1)
    low = min(low, high)
    state = AdaptiveRank(side, dim, experts * kept, start, low, high)
    layer.register_buffer("galore_spectrum", torch.full((high,), math.nan, dtype=torch.float32, device=device))
    layer.register_buffer("galore_spectrum_total", torch.tensor(math.nan, dtype=torch.float32, device=device))
    layer.register_buffer("galore_rank_target", torch.tensor(0, dtype=torch.int64, device=device))
    return state


def current_rank(layer: Any) -> int:
    state: AdaptiveRank = layer.rank_state
    return layer.right_rank if state.side == "right" else layer.left_rank


def record_rank(layer: Any, rank: int) -> int:
    """The rank the next refresh record must serve: `rank` (the current), the largest one until the spectrum
    is measured, the target once allocated."""
    state: Optional[AdaptiveRank] = layer.rank_state
    if state is None:
        return rank
    if not state.measured:
        return max(rank, state.high)
    return max(rank, state.target)


@torch.no_grad()
def measure_spectrum(layer: Any, record: Any) -> None:
    """Keep the spectrum of the calibration record: a sketch Y = G^T Omega (Omega Gaussian with k columns, so
    E ||Y||^2 = k ||G||^2 and the top singular values of Y / sqrt(k) estimate G's), or the dense gradient G
    (exact singular values). Already averaged over data-parallel ranks."""
    state: Optional[AdaptiveRank] = layer.rank_state
    if state is None or state.measured:
        return
    if isinstance(record, dict):
        sketch = record[state.side].to(torch.float32)
        scale = sketch.shape[-1]
        # The squared singular values of the tall d x k sketch are the eigenvalues of its k x k Gram matrix:
        # a small symmetric eigenproblem instead of an SVD of the sketch. Both err by ~eps x the largest
        # energy, far below the shares of the energy the allocation compares; rounding can leave a vanishing
        # eigenvalue slightly negative, hence the clamp. The Gram's trace is the sketch's whole energy.
        gram = sketch.mT @ sketch
        values = torch.linalg.eigvalsh(gram).flip(-1).clamp_min_(0)
        total = gram.diagonal(dim1=-2, dim2=-1).sum()
    else:
        grad = record.to(torch.float32)
        scale = 1
        values = torch.linalg.svdvals(grad).square()
        total = grad.square().sum()
    # An expert stack's record has the experts in front (E x ...): its spectrum is the experts' summed value by
    # value (each expert's sorted descending, so the sum is too), its total the whole stack's energy.
    if values.dim() > 1:
        values = values.reshape(-1, values.shape[-1]).sum(0)
    count = min(state.high, values.shape[0])
    torch.div(values[:count], scale, out=layer.galore_spectrum[:count])
    if count < state.high:
        layer.galore_spectrum[count:].zero_()  # past the values measured (a record narrower than rank_max)
    torch.div(total, scale, out=layer.galore_spectrum_total)
    state.measured = True


def basis_columns(layer: Any, sketch: torch.Tensor, rank: int) -> torch.Tensor:
    """The columns of a refresh's sketch (d x k, or E x d x k) from which the basis of rank `rank` is computed:
    the first rank + oversampling, the width a uniform layer of that rank records. An adaptive layer's record
    is wider where it serves more than this basis (the calibration's, for the spectrum; a refresh that lowers
    the rank, recorded for the old one); the leading columns of a Gaussian sketch are a Gaussian sketch too,
    so the basis costs and is as good as a uniform layer's. A fixed-rank layer's record is that width already."""
    if layer.rank_state is None:
        return sketch
    return sketch[..., : min(rank + layer.config.oversampling, sketch.shape[-1])]


def set_target(layer: Any, rank: int) -> None:
    """Give the layer the rank it takes at its next refresh (the allocator's)."""
    state: AdaptiveRank = layer.rank_state
    if not state.low <= rank <= state.high:
        raise ValueError(f"rank {rank} is outside this layer's bounds [{state.low}, {state.high}]")
    state.target = rank
    layer.galore_rank_target.fill_(rank)


def rank_to_adopt(layer: Any) -> Optional[int]:
    """The rank this refresh gives the layer where it differs from the current one (None: keep)."""
    state: Optional[AdaptiveRank] = layer.rank_state
    if state is None or not state.target or state.target == current_rank(layer):
        return None
    return state.target


@torch.no_grad()
def resize(layer: Any, rank: int) -> None:
    """Give the layer rank `rank`: a zero factor and a zero basis of the new shape and the scale of the new
    rank. The caller folds the factor into W0 first (a refresh) or loads values after (a load)."""
    state: AdaptiveRank = layer.rank_state
    if state.side == "right":
        layer.right_rank = rank
    else:
        layer.left_rank = rank
    factor = layer.galore_factor
    shape = (*layer.stack_shape, layer.left_rank or layer.out_features, layer.right_rank or layer.in_features)
    # The same Parameter object with new contents (an optimizer's param groups hold it): swapped rather than
    # `.data` reassigned, because a graph still alive from the last step (a loss variable a loop keeps) holds
    # the factor's gradient accumulator, which checks gradients against the shape it was created with.
    fresh = torch.nn.Parameter(
        torch.zeros(shape, dtype=factor.dtype, device=factor.device), requires_grad=factor.requires_grad
    )
    fresh.__dict__.update(factor.__dict__)
    factor.grad = None
    try:
        torch.utils.swap_tensors(factor, fresh)
    except RuntimeError:
        # swap_tensors refuses a tensor something holds a weak reference to (a memory tracker, an engine's
        # registry): the contents then go in through `.data`, which holds as long as no graph of an earlier
        # step is alive (the Trainer's loop keeps none).
        factor.data = fresh.data
    layer.scale = layer.config.layer_scale([(state.dim, rank)])
    if layer.folded_side is not None:
        layer.galore_folded_scale.fill_(layer.scale)
    layer.set_basis(state.side, torch.zeros(layer.basis_shape(state.dim, rank), device=factor.device))


def before_load(layer: Any, state_dict: dict[str, Any], prefix: str) -> None:
    """Take the rank of the factor being loaded (a checkpoint of a run whose allocation changed it)."""
    state: Optional[AdaptiveRank] = layer.rank_state
    if state is None:
        return
    saved = state_dict.get(prefix + "galore_factor")
    factor = layer.galore_factor
    if saved is None or tuple(saved.shape) == tuple(factor.shape) or saved.dim() != factor.dim():
        return
    if saved.shape[:-2] != factor.shape[:-2]:
        return
    rank = saved.shape[-1] if state.side == "right" else saved.shape[-2]
    if not 1 <= rank <= state.high:
        return  # not a rank this layer can take: the load reports the size mismatch
    resize(layer, rank)


def after_load(layer: Any) -> None:
    """Re-read the host copies from the loaded buffers (a load syncs anyway)."""
    state: Optional[AdaptiveRank] = layer.rank_state
    if state is None:
        return
    spectrum, target = layer.galore_spectrum, layer.galore_rank_target
    if spectrum.is_meta or target.is_meta or _fake(spectrum):
        return
    state.measured = not bool(torch.isnan(spectrum[0]))
    state.target = int(target)


def reset(layer: Any) -> None:
    """A new layer's rank state (``reset_galore_state``): the starting rank, nothing measured or allocated."""
    state: Optional[AdaptiveRank] = layer.rank_state
    if state is None:
        return
    if current_rank(layer) != state.start:
        resize(layer, state.start)
    layer.galore_spectrum.fill_(math.nan)
    layer.galore_spectrum_total.fill_(math.nan)
    layer.galore_rank_target.zero_()
    state.measured, state.target = False, 0


def _fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(tensor)

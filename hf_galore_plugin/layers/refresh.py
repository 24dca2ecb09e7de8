"""A GaLore layer's basis refresh: what a refresh step records, and the refresh itself.

Recording (in the refresh step's backward, a hook on the output of :func:`~.function.galore_linear`): the dense fp32
gradient G = dy^T x, or with ``basis_method='sketch'`` one streaming sketch per basis side, summed over
micro-batches. The refresh (after the optimizer step): average the record over data-parallel ranks,
compute the new bases (:mod:`hf_galore_plugin.projection`), fold the factor B into W0, install the bases,
adapt the lazy gap (Q-GaLore) and hand the optimizer the change of basis of the factor (its transport
matrices and the ``moment_handling`` policy) through the engine contract's one seam
(:func:`hf_galore_plugin.engines.contract.change_basis`): what it means for the optimizer's state is the
optimizer's business, and a layer never touches that state. The effective weight is unchanged by a refresh.

The functions take the layer as a :class:`RefreshTarget`: the protocol lists everything a refresh reads
and writes, all of it public members of the layer, and :class:`~.base.GaLoreLayerBase` (which binds the public
functions as its methods) is checked against it by mypy.
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional, Protocol, TypeVar

import torch

from ..engines.capabilities import check_moment_handling
from ..engines.collectives import all_reduce_mean as _all_reduce_mean
from ..engines.collectives import is_dtensor as _is_dtensor
from ..engines.collectives import local_shard as _local
from ..engines.collectives import world_size as _world_size
from ..engines.contract import change_basis, factor_rescaled, gathered_parameters, param_changed
from ..projection import BasisError, Reduce, basis_from_sketch, compute_basis, subspace_similarity, transport_matrix
from ..config import GaLoreConfig
from . import rank as _rank
from .counters import LayerCounters
from .storage import stochastic_round_to_bf16

__all__ = [
    "RefreshTarget",
    "basis_from_gradient",
    "fold_factor_into_base",
    "record_gradient",
    "refresh",
    "refresh_record_nbytes",
    "run_refresh",
    "sketch_exchange_numel",
    "sketch_test_matrix",
    "update_lazy_gap",
]


class RefreshTarget(Protocol):
    """What the refresh reads and writes of a layer (a :class:`~hf_galore_plugin.layers.GaLoreLinear`): public
    members only."""

    refresh_record: Optional[torch.Tensor | dict[str, torch.Tensor]]

    @property
    def config(self) -> GaLoreConfig: ...
    @property
    def scale(self) -> float: ...
    @property
    def in_features(self) -> int: ...
    @property
    def out_features(self) -> int: ...
    @property
    def left_rank(self) -> Optional[int]: ...
    @property
    def right_rank(self) -> Optional[int]: ...
    @property
    def left_identity(self) -> bool: ...
    @property
    def right_identity(self) -> bool: ...
    @property
    def needs_basis(self) -> bool: ...
    @property
    def calibrated(self) -> bool: ...
    @property
    def galore_factor(self) -> torch.nn.Parameter: ...
    @property
    def weight(self) -> Optional[torch.nn.Parameter]: ...
    @property
    def galore_step(self) -> torch.Tensor: ...
    @property
    def galore_last_similarity(self) -> torch.Tensor: ...

    @property
    def counts(self) -> LayerCounters: ...

    def counter(self, name: str) -> int: ...
    def adopt_counter_writes(self) -> None: ...
    def update_refresh_due(self) -> bool: ...
    def basis_sides(self) -> list[tuple[str, int]]: ...
    def sketch_width(self, rank: int) -> int: ...
    def next_generator(self, device: torch.device) -> torch.Generator: ...
    def basis(self, side: str, dtype: Optional[torch.dtype] = None) -> Optional[torch.Tensor]: ...
    def set_basis(self, side: str, basis: torch.Tensor) -> None: ...
    def effective_weight(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor: ...
    def store_weight(self, value: torch.Tensor, *, measure: bool = True) -> None: ...
    def reset_alpha(self) -> None: ...
    def refresh_record_nbytes(self) -> int: ...
    def sketch_test_matrix(self, side: str, device: Optional[torch.device] = None) -> torch.Tensor: ...
    def sketch_exchange_numel(self) -> int: ...


# Keeps the sketch's test-matrix seeds apart from the counter-driven seeds of the layer's next_generator.
_SKETCH_STREAM = 0x5EED_5EED_0000_0000


# ---------------------------------------------------------------------- what a refresh step records
def refresh_record_nbytes(layer: RefreshTarget) -> int:
    """Bytes a refresh of this layer holds from its backward to the refresh: the fp32 gradient (m x n),
    or with basis_method='sketch' one fp32 sketch per basis side (that side's dimension x k)."""
    if not layer.needs_basis:
        return 0
    if layer.config.basis_method != "sketch":
        return 4 * layer.out_features * layer.in_features
    dims = {"left": layer.out_features, "right": layer.in_features}
    return sum(4 * dims[side] * layer.sketch_width(rank) for side, rank in layer.basis_sides())


def sketch_test_matrix(layer: RefreshTarget, side: str, device: Optional[torch.device] = None) -> torch.Tensor:
    """The Gaussian test matrix Omega of the current step's sketch of `side` (fp32).

    'left' (basis P, m x r): Omega is n x k and the sketch G Omega = dy^T (x Omega) spans G's columns;
    'right' (basis Q, n x r): Omega is m x k and the sketch G^T Omega = x^T (dy Omega) spans G's rows.
    Drawn from (layer seed, step, side): the same on every data-parallel rank and every micro-batch of
    a step (so the sketch stays linear in the step's gradient), and after a resume; a stream of its
    own, apart from the counter-driven one of stochastic rounding and the randomized range finder.
    """
    rank = dict(layer.basis_sides())[side]
    dim = layer.in_features if side == "left" else layer.out_features
    device = torch.device(device) if device is not None else layer.galore_step.device
    generator = torch.Generator(device=device)
    side_index = 0 if side == "left" else 1
    stream = (layer.counter("galore_seed") * 1_000_039 + layer.counter("galore_step")) * 2 + side_index
    generator.manual_seed(stream ^ _SKETCH_STREAM)
    return torch.randn(dim, layer.sketch_width(rank), generator=generator, device=device, dtype=torch.float32)


def record_gradient(layer: RefreshTarget, dy: torch.Tensor, x: torch.Tensor) -> None:
    """Add this micro-batch's gradient (dy: N x m, x: N x n) to the layer's refresh record.

    Accumulates over micro-batches (gradient accumulation, or several forwards in one step).
    """
    if layer.config.basis_method == "sketch":
        _record_sketch(layer, dy, x)
        return
    g = dy.to(torch.float32).mT @ x.to(torch.float32)
    record = layer.refresh_record
    if record is None:
        layer.refresh_record = g
    else:
        assert isinstance(record, torch.Tensor), "a dense record is one tensor"
        record += g


def _record_sketch(layer: RefreshTarget, dy: torch.Tensor, x: torch.Tensor) -> None:
    # Y = G Omega (left) or G^T Omega (right) with G = dy^T x, evaluated so that no m x n tensor is
    # formed: N x k and k x dim temporaries only. Linear in G, so the sum over micro-batches is the
    # sketch of the step's gradient, and the mean over ranks the sketch of the averaged gradient.
    dy32, x32 = dy.to(torch.float32), x.to(torch.float32)
    record = layer.refresh_record if layer.refresh_record is not None else {}
    assert isinstance(record, dict), "a sketch record holds one sketch per basis side"
    for side, _ in layer.basis_sides():
        omega = layer.sketch_test_matrix(side, dy.device)
        sketch = dy32.mT @ (x32 @ omega) if side == "left" else x32.mT @ (dy32 @ omega)
        if side in record:
            record[side] += sketch
        else:
            record[side] = sketch
    layer.refresh_record = record


def sketch_exchange_numel(layer: RefreshTarget) -> int:
    """Values a data-parallel refresh all-reduces with the randomized range finder's sketches (with
    basis_method='sketch': the streaming sketches themselves)."""
    m, n = layer.out_features, layer.in_features
    if layer.config.basis_method == "sketch":
        return layer.refresh_record_nbytes() // 4
    total = 0
    for rank, identity in ((layer.left_rank, layer.left_identity), (layer.right_rank, layer.right_identity)):
        if rank is not None and not identity:
            k = min(rank + layer.config.oversampling, m, n)
            total += k * (m + n) * (1 + layer.config.power_iterations)
    return total


# ---------------------------------------------------------------------- the refresh
def basis_from_gradient(
    layer: RefreshTarget, grad: torch.Tensor, side: str, rank: int, *, reduce: Optional[Reduce] = None
) -> torch.Tensor:
    """The new basis of `side` from the recorded gradient `grad` by the layer's ``basis_method`` (its random
    stream for the randomized range finder; `reduce` averages its sketches over data-parallel ranks)."""
    config = layer.config
    generator = layer.next_generator(grad.device) if config.basis_method == "randomized" else None
    return compute_basis(
        grad,
        side=side,
        rank=rank,
        method=config.basis_method,
        oversampling=config.oversampling,
        power_iterations=config.power_iterations,
        generator=generator,
        reduce=reduce,
    )


def refresh(layer: RefreshTarget, optimizer: Optional[torch.optim.Optimizer] = None) -> Optional[float]:
    """Fold the factor into W0, compute the new basis from the recorded gradient, adapt the gap.

    `optimizer` may be an engine adapter (hf_galore_plugin.engines.contract.EngineAdapter) that also
    provides ``gathered_parameters(layer)``: a context in which the layer's partitioned
    parameters are whole (DeepSpeed ZeRO-3) and after which changes are partitioned again.
    """
    return run_refresh(layer, optimizer, _refresh)


_Target = TypeVar("_Target", bound=RefreshTarget)


def run_refresh(
    layer: _Target,
    optimizer: Optional[torch.optim.Optimizer],
    body: Callable[[_Target, Optional[torch.optim.Optimizer]], Optional[float]],
) -> Optional[float]:
    """Run a refresh `body` (a linear layer's or an expert stack's) on `layer`: its counters taken from their
    buffers first, its parameters whole inside (an engine's gather), its due flag recomputed after, also
    when `body` raises."""
    # A refresh syncs the device anyway (basis computation, similarity): the one place where comparing
    # the counter buffers with their host copies costs nothing extra.
    assert isinstance(layer, torch.nn.Module), "a GaLore layer is an nn.Module (an engine gathers its parameters)"
    layer.adopt_counter_writes()
    try:
        with gathered_parameters(optimizer, layer):
            return body(layer, optimizer)
    finally:
        layer.update_refresh_due()


@torch.no_grad()
def _refresh(layer: RefreshTarget, optimizer: Optional[torch.optim.Optimizer]) -> Optional[float]:
    grad = layer.refresh_record
    layer.refresh_record = None
    if grad is None:
        raise RuntimeError("GaLoreLinear.refresh() needs the gradient recorded during a refresh step's backward")
    if isinstance(grad, dict):
        # Streaming sketches: averaging them over the ranks is exact (they are linear in the gradient).
        reduced = {side: _all_reduce_mean(grad[side]) for side, _ in layer.basis_sides()}
        _rank.measure_spectrum(layer, reduced)
        target = _rank.rank_to_adopt(layer)
        try:
            sketched = {
                side: basis_from_sketch(_rank.basis_columns(layer, reduced[side], target or rank), rank=target or rank)
                for side, rank in layer.basis_sides()
            }
        except BasisError as exc:
            _basis_failed(layer, exc)
            return None
        return _install_bases(layer, sketched, optimizer)
    # Data-parallel ranks recorded different micro-batches. The randomized range finder can average
    # its sketches over the ranks instead of the gradient: k (m + n) (1 + power_iterations) values
    # per side, which beats the m x n gradient only when k is small against m and n; each layer
    # takes the smaller exchange (the same choice on every rank). The exact SVD needs the averaged
    # gradient itself (one layer at a time, once per gap).
    config = layer.config
    sketch_reduce = None
    if config.basis_method == "randomized" and _world_size() > 1:
        if layer.sketch_exchange_numel() < layer.out_features * layer.in_features:
            sketch_reduce = _all_reduce_mean
    if sketch_reduce is None:
        grad = _all_reduce_mean(grad)
        _rank.measure_spectrum(layer, grad)
    target = _rank.rank_to_adopt(layer)
    new_bases: dict[str, torch.Tensor] = {}
    try:
        for side in ("left", "right"):
            rank = layer.left_rank if side == "left" else layer.right_rank
            identity = layer.left_identity if side == "left" else layer.right_identity
            if rank is None or identity:
                continue
            new_bases[side] = basis_from_gradient(layer, grad, side, target or rank, reduce=sketch_reduce)
    except BasisError as exc:
        _basis_failed(layer, exc)
        return None
    return _install_bases(layer, new_bases, optimizer)


def _basis_failed(layer: RefreshTarget, exc: BasisError) -> None:
    # Never stop training for a bad basis: keep the old one, try again after one more gap.
    warnings.warn(f"GaLore basis refresh failed ({exc}); keeping the previous basis", stacklevel=4)
    layer.counts.set("galore_last_refresh", layer.counter("galore_step"))


def _basis(layer: RefreshTarget, side: str) -> torch.Tensor:
    basis = layer.basis(side, torch.float32)
    assert basis is not None, f"the {side} side of this layer has a basis"
    return basis


def _install_bases(
    layer: RefreshTarget, new_bases: dict[str, torch.Tensor], optimizer: Optional[torch.optim.Optimizer]
) -> float:
    """Fold the factor into W0, swap in `new_bases`, adapt the lazy gap and the optimizer state. Bases of another
    rank (rank_allocation='auto') give the factor their shape, and its optimizer state restarts."""
    first = not layer.calibrated
    old_bases = {side: _basis(layer, side).clone() for side in new_bases}
    fold_factor_into_base(layer, optimizer)
    resized = any(basis.shape[-1] != old_bases[side].shape[-1] for side, basis in new_bases.items())
    if resized:
        old_scale = layer.scale
        _rank.resize(layer, next(iter(new_bases.values())).shape[-1])
        factor_rescaled(optimizer, layer.galore_factor, layer.scale / old_scale)
        first = True  # no similarity between subspaces of different ranks; the state restarts
    for side, basis in new_bases.items():
        layer.set_basis(side, basis)
    stored = {side: _basis(layer, side) for side in new_bases}

    similarity = float("nan")
    if not first:
        similarity = sum(float(subspace_similarity(old_bases[s], stored[s])) for s in stored) / len(stored)
        update_lazy_gap(layer, similarity)
    layer.galore_last_similarity.fill_(similarity)
    if optimizer is not None:
        _change_basis(layer, optimizer, "reset" if first else layer.config.moment_handling, old_bases, stored)
    layer.counts.set("galore_last_refresh", layer.counter("galore_step"))
    layer.counts.add("galore_num_refreshes")
    return similarity


def fold_factor_into_base(layer: RefreshTarget, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """W0 <- alpha * W0 + scale * lowrank(B), alpha <- 1, B <- 0: the effective weight is unchanged."""
    merged = layer.effective_weight(torch.float32)
    weight = layer.weight
    if weight is not None:
        merged = _local(merged)
        if weight.dtype == torch.bfloat16 and layer.config.stochastic_rounding:
            merged = stochastic_round_to_bf16(merged, layer.next_generator(merged.device))
        # In place: FSDP2 all-gathers W0 from the storage of its local shard, and DDP/ZeRO keep
        # references to the parameter; rebinding `.data` would detach W0 from the engine.
        _local(weight).copy_(merged)
    else:
        layer.store_weight(merged)
    layer.reset_alpha()
    _local(layer.galore_factor).zero_()
    # Engines that keep their own master copy of the factor (DeepSpeed ZeRO) reload it from the model.
    param_changed(optimizer, layer.galore_factor)


def update_lazy_gap(layer: RefreshTarget, similarity: float) -> None:
    """Q-GaLore's lazy refresh (Zhang et al. 2024, Sec. 3.3): a layer whose subspace stopped moving (`similarity`
    at least ``cos_threshold`` for ``lazy_window`` refreshes) refreshes less often (its gap grows)."""
    config = layer.config
    if not config.lazy_refresh:
        return
    if similarity >= config.cos_threshold:
        layer.counts.add("galore_agree_count")
    else:
        layer.counts.set("galore_agree_count", 0)
    if layer.counter("galore_agree_count") >= config.lazy_window:
        grown = min(layer.counter("galore_gap") * config.lazy_growth, config.effective_max_proj_gap)
        layer.counts.set("galore_gap", grown)
        layer.counts.set("galore_agree_count", 0)


def _change_basis(
    layer: RefreshTarget, optimizer, policy: str, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]
) -> None:
    # The optimizer gets the geometry of the change and the policy; what they mean for its state is its own
    # business (engines.basis). The transport matrices are needed for 'project' only.
    left = right = None
    if policy == "project":
        if _is_dtensor(layer.galore_factor):
            check_moment_handling("fsdp2", moment_handling="project", left_basis="left" in new)
        left = transport_matrix(old["left"], new["left"]) if "left" in new else None
        right = transport_matrix(old["right"], new["right"]) if "right" in new else None
    change_basis(optimizer, layer.galore_factor, left=left, right=right, policy=policy)

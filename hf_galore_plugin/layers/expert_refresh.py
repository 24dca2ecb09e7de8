"""The refresh of a :class:`~.experts.GaLoreExpertStack`: each expert that received tokens in the recorded step
gets a new basis from its own gradient (or sketch), the others keep theirs.

Data-parallel ranks routed different tokens: an expert counts as hit when any rank sent it tokens, and its basis
comes from the record averaged over the ranks. An expert that received fewer tokens than the rank has a record
of rank below r, whose decomposition leaves columns that rounding picks: :func:`_complete` fixes them. The
functions take the stack as an :class:`ExpertRefreshTarget` (public members only); the change of basis of the
factor goes to the optimizer per expert (``engines.contract.change_basis`` with an expert mask).
"""

from __future__ import annotations

import logging
import warnings
from typing import Optional, Protocol

import torch
from torch._subclasses.fake_tensor import is_fake

from ..engines.collectives import all_reduce_mean
from ..engines.contract import change_basis, factor_rescaled
from ..projection import BasisError, basis_from_sketch, subspace_similarity, transport_matrix
from . import rank as _rank
from .refresh import RefreshTarget, basis_from_gradient, run_refresh, update_lazy_gap

__all__ = ["ExpertRefreshTarget", "refresh"]

# The expert layers' one logger (hf_galore_plugin.layers.experts), whose INFO records report experts without tokens.
logger = logging.getLogger(f"{__package__}.experts")


class ExpertRefreshTarget(RefreshTarget, Protocol):
    """What the expert refresh reads and writes of a stack, besides a layer's :class:`~.refresh.RefreshTarget`."""

    refresh_tokens: Optional[torch.Tensor]

    @property
    def num_experts(self) -> int: ...
    @property
    def galore_expert_refreshes(self) -> torch.Tensor: ...

    def fold_factor_into_base(self, optimizer: Optional[torch.optim.Optimizer] = None) -> None: ...


def _basis_value(stack: ExpertRefreshTarget, side: str) -> torch.Tensor:
    basis = stack.basis(side, torch.float32)
    assert basis is not None, "sides come from basis_sides()"
    return basis


def refresh(stack: ExpertRefreshTarget, optimizer: Optional[torch.optim.Optimizer] = None) -> Optional[float]:
    """Fold the factors into W0 and give every expert that received tokens in the recorded step a new
    basis from its own gradient; the others keep theirs. Returns the mean subspace similarity of the
    experts that were refreshed and had a basis before (NaN when none had)."""
    return run_refresh(stack, optimizer, _refresh_experts)


@torch.no_grad()
def _refresh_experts(stack: ExpertRefreshTarget, optimizer: Optional[torch.optim.Optimizer]) -> Optional[float]:
    record, tokens = stack.refresh_record, stack.refresh_tokens
    stack.refresh_record, stack.refresh_tokens = None, None
    if record is None or tokens is None:
        raise RuntimeError("GaLoreExpertStack.refresh() needs the gradient recorded during a refresh step's backward")
    # Data-parallel ranks routed different tokens: an expert counts as hit when any rank sent it tokens,
    # and its basis comes from the gradient averaged over the ranks (as for a linear layer).
    fake = is_fake(tokens)
    # Under fake tensors (the memory planner) every expert counts as routed to (even routing).
    hit = [True] * stack.num_experts if fake else (all_reduce_mean(tokens) > 0).tolist()
    # rank_allocation='auto': the calibration measures the experts' spectra (rank.measure_spectrum), and a refresh
    # after the allocation gives every expert the stack's new rank (rank.rank_to_adopt).
    if isinstance(record, dict):
        record = {side: all_reduce_mean(record[side]) for side, _ in stack.basis_sides()}
    else:
        record = all_reduce_mean(record)
    _rank.measure_spectrum(stack, record)
    target = _rank.rank_to_adopt(stack)
    sides = [(side, target or rank) for side, rank in stack.basis_sides()]
    old = {side: _basis_value(stack, side).clone() for side, _ in sides}
    new = {side: _kept_bases(old[side], rank, fake) for side, rank in sides}
    try:
        if isinstance(record, dict):
            for expert in (e for e in range(stack.num_experts) if hit[e]):
                for side, rank in sides:
                    sketch = _rank.basis_columns(stack, record[side][expert], rank)
                    basis = basis_from_sketch(sketch, rank=rank)
                    new[side][expert] = basis if fake else _complete(basis, _numerical_rank(sketch), old[side][expert])
        else:
            grad = record
            for expert in (e for e in range(stack.num_experts) if hit[e]):
                determined = None if fake else _numerical_rank(grad[expert])
                for side, rank in sides:
                    basis = basis_from_gradient(stack, grad[expert], side, rank)
                    new[side][expert] = basis if determined is None else _complete(basis, determined, old[side][expert])
    except BasisError as exc:
        warnings.warn(f"GaLore expert basis refresh failed ({exc}); keeping the previous bases", stacklevel=4)
        stack.counts.set("galore_last_refresh", stack.counter("galore_step"))
        return None
    del record
    first = not stack.calibrated
    had_basis = [not first] * stack.num_experts if fake else (stack.galore_expert_refreshes > 0).tolist()
    stack.fold_factor_into_base(optimizer)
    if target is not None:
        # Bases of another rank give the factor their shape; its optimizer state restarts (as a linear layer's).
        old_scale = stack.scale
        _rank.resize(stack, target)
        factor_rescaled(optimizer, stack.galore_factor, stack.scale / old_scale)
        first = True  # no similarity between subspaces of different ranks
    for side, basis in new.items():
        stack.set_basis(side, basis)
    stored = {side: _basis_value(stack, side) for side in new}
    refreshed = [e for e in range(stack.num_experts) if hit[e]]
    compared = [] if first else [e for e in refreshed if had_basis[e]]
    similarity = float("nan")
    if compared:
        similarity = sum(subspace_similarity(old[side][e], stored[side][e]) for side in stored for e in compared) / (
            len(compared) * len(stored)
        )
        update_lazy_gap(stack, similarity)
    stack.galore_last_similarity.fill_(similarity)
    if optimizer is not None:
        _change_basis(stack, optimizer, first, hit, old, stored)
    kept = stack.num_experts - len(refreshed)
    if kept:
        never = sum(1 for e in range(stack.num_experts) if not hit[e] and not had_basis[e])
        logger.info(
            "GaLore expert refresh at step %d: %d of %d experts received no tokens in the recorded step and "
            "keep their basis%s",
            stack.counter("galore_step"),
            kept,
            stack.num_experts,
            f" ({never} have none yet: their factors get no gradient until a refresh step routes tokens to them)"
            if never
            else "",
        )
    refreshes = stack.galore_expert_refreshes
    refreshes.add_(torch.tensor(hit, device=refreshes.device).to(torch.int64))
    stack.counts.set("galore_last_refresh", stack.counter("galore_step"))
    stack.counts.add("galore_num_refreshes")
    return similarity


def _change_basis(
    stack: ExpertRefreshTarget,
    optimizer: torch.optim.Optimizer,
    first: bool,
    hit: list[bool],
    old: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
) -> None:
    """Hand the optimizer the change of basis of the factor (engines.contract.change_basis): per expert, one
    that kept its basis keeps its state (identity transport, out of the `experts` mask); a refreshed one
    follows ``moment_handling`` ('keep', 'reset', 'project'); a first calibration resets the whole state."""
    policy = "reset" if first else stack.config.moment_handling
    device = stack.galore_factor.device
    experts = None if first or all(hit) else torch.tensor(hit, dtype=torch.bool, device=device)
    transports: dict[str, torch.Tensor] = {}
    if policy == "project":
        mask = torch.tensor(hit, dtype=torch.bool, device=device).view(-1, 1, 1)
        for side, basis in new.items():
            eye = torch.eye(basis.shape[-1], device=basis.device).expand(stack.num_experts, -1, -1)
            transports[side] = torch.where(mask, transport_matrix(old[side], basis), eye)
    change_basis(
        optimizer,
        stack.galore_factor,
        left=transports.get("left"),
        right=transports.get("right"),
        policy=policy,
        experts=experts,
    )


def _kept_bases(old: torch.Tensor, rank: int, fake: bool) -> torch.Tensor:
    """The bases (E x d x `rank`) of the experts that keep theirs at a refresh: their own where the rank stays; at
    a change of rank (rank_allocation='auto') their first columns, completed as :func:`_complete` does."""
    if old.shape[-1] == rank:
        return old.clone()
    if fake:
        return old.new_zeros(*old.shape[:-1], rank)
    kept = min(rank, old.shape[-1])
    bases = []
    for previous in old.unbind(0):
        padded = torch.cat([previous[:, :kept], previous.new_zeros(previous.shape[0], rank - kept)], 1)
        bases.append(_complete(padded, kept, previous))
    return torch.stack(bases)


def _numerical_rank(matrix: torch.Tensor) -> int:
    """The rank of `matrix` at fp32 precision: its singular values above max(shape) * eps * the largest (the
    rule of LAPACK's and numpy's matrix_rank)."""
    values = torch.linalg.svdvals(matrix.detach().to(torch.float32))
    if values.numel() == 0 or float(values[0]) == 0.0:
        return 0
    return int((values > float(values[0]) * max(matrix.shape) * torch.finfo(torch.float32).eps).sum())


def _complete(basis: torch.Tensor, determined: int, previous: torch.Tensor) -> torch.Tensor:
    """`basis` (d x r) with its columns past the first `determined` replaced by directions rounding cannot move.

    An expert that received fewer tokens than the rank in the recorded step has a gradient (and sketch) of
    rank below r: a decomposition returns its top `determined` singular vectors and then vectors of singular
    value ~0, which the last bits of the input pick, so two runs that sum in another order (data-parallel
    ranks against one process) get different ones. Those columns are replaced by the expert's previous basis
    vectors, then the coordinate axes, each with the columns before it projected out (Gram-Schmidt, twice)
    and taken when more than half of its length is left: a continuous function of the determined columns,
    and the directions the gradient does not fix stay where they were. With a dense record ('svd', 'randomized')
    the rank costs one more decomposition (singular values only) of each refreshed expert's m x n gradient.
    """
    dim, rank = basis.shape
    if determined >= rank:
        return basis
    columns = list(basis[:, :determined].unbind(1))
    candidates = torch.cat([previous.to(basis.dtype), torch.eye(dim, dtype=basis.dtype, device=basis.device)], 1)
    for threshold in (0.5, 1e-3):
        for candidate in candidates.unbind(1):
            if len(columns) == rank:
                break
            vector = candidate
            for _ in range(2):
                if columns:
                    kept = torch.stack(columns, 1)
                    vector = vector - kept @ (kept.mT @ vector)
            norm = float(vector.norm())
            if norm > threshold:
                columns.append(vector / norm)
    return torch.stack(columns, 1).contiguous()

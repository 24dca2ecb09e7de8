"""Adafactor (Shazeer & Stern 2018, arXiv 1804.04235) for GaLore factors and the model's other parameters.

The algorithm is the one ``transformers.optimization.Adafactor`` (fairseq's) implements, with the same arguments
and defaults; written here so that it owns the change of basis of a GaLore factor (`change_basis`, the engine
contract's seam) and refuses what it cannot do on a factor.

Per parameter and step t (fp32 arithmetic; bf16 / fp16 parameters step in an fp32 copy):
- beta2_t = 1 - t ** decay_rate; the squared gradient g^2 + eps[0].
- Factored second moment for tensors of 2 or more dimensions (the last two are the matrix: an expert stack's
  E x m x r factor gets E row and column statistics): row = EMA of the mean of g^2 over the last dimension,
  col = EMA of its mean over the one before; v is approximated by (row / mean(row)) (x) col, so an m x r factor
  keeps m + r values instead of Adam's 2 m r. 1-D tensors keep the whole EMA of g^2.
- u = g / sqrt(v), clipped to RMS(u) <= clip_threshold (update clipping, the paper's section 6).
- Step size (relative step, section 8): with ``relative_step``, min(1e-2, 1/sqrt(t)) (``warmup_init``:
  min(1e-6 t, 1/sqrt(t))), else the group's lr; with ``scale_parameter`` multiplied by max(eps[1], RMS(param)).
- Optional first moment (``beta1``): m = beta1 m + (1 - beta1) lr_t u, the step is m (the momentum of the
  scaled update, as transformers keeps it).
- Weight decay ``param -= weight_decay * lr_t * param`` before the update (transformers' order).

State per parameter (tensors and plain values, so ``torch.load(weights_only=True)`` works): "step" (int),
"exp_avg_sq_row" / "exp_avg_sq_col" (fp32; shapes ``shape[:-1]`` and ``shape[:-2] + shape[-1:]``) or
"exp_avg_sq" (1-D), and "exp_avg" (fp32, the parameter's shape) with ``beta1``.

On a GaLore factor (a group with ``"galore": True``, from ``hf_galore_plugin.create_optimizer``): the factor's
gradient is ``scale * R`` (R the projected gradient galore-torch's GaLoreAdafactor steps on), so such a group's
eps[0] is multiplied by scale**2 (``galore_param_groups``) and the update is exactly the one of R; the weight
moves by ``lr * scale * update`` as in galore-torch. ``scale_parameter`` is refused there: it scales the step
by the RMS of the parameter, which for galore-torch is the whole weight and here would be the factor B (zero
after every refresh). ``relative_step`` with weight decay is refused there too: the base weight W0 decays with
the group's lr (``install_base_decay_hook``), which a relative step does not use. A GaLore factor must
be 2-D or 3-D, or a 1-D slice with registered fragments (below); an unregistered 1-D slice is refused.

Under FSDP2 a parameter is a DTensor sharded on rows (``Shard(0)``, replicated over any other mesh dimension) and
its state is DTensors (distributed checkpoints reshard them): "exp_avg", "exp_avg_sq" and "exp_avg_sq_row" are
sharded on dimension 0 like the parameter, each rank updating its own rows. What sums over the sharded
dimension is summed over the shards (one all-reduce each): the column statistic of a matrix (the mean of g^2
over its rows, r values; kept whole on every rank, a replicated DTensor), the mean of its row statistic, and the
RMS of the update (and of the parameter, with ``scale_parameter``). An expert stack sharded on its expert
dimension holds whole matrices: its statistics are local, and only the RMS is summed. The update is one
process's up to the order of those sums.

An engine's 1-D slice (FSDP1's views with ``use_orig_params=True``; DeepSpeed ZeRO's flat partitions) steps by
the fragments its engine registered on it (``engines.fragments``: elements [start, stop) of each matrix or
vector flattened row-major, possibly none), one by one in the order every rank shares, with two small
all-reduces each: the partial row and column sums of the squared gradient over the local elements (the
matrix's m + r values, E m + E r for a stack), with the parameter's sum of squares under ``scale_parameter``;
then the update's sum of squares. Whether the slice steps at all is decided once per slice and step by one
all-reduced flag (`engines.fragments.any_rank`: a rank without elements has no gradient where the others have
one; skipping follows the flag, never a local None, so every rank makes the same collectives).
The row and column statistics are whole on every rank that holds elements of the matrix, the factored
``1/sqrt(v)`` is taken at the local elements, and the RMS, clipping, step size, first moment and weight decay
are the whole matrix's, so the update is one process's up to the order of the sums. State of such a slice:
"step", "exp_avg" (beta1) and "exp_avg_sq" (for vector fragments) as 1-D tensors of the slice's shape
(elementwise, sharded as the slice is), and "exp_avg_sq_row" / "exp_avg_sq_col" as lists with one entry per
fragment (None for a vector or one without local elements). ``state_dict`` writes those lists as numbers,
which FSDP1's optimizer state dict keeps as they are (it checks them equal on the ranks holding the
parameter; a tensor there would be cut as a slice of the flat parameter), and gives every registered slice
every elementwise key of the others (zeros without memory, dropped by ``load_state_dict``): FSDP1's optimizer
state dict needs the same elementwise keys on every parameter of a unit. A rank without elements of a
parameter keeps no state for it. 'project' is refused there (``engines.capabilities``); 'reset' of some
experts zeroes their elements and statistics.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Optional

import torch

from hf_galore_plugin.engines.basis import LINEAR, SQUARED, BasisChange
from hf_galore_plugin.engines.collectives import (
    check_matrix_layout,
    is_dtensor,
    local_shard,
    placed_like,
    sum_over_shards,
)
from hf_galore_plugin.engines.fragments import (
    expert_elements,
    any_rank,
    fragments_of,
    is_placeholder,
    matrix_indices,
    sum_over_fragment,
    uniform_elementwise_state,
)

__all__ = ["Adafactor", "ADAFACTOR_STATE_KEYS"]

ADAFACTOR_STATE_KEYS = ("exp_avg", "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq")


def _rms(tensor: torch.Tensor, param: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The RMS of the whole tensor whose local part is `tensor`: of `param`'s shape, summed over its shards
    (*collective*) when `param` is a DTensor."""
    if param is None or not is_dtensor(param):
        return tensor.norm(2) / (tensor.numel() ** 0.5)
    return sum_over_shards(tensor.square().sum(), param).sqrt() / (param.numel() ** 0.5)


def _mean(local: torch.Tensor, dim: int, param: Optional[torch.Tensor], keepdim: bool = False) -> torch.Tensor:
    """The mean over dimension `dim` of the state or gradient tensor whose local part is `local`. Where that
    dimension is `param`'s dimension 0 and `param` a DTensor (a matrix's rows under FSDP2), the sums of the
    shards are summed (*collective*) and divided by the rows of the whole parameter."""
    if param is None or not (is_dtensor(param) and dim % local.dim() == 0):
        return local.mean(dim=dim, keepdim=keepdim)
    return sum_over_shards(local.sum(dim=dim, keepdim=keepdim), param) / param.shape[0]


def _second_moment(row: torch.Tensor, col: torch.Tensor, param: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The factored second moment as a matrix: (row / mean(row)) (x) col (the paper's rank-1 reconstruction,
    Algorithm 4; ``row / mean(row)`` is transformers' normalisation, mean(row) being the mean of the whole
    matrix). Local rows of a DTensor `param`."""
    return (row / _mean(row, -1, param, keepdim=True)).unsqueeze(-1) * col.unsqueeze(-2)


def _inverse_sqrt_second_moment(
    row: torch.Tensor, col: torch.Tensor, param: Optional[torch.Tensor] = None
) -> torch.Tensor:
    r_factor = (row / _mean(row, -1, param, keepdim=True)).rsqrt_().unsqueeze(-1)
    return r_factor * col.unsqueeze(-2).rsqrt()


def _check_group(group: dict[str, Any]) -> None:
    lr, eps = group["lr"], group["eps"]
    if group["relative_step"]:
        if lr is not None:
            raise ValueError(
                f"Adafactor: lr={lr} and relative_step=True cannot be combined (the relative step sets the step "
                "size); pass lr=None, or relative_step=False with a learning rate"
            )
    elif lr is None or not float(lr) >= 0.0:
        raise ValueError(f"Adafactor: lr={lr!r} is invalid without relative_step; use a learning rate >= 0 (e.g. 1e-3)")
    if group["warmup_init"] and not group["relative_step"]:
        raise ValueError("Adafactor: warmup_init=True needs relative_step=True (it is the relative step's warm-up)")
    if len(eps) != 2 or not all(float(e) >= 0.0 for e in eps):
        raise ValueError(f"Adafactor: eps={eps!r} is invalid; use two values >= 0, e.g. (1e-30, 1e-3)")
    if not float(group["clip_threshold"]) > 0.0:
        raise ValueError(f"Adafactor: clip_threshold={group['clip_threshold']!r} is invalid; use a value > 0 (1.0)")
    if not float(group["decay_rate"]) < 0.0:
        # beta2_t = 1 - t ** decay_rate must grow towards 1.
        raise ValueError(f"Adafactor: decay_rate={group['decay_rate']!r} is invalid; use a value < 0 (-0.8)")
    beta1 = group["beta1"]
    if beta1 is not None and not 0.0 <= float(beta1) < 1.0:
        raise ValueError(f"Adafactor: beta1={beta1!r} is invalid; use None (no first moment) or a value in [0, 1)")
    if not float(group["weight_decay"]) >= 0.0:
        raise ValueError(f"Adafactor: weight_decay={group['weight_decay']!r} is invalid; use a value >= 0")
    if group.get("galore"):
        if group["scale_parameter"]:
            raise ValueError(
                "Adafactor: scale_parameter=True is not supported on a GaLore group: it scales the step by the RMS "
                "of the parameter, which galore-torch takes of the whole weight but which here is the low-rank "
                "factor B (zero after every refresh). Use scale_parameter=False (transformers' galore_adafactor)."
            )
        if group["relative_step"] and float(group["weight_decay"]):
            raise ValueError(
                "Adafactor: relative_step=True with weight_decay > 0 is not supported on a GaLore group: the frozen "
                "base weight decays at the group's lr, which a relative step does not use. Use relative_step=False "
                "with a learning rate, or weight_decay=0."
            )


def _refuse_partitioned(param: torch.Tensor, group: dict[str, Any], building: bool = False) -> None:
    check_matrix_layout(
        param, optimizer="Adafactor", needs="its factored second moment needs the rows and columns of the matrix",
        preset="galore_adafactor", building=building,
    )  # fmt: skip


class Adafactor(torch.optim.Optimizer):
    """Adafactor with transformers' arguments and defaults (module docstring); every keyword may be set per group.

    A GaLore refresh changes the basis of a factor through `change_basis` (keep, reset, project).
    """

    # Per-matrix state (row and column statistics) beside the elementwise one, and one step count per parameter: an
    # engine cannot restart one factor inside a flat partition by zeroing its elements (DeepSpeedGaLoreOptimizer).
    elementwise_state = False

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: Optional[float] = None,
        eps: tuple[float, float] = (1e-30, 1e-3),
        clip_threshold: float = 1.0,
        decay_rate: float = -0.8,
        beta1: Optional[float] = None,
        weight_decay: float = 0.0,
        scale_parameter: bool = True,
        relative_step: bool = True,
        warmup_init: bool = False,
    ) -> None:
        defaults = {
            "lr": lr,
            "eps": tuple(eps),
            "clip_threshold": clip_threshold,
            "decay_rate": decay_rate,
            "beta1": beta1,
            "weight_decay": weight_decay,
            "scale_parameter": scale_parameter,
            "relative_step": relative_step,
            "warmup_init": warmup_init,
        }
        _check_group(defaults)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group["eps"] = tuple(group["eps"])
        _check_group(group)
        if group.get("galore"):
            for param in group["params"]:
                _refuse_partitioned(param, group, building=True)

    @staticmethod
    def _step_size(group: dict[str, Any], step: int, work: torch.Tensor, param: torch.Tensor) -> float | torch.Tensor:
        size: float = float(group["lr"]) if not group["relative_step"] else 0.0
        if group["relative_step"]:
            floor = 1e-6 * step if group["warmup_init"] else 1e-2
            size = min(floor, 1.0 / math.sqrt(step))
        if group["scale_parameter"]:
            # A tensor (no host sync): max(eps[1], RMS(param)) * size.
            return _rms(work, param).clamp(min=float(group["eps"][1])) * size
        return size

    def _init_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        shape = param.shape
        local = local_shard(param)
        device = local.device

        def zeros(whole: torch.Size, rows: torch.Size, replicated: bool = False) -> torch.Tensor:
            # `whole`: the state tensor's shape; `rows`: its local part's shape under a DTensor `param`
            # (its dimension 0 is the parameter's, sharded alike, unless `replicated`).
            if not is_dtensor(param):
                return torch.zeros(whole, dtype=torch.float32, device=device)
            value = torch.zeros(whole if replicated else rows, dtype=torch.float32, device=device)
            return placed_like(value, param, whole, replicated=replicated)

        state: dict[str, Any] = {"step": 0}
        if group["beta1"] is not None:
            state["exp_avg"] = zeros(shape, local.shape)
        if len(shape) >= 2:
            state["exp_avg_sq_row"] = zeros(shape[:-1], local.shape[:-1])
            # A matrix's column statistic sums over all rows: whole on every rank; a stack's is per expert.
            col_rows = local.shape[:-2] + local.shape[-1:]
            state["exp_avg_sq_col"] = zeros(shape[:-2] + shape[-1:], col_rows, replicated=len(shape) == 2)
        else:
            state["exp_avg_sq"] = zeros(shape, local.shape)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            galore = bool(group.get("galore"))
            eps1, clip = float(group["eps"][0]), float(group["clip_threshold"])
            beta1, wd = group["beta1"], float(group["weight_decay"])
            for param in group["params"]:
                if fragments_of(param) is not None:
                    # An engine's 1-D slice (FSDP1, ZeRO): stepped whatever its local gradient, see _step_fragments.
                    self._step_fragments(param, group)
                    continue
                if param.grad is None:
                    continue
                if galore or is_dtensor(param):
                    _refuse_partitioned(param, group)
                if param.grad.is_sparse:
                    raise RuntimeError("Adafactor does not support sparse gradients")
                # A DTensor (FSDP2) steps its local rows with the local rows of its state; `param` still says
                # what the sums over rows and the RMS reduce over (_mean, _rms).
                local = local_shard(param)
                grad = local_shard(param.grad).float()
                state = self.state[param]
                if not state:
                    state.update(self._init_state(param, group))
                state["step"] = step = int(state["step"]) + 1
                work = local if local.dtype == torch.float32 else local.float()
                lr_t = self._step_size(group, step, work, param)
                beta2t = 1.0 - math.pow(step, float(group["decay_rate"]))
                squared = grad.square().add_(eps1)
                if "exp_avg_sq_row" in state:
                    row, col = local_shard(state["exp_avg_sq_row"]), local_shard(state["exp_avg_sq_col"])
                    row.mul_(beta2t).add_(squared.mean(dim=-1), alpha=1.0 - beta2t)
                    col.mul_(beta2t).add_(_mean(squared, -2, param), alpha=1.0 - beta2t)
                    update = _inverse_sqrt_second_moment(row, col, param).mul_(grad)
                else:
                    exp_avg_sq = local_shard(state["exp_avg_sq"])
                    exp_avg_sq.mul_(beta2t).add_(squared, alpha=1.0 - beta2t)
                    update = exp_avg_sq.rsqrt().mul_(grad)
                exp_avg = local_shard(state["exp_avg"]) if beta1 is not None else None
                _apply_update(update, _rms(update, param), clip, lr_t, exp_avg, beta1, wd, work, local)
        return loss

    def _init_fragment_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """Zero state of a registered 1-D slice (module docstring): elementwise "exp_avg" (beta1) and "exp_avg_sq"
        (1-D fragments) of the slice's shape, and per fragment of a matrix its whole row and column statistics
        (lists, one entry per fragment: None for a 1-D fragment or one without local elements)."""
        fragments = fragments_of(param) or ()
        device = param.device

        def zeros(shape: Any) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.float32, device=device)

        state: dict[str, Any] = {"step": 0}
        if group["beta1"] is not None:
            state["exp_avg"] = zeros(param.shape)
        if any(len(f.shape) < 2 and f.numel for f in fragments):
            state["exp_avg_sq"] = zeros(param.shape)
        if any(len(f.shape) >= 2 for f in fragments):
            matrices = [f if len(f.shape) >= 2 and f.numel else None for f in fragments]
            state["exp_avg_sq_row"] = [None if f is None else zeros(f.shape[:-1]) for f in matrices]
            state["exp_avg_sq_col"] = [None if f is None else zeros(f.shape[:-2] + f.shape[-1:]) for f in matrices]
        return state

    def _step_fragments(self, param: torch.Tensor, group: dict[str, Any]) -> None:
        """One step of a 1-D tensor holding fragments of matrices or vectors (module docstring), fragment by
        fragment in the order every rank shares, each with two all-reduces: (1) the partial row and column sums
        of the squared gradient over the local elements, the parameter's sum of squares with scale_parameter;
        (2) the update's sum of squares. Every rank makes both for every fragment, also without local elements or
        gradient; the slice steps where any rank has a gradient."""
        eps1, clip = float(group["eps"][0]), float(group["clip_threshold"])
        beta1, wd = group["beta1"], float(group["weight_decay"])
        if param.grad is not None and param.grad.is_sparse:
            raise RuntimeError("Adafactor does not support sparse gradients")
        # No local gradient (FSDP1: no local elements): zeros; the parameter steps where any rank has a gradient
        # (one process would skip it where none has), decided alike on every rank.
        fragments = fragments_of(param) or ()
        if not any_rank(param.grad is not None, fragments, param.device):
            return
        grad = (
            param.grad.reshape(-1).float()
            if param.grad is not None
            else torch.zeros(param.numel(), device=param.device)
        )
        # A rank without local elements keeps no state (nothing of the parameter to step; FSDP1's optimizer state
        # dict gives such a rank none either): its all-reduces are zeros.
        state = self.state[param] if param.numel() else {}
        if param.numel() and not state:
            state.update(self._init_fragment_state(param, group))
        step = int(state.get("step", 0)) + 1
        local = param.data.view(-1)
        for index, fragment in enumerate(fragments):
            g = fragment.local(grad)
            target = fragment.local(local)
            work = target if target.dtype == torch.float32 else target.float()
            squared = g.square().add_(eps1)
            matrix = len(fragment.shape) >= 2
            if matrix:
                row_of, col_of = matrix_indices(fragment, device=param.device)
                n_rows, n_cols = math.prod(fragment.shape[:-1]), math.prod(fragment.shape[:-2] + fragment.shape[-1:])
                partial = [
                    torch.zeros(n_rows, device=param.device).index_add_(0, row_of, squared),
                    torch.zeros(n_cols, device=param.device).index_add_(0, col_of, squared),
                ]
            else:
                partial = []
            if group["scale_parameter"]:
                partial.append(work.square().sum().reshape(1))
            sums = sum_over_fragment(torch.cat(partial) if partial else squared.new_zeros(0), fragment)
            size: float | torch.Tensor = float(group["lr"]) if not group["relative_step"] else 0.0
            if group["relative_step"]:
                size = min(1e-6 * step if group["warmup_init"] else 1e-2, 1.0 / math.sqrt(step))
            if group["scale_parameter"]:
                rms = (sums[-1] / math.prod(fragment.shape)).sqrt()
                size = rms.clamp(min=float(group["eps"][1])) * size
            beta2t = 1.0 - math.pow(step, float(group["decay_rate"]))
            if matrix:
                # Means over the whole matrix's columns (rows): the summed partial sums over their counts.
                row_mean = sums[:n_rows].view(fragment.shape[:-1]) / fragment.shape[-1]
                col_mean = sums[n_rows : n_rows + n_cols].view(fragment.shape[:-2] + fragment.shape[-1:])
                col_mean = col_mean / fragment.shape[-2]
                if not fragment.numel:
                    # Nothing local to step: the second all-reduce still.
                    sum_over_fragment(g.new_zeros(1), fragment)
                    continue
                row, col = state["exp_avg_sq_row"][index], state["exp_avg_sq_col"][index]
                row.mul_(beta2t).add_(row_mean, alpha=1.0 - beta2t)
                col.mul_(beta2t).add_(col_mean, alpha=1.0 - beta2t)
                r_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().reshape(-1)
                c_factor = col.rsqrt().reshape(-1)
                update = (r_factor[row_of] * c_factor[col_of]).mul_(g)
            elif fragment.numel:
                exp_avg_sq = fragment.local(state["exp_avg_sq"].view(-1))
                exp_avg_sq.mul_(beta2t).add_(squared, alpha=1.0 - beta2t)
                update = exp_avg_sq.rsqrt().mul_(g)
            else:
                update = g.new_zeros(0)
            square_sum = sum_over_fragment(update.square().sum().reshape(1), fragment)
            if not fragment.numel:
                continue
            rms = square_sum[0].sqrt() / (math.prod(fragment.shape) ** 0.5)
            exp_avg = fragment.local(state["exp_avg"].view(-1)) if beta1 is not None else None
            _apply_update(update, rms, clip, size, exp_avg, beta1, wd, work, target)
        if state:
            state["step"] = step

    def reset_state(self, param: torch.Tensor) -> None:
        """Forget `param`'s state: its next step is a first step (step 1, beta2_t = 0: v = g^2)."""
        self.state.pop(param, None)

    def initialize_state(self) -> None:
        """Give every trainable parameter without state its zero state (step 0), without stepping: for loaders
        that fill the optimizer's existing state in place (FSDP1's sharded checkpoint through accelerate). A
        state at step 0 steps exactly like a missing one. A registered 1-D slice without local elements keeps
        none (as its step does)."""
        for group in self.param_groups:
            for param in group["params"]:
                if not param.requires_grad or self.state.get(param):
                    continue
                if fragments_of(param) is not None:
                    if param.numel():
                        self.state[param].update(self._init_fragment_state(param, group))
                else:
                    self.state[param].update(self._init_state(param, group))

    @torch.no_grad()
    def change_basis(
        self,
        param: torch.Tensor,
        *,
        left: Optional[torch.Tensor] = None,
        right: Optional[torch.Tensor] = None,
        policy: str,
        experts: Optional[torch.Tensor] = None,
    ) -> None:
        """`param`'s GaLore basis changed (`hf_galore_plugin.engines.basis`).

        'keep': the state stays (galore-torch's behaviour). 'reset': the state is dropped (for some experts of a
        stack: their statistics and momentum restart at zero, the step count runs on). 'project': the first
        moment moves exactly (T^T m, m T: it is a linear function of past updates, as Adam's). The factored second
        moment has no exact transport (nor has Adam's: `engines.basis`); the rule chosen here is Adam's SQUARED
        rule applied to the matrix the factors stand for, then factored again: V = (row / mean(row)) (x) col,
        V' = T_l.square()^T V T_r.square(), row' = mean of V' over the last dimension, col' = over the one before.
        V is rank one and the rule multiplies it by matrices on its two sides, so V' is rank one and the new
        factors reconstruct exactly V' (no refactoring loss): the factor state moves exactly as this package's
        AdamW moves its second moment, restricted to the rank-one matrices Adafactor keeps. On the unprojected
        side this keeps the statistics (up to their common scale, which shrinks with the mass T.square() loses
        when the subspaces differ, as Adam's does). Adafactor's paper (section 3) factors the statistics because
        only their row and column sums are needed; the rule keeps exactly the row/column sums of the transported
        matrix. The alternative of resetting the projected side's statistics (col) would mix a fresh col with
        an old row, which (row / mean(row)) (x) col normalises anyway, but makes every refresh a cold start of
        that side (beta2_t stays near 1 at late steps, so a zero col would give huge updates until clipped).
        """
        change = BasisChange(policy=policy, left=left, right=right, experts=experts).for_state(
            lambda: self.reset_state(param)
        )
        if change is None:
            return
        state = self.state.get(param)
        fragments = fragments_of(param)
        if fragments is not None:
            self._change_fragment_basis(state, fragments, policy, experts)
            return
        if not state:
            return
        if "exp_avg" in state:
            state["exp_avg"].copy_(change.apply(state["exp_avg"], LINEAR, param))
        if "exp_avg_sq_row" in state:
            row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
            if policy == "reset":  # some experts: BasisChange zeroes their rows, whatever the rule
                row.copy_(change.apply(row, SQUARED, param))
                col.copy_(change.apply(col, SQUARED, param))
                return
            # On local rows under FSDP2 (a left basis mixes rows: refused there for a matrix by
            # engines.capabilities.check_moment_handling; a stack's experts are whole on their rank).
            row, col = local_shard(row), local_shard(col)
            moved = change.apply(_second_moment(row, col, param), SQUARED, param)
            row.copy_(moved.mean(dim=-1))
            col.copy_(_mean(moved, -2, param))
        elif "exp_avg_sq" in state:
            state["exp_avg_sq"].copy_(change.apply(state["exp_avg_sq"], SQUARED, param))

    @staticmethod
    def _change_fragment_basis(
        state: Optional[dict[str, Any]], fragments: tuple, policy: str, experts: Optional[torch.Tensor]
    ) -> None:
        """A per-expert reset of a registered 1-D slice's state (the whole reset and 'keep' are done by then):
        the experts' local elements of "exp_avg" and their rows of each fragment's row and column statistics are
        zero. 'project' is refused before the first step by the engines that hand such slices
        (engines.capabilities.check_moment_handling)."""
        if policy != "reset" or experts is None:
            raise RuntimeError(
                f"Adafactor: moment_handling={policy!r} cannot move the statistics of a parameter held as 1-D "
                "slices (FSDP1, DeepSpeed ZeRO); use moment_handling='keep' or 'reset'"
            )
        if not state:
            return
        for index, fragment in enumerate(fragments):
            if len(fragment.shape) < 3:
                continue
            if "exp_avg" in state:
                fragment.local(state["exp_avg"].view(-1))[expert_elements(fragment, experts)] = 0.0
            for key in ("exp_avg_sq_row", "exp_avg_sq_col"):
                stat = state[key][index] if key in state else None
                if stat is not None:
                    stat[experts.to(device=stat.device, dtype=torch.bool)] = 0.0

    def _fragment_keys(self, param: torch.Tensor, group: dict[str, Any]) -> set[str]:
        """The state keys of a registered 1-D slice (`_init_fragment_state`)."""
        fragments = fragments_of(param) or ()
        keys = {"step"}
        if group["beta1"] is not None:
            keys.add("exp_avg")
        if any(len(f.shape) < 2 and f.numel for f in fragments):
            keys.add("exp_avg_sq")
        if any(len(f.shape) >= 2 for f in fragments):
            keys.update(("exp_avg_sq_row", "exp_avg_sq_col"))
        return keys

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, except for a registered 1-D slice (FSDP1, ZeRO): its whole row and column
        statistics are lists of numbers (per fragment; FSDP1's optimizer state dict keeps a value that is not a
        tensor as it is, checked equal on the ranks holding the parameter, where it would cut a tensor as a
        slice of the flat parameter), and it carries every elementwise key of the other slices (the ones it lacks
        as zeros without memory, dropped by `load_state_dict`), as FSDP1's optimizer state dict needs of a unit."""
        state_dict = super().state_dict()
        params = dict(enumerate(p for g in self.param_groups for p in g["params"]))
        packed = state_dict["state"]
        for key, param in params.items():
            if key in packed and fragments_of(param) is not None:
                packed[key] = {
                    name: [None if t is None else t.tolist() for t in value]
                    if name in ("exp_avg_sq_row", "exp_avg_sq_col")
                    else value
                    for name, value in packed[key].items()
                }
        uniform_elementwise_state(packed, params)
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loader, except every state tensor keeps its saved dtype (fp32 statistics of a bf16 parameter
        stay fp32): torch casts floating state to the parameter's dtype; a registered 1-D slice's statistics
        become tensors again, and it keeps its own keys only (`state_dict`)."""
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        saved = {p: state_dict["state"][i] for i, p in zip(saved_ids, params) if i in state_dict["state"]}
        super().load_state_dict(state_dict)
        groups = {id(p): g for g in self.param_groups for p in g["params"]}
        for group in self.param_groups:
            group["eps"] = tuple(group["eps"])
        for param, values in saved.items():
            own = self._fragment_keys(param, groups[id(param)]) if fragments_of(param) is not None else set(values)
            # (a ZeRO checkpoint loads before its flats are registered: the placeholders go by their layout)
            self.state[param] = {
                key: _to_state(value, param.device) for key, value in values.items()
                if key in own and not is_placeholder(value)
            }  # fmt: skip

    def state_nbytes(self) -> int:
        """Bytes of every state tensor this process holds (local shards of DTensors, the statistics of each
        fragment of a registered 1-D slice)."""
        return sum(
            local_shard(t).numel() * t.element_size() for state in self.state.values() for v in state.values()
            for t in (v if isinstance(v, list) else [v]) if isinstance(t, torch.Tensor)
        )  # fmt: skip


def _apply_update(
    update: torch.Tensor,
    rms: torch.Tensor,
    clip: float,
    size: float | torch.Tensor,
    exp_avg: Optional[torch.Tensor],
    beta1: Optional[float],
    weight_decay: float,
    work: torch.Tensor,
    target: torch.Tensor,
) -> None:
    """The end of a step, after the unscaled update u = g / sqrt(v): clipped to RMS <= `clip` (`rms`: the whole
    tensor's RMS of u), times the step `size`, through the first moment `exp_avg` with `beta1`, then decoupled
    weight decay and the update applied to `work` (fp32), copied into `target` where `work` is a copy of it."""
    update.div_((rms / clip).clamp_(min=1.0))
    update.mul_(size)
    if exp_avg is not None and beta1 is not None:
        exp_avg.mul_(float(beta1)).add_(update, alpha=1.0 - float(beta1))
        update = exp_avg
    if weight_decay:
        work.add_(work * (-weight_decay * size))
    work.sub_(update)
    if work is not target:
        target.copy_(work)


def _to_state(value: Any, device: torch.device) -> Any:
    """A loaded state value on `device`: a tensor moved, a list of statistics (numbers, per fragment) as fp32
    tensors, anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device)
    if isinstance(value, list):
        return [
            None if v is None else v.to(device=device) if isinstance(v, torch.Tensor)
            else torch.tensor(v, dtype=torch.float32, device=device)
            for v in value
        ]  # fmt: skip
    return value

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
be 2-D or 3-D with whole rows: the factored moment of an engine's 1-D flat partition (FSDP1, DeepSpeed ZeRO) would
be another optimizer, so those are refused (``hf_galore_plugin.create_optimizer`` refuses them by engine before;
the step refuses what gets past).

Under FSDP2 a parameter is a DTensor sharded on rows (``Shard(0)``, replicated over any other mesh dimension) and
its state is DTensors (distributed checkpoints reshard them): "exp_avg", "exp_avg_sq" and "exp_avg_sq_row" are
sharded on dimension 0 like the parameter, each rank updating its own rows. What sums over the sharded
dimension is summed over the shards (one all-reduce each): the column statistic of a matrix (the mean of g^2
over its rows, r values; kept whole on every rank, a replicated DTensor), the mean of its row statistic, and the
RMS of the update (and of the parameter, with ``scale_parameter``). An expert stack sharded on its expert
dimension holds whole matrices: its statistics are local, and only the RMS is summed. The update is one
process's up to the order of those sums.
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


def _refuse_partitioned(param: torch.Tensor, group: dict[str, Any]) -> None:
    check_matrix_layout(
        param, optimizer="Adafactor", needs="its factored second moment needs the rows and columns of the matrix",
        preset="galore_adafactor",
    )  # fmt: skip


class Adafactor(torch.optim.Optimizer):
    """Adafactor with transformers' arguments and defaults (module docstring); every keyword may be set per group.

    A GaLore refresh changes the basis of a factor through `change_basis` (keep, reset, project).
    """

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
                _refuse_partitioned(param, group)

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
                update.div_((_rms(update, param) / clip).clamp_(min=1.0))
                update.mul_(lr_t)
                if beta1 is not None:
                    exp_avg = local_shard(state["exp_avg"])
                    exp_avg.mul_(float(beta1)).add_(update, alpha=1.0 - float(beta1))
                    update = exp_avg
                if wd:
                    work.add_(work * (-wd * lr_t))
                work.sub_(update)
                if work is not local:
                    local.copy_(work)
        return loss

    def reset_state(self, param: torch.Tensor) -> None:
        """Forget `param`'s state: its next step is a first step (step 1, beta2_t = 0: v = g^2)."""
        self.state.pop(param, None)

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

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loader, except every state tensor keeps its saved dtype (fp32 statistics of a bf16 parameter
        stay fp32): torch casts floating state to the parameter's dtype."""
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        saved = {p: state_dict["state"][i] for i, p in zip(saved_ids, params) if i in state_dict["state"]}
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group["eps"] = tuple(group["eps"])
        for param, values in saved.items():
            self.state[param] = {
                key: value.to(device=param.device) if isinstance(value, torch.Tensor) else value
                for key, value in values.items()
            }

    def state_nbytes(self) -> int:
        """Bytes of every state tensor this process holds (local shards of DTensors)."""
        return sum(
            local_shard(v).numel() * v.element_size() for state in self.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)
        )  # fmt: skip

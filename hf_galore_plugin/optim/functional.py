"""Pure per-parameter AdamW updates (Loshchilov & Hutter 2019, decoupled weight decay).

Each function updates one parameter's local tensor and its state tensors in place and keeps no
state of its own; `hf_galore_plugin.optim.AdamW` only creates the state and loops over these.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_galore_plugin.optim.adamw8bit import AdamW8bitHyper, adamw8bit_step_multi
from hf_galore_plugin.optim.adamw8bit import RESIDUAL_KEYS as RESIDUAL_STATE_KEYS
from hf_galore_plugin.optim.adamw8bit import STATE_KEYS as EIGHT_BIT_STATE_KEYS

__all__ = ["adamw_step_fp32", "adamw_step_8bit", "adamw_steps_8bit", "EIGHT_BIT_STATE_KEYS", "RESIDUAL_STATE_KEYS"]

_KEYS_WITH_RESIDUALS = EIGHT_BIT_STATE_KEYS + RESIDUAL_STATE_KEYS


def adamw_step_fp32(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """AdamW with fp32 moments; the same op sequence as torch.optim.AdamW(foreach=False).

    With an fp32 `param` the result is bit-identical to torch's single-tensor AdamW. A bf16 or
    fp16 `param` is updated in an fp32 copy and rounded back once, so tiny updates are not lost
    to 8-bit mantissa arithmetic inside the step (they can still be lost in the final rounding).
    """
    work = param if param.dtype == torch.float32 else param.float()
    g = grad if grad.dtype == torch.float32 else grad.float()
    work.mul_(1.0 - lr * weight_decay)
    exp_avg.lerp_(g, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    step_size = lr / (1.0 - beta1**step)
    bias_correction2_sqrt = (1.0 - beta2**step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    work.addcdiv_(exp_avg, denom, value=-step_size)
    if work is not param:
        param.copy_(work)


def adamw_step_8bit(
    param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], *, step: int, **options: Any
) -> None:
    """AdamW with 8-bit blockwise moments (keys `EIGHT_BIT_STATE_KEYS`, plus `RESIDUAL_STATE_KEYS`
    when error feedback is on) in one fused pass over the flattened parameter.

    `options`: the fields of `optim.adamw8bit.AdamW8bitHyper` (lr, beta1, beta2, eps, weight_decay,
    block_size). `state` holds local tensors: codes with the parameter's element count, scales with one
    fp32 per block of `block_size` flattened values.
    """
    adamw_steps_8bit([param], [grad], [state], [step], hyper=AdamW8bitHyper(**options))


def adamw_steps_8bit(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: list[dict[str, torch.Tensor]],
    steps: list[int],
    *,
    hyper: AdamW8bitHyper,
) -> None:
    """`adamw_step_8bit` for many parameters of one device, one block size and one error-feedback
    setting, in one `adamw8bit_step_multi` call (per parameter bit-identical to `adamw_step_8bit`).

    Tensors go in as they are (the op takes contiguous tensors of any shape): a view per tensor per
    step would cost more Python than the C++ step of a small parameter. A non-contiguous parameter
    steps in a contiguous copy, written back after."""
    block_size = hyper.block_size
    works, state_lists, written_back = [], [], []
    for param, state in zip(params, states):
        work = param if param.is_contiguous() else param.contiguous()
        if work is not param:
            written_back.append((param, work))
        works.append(work)
        keys = _KEYS_WITH_RESIDUALS if RESIDUAL_STATE_KEYS[0] in state else EIGHT_BIT_STATE_KEYS
        tensors = tuple(state[key] for key in keys)
        # Scales may be longer than the parameter's block count (a DTensor shard pads to the largest
        # shard's count); they are 1-D, so a cut is a slice.
        n_blocks = -(-work.numel() // block_size)
        if tensors[1].numel() != n_blocks:
            tensors = tuple(t[:n_blocks] if key.endswith("scales") else t for key, t in zip(keys, tensors))
        state_lists.append(tensors)
    grads = [grad if grad.is_contiguous() else grad.contiguous() for grad in grads]
    adamw8bit_step_multi(works, grads, state_lists, steps=steps, hyper=hyper)
    for param, work in written_back:
        param.copy_(work)

"""AdamW with fp32 or 8-bit blockwise state, on any tensor: dense, 1-D flat partitions
(DeepSpeed ZeRO, FSDP1), empty shards, and DTensor shards (FSDP2).

The class validates groups, creates state and loops; the math is in `optim.functional`.

State per parameter (tensors and plain values only, so `torch.load(weights_only=True)` works):
- "step": fp32 scalar tensor on the CPU, as torch.optim.AdamW keeps it.
- fp32 state: "exp_avg", "exp_avg_sq" (fp32, the parameter's shape; DTensors for DTensor params,
  like torch's AdamW, so distributed checkpoints can reshard them).
- 8-bit state: "exp_avg_codes" (int8) and "exp_avg_sq_codes" (uint8) in the parameter's shape,
  "exp_avg_scales" / "exp_avg_sq_scales" (fp32, one per block of "block_size" flattened values),
  "block_size" (int). With error feedback also "exp_avg_residual_codes" /
  "exp_avg_sq_residual_codes" (int8) and their fp32 "*_residual_scales".
  Bytes per value: 2 + 8/block_size (2.03 at 256); with error feedback 4 + 16/block_size (4.06),
  against 8 for fp32 state. For a DTensor parameter, codes are DTensors placed like the
  parameter and scales are DTensors of shape (number of shards, largest shard's block count),
  sharded on dim 0, so each rank saves its own scales; resuming 8-bit state therefore needs the
  same mesh (blocks are cut from the local shard, so they cannot be resharded).
Numerics: fp32 state of a contiguous fp32 CPU tensor steps in torch's fused multi-tensor AdamW
kernel (one call per group; results identical to torch.optim.AdamW(fused=True) on tensors of a
multiple of 64 values, and for every value the same as if its tensor were cut anywhere: see
`_FUSED_ALIGN`); any other fp32
state (bf16/fp16 parameters, non-contiguous or non-CPU tensors) steps in `adamw_step_fp32`, torch's
single-tensor op sequence. The two differ by fp32 rounding only (a few ulps after 100 steps,
tests/test_optim.py). 8-bit state steps in `optim.adamw8bit` (Triton on CUDA; on the CPU the C++ step
where it is built, else the torch step).
Tensors with fewer than `min_8bit_numel` values keep fp32 state even when state_bits=8, as
bitsandbytes does (its default threshold is 4096): for biases and norms the 8-bit saving is a
few KB while their scales would cost up to 4 B per block.
Step counts: the bias correction needs each parameter's count as a Python number. The optimizer keeps
a host copy of every "step" tensor it advances (not in the state, which stays as torch's), trusted
while the tensor's version counter shows no other write, so an ordinary step reads no tensor value:
no device sync wherever the counts live (tests/test_optim_step_overhead.py counts them).
Update observers (`engines.contract.observe_updates`: GaLore layers with ``residual=True``): after a step, a
parameter with an observer hands it its gradient, its Adam update m_hat / (sqrt(v_hat) + eps) recomputed from
the new moments (8-bit ones dequantized) and the group's lr of the step. Without any observer registered in
the process the step looks nothing up (one dict check per step).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from hf_galore_plugin.engines.collectives import from_local, is_dtensor, local_shard, one_row_per_shard
from hf_galore_plugin.engines.basis import ADAM_STATE_RULES, LINEAR, SQUARED, BasisChange
from hf_galore_plugin.engines.contract import has_update_observers, update_observer
from hf_galore_plugin.optim.adamw8bit import AdamW8bitHyper, dequantize_moment, quantize_moment
from hf_galore_plugin.optim.functional import (
    EIGHT_BIT_STATE_KEYS,
    RESIDUAL_STATE_KEYS,
    adamw_step_8bit,
    adamw_steps_8bit,
    adamw_step_fp32,
)
from hf_galore_plugin.optim.offload import (
    DEFAULT_CHUNK_MB,
    STATE_OFFLOAD,
    StateStreamer,
    bytes_per_value,
    chunk_bounds,
    host_allocation,
    host_copy,
    state_slices,
)
from hf_galore_plugin.utils import KERNEL_DISPATCH

__all__ = ["AdamW"]

_MIN_BLOCK, _MAX_BLOCK = 16, 4096
_FUSED_AVAILABLE = hasattr(torch, "_fused_adamw_")


def _fused_enabled() -> bool:
    """Whether torch's fused AdamW kernel exists and `KERNEL_DISPATCH.fused_adamw` allows it (read once per
    step, not per parameter)."""
    return _FUSED_AVAILABLE and KERNEL_DISPATCH.fused_adamw


def _fusable(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> bool:
    """Whether torch's fused AdamW kernel can step this fp32-state tensor: fp32 everywhere, dense
    contiguous CPU tensors (its step counters live on the CPU, as ours do). Callers check
    `_fused_enabled()` first."""
    # Plain `and`s, no generator: this runs once per parameter per step.
    fp32 = torch.float32
    return (
        param.device.type == "cpu"
        and param.dtype == fp32
        and grad.dtype == fp32
        and exp_avg.dtype == fp32
        and exp_avg_sq.dtype == fp32
        and param.is_contiguous()
        and grad.is_contiguous()
        and exp_avg.is_contiguous()
        and exp_avg_sq.is_contiguous()
        and grad.device == param.device
    )


def _version(tensor: torch.Tensor) -> int | None:
    """`tensor`'s version counter, which every in-place write through it or a view of it bumps; None for
    an inference tensor, which keeps none."""
    try:
        return tensor._version
    except RuntimeError:
        return None


# torch's fused CPU kernel runs its vector loop over all but the last numel % (vector width) values
# of a tensor and a scalar loop, which rounds differently, over those. So that a value's result never
# depends on where it sits in its tensor (FSDP shards must step exactly like the whole tensor), every
# value goes through the vector loop: each tensor goes in as its first multiple of _FUSED_ALIGN values,
# and the rest of every tensor at the same step count goes in as one buffer, zero-padded to a multiple
# of _FUSED_ALIGN values (a multiple of every vector width: 8 on AVX2, 16 on AVX-512, and of the
# kernel's 16-value thread split).
_FUSED_ALIGN = 64


class _FusedBatch:
    """The fp32-state tensors of one group on one device, stepped by one `torch._fused_adamw_` call."""

    def __init__(self) -> None:
        self.lists: tuple[list[torch.Tensor], ...] = ([], [], [], [])  # params, grads, exp_avgs, exp_avg_sqs
        self.steps: list[torch.Tensor] = []
        # step count -> (a step tensor holding it, the four lists of tails): tails of one count share a buffer.
        self.tails: dict[int, tuple[torch.Tensor, tuple[list[torch.Tensor], ...]]] = {}

    def add(self, tensors: tuple[torch.Tensor, ...], step: torch.Tensor, count: int) -> None:
        """`tensors` (param, grad, exp_avg, exp_avg_sq), whose step tensor `step` holds `count` when `run` runs."""
        n = tensors[0].numel()
        body = n - n % _FUSED_ALIGN
        if body == n:  # the whole tensors, as they are (the kernel takes any shape; views cost microseconds)
            for lst, t in zip(self.lists, tensors):
                lst.append(t)
            self.steps.append(step)
            return
        flat = [t.view(-1) for t in tensors]
        if body:
            for lst, t in zip(self.lists, flat):
                lst.append(t[:body])
            self.steps.append(step)
        tails = self.tails.setdefault(count, (step, ([], [], [], [])))[1]
        for lst, t in zip(tails, flat):
            lst.append(t[body:])

    def run(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs = self.lists
        written_back = []
        for step, tails in self.tails.values():
            sizes = [t.numel() for t in tails[0]]
            padding = tails[0][0].new_zeros(-sum(sizes) % _FUSED_ALIGN)
            buffers = [torch.cat([*parts, padding]) for parts in tails]
            for lst, buffer in zip(self.lists, buffers):
                lst.append(buffer)
            self.steps.append(step)
            written_back.append((buffers, tails, sizes))
        beta1, beta2 = (float(b) for b in group["betas"])
        torch._fused_adamw_(
            params, grads, exp_avgs, exp_avg_sqs, [], self.steps,
            amsgrad=False, lr=float(group["lr"]), beta1=beta1, beta2=beta2,
            weight_decay=float(group["weight_decay"]), eps=float(group["eps"]), maximize=False,
        )  # fmt: skip
        for buffers, tails, sizes in written_back:
            for i in (0, 2, 3):  # the gradient is only read
                torch._foreach_copy_(tails[i], list(buffers[i][: sum(sizes)].split(sizes)))


def _place(value: torch.Tensor, param: torch.Tensor, offload: bool) -> torch.Tensor:
    """A loaded state tensor where this optimizer keeps it: on the host (contiguous, pinned when
    CUDA is available) when offloaded, else on the parameter's device."""
    if not offload:
        return value.to(device=local_shard(param).device)
    with host_allocation():
        return host_copy(value.contiguous())


def _refuse_dtensor_offload() -> None:
    from hf_galore_plugin.engines.capabilities import check_state_offload

    check_state_offload("fsdp2", state_offload="cpu")


def _hyper(group: dict[str, Any], step: int | None = None) -> dict[str, Any]:
    """The step's keyword arguments: the group's options, and the parameter's step count when given."""
    beta1, beta2 = (float(b) for b in group["betas"])
    return {
        **({"step": step} if step is not None else {}),
        "lr": float(group["lr"]),
        "beta1": beta1,
        "beta2": beta2,
        "eps": float(group["eps"]),
        "weight_decay": float(group["weight_decay"]),
    }


def _validate_group(group: dict[str, Any]) -> None:
    lr, betas, eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    if not float(lr) >= 0.0:
        raise ValueError(f"AdamW: lr={lr} is invalid; use a learning rate >= 0 (e.g. 1e-3).")
    if len(betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in betas):
        raise ValueError(f"AdamW: betas={betas} is invalid; use two values in [0, 1), e.g. (0.9, 0.999).")
    if not float(eps) > 0.0:
        raise ValueError(f"AdamW: eps={eps} is invalid; use eps > 0 (e.g. 1e-8) so m / (sqrt(v) + eps) is finite.")
    if not float(wd) >= 0.0:
        raise ValueError(f"AdamW: weight_decay={wd} is invalid; use weight_decay >= 0 (0 disables it).")
    bits, block = group["state_bits"], group["block_size"]
    if bits not in (8, 32):
        raise ValueError(f"AdamW: state_bits={bits} is not supported; use 32 (fp32 state) or 8 (8-bit blockwise).")
    if not (isinstance(block, int) and _MIN_BLOCK <= block <= _MAX_BLOCK and block & (block - 1) == 0):
        # Triton needs a power-of-two block; below 16 the fp32 scales cost >= 0.25 B per value, above
        # 4096 one outlier sets the scale of too many values (the paper's case for small blocks).
        raise ValueError(
            f"AdamW: block_size={block} is invalid; use a power of two in [{_MIN_BLOCK}, {_MAX_BLOCK}] (e.g. 256)."
        )
    if group["error_feedback"] and bits != 8:
        raise ValueError(
            f"AdamW: error_feedback=True needs state_bits=8 (got state_bits={bits}); fp32 state has no "
            "quantization residual. Set state_bits=8 or error_feedback=False."
        )
    if not (isinstance(group["min_8bit_numel"], int) and group["min_8bit_numel"] >= 0):
        raise ValueError(f"AdamW: min_8bit_numel={group['min_8bit_numel']} is invalid; use an int >= 0 (e.g. 4096).")
    if group["state_offload"] not in STATE_OFFLOAD:
        raise ValueError(
            f"AdamW: state_offload={group['state_offload']!r} is invalid; choose one of {list(STATE_OFFLOAD)} "
            "('cpu' keeps the optimizer state in host memory and streams it through the device)."
        )


def _block_scales(param: torch.Tensor, block_size: int, device: str | None = None) -> torch.Tensor:
    """Zeroed fp32 block scales for `param`'s local values (a sharded DTensor for a DTensor param),
    on `device` (default: the parameter's)."""
    local = local_shard(param)
    if not is_dtensor(param):
        return torch.zeros(math.ceil(local.numel() / block_size), dtype=torch.float32, device=device or local.device)
    # Every rank must hold the same local scale shape, so size it for the largest shard.
    n_shards, largest_shape, placements = one_row_per_shard(param)
    max_blocks = math.ceil(math.prod(largest_shape) / block_size)
    zeros = torch.zeros(1, max_blocks, dtype=torch.float32, device=local.device)
    return from_local(zeros, param, placements, shape=torch.Size((n_shards, max_blocks)), stride=(max_blocks, 1))


class AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction; amsgrad and maximize off) with fp32 or
    8-bit blockwise state. Every keyword below may also be set per param group; unknown group
    keys are kept and ignored.

    Args:
        lr, betas, eps, weight_decay: as in torch.optim.AdamW.
        state_bits: 32 (fp32 moments) or 8 (dynamic-code 8-bit moments, one fp32 scale per block).
        block_size: values per quantization block (power of two, 16..4096).
        error_feedback: keep each moment's 8-bit quantization residual and add it back next step.
        min_8bit_numel: parameters with fewer values keep fp32 state even when state_bits=8.
        state_offload: "none" (state on the parameter's device) or "cpu" (state in host memory, pinned
            when CUDA is available, streamed through the device in chunks; results bit-identical; see
            `optim.offload`). Refused for DTensor parameters (FSDP2): use FSDP2's CPUOffloadPolicy.
        state_offload_chunk_mb: MiB of state per staging slot with state_offload="cpu"; two slots per
            device bound the device memory the state takes during a step (32 MiB by default).
    state_bits, block_size, error_feedback and state_offload take effect when a parameter's state is created
    (its first step, or the first step after `reset_state`).

    A GaLore refresh changes the basis of a factor through `change_basis` (the engine contract's seam); engines
    that handle the fp32 state by key (DeepSpeed ZeRO's partitions) read how each moment follows a change of
    basis from `basis_state_rules`.
    """

    basis_state_rules = ADAM_STATE_RULES

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        state_bits: int = 32,
        block_size: int = 256,
        error_feedback: bool = False,
        min_8bit_numel: int = 4096,
        state_offload: str = "none",
        state_offload_chunk_mb: float = DEFAULT_CHUNK_MB,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "state_bits": state_bits,
            "block_size": block_size,
            "error_feedback": error_feedback,
            "min_8bit_numel": min_8bit_numel,
            "state_offload": state_offload,
        }
        _validate_group(defaults)
        if isinstance(state_offload_chunk_mb, bool) or not (
            isinstance(state_offload_chunk_mb, (int, float)) and state_offload_chunk_mb > 0
        ):
            raise ValueError(
                f"AdamW: state_offload_chunk_mb={state_offload_chunk_mb!r} is invalid; use a positive number of "
                f"MiB (default {DEFAULT_CHUNK_MB})."
            )
        self._chunk_bytes = int(state_offload_chunk_mb * 2**20)
        self._streamers: dict[torch.device, StateStreamer] = {}
        # The host copy of each parameter's step count: id(param) -> (its "step" tensor, that tensor's
        # version counter when this optimizer last wrote it, the count). See `_step_count`.
        self._step_counts: dict[int, tuple[torch.Tensor, int, int]] = {}
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # torch pickles (and deep-copies) an optimizer as defaults, state and groups only, and its
        # load_state_dict ends here too: what this optimizer keeps besides is rebuilt only where missing.
        super().__setstate__(state)
        self.__dict__.setdefault("_chunk_bytes", int(DEFAULT_CHUNK_MB * 2**20))
        self.__dict__.setdefault("_streamers", {})
        self.__dict__.setdefault("_step_counts", {})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _validate_group(group)
        if group["state_offload"] == "cpu" and any(is_dtensor(p) for p in group["params"]):
            _refuse_dtensor_offload()
        if has_update_observers():
            # The observer refuses here, when the optimizer is built, a parameter it cannot serve.
            for param in group["params"]:
                observer = update_observer(param)
                if observer is not None:
                    observer.check_optimized(param)

    def _init_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        # The step counter is a host scalar for every parameter, offloaded or not.
        state: dict[str, Any] = {"step": torch.zeros((), dtype=torch.float32)}
        with host_allocation() if group["state_offload"] == "cpu" else contextlib.nullcontext():
            state.update(self._moments(param, group))
        self.state[param] = state
        self._remember_step(param, state["step"], 0)
        return state

    def _remember_step(self, param: torch.Tensor, step: torch.Tensor, count: int) -> None:
        version = _version(step)
        if version is not None:
            self._step_counts[id(param)] = (step, version, count)

    def _step_count(self, param: torch.Tensor, step: torch.Tensor) -> int:
        """The count `param`'s "step" tensor holds, as a Python int (the bias correction's exponent).

        The host copy answers while the state holds the very tensor this optimizer last advanced and
        nothing wrote it since (its version counter says so): an ordinary step reads no tensor, which
        for a step count on a device would be a sync per parameter. A tensor replaced (a loader, a
        reset), written in place (DeepSpeed zeroing a partition's state) or never seen is read once.
        Writes through `.data`, which bypass the version counter, are not seen: call
        `reload_step_counts` after such a loader.
        """
        entry = self._step_counts.get(id(param))
        if entry is not None and entry[0] is step and entry[1] == _version(step):
            return entry[2]
        return int(step.item())

    def _advance_steps(self, advanced: list[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
        """Add one to each (param, step tensor, new count)'s step tensor in one multi-tensor call, as
        torch's AdamW does, and remember the new counts."""
        torch._foreach_add_([step for _, step, _ in advanced], 1)
        for param, step, count in advanced:
            self._remember_step(param, step, count)

    def reload_step_counts(self) -> None:
        """Read every parameter's step count from its state again (one read each; `load_state_dict`
        calls it). For loaders that write the state's tensors through `.data`, which the version
        counter the host copy trusts does not see."""
        self._step_counts = {}
        for param, state in self.state.items():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                self._remember_step(param, step, int(step.item()))

    def _moments(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """The zeroed moment tensors (and 8-bit block size) of a new state: on the host when offloaded."""
        state: dict[str, Any] = {}
        offload = group["state_offload"] == "cpu"
        if offload and is_dtensor(param):  # parameters swapped for DTensors after construction
            _refuse_dtensor_offload()
        # Offloaded state is created on the host directly: the device never holds a whole state tensor.
        device = "cpu" if offload else None  # None: the parameter's
        # The global numel decides, so every rank of a DTensor picks the same state format.
        if group["state_bits"] == 32 or param.numel() < group["min_8bit_numel"]:
            for key in ("exp_avg", "exp_avg_sq"):
                # Offloaded moments are contiguous: chunks are ranges of the flattened values.
                layout = torch.contiguous_format if offload else torch.preserve_format
                state[key] = torch.zeros_like(param, dtype=torch.float32, memory_format=layout, device=device)
        else:
            block_size = group["block_size"]
            state["block_size"] = block_size
            residuals = RESIDUAL_STATE_KEYS if group["error_feedback"] else ()
            for key in EIGHT_BIT_STATE_KEYS + residuals:
                if key.endswith("scales"):
                    state[key] = _block_scales(param, block_size, device)
                else:
                    dtype = torch.uint8 if key == "exp_avg_sq_codes" else torch.int8
                    layout = torch.contiguous_format
                    state[key] = torch.zeros_like(param, dtype=dtype, memory_format=layout, device=device)
        if offload:
            state = {key: host_copy(v) if isinstance(v, torch.Tensor) else v for key, v in state.items()}
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        fused_enabled = _fused_enabled()
        observing = has_update_observers()
        for group in self.param_groups:
            fused: dict[torch.device, _FusedBatch] = {}
            streamed: dict[torch.device, list] = {}
            # 8-bit parameters per (device, block size, error feedback): one multi-tensor call each.
            eight_bit: dict[tuple[torch.device, int, bool], tuple[list, list, list, list]] = {}
            # (param, step tensor, new count) of each parameter stepped; the tensors advance in one call
            # before the fused kernel and the offloaded updates read them.
            advanced: list[tuple[torch.Tensor, torch.Tensor, int]] = []
            # (observer, local tensor, gradient, state, step count) of each stepped parameter with an observer.
            observed: list[tuple[Any, torch.Tensor, torch.Tensor, dict[str, Any], int]] = []
            offload = group["state_offload"] == "cpu"
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                # A DTensor (FSDP2) steps its local shard, with the shards of its state; any other tensor
                # as it is (tested once per parameter: this loop is the step's per-parameter host work).
                sharded = is_dtensor(param)
                local = param.to_local() if sharded else param
                if sharded:
                    grad = local_shard(grad)
                if grad.is_sparse or torch.is_complex(local):
                    raise RuntimeError("hf_galore_plugin AdamW supports dense real tensors only.")
                # Empty shards (FSDP1 / FSDP2 ranks past the last row) still get state and a step
                # count, as torch's AdamW does, so every rank holds the same keys for checkpoints.
                state = self.state[param] or self._init_state(param, group)
                step = self._step_count(param, state["step"]) + 1
                advanced.append((param, state["step"], step))
                if local.numel() == 0:
                    continue
                if observing:
                    observer = update_observer(param)
                    if observer is not None:
                        observed.append((observer, local, grad, state, step))
                if offload:
                    chunks = self._offloaded_chunks(local, grad, state, group, step, fused_enabled)
                    streamed.setdefault(local.device, []).extend(chunks)
                    continue
                if "exp_avg" in state:
                    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                    if sharded:
                        exp_avg, exp_avg_sq = local_shard(exp_avg), local_shard(exp_avg_sq)
                    if fused_enabled and _fusable(local, grad, exp_avg, exp_avg_sq):
                        batch = fused.get(local.device) or fused.setdefault(local.device, _FusedBatch())
                        batch.add((local, grad, exp_avg, exp_avg_sq), state["step"], step)
                    else:
                        adamw_step_fp32(local, grad, exp_avg, exp_avg_sq, **_hyper(group, step))
                    continue
                residuals = RESIDUAL_STATE_KEYS[0] in state
                params, grads, states, steps = eight_bit.setdefault(
                    (local.device, state["block_size"], residuals), ([], [], [], [])
                )
                params.append(local)
                grads.append(grad)
                states.append({k: local_shard(v) for k, v in state.items()} if sharded else state)
                steps.append(step)
            if advanced:
                self._advance_steps(advanced)
            for (_, block_size, _), (params, grads, states, steps) in eight_bit.items():
                hyper = AdamW8bitHyper(**_hyper(group), block_size=block_size)
                adamw_steps_8bit(params, grads, states, steps, hyper=hyper)
            for batch in fused.values():
                # torch's multi-tensor fused AdamW kernel: one call for every fp32 tensor of the group
                # (no per-tensor Python).
                batch.run(group)
            for device, chunks in streamed.items():
                if device not in self._streamers:
                    self._streamers[device] = StateStreamer(device, self._chunk_bytes)
                self._streamers[device].run(chunks)
            for observer, local, grad, state, step in observed:
                observer.observe_update(grad, _adam_update(local, state, group, step), float(group["lr"]))
        return loss

    def _offloaded_chunks(
        self,
        local: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, Any],
        group: dict[str, Any],
        step: int,
        fused_enabled: bool,
    ) -> list[tuple[dict[str, torch.Tensor], Callable[[dict[str, torch.Tensor]], None]]]:
        """(host state slices, update of those values) for each chunk of an offloaded parameter.

        Each update is the resident path's function on a range of the flattened values: the fused
        kernel where the resident step would use it, else `adamw_step_fp32` / `adamw_step_8bit`."""
        block_size = state.get("block_size")
        fp32 = "exp_avg" in state
        # Decided on whole tensors, exactly as the resident step decides.
        fusable = fp32 and fused_enabled and _fusable(local, grad, state["exp_avg"], state["exp_avg_sq"])
        values = local.view(-1) if local.is_contiguous() else local.contiguous().view(-1)
        grads = grad.reshape(-1)
        hyper = _hyper(group, step)
        align = math.lcm(_FUSED_ALIGN, block_size or 1)
        bounds = chunk_bounds(values.numel(), bytes_per_value(state, block_size), self._chunk_bytes, align)
        chunks: list[tuple[dict[str, torch.Tensor], Callable[[dict[str, torch.Tensor]], None]]] = []
        for start, end in bounds:
            part, part_grad = values[start:end], grads[start:end]

            def update(staged, part=part, part_grad=part_grad):
                if fusable:
                    batch = _FusedBatch()
                    batch.add((part, part_grad, staged["exp_avg"], staged["exp_avg_sq"]), state["step"], step)
                    batch.run(group)
                elif fp32:
                    adamw_step_fp32(part, part_grad, staged["exp_avg"], staged["exp_avg_sq"], **hyper)
                else:
                    adamw_step_8bit(part, part_grad, staged, block_size=block_size, **hyper)

            chunks.append((state_slices(state, start, end, block_size), update))
        if not local.is_contiguous():
            # A non-contiguous parameter steps in a contiguous copy, written back after its last chunk.
            last_host, last_update = chunks[-1]

            def update_and_write_back(staged, last_update=last_update):
                last_update(staged)
                local.copy_(values.view(local.shape))

            chunks[-1] = (last_host, update_and_write_back)
        return chunks

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loader, except every state tensor keeps its saved dtype.

        torch.optim.Optimizer casts floating state to the parameter's dtype, which would turn fp32
        scales and moments of a bf16 parameter into bf16 (and is not a documented hook we can
        rely on across torch versions), so the saved tensors are restored afterwards, moved to the
        parameter's device only.
        """
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        saved_states = {p: state_dict["state"][i] for i, p in zip(saved_ids, params) if i in state_dict["state"]}
        # Where the state lives is this optimizer's choice, not the checkpoint's: torch's loader
        # replaces each group's options by the saved ones (and drops options a checkpoint written
        # before state_offload existed lacks), so the current placement is put back.
        placements = [group["state_offload"] for group in self.param_groups]
        super().load_state_dict(state_dict)
        for group, placement in zip(self.param_groups, placements):
            group["state_offload"] = placement
        groups = {id(p): g for g in self.param_groups for p in g["params"]}
        for param, saved in saved_states.items():
            # A checkpoint loads with or without offload, whichever way it was written.
            offload = groups[id(param)]["state_offload"] == "cpu"
            if offload and is_dtensor(param):
                _refuse_dtensor_offload()
            self.state[param] = {
                key: _place(value, param, offload) if isinstance(value, torch.Tensor) and key != "step" else value
                for key, value in saved.items()
            }
        self.reload_step_counts()

    @torch.no_grad()
    def initialize_state(self) -> None:
        """Give every trainable parameter without state its zero state (step 0), without stepping.

        For loaders that fill the optimizer's existing state in place and skip what is absent:
        FSDP1's sharded checkpoint (accelerate's ``load_fsdp_optimizer`` reads into
        ``FSDP.optim_state_dict`` of the current optimizer) loads nothing into a fresh optimizer.
        A state at step 0 steps exactly like a missing one.
        """
        for group in self.param_groups:
            for param in group["params"]:
                if param.requires_grad and not self.state[param]:
                    self._init_state(param, group)

    def reset_state(self, param: torch.Tensor) -> None:
        """Forget `param`'s state; its next step starts from zero moments at step 1."""
        self.state.pop(param, None)
        self._step_counts.pop(id(param), None)

    def change_basis(
        self,
        param: torch.Tensor,
        *,
        left: torch.Tensor | None = None,
        right: torch.Tensor | None = None,
        policy: str,
        experts: torch.Tensor | None = None,
    ) -> None:
        """`param`'s GaLore basis changed (`hf_galore_plugin.engines.basis`): 'keep' leaves the state, 'reset'
        forgets it (`reset_state`; for some experts of a stack: their moments restart at zero, the step count
        runs on), 'project' moves the moments into the new coordinates: the first one exactly (T^T m, m T), the
        second through the elementwise square of T (T.square()^T v, v T.square()). 8-bit state is dequantized,
        changed and requantized (`transform_state`); no-op before the first step."""
        change = BasisChange(policy=policy, left=left, right=right, experts=experts).for_state(
            lambda: self.reset_state(param)
        )
        if change is None:
            return
        self.transform_state(param, lambda m, v: (change.apply(m, LINEAR, param), change.apply(v, SQUARED, param)))

    def transform_state(
        self, param: torch.Tensor, fn: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Replace `param`'s moments by `fn(exp_avg, exp_avg_sq)` (fp32, the shape of the local shard).

        8-bit state is dequantized (residual included), transformed and requantized with a fresh
        residual. No-op when `param` has no state yet.
        """
        state = self.state.get(param)
        if not state:
            return
        if any(
            key != "step" and isinstance(v, torch.Tensor) and v.device != local_shard(param).device
            for key, v in state.items()
        ):
            # Offloaded state: transformed on the parameter's device (fn may use device tensors such as a
            # basis), one parameter at a time, and written back to the host.
            staged = {
                key: v.to(local_shard(param).device) if key != "step" and isinstance(v, torch.Tensor) else v
                for key, v in state.items()
            }
            _transform(staged, local_shard(param).shape, fn)
            for key, value in staged.items():
                if key != "step" and isinstance(value, torch.Tensor):
                    state[key].copy_(value)
            return
        _transform(state, local_shard(param).shape, fn)

    def state_nbytes(self) -> int:
        """Bytes of every state tensor this process holds (local shards of DTensors), step counters included."""
        return sum(
            local_shard(v).numel() * local_shard(v).element_size()
            for state in self.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        )

    def host_state_nbytes(self) -> int:
        """Bytes of the state tensors ``state_offload='cpu'`` keeps in host memory (step counters,
        which every parameter keeps on the host, excluded)."""
        offloaded = {id(p) for g in self.param_groups if g["state_offload"] == "cpu" for p in g["params"]}
        return sum(
            v.numel() * v.element_size()
            for param, state in self.state.items()
            if id(param) in offloaded
            for key, v in state.items()
            if key != "step" and isinstance(v, torch.Tensor)
        )

    def staging_nbytes(self) -> int:
        """Device bytes of the offload staging buffers (two slots per device once a step has run)."""
        return sum(streamer.nbytes() for streamer in self._streamers.values())


def _transform(
    state: dict[str, Any],
    local_shape: torch.Size,
    fn: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """`AdamW.transform_state` on state tensors that live with the parameter."""
    if "exp_avg" in state:
        exp_avg, exp_avg_sq = local_shard(state["exp_avg"]), local_shard(state["exp_avg_sq"])
        new_avg, new_avg_sq = fn(exp_avg.clone(), exp_avg_sq.clone())
        _check_shape(new_avg, new_avg_sq, local_shape)
        exp_avg.copy_(new_avg)
        exp_avg_sq.copy_(new_avg_sq)
        return
    block_size = state["block_size"]
    n_blocks = math.ceil(math.prod(local_shape) / block_size)

    def flat(key: str) -> torch.Tensor:
        view = local_shard(state[key]).view(-1)
        return view[:n_blocks] if key.endswith("scales") else view

    moments = []
    for name in ("exp_avg", "exp_avg_sq"):
        codes, scales = flat(f"{name}_codes"), flat(f"{name}_scales")
        with_residual = f"{name}_residual_codes" in state
        residual = (flat(f"{name}_residual_codes"), flat(f"{name}_residual_scales")) if with_residual else None
        moments.append((codes, scales, residual, dequantize_moment(codes, scales, residual, block_size=block_size)))
    new_values = fn(*(m[3].view(local_shape) for m in moments))
    _check_shape(*new_values, local_shape)
    for (codes, scales, residual, _), value in zip(moments, new_values):
        quantize_moment(value.float().reshape(-1), codes, scales, residual, block_size=block_size)


def _adam_update(local: torch.Tensor, state: dict[str, Any], group: dict[str, Any], step: int) -> torch.Tensor:
    """The Adam update of `local`'s last step (its `step`-th), m_hat / (sqrt(v_hat) + eps) without lr and weight
    decay, as `adamw_step_fp32` forms it, from the new moments (fp32; 8-bit ones dequantized, residuals included),
    on `local`'s device in its shape."""
    beta1, beta2 = (float(b) for b in group["betas"])
    if "exp_avg" in state:
        exp_avg, exp_avg_sq = local_shard(state["exp_avg"]), local_shard(state["exp_avg_sq"])
    else:
        block_size = state["block_size"]
        n_blocks = math.ceil(local.numel() / block_size)

        def moment(name: str) -> torch.Tensor:
            def flat(key: str) -> torch.Tensor:
                view = local_shard(state[key]).view(-1)
                return view[:n_blocks] if key.endswith("scales") else view

            residual = None
            if f"{name}_residual_codes" in state:
                residual = (flat(f"{name}_residual_codes"), flat(f"{name}_residual_scales"))
            value = dequantize_moment(flat(f"{name}_codes"), flat(f"{name}_scales"), residual, block_size=block_size)
            return value.view(local.shape)

        exp_avg, exp_avg_sq = moment("exp_avg"), moment("exp_avg_sq")
    exp_avg, exp_avg_sq = exp_avg.to(local.device), exp_avg_sq.to(local.device)
    denom = (exp_avg_sq.sqrt() / (1.0 - beta2**step) ** 0.5).add_(float(group["eps"]))
    return (exp_avg / denom).div_(1.0 - beta1**step)


def _check_shape(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, shape: torch.Size) -> None:
    if exp_avg.shape != shape or exp_avg_sq.shape != shape:
        raise ValueError(
            f"AdamW.transform_state: fn returned shapes {tuple(exp_avg.shape)} and {tuple(exp_avg_sq.shape)}; "
            f"it must return two tensors of the parameter's (local) shape {tuple(shape)}."
        )

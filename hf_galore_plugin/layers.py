"""The GaLore linear layer: GaLore as a frozen-basis reparametrization of an ``nn.Linear``.

With the basis fixed, GaLore on a weight W (m x n) is Adam on a small factor B in

    W = alpha * W0 + scale * B Q^T      (right basis Q: n x r, B: m x r)
    W = alpha * W0 + scale * P B        (left basis P: m x r, B: r x n)
    W = alpha * W0 + scale * P C Q^T    ('full': C is r x r)

because dL/dB = scale * G Q, the projected gradient (G = dL/dW). W0 is frozen (plain, int8 or NF4),
alpha is a scalar that carries decoupled weight decay of the frozen part, and the full-size weight
gradient G is never formed in a normal step: the custom autograd function below skips the weight
GEMM of W0 and computes only dX and dB. On a refresh step the backward also accumulates G (one
layer at a time), and :meth:`GaLoreLinear.refresh` folds B into W0, computes the new basis and
restarts B at zero. The effective weight is unchanged by a refresh.

Step semantics (documented in README "How a step works"): the basis computed from the gradient of
step t is used from step t+1 (one-step subspace lag; GaLore uses it at step t already). Step 0 is a
calibration step for GaLore layers: their basis is still zero, so the factor receives a zero
gradient (only weight decay applies), the gradient of step 0 gives the first basis, and the
factor's optimizer state is reset so step 1 is Adam's first real step.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import GaLoreConfig
from .engines.capabilities import check_moment_handling
from .engines.collectives import all_reduce_mean as _all_reduce_mean
from .engines.collectives import full_tensor as _full_tensor
from .engines.collectives import is_dtensor as _is_dtensor
from .engines.collectives import local_shard as _local
from .engines.collectives import world_size as _world_size
from .engines.contract import gathered_parameters, param_changed
from .engines.contract import reset_state as _reset_state
from .engines.contract import transform_state as _transform_state
from .projection import (
    BasisError,
    basis_from_sketch,
    compute_basis,
    resolve_sides,
    subspace_similarity,
    transport_matrix,
)

try:
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # torch built without distributed support
    DTensor = None

logger = logging.getLogger(__name__)

__all__ = ["GaLoreLinear", "assign_refresh_phases", "pack_refresh_phases", "refresh_phase_capacity"]

_QUANT_SCHEMES = {
    # storage name -> (scheme, bits) of hf_galore_plugin.quant.quantize
    "int8": ("symmetric", 8),
    "int4": ("symmetric", 4),
    "nf4": ("nf4", 4),
}


def _stochastic_round_to_bf16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    # bf16 is the top 16 bits of fp32: adding uniform noise to the 16 discarded bits and truncating
    # rounds up with probability equal to the discarded fraction, which makes the rounding unbiased
    # (Gupta et al. 2015). Without it, folds smaller than half a bf16 ulp of W0 would be lost.
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, generator=generator, device=generator.device, dtype=torch.int32)
    rounded = (bits + noise.to(x.device)) & ~0xFFFF
    return rounded.view(torch.float32).to(torch.bfloat16)


class _GaLoreLinearFunction(torch.autograd.Function):
    """y = alpha * x W0^T + scale * lowrank(x) + bias, with the W0 weight-gradient GEMM skipped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: torch.Tensor, bias: Optional[torch.Tensor], layer: "GaLoreLinear"):
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            # Mixed precision: compute in the autocast dtype, as nn.Linear would; backward (which runs
            # outside autocast) then sees the same dtype.
            x = x.to(torch.get_autocast_dtype(device_type))
        with torch.autocast(device_type, enabled=False):
            return _GaLoreLinearFunction._forward(ctx, x, factor, bias, layer)

    @staticmethod
    def _forward(ctx, x, factor, bias, layer):
        base = layer.base_weight(x.dtype)
        y = F.linear(x, base)
        del base  # a dequantized int8/NF4 copy is freed here, one layer at a time
        y = y * layer.base_multiplier.to(y.dtype)
        y = y + layer._lowrank_forward(x, factor)
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.layer = layer
        ctx.has_bias = bias is not None
        # Read here, as a Python bool kept up to date outside the step, so torch.compile traces the
        # backward without a tensor-to-Python sync (the flag cannot change between forward and backward).
        ctx.record = layer.refresh_due
        ctx.save_for_backward(x, factor)
        return y

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, factor = ctx.saved_tensors
        layer: GaLoreLinear = ctx.layer
        grad_x = grad_factor = grad_bias = None
        dy = grad_out.reshape(-1, grad_out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        if ctx.needs_input_grad[0]:
            base = layer.base_weight(grad_out.dtype)
            grad_x = (grad_out @ base) * layer.base_multiplier.to(grad_out.dtype)
            del base
            grad_x = grad_x + layer._lowrank_backward_input(grad_out, factor)
        if ctx.needs_input_grad[1]:
            grad_factor = layer._lowrank_backward_factor(dy, x2)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = dy.sum(0)
        if ctx.record:
            layer._record_gradient(dy, x2)
        return grad_x, grad_factor, grad_bias, None


class GaLoreLinear(nn.Module):
    """Drop-in replacement of an ``nn.Linear`` whose weight is trained by GaLore / Q-GaLore.

    Parameters: ``galore_factor`` (trainable, small) and ``bias`` (as in the original layer).
    ``weight`` is the frozen base W0 when it is kept as loaded (same state-dict key as nn.Linear);
    a quantized W0 lives in buffers ``weight_q_*``. Counters and bases are buffers, so a
    ``state_dict()`` holds tensors only and restores the layer exactly.
    """

    def __init__(self, base: nn.Linear, config: GaLoreConfig, *, layer_index: int = 0) -> None:
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"GaLoreLinear wraps nn.Linear, got {type(base).__name__}")
        weight = base.weight
        if not weight.is_floating_point():
            raise TypeError(f"GaLoreLinear needs a floating-point weight, got {weight.dtype}")
        if getattr(weight, "ds_numel", weight.numel()) != weight.numel():
            # DeepSpeed ZeRO-3 zero.Init (from_pretrained under a stage-3 config) left only this rank's
            # partition here; copying it would silently lose the rest of W0.
            raise RuntimeError(
                f"GaLoreLinear: the weight ({weight.ds_numel} values) is partitioned by DeepSpeed ZeRO-3 "
                "(zero.Init); replace layers before partitioning, or inside "
                "deepspeed.zero.GatheredParameters(module.parameters(), modifier_rank=0)"
            )
        self.config = config
        self._quant_errors: dict[str, float] = {}
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.weight_dtype = weight.dtype  # the dtype the model was loaded in; merges return to it
        m, n = self.out_features, self.in_features
        has_left, has_right = resolve_sides(config.proj_type, m, n)
        # A side whose dimension the rank covers needs no basis: the subspace is the whole space and the
        # canonical basis makes the step exactly Adam on W (no rotation; Adam is not rotation-invariant).
        self.left_rank = min(config.rank, m) if has_left else None
        self.right_rank = min(config.rank, n) if has_right else None
        self.left_identity = has_left and config.rank >= m
        self.right_identity = has_right and config.rank >= n
        factor_rows = self.left_rank if has_left else m
        factor_cols = self.right_rank if has_right else n
        device = weight.device

        self.galore_factor = nn.Parameter(torch.zeros(factor_rows, factor_cols, device=device, dtype=weight.dtype))
        self.bias = base.bias
        if config.weight_storage == "as_loaded":
            self.weight = nn.Parameter(weight.detach(), requires_grad=False)
            self._weight_meta = None
        else:
            self.register_parameter("weight", None)
            self._weight_meta: Optional[dict[str, Any]] = None
            self._store_quantized(
                "weight_q", weight.detach(), config.weight_storage, config.effective_weight_group_size
            )

        self._basis_meta: dict[str, Optional[dict[str, Any]]] = {"left": None, "right": None}
        for side, rank, identity, dim in (
            ("left", self.left_rank, self.left_identity, m),
            ("right", self.right_rank, self.right_identity, n),
        ):
            if rank is not None and not identity:
                self._set_basis(side, torch.zeros(dim, rank, device=device, dtype=torch.float32))

        def buf(value, dtype):
            return torch.tensor(value, dtype=dtype, device=device)

        self.register_buffer("base_multiplier", buf(1.0, torch.float32))
        self.register_buffer("galore_step", buf(0, torch.int64))
        self.register_buffer("galore_last_refresh", buf(-1, torch.int64))
        self.register_buffer("galore_num_refreshes", buf(0, torch.int64))
        self.register_buffer("galore_gap", buf(config.update_proj_gap, torch.int64))
        self.register_buffer("galore_agree_count", buf(0, torch.int64))
        self.register_buffer("galore_last_similarity", buf(float("nan"), torch.float32))
        # Randomness (stochastic rounding, randomized SVD) comes from (seed, layer, counter): the same on
        # every data-parallel rank, device independent, and exactly restored from a checkpoint.
        self.register_buffer("galore_seed", buf(config.seed * 1_000_003 + layer_index, torch.int64))
        self.register_buffer("galore_rng_counter", buf(0, torch.int64))
        # The step (modulo update_proj_gap) of this layer's calibration and refreshes under
        # refresh_schedule='staggered' (set for all layers at once by assign_refresh_phases); 0 = aligned.
        self.register_buffer("galore_phase", buf(0, torch.int64))
        self._phase = 0  # the phase as a Python int, to restore the buffer after to_empty() (meta device)
        # What this step's backward recorded for the next basis: the dense fp32 gradient (m x n), or with
        # basis_method='sketch' a dict side -> sketch (the basis side's dimension x k). It lives from the
        # step's first backward to its after_optimizer_step, so a checkpoint (taken between steps) never
        # holds one; it is not a buffer because DDP broadcasts buffers from rank 0 at every forward, which
        # would overwrite the other ranks' partial records during gradient accumulation.
        self._pending_grad: Optional[torch.Tensor | dict[str, torch.Tensor]] = None
        self._layer_index = layer_index
        # Built on the meta device: after to_empty() every buffer holds uninitialised memory until
        # reset_galore_state() (create_optimizer calls it) or a load of the layer's own state.
        self._built_on_meta = weight.is_meta
        # A new layer has no basis yet: it records on its first step (known without reading a buffer,
        # which on the meta device would fail).
        self._refresh_due_cache: Optional[bool] = self.needs_basis

    # ------------------------------------------------------------------ initialisation
    @torch.no_grad()
    def reset_galore_state(self) -> None:
        """Set the layer's own state (factor, bases, multiplier, counters, seed) to that of a new layer;
        W0 and the bias are left as they are (loaded weights). For a model prepared on the meta device
        and materialised with ``to_empty()``."""
        self.galore_factor.zero_()
        for side, dim, rank, identity in (
            ("left", self.out_features, self.left_rank, self.left_identity),
            ("right", self.in_features, self.right_rank, self.right_identity),
        ):
            if rank is not None and not identity:
                self._set_basis(side, torch.zeros(dim, rank, device=self.galore_factor.device, dtype=torch.float32))
        self.base_multiplier.fill_(1.0)
        self.galore_step.fill_(0)
        self.galore_last_refresh.fill_(-1)
        self.galore_num_refreshes.fill_(0)
        self.galore_gap.fill_(self.config.update_proj_gap)
        self.galore_agree_count.fill_(0)
        self.galore_last_similarity.fill_(float("nan"))
        self.galore_seed.fill_(self.config.seed * 1_000_003 + self._layer_index)
        self.galore_rng_counter.fill_(0)
        self.galore_phase.fill_(self._phase)
        self._pending_grad = None
        self._refresh_due_cache = self.needs_basis and self._phase == 0
        self._built_on_meta = False

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """A fresh layer as ``nn.Linear.reset_parameters`` initialises one (W0, bias), with new GaLore state:
        the hook torch (FSDP's meta-device init) and users call on every module after ``to_empty()``."""
        w = torch.empty(self.out_features, self.in_features, device=self.galore_factor.device, dtype=self.weight_dtype)
        nn.init.kaiming_uniform_(w, a=math.sqrt(5))
        if self.weight is not None:
            self.weight.copy_(w)
        else:
            self._store_quantized("weight_q", w, self.config.weight_storage, self.config.effective_weight_group_size)
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)
        self.reset_galore_state()

    # ------------------------------------------------------------------ storage helpers
    def _store_quantized(self, prefix: str, value: torch.Tensor, storage: str, group_size: int) -> None:
        from .quant import quantize

        scheme, bits = _QUANT_SCHEMES[storage]
        stochastic = self.config.stochastic_rounding and prefix == "weight_q" and hasattr(self, "galore_seed")
        qt = quantize(
            value,
            scheme=scheme,
            bits=bits,
            block_size=group_size,
            stochastic=stochastic,
            generator=self._next_generator(value.device) if stochastic else None,
        )
        # Measured here, where the exact value is at hand, so logging it costs nothing later.
        if not value.is_meta:
            self._quant_errors[prefix.removeprefix("galore_").removesuffix("_q")] = _relative_rms(
                qt.dequantize(torch.float32), value.to(torch.float32)
            )
        tensors, meta = qt.to_state()
        for key, tensor in tensors.items():
            self._assign_buffer(f"{prefix}_{key}", tensor)
        if prefix == "weight_q":
            self._weight_meta = meta
        else:
            self._basis_meta[prefix.rsplit("_", 1)[1]] = meta

    def _assign_buffer(self, name: str, value: torch.Tensor) -> None:
        # In place when the shape allows: engines (DDP's buffer broadcast, FSDP) keep references to
        # the buffer tensors they saw at wrap time.
        current = self._buffers.get(name)
        if current is None:
            self.register_buffer(name, value)
        elif current.shape == value.shape and current.dtype == value.dtype:
            current.copy_(value)
        else:
            self._buffers[name] = value

    def _load_quantized(self, prefix: str, meta: dict[str, Any]):
        from .quant import QuantizedTensor

        start = len(prefix) + 1
        tensors = {name[start:]: t for name, t in self._buffers.items() if name.startswith(prefix + "_")}
        return QuantizedTensor.from_state(tensors, meta)

    def _next_generator(self, device: torch.device) -> torch.Generator:
        generator = torch.Generator(device=device)
        generator.manual_seed(int(self.galore_seed) * 1_000_033 + int(self.galore_rng_counter))
        self.galore_rng_counter += 1
        return generator

    def base_weight(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """W0 (without the decay multiplier) in `dtype`; a fresh dequantized copy for int8/NF4."""
        dtype = dtype or self.weight_dtype
        if self.weight is not None:
            return self.weight if self.weight.dtype == dtype else self.weight.to(dtype)
        return self._load_quantized("weight_q", self._weight_meta).dequantize(dtype)

    def _set_basis(self, side: str, basis: torch.Tensor) -> None:
        storage = self.config.basis_storage
        name = f"galore_basis_{side}"
        if storage == "as_computed":
            # Stored in the model's dtype (fp32 for fp32 models) to keep a bf16 model's bases small.
            self._assign_buffer(name, basis.to(self.weight_dtype))
        else:
            self._store_quantized(name, basis, storage, self.config.effective_basis_group_size)

    def basis(self, side: str, dtype: Optional[torch.dtype] = None) -> Optional[torch.Tensor]:
        """The basis of `side` ('left' P: m x r, 'right' Q: n x r); None for no basis or the identity."""
        rank = self.left_rank if side == "left" else self.right_rank
        identity = self.left_identity if side == "left" else self.right_identity
        if rank is None or identity:
            return None
        dtype = dtype or self.weight_dtype
        if self.config.basis_storage == "as_computed":
            return self._buffers[f"galore_basis_{side}"].to(dtype)
        return self._load_quantized(f"galore_basis_{side}", self._basis_meta[side]).dequantize(dtype)

    # ------------------------------------------------------------------ low-rank branch
    def _lowrank_forward(self, x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        p, q = self.basis("left", x.dtype), self.basis("right", x.dtype)
        h = x if q is None else x @ q
        h = h @ factor.to(x.dtype).mT
        if p is not None:
            h = h @ p.mT
        return h * self.config.scale

    def _lowrank_backward_input(self, dy: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        p, q = self.basis("left", dy.dtype), self.basis("right", dy.dtype)
        h = dy if p is None else dy @ p
        h = h @ factor.to(dy.dtype)
        if q is not None:
            h = h @ q.mT
        return h * self.config.scale

    def _lowrank_backward_factor(self, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # dB = scale * P^T G Q with G = dy^T x, evaluated right-to-left so no m x n tensor is formed.
        p, q = self.basis("left", dy.dtype), self.basis("right", dy.dtype)
        a = dy if p is None else dy @ p  # (N, r_left or m)
        b = x if q is None else x @ q  # (N, r_right or n)
        return (a.mT @ b).to(self.galore_factor.dtype) * self.config.scale

    def lowrank_delta(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """scale * (P) B (Q^T) as a full m x n tensor (formed only when merging or refreshing).

        A sharded factor (FSDP2 DTensor) is gathered first: a collective, every rank must call it.
        """
        self._check_factor_layout()
        p, q = self.basis("left", dtype), self.basis("right", dtype)
        delta = _full_tensor(self.galore_factor.detach()).to(dtype)
        if q is None and p is None:
            return delta * self.config.scale
        if q is not None:
            delta = delta @ q.mT
        if p is not None:
            delta = p @ delta
        # In place on the product (a fresh m x n tensor): one full-size temporary fewer when folding.
        return delta.mul_(self.config.scale)

    def _local_lowrank_delta(self, like: "DTensor") -> torch.Tensor:
        """This rank's part of the low-rank delta, for a W0 sharded as `like` (FSDP2: Shard(0) rows)."""
        factor = self.galore_factor.detach()
        row_local = (
            (self.left_rank is None or self.left_identity)
            and _is_dtensor(factor)
            and factor.device_mesh == like.device_mesh
            and tuple(factor.placements) == tuple(like.placements)
        )
        if row_local:
            # B (m x r) and W0 (m x n) share their rows and are cut the same way: the right-basis fold
            # W0 += scale * B Q^T is local to each shard and needs no communication.
            delta = factor.to_local().to(torch.float32)
            q = self.basis("right", torch.float32)
            if q is not None:
                delta = delta @ q.mT
            return delta * self.config.scale
        # A left basis mixes all rows of B into each row of W0: gather B (small), form the delta, keep
        # this rank's rows (src_data_rank=None splits locally, without communication).
        full = self.lowrank_delta(torch.float32)
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()

    def effective_weight(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """alpha * W0 + scale * lowrank(B): the weight the layer computes with, in fp32 by default.

        When W0 is a sharded DTensor (FSDP2) the result is a DTensor placed like W0 (``full_tensor()``
        gathers it); otherwise a full tensor (gathering a sharded factor: every rank must call it).
        """
        dtype = dtype or torch.float32
        if _is_dtensor(self.weight):
            w = self.weight
            local = w.to_local().to(torch.float32) * self.base_multiplier + self._local_lowrank_delta(w)
            return DTensor.from_local(
                local.to(dtype), w.device_mesh, w.placements, run_check=False, shape=w.shape, stride=w.stride()
            )
        # A fresh tensor (the product), so the delta is added in place: the same sum, one m x n fp32
        # temporary fewer at a refresh's fold (the peak of a refresh step with a quantized W0).
        w = self.base_weight(torch.float32) * self.base_multiplier
        w.add_(self.lowrank_delta(torch.float32))
        return w.to(dtype)

    def _check_factor_layout(self) -> None:
        expected = (self.left_rank or self.out_features, self.right_rank or self.in_features)
        if tuple(self.galore_factor.shape) != expected:
            raise RuntimeError(
                f"GaLore factor has shape {tuple(self.galore_factor.shape)}, expected {expected}: an engine "
                "holds it as a flat 1-D shard (FSDP1, or DeepSpeed ZeRO-3) and it was used outside a gather. "
                "Pass the FSDP1-wrapped model to create_optimizer/after_step (they gather each refreshing "
                "layer's unit) and merge inside FullyShardedDataParallel.summon_full_params(model); under ZeRO "
                "use hf_galore_plugin.engines.deepspeed.DeepSpeedGaLoreOptimizer."
            )

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GaLoreLinearFunction.apply(x, self.galore_factor, self.bias, self)

    def extra_repr(self) -> str:
        sides = []
        if self.left_rank is not None:
            sides.append(f"left_rank={self.left_rank}{' (identity)' if self.left_identity else ''}")
        if self.right_rank is not None:
            sides.append(f"right_rank={self.right_rank}{' (identity)' if self.right_identity else ''}")
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"{', '.join(sides)}, weight_storage={self.config.weight_storage}, basis_storage={self.config.basis_storage}"
        )

    # ------------------------------------------------------------------ refresh
    @property
    def needs_basis(self) -> bool:
        return (self.left_rank is not None and not self.left_identity) or (
            self.right_rank is not None and not self.right_identity
        )

    @property
    def calibrated(self) -> bool:
        return not self.needs_basis or int(self.galore_num_refreshes) > 0

    @property
    def refresh_due(self) -> bool:
        """True while the current step's backward must record the layer gradient for a new basis.

        Cached as a Python bool (reading the counter buffers costs a device sync per layer on GPU);
        the cache is dropped whenever the counters change (step, refresh, load_state_dict).
        """
        if self._refresh_due_cache is None:
            self._update_refresh_due()
        return self._refresh_due_cache

    def _update_refresh_due(self) -> None:
        self._refresh_due_cache = self._compute_refresh_due()

    def _compute_refresh_due(self) -> bool:
        if not self.needs_basis:
            return False
        if self.config.refresh_schedule == "staggered":
            return self._staggered_refresh_due()
        if not self.calibrated:
            return True
        return int(self.galore_step) - int(self.galore_last_refresh) >= int(self.galore_gap)

    def _staggered_refresh_due(self) -> bool:
        # The schedule rule (README "Options", Refresh memory): calibrate at step == phase (or at the first
        # step after it that reaches the layer), then refresh only at steps == phase (mod update_proj_gap) at
        # least the layer's (lazy) gap after its last refresh. Phases come from assign_refresh_phases, which packs the
        # layers so that one phase's records fit the budget: holding to the phase keeps every step within it
        # (a lazily grown gap, or one clipped to a max_proj_gap that is no multiple of the gap, waits for the
        # next step of its phase). With every phase 0 this is the aligned schedule.
        step, phase = int(self.galore_step), int(self.galore_phase)
        if not self.calibrated:
            return step >= phase
        if (step - phase) % self.config.update_proj_gap != 0:
            return False
        return step - int(self.galore_last_refresh) >= int(self.galore_gap)

    def _basis_sides(self) -> list[tuple[str, int]]:
        """(side, rank) of every side with a computed (non-identity) basis."""
        sides = []
        if self.left_rank is not None and not self.left_identity:
            sides.append(("left", self.left_rank))
        if self.right_rank is not None and not self.right_identity:
            sides.append(("right", self.right_rank))
        return sides

    def _sketch_width(self, rank: int) -> int:
        return min(rank + self.config.oversampling, self.out_features, self.in_features)

    def refresh_record_nbytes(self) -> int:
        """Bytes a refresh of this layer holds from its backward to the refresh: the fp32 gradient (m x n),
        or with basis_method='sketch' one fp32 sketch per basis side (that side's dimension x k)."""
        if not self.needs_basis:
            return 0
        if self.config.basis_method != "sketch":
            return 4 * self.out_features * self.in_features
        dims = {"left": self.out_features, "right": self.in_features}
        return sum(4 * dims[side] * self._sketch_width(rank) for side, rank in self._basis_sides())

    def recorded_nbytes(self) -> int:
        """Bytes of refresh records this layer holds now (0 outside a refresh step's backward..refresh)."""
        record = self._pending_grad
        if record is None:
            return 0
        tensors = record.values() if isinstance(record, dict) else (record,)
        return sum(t.numel() * t.element_size() for t in tensors)

    def sketch_test_matrix(self, side: str, device: Optional[torch.device] = None) -> torch.Tensor:
        """The Gaussian test matrix Omega of the current step's sketch of `side` (fp32).

        'left' (basis P, m x r): Omega is n x k and the sketch G Omega = dy^T (x Omega) spans G's columns;
        'right' (basis Q, n x r): Omega is m x k and the sketch G^T Omega = x^T (dy Omega) spans G's rows.
        Drawn from (layer seed, step, side): the same on every data-parallel rank and every micro-batch of
        a step (so the sketch stays linear in the step's gradient), and after a resume; a stream of its
        own, apart from the counter-driven one of stochastic rounding and the randomized range finder.
        """
        rank = dict(self._basis_sides())[side]
        dim = self.in_features if side == "left" else self.out_features
        device = torch.device(device) if device is not None else self.galore_step.device
        generator = torch.Generator(device=device)
        side_index = 0 if side == "left" else 1
        stream = (int(self.galore_seed) * 1_000_039 + int(self.galore_step)) * 2 + side_index
        generator.manual_seed(stream ^ _SKETCH_STREAM)
        return torch.randn(dim, self._sketch_width(rank), generator=generator, device=device, dtype=torch.float32)

    def _record_gradient(self, dy: torch.Tensor, x: torch.Tensor) -> None:
        # Accumulates over micro-batches (gradient accumulation, or several forwards in one step).
        if self.config.basis_method == "sketch":
            self._record_sketch(dy, x)
            return
        g = dy.to(torch.float32).mT @ x.to(torch.float32)
        if self._pending_grad is None:
            self._pending_grad = g
        else:
            self._pending_grad += g

    def _record_sketch(self, dy: torch.Tensor, x: torch.Tensor) -> None:
        # Y = G Omega (left) or G^T Omega (right) with G = dy^T x, evaluated so that no m x n tensor is
        # formed: N x k and k x dim temporaries only. Linear in G, so the sum over micro-batches is the
        # sketch of the step's gradient, and the mean over ranks the sketch of the averaged gradient.
        dy32, x32 = dy.to(torch.float32), x.to(torch.float32)
        record = self._pending_grad if self._pending_grad is not None else {}
        for side, _ in self._basis_sides():
            omega = self.sketch_test_matrix(side, dy.device)
            sketch = dy32.mT @ (x32 @ omega) if side == "left" else x32.mT @ (dy32 @ omega)
            if side in record:
                record[side] += sketch
            else:
                record[side] = sketch
        self._pending_grad = record

    def discard_recorded_gradient(self) -> None:
        """Forget what this step's backward recorded (its optimizer step was skipped)."""
        self._pending_grad = None

    def after_optimizer_step(self, optimizer: Optional[torch.optim.Optimizer] = None) -> Optional[float]:
        """Advance the layer's step counter and refresh the basis if this step recorded a gradient.

        Returns the subspace similarity of a refresh (NaN for the first basis), or None.
        """
        similarity = None
        if self.refresh_due:
            if self._pending_grad is None:
                warnings.warn(
                    f"GaLore layer {self.out_features}x{self.in_features}: a basis refresh was due but no "
                    "backward ran through the layer this step; the refresh moves to the next step",
                    stacklevel=3,
                )
            else:
                similarity = self.refresh(optimizer)
        self.galore_step += 1
        self._update_refresh_due()
        return similarity

    def refresh(self, optimizer: Optional[torch.optim.Optimizer] = None) -> Optional[float]:
        """Fold the factor into W0, compute the new basis from the recorded gradient, adapt the gap.

        `optimizer` may be an engine adapter (hf_galore_plugin.engines.contract.EngineAdapter) that also
        provides ``gathered_parameters(layer)``: a context in which the layer's partitioned
        parameters are whole (DeepSpeed ZeRO-3) and after which changes are partitioned again.
        """
        try:
            with gathered_parameters(optimizer, self):
                return self._refresh(optimizer)
        finally:
            self._update_refresh_due()

    @torch.no_grad()
    def _refresh(self, optimizer: Optional[torch.optim.Optimizer]) -> Optional[float]:
        grad = self._pending_grad
        self._pending_grad = None
        if grad is None:
            raise RuntimeError("GaLoreLinear.refresh() needs the gradient recorded during a refresh step's backward")
        if isinstance(grad, dict):
            # Streaming sketches: averaging them over the ranks is exact (they are linear in the gradient).
            try:
                new_bases = {
                    side: basis_from_sketch(_all_reduce_mean(grad[side]), rank=rank)
                    for side, rank in self._basis_sides()
                }
            except BasisError as exc:
                return self._basis_failed(exc)
            return self._install_bases(new_bases, optimizer)
        # Data-parallel ranks recorded different micro-batches. The randomized range finder can average
        # its sketches over the ranks instead of the gradient: k (m + n) (1 + power_iterations) values
        # per side, which beats the m x n gradient only when k is small against m and n; each layer
        # takes the smaller exchange (the same choice on every rank). The exact SVD needs the averaged
        # gradient itself (one layer at a time, once per gap).
        sketch_reduce = None
        if self.config.basis_method == "randomized" and _world_size() > 1:
            if self.sketch_exchange_numel() < self.out_features * self.in_features:
                sketch_reduce = _all_reduce_mean
        if sketch_reduce is None:
            grad = _all_reduce_mean(grad)
        new_bases: dict[str, torch.Tensor] = {}
        try:
            for side in ("left", "right"):
                rank = self.left_rank if side == "left" else self.right_rank
                identity = self.left_identity if side == "left" else self.right_identity
                if rank is None or identity:
                    continue
                generator = self._next_generator(grad.device) if self.config.basis_method == "randomized" else None
                new_bases[side] = compute_basis(
                    grad,
                    side=side,
                    rank=rank,
                    method=self.config.basis_method,
                    oversampling=self.config.oversampling,
                    power_iterations=self.config.power_iterations,
                    generator=generator,
                    reduce=sketch_reduce,
                )
        except BasisError as exc:
            return self._basis_failed(exc)
        return self._install_bases(new_bases, optimizer)

    def _basis_failed(self, exc: BasisError) -> None:
        # Never stop training for a bad basis: keep the old one, try again after one more gap.
        warnings.warn(f"GaLore basis refresh failed ({exc}); keeping the previous basis", stacklevel=4)
        self.galore_last_refresh.fill_(int(self.galore_step))

    def _install_bases(self, new_bases: dict[str, torch.Tensor], optimizer: Optional[torch.optim.Optimizer]) -> float:
        """Fold the factor into W0, swap in `new_bases`, adapt the lazy gap and the optimizer state."""
        first = not self.calibrated
        old_bases = {side: self.basis(side, torch.float32).clone() for side in new_bases}
        self._fold_factor_into_base(optimizer)
        for side, basis in new_bases.items():
            self._set_basis(side, basis)
        stored = {side: self.basis(side, torch.float32) for side in new_bases}

        similarity = float("nan")
        if not first:
            similarity = sum(subspace_similarity(old_bases[s], stored[s]) for s in stored) / len(stored)
            self._update_lazy_gap(similarity)
        self.galore_last_similarity.fill_(similarity)
        if optimizer is not None:
            if first or self.config.moment_handling == "reset":
                _reset_state(optimizer, self.galore_factor)
            elif self.config.moment_handling == "project":
                self._transport_moments(optimizer, old_bases, stored)
        self.galore_last_refresh.fill_(int(self.galore_step))
        self.galore_num_refreshes += 1
        return similarity

    def sketch_exchange_numel(self) -> int:
        """Values a data-parallel refresh all-reduces with the randomized range finder's sketches (with
        basis_method='sketch': the streaming sketches themselves)."""
        m, n = self.out_features, self.in_features
        if self.config.basis_method == "sketch":
            return self.refresh_record_nbytes() // 4
        total = 0
        for rank, identity in ((self.left_rank, self.left_identity), (self.right_rank, self.right_identity)):
            if rank is not None and not identity:
                k = min(rank + self.config.oversampling, m, n)
                total += k * (m + n) * (1 + self.config.power_iterations)
        return total

    def _fold_factor_into_base(self, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        merged = self.effective_weight(torch.float32)
        if self.weight is not None:
            merged = _local(merged)
            if self.weight.dtype == torch.bfloat16 and self.config.stochastic_rounding:
                merged = _stochastic_round_to_bf16(merged, self._next_generator(merged.device))
            # In place: FSDP2 all-gathers W0 from the storage of its local shard, and DDP/ZeRO keep
            # references to the parameter; rebinding `.data` would detach W0 from the engine.
            _local(self.weight).copy_(merged)
        else:
            self._store_quantized(
                "weight_q", merged, self.config.weight_storage, self.config.effective_weight_group_size
            )
        self.base_multiplier.fill_(1.0)
        _local(self.galore_factor).zero_()
        # Engines that keep their own master copy of the factor (DeepSpeed ZeRO) reload it from the model.
        param_changed(optimizer, self.galore_factor)

    def _update_lazy_gap(self, similarity: float) -> None:
        # Q-GaLore (Zhang et al. 2024, Sec. 3.3): layers whose subspace stopped moving refresh less often.
        if not self.config.lazy_refresh:
            return
        if similarity >= self.config.cos_threshold:
            self.galore_agree_count += 1
        else:
            self.galore_agree_count.zero_()
        if int(self.galore_agree_count) >= self.config.lazy_window:
            grown = min(int(self.galore_gap) * self.config.lazy_growth, self.config.effective_max_proj_gap)
            self.galore_gap.fill_(grown)
            self.galore_agree_count.zero_()

    def _transport_moments(self, optimizer, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
        # First moment: exact change of coordinates (it is a linear function of past projected
        # gradients). Second moment: no exact transport exists for an elementwise statistic; mapping it
        # with the squared transport matrix keeps it non-negative and exact for permutations/sign flips.
        if _is_dtensor(self.galore_factor):
            check_moment_handling("fsdp2", moment_handling="project", left_basis="left" in new)
        t_left = transport_matrix(old["left"], new["left"]) if "left" in new else None
        t_right = transport_matrix(old["right"], new["right"]) if "right" in new else None

        def transport(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor):
            if t_left is not None:
                exp_avg = t_left.mT @ exp_avg
                exp_avg_sq = t_left.square().mT @ exp_avg_sq
            if t_right is not None:
                exp_avg = exp_avg @ t_right
                exp_avg_sq = exp_avg_sq @ t_right.square()
            return exp_avg, exp_avg_sq

        _transform_state(optimizer, self.galore_factor, transport)

    # ------------------------------------------------------------------ accounting
    def quantization_error(self) -> dict[str, float]:
        """Relative RMS error of the last quantization of W0 ('weight') and of each quantized basis
        ('basis_left', 'basis_right'), measured against the exact values when they were stored."""
        return dict(self._quant_errors)

    def state_nbytes(self) -> dict[str, int]:
        """Exact bytes of the layer's tensors by role."""
        weight = sum(t.numel() * t.element_size() for n, t in self._buffers.items() if n.startswith("weight_q_"))
        if self.weight is not None:
            weight += self.weight.numel() * self.weight.element_size()
        basis = sum(t.numel() * t.element_size() for n, t in self._buffers.items() if n.startswith("galore_basis_"))
        factor = self.galore_factor.numel() * self.galore_factor.element_size()
        bias = self.bias.numel() * self.bias.element_size() if self.bias is not None else 0
        return {"weight": weight, "basis": basis, "factor": factor, "bias": bias}

    # ------------------------------------------------------------------ state dict
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors):
        # Quantized parts may change shape between save and load only if the config changed: make the
        # buffers match what is being loaded so a resume restores them bit-exactly.
        for name in list(self._buffers):
            key = prefix + name
            if (
                key in state_dict
                and self._buffers[name] is not None
                and state_dict[key].shape != self._buffers[name].shape
            ):
                self._buffers[name] = torch.empty_like(state_dict[key], device=self._buffers[name].device)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors)
        if prefix + "galore_step" in state_dict:
            self._built_on_meta = False  # its own state came with the load
        self._update_refresh_due()
        self._pending_grad = None


# Keeps the sketch's test-matrix seeds apart from the counter-driven seeds of _next_generator.
_SKETCH_STREAM = 0x5EED_5EED_0000_0000


def refresh_phase_capacity(config, layers: list["GaLoreLinear"], costs: list[int]) -> int:
    """Most bytes of refresh records one staggered phase may hold: ``refresh_budget_mb``, by default the
    largest targeted layer's dense fp32 gradient; never less than the largest single record."""
    if config.refresh_budget_mb is not None:
        budget = int(config.refresh_budget_mb * 2**20)
    else:
        budget = max((4 * layer.out_features * layer.in_features for layer in layers if layer.needs_basis), default=0)
    return max(budget, *costs) if costs else budget


def pack_refresh_phases(costs: list[int], capacity: int, gap: int) -> tuple[list[int], bool]:
    """Phases for records of `costs` bytes (0: no record): first-fit decreasing into the fewest phases of
    `capacity` bytes, then spread largest-first onto the lightest phase where that still fits. Returns
    (phase per cost, overflow): with more phases than `gap` the records are balanced over `gap` phases
    and overflow is True. Deterministic: ties are broken by position."""
    order = sorted((i for i in range(len(costs)) if costs[i] > 0), key=lambda i: (-costs[i], i))

    def pack_first_fit() -> list[int]:
        loads: list[int] = []
        phase_of = [0] * len(costs)
        for i in order:
            phase = next((p for p, load in enumerate(loads) if load + costs[i] <= capacity), len(loads))
            if phase == len(loads):
                loads.append(0)
            loads[phase] += costs[i]
            phase_of[i] = phase
        return phase_of

    def pack_balanced(count: int) -> list[int]:
        loads, phase_of = [0] * count, [0] * len(costs)
        for i in order:
            phase = min(range(count), key=lambda p: (loads[p], p))
            loads[phase] += costs[i]
            phase_of[i] = phase
        return phase_of

    def peak(phase_of: list[int]) -> int:
        loads: dict[int, int] = {}
        for i, phase in enumerate(phase_of):
            loads[phase] = loads.get(phase, 0) + costs[i]
        return max(loads.values(), default=0)

    phase_of = pack_first_fit()
    count = max(phase_of, default=0) + 1
    if count > gap:
        return pack_balanced(gap), True
    balanced = pack_balanced(count)
    return (balanced if peak(balanced) <= capacity else phase_of), False


def assign_refresh_phases(layers: list["GaLoreLinear"]) -> list[int]:
    """Give each layer its refresh phase (``galore_phase``) under refresh_schedule='staggered'; returns the
    phases in the layers' order (all 0 under 'aligned'), readable also for layers on the meta device.

    Rule: the layers' refresh records (:meth:`GaLoreLinear.refresh_record_nbytes`) are packed into the
    fewest phases whose records fit the budget (``refresh_budget_mb``; default the largest layer's dense
    fp32 gradient; a layer above it gets a phase to itself) by first-fit decreasing, then spread over that
    many phases by largest-first onto the lightest phase when that still fits, so the steps carry about
    equal bytes. More phases than update_proj_gap steps cannot exist: the layers are then balanced over
    update_proj_gap phases and the budget is exceeded (a warning says by how much). Deterministic (ties
    broken by the layers' order), so every data-parallel rank computes the same phases.
    """
    layers = list(layers)
    if not layers:
        return []
    config = layers[0].config
    if config.refresh_schedule != "staggered":
        for layer in layers:
            layer.galore_phase.fill_(0)
            layer._phase = 0
        return [0] * len(layers)
    costs = [layer.refresh_record_nbytes() for layer in layers]
    capacity = refresh_phase_capacity(config, layers, costs)
    phase_of, overflow = pack_refresh_phases(costs, capacity, config.update_proj_gap)
    if overflow:
        loads: dict[int, int] = {}
        for i, phase in enumerate(phase_of):
            loads[phase] = loads.get(phase, 0) + costs[i]
        warnings.warn(
            f"refresh_schedule='staggered': {sum(c > 0 for c in costs)} layers do not fit "
            f"update_proj_gap={config.update_proj_gap} phases of {capacity / 2**20:.1f} MiB; the largest phase "
            f"records {max(loads.values()) / 2**20:.1f} MiB. Raise refresh_budget_mb or update_proj_gap, or use "
            "basis_method='sketch' (smaller records)",
            stacklevel=2,
        )
    for layer, phase in zip(layers, phase_of):
        layer.galore_phase.fill_(phase)
        layer._phase = phase
        # A new layer is at step 0, uncalibrated: due now iff its phase is 0 (set without reading a
        # buffer, which on the meta device would fail).
        layer._refresh_due_cache = layer.needs_basis and phase == 0
    return phase_of


def _relative_rms(approx: torch.Tensor, exact: torch.Tensor, chunk: int = 1 << 22) -> float:
    """rms(approx - exact) / rms(exact), summed over chunks of `chunk` values so that measuring the
    quantization error of a large weight adds no full-size temporaries to a refresh step."""
    a, e = approx.reshape(-1), exact.reshape(-1)
    err = ref = torch.zeros((), dtype=torch.float64, device=e.device)
    for start in range(0, e.numel(), chunk):
        ec = e[start : start + chunk].to(torch.float32)
        ref = ref + ec.square().sum(dtype=torch.float64)
        err = err + (a[start : start + chunk].to(torch.float32) - ec).square().sum(dtype=torch.float64)
    if e.numel() == 0:
        return 0.0
    return float(err.sqrt() / ref.sqrt().clamp_min(1e-30))

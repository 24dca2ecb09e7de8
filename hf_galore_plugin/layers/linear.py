"""The GaLore linear layer: GaLore as a frozen-basis reparametrization of an ``nn.Linear``.

With the basis fixed, GaLore on a weight W (m x n) is Adam on a small factor B in

    W = alpha * W0 + scale * B Q^T      (right basis Q: n x r, B: m x r)
    W = alpha * W0 + scale * P B        (left basis P: m x r, B: r x n)
    W = alpha * W0 + scale * P C Q^T    ('full': C is r x r)

because dL/dB = scale * G Q, the projected gradient (G = dL/dW). W0 is frozen (plain, int8 or NF4),
alpha is a scalar that carries decoupled weight decay of the frozen part, and the full-size weight
gradient G is never formed in a normal step: the custom autograd function (:mod:`.function`) skips
the weight GEMM of W0 and computes only dX and dB. On a refresh step the backward also accumulates G
(one layer at a time), and :meth:`GaLoreLinear.refresh` (:mod:`.refresh`) folds B into W0, computes the
new basis and restarts B at zero. The effective weight is unchanged by a refresh. W0 under a quantized
``weight_storage`` and the bases are :class:`~.storage.StoredTensor` objects; when a layer refreshes
is decided in :mod:`.schedule`. This module ties them together.

Step semantics (documented in docs/guides/how-it-works.md): the basis computed from the gradient of
step t is used from step t+1 (one-step subspace lag; GaLore uses it at step t already). Step 0 is a
calibration step for GaLore layers: their basis is still zero, so the factor receives a zero
gradient (only weight decay applies), the gradient of step 0 gives the first basis, and the
factor's optimizer state is reset so step 1 is Adam's first real step.

Residual mode (``GaLoreConfig.residual``, Fira: Chen et al. 2024, arXiv 2410.01623) also trains W0 with the
part of the gradient the basis leaves out, S = G - G Q Q^T (right basis; G - P P^T G left), without ever
storing G: the layer's backward computes it from x, dy and the basis and writes it into W0 (see
:meth:`GaLoreLinear._apply_residual` for the rule, the lag and what gradient accumulation changes).
"""

from __future__ import annotations

import math
import struct
import warnings
from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from ..config import GaLoreConfig
from ..engines.capabilities import check_residual
from ..engines.collectives import (
    all_reduce_mean,
    from_local,
    full_tensor,
    is_dtensor,
    local_shard,
    same_layout,
    shard_like,
)
from ..engines.contract import observe_updates, update_observer
from ..projection import resolve_sides
from . import rank as _rank_mod
from . import refresh as _refresh_mod
from . import schedule as _schedule
from .function import galore_linear, register_recorder
from .schedule import StepClock
from .storage import StoredTensor, stochastic_round_to_bf16

__all__ = ["GaLoreLinear"]


def _write_lazy_buffers(layer: "GaLoreLinear", prefix: str, keep_vars: bool) -> None:
    # state_dict pre-hook: the buffers of galore_step and base_multiplier are written when they are read
    # out (every save path calls state_dict(): torch, the engines, the Trainer integration).
    step = layer.counter("galore_step")
    layer.galore_step.fill_(step)
    layer._step_written = step


def check_base_weight(weight: torch.Tensor, layer: str) -> None:
    """Refuse a weight a GaLore layer (named `layer` in the message) cannot take over as its W0."""
    if not weight.is_floating_point():
        raise TypeError(f"{layer} needs a floating-point weight, got {weight.dtype}")
    partitioned_numel = getattr(weight, "ds_numel", weight.numel())
    if partitioned_numel != weight.numel():
        # DeepSpeed ZeRO-3 zero.Init (from_pretrained under a stage-3 config) left only this rank's
        # partition here; copying it would silently lose the rest of W0.
        raise RuntimeError(
            f"{layer}: the weight ({partitioned_numel} values) is partitioned by DeepSpeed ZeRO-3 "
            "(zero.Init); replace layers before partitioning, or inside "
            "deepspeed.zero.GatheredParameters(module.parameters(), modifier_rank=0)"
        )


def scale_bases(layers: "list[GaLoreLinear]", factor: float) -> None:
    """alpha *= `factor` for every layer of `layers` (decoupled weight decay of the frozen W0s): the buffers in
    one multi-tensor kernel, and the host copies computed as a float32 ``mul_`` computes (the scalar rounded
    to fp32, then the product)."""
    if not layers:
        return
    torch._foreach_mul_([layer.base_multiplier for layer in layers], factor)
    factor32 = _round_fp32(factor)
    for layer in layers:
        layer._alpha = _round_fp32(layer._alpha * factor32)


def _round_fp32(value: float) -> float:
    """`value` rounded to the nearest fp32 (the product of two fp32 numbers is exact in a double, so this is
    the fp32 product, as a float32 buffer's ``mul_`` computes it)."""
    return struct.unpack("f", struct.pack("f", value))[0]


# The schedule counters: int64 scalar buffers (so they travel with every state dict and engine
# checkpoint) with a host copy each in ``GaLoreLinear._counts``, which every read in the step path uses.
# Reading the buffer itself (``int(layer.galore_step)``) is a device-to-host sync on a GPU; the host copy
# keeps the step driver free of them (about four per layer per step otherwise).
# DDP with broadcast_buffers copies rank 0's buffers into every rank at each forward, behind the layer's
# back; the copy changes no counter: every rank starts from the same values (same seed, same state
# dict) and runs the same schedule (refreshes are collectives that all ranks take at the same steps),
# so the counters agree across ranks by construction and the host copies stay valid.
COUNTER_NAMES = (
    "galore_step",
    "galore_last_refresh",
    "galore_num_refreshes",
    "galore_gap",
    "galore_agree_count",
    "galore_seed",
    "galore_rng_counter",
    "galore_phase",
)

# Fira's norm-growth limiter (arXiv 2410.01623, Sec. 4.2): the scaled residual's norm may grow by at most this
# factor from one step to the next; a sudden jump of the gradient outside the subspace (a loss spike) is held back.
RESIDUAL_GROWTH_LIMIT = 1.01
# Added to the projected gradient's row norms in the residual's scaling ratio (Fira's own 1e-8): a row without
# gradient gets ratio 0, not NaN.
_RESIDUAL_NORM_EPS = 1e-8


class GaLoreLinear(nn.Module):
    """Drop-in replacement of an ``nn.Linear`` whose weight is trained by GaLore / Q-GaLore.

    Parameters: ``galore_factor`` (trainable, small) and ``bias`` (as in the original layer).
    ``weight`` is the frozen base W0 when it is kept as loaded (same state-dict key as nn.Linear);
    a quantized W0 lives in buffers ``weight_q_*``, a basis in ``galore_basis_<side>`` (plain) or
    ``galore_basis_<side>_*`` (quantized), each owned by a :class:`~.storage.StoredTensor`. Counters and
    bases are buffers, so a ``state_dict()`` holds tensors only and restores the layer exactly.

    The counters (:data:`COUNTER_NAMES`) are read from host copies (:meth:`counter`), never from the
    buffers, so a training step makes no device sync for them. The layer writes both at once and
    re-reads the buffers whenever a load replaces them (``load_state_dict``, including the engines' and
    the Trainer integration's loads). Code that writes a counter buffer directly (``fill_``, ``copy_``,
    an in-place ``torch.distributed.checkpoint`` load without ``load_state_dict``) must call
    :meth:`sync_counters` afterwards; a refresh compares the buffers with the host copies (it syncs the
    device anyway) and warns when they differ.
    """

    # The buffers and parameters the class registers, for type checkers (nn.Module's attribute lookup
    # types them as Tensor | Module).
    galore_factor: nn.Parameter
    bias: Optional[nn.Parameter]
    base_multiplier: torch.Tensor
    galore_folded_scale: torch.Tensor  # registered where a stored basis carries the scale
    galore_step: torch.Tensor
    galore_last_refresh: torch.Tensor
    galore_num_refreshes: torch.Tensor
    galore_gap: torch.Tensor
    galore_agree_count: torch.Tensor
    galore_last_similarity: torch.Tensor
    galore_seed: torch.Tensor
    galore_rng_counter: torch.Tensor
    galore_phase: torch.Tensor
    # Residual mode (config.residual, one-sided basis): the previous step's scaling ratio per row of the projected
    # gradient's unprojected dimension, the learning rate of that step, and the (limited) norm of that step's
    # scaled residual, for the growth limiter (NaN rate: no step observed yet; inf norm: no residual applied yet,
    # nothing to limit against, as at Fira's first step).
    galore_residual_ratio: torch.Tensor
    galore_residual_rate: torch.Tensor
    galore_residual_norm: torch.Tensor
    # rank_allocation='auto' (layers/rank.py): the calibration gradient's squared singular values and whole
    # energy, and the rank the allocator gave the layer (0: none yet). Registered on adaptive layers only.
    galore_spectrum: torch.Tensor
    galore_spectrum_total: torch.Tensor
    galore_rank_target: torch.Tensor
    # The basis side the residual is taken against; None: no residual (off, or no computed basis, where it is
    # zero). Class defaults, so a layer kind that does not set up the residual (expert stacks) has none.
    _residual_side: Optional[str] = None
    # Whether a step of the factor has been observed since the first basis (the ratio to lag exists).
    _residual_ready = False
    # rank_allocation='auto': the layer's rank state (layers/rank.py); None: the rank is fixed.
    _adaptive: Optional[_rank_mod.AdaptiveRank] = None

    def __init__(
        self, base: nn.Linear, config: GaLoreConfig, *, layer_index: int = 0, rank: Optional[int] = None
    ) -> None:
        """`rank`: this layer's rank where it is not ``config.rank`` (a file of per-layer ranks:
        ``GaLoreConfig.rank_allocation``)."""
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"GaLoreLinear wraps nn.Linear, got {type(base).__name__}")
        weight = base.weight
        check_base_weight(weight, "GaLoreLinear")
        self.config = config
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.weight_dtype = weight.dtype  # the dtype the model was loaded in; merges return to it
        m, n = self.out_features, self.in_features
        has_left, has_right = resolve_sides(config.proj_type, m, n)
        # A side whose dimension the rank covers needs no basis: the subspace is the whole space and the
        # canonical basis makes the step exactly Adam on W (no rotation; Adam is not rotation-invariant).
        rank = config.rank if rank is None else rank
        self.left_rank = min(rank, m) if has_left else None
        self.right_rank = min(rank, n) if has_right else None
        self.left_identity = has_left and rank >= m
        self.right_identity = has_right and rank >= n
        factor_rows = self.left_rank if self.left_rank is not None else m
        factor_cols = self.right_rank if self.right_rank is not None else n
        device = weight.device

        self.galore_factor = nn.Parameter(torch.zeros(factor_rows, factor_cols, device=device, dtype=weight.dtype))
        self.bias = base.bias
        self._init_storage(config, weight, device)

        self._init_step_state(config, layer_index, device, base_is_meta=weight.is_meta)
        self._init_residual(config, device)
        _rank_mod.init_adaptive(self, config, self._basis_sides(), device)

    def _init_storage(self, config: GaLoreConfig, weight: torch.Tensor, device: torch.device) -> None:
        """W0 and the bases' storage, for a weight of this layer's shape (an expert stack's: E stacked maps)."""
        m, n = self.out_features, self.in_features
        # W0: the parameter `weight` as loaded, or quantized into buffers weight_q_* (no `weight` then).
        self._weight_store: Optional[StoredTensor] = None
        if config.weight_storage == "as_loaded":
            self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        else:
            self.register_parameter("weight", None)
            self._weight_store = StoredTensor(
                self, "weight_q", config.weight_storage, group_size=config.effective_weight_group_size
            )
            self._store_weight(weight.detach())

        # The bases, side -> its storage (None: no basis, or the identity). Plain bases are kept in the
        # model's dtype (fp32 for fp32 models) to keep a bf16 model's bases small.
        self._bases: dict[str, Optional[StoredTensor]] = {"left": None, "right": None}
        sides = (("left", self.left_rank, self.left_identity, m), ("right", self.right_rank, self.right_identity, n))
        for side, rank, identity, _ in sides:
            if rank is not None and not identity:
                self._bases[side] = StoredTensor(
                    self,
                    f"galore_basis_{side}",
                    config.basis_storage,
                    group_size=config.effective_basis_group_size,
                    dtype=self.weight_dtype,
                )
        # The GaLore scale is folded into one stored basis (the right one where there is one): its buffers
        # hold scale * Q (or scale * P), so the step multiplies by nothing (no pass over B or its gradient)
        # and dB = (dy P)^T (x scale Q) is the exact gradient. ``galore_folded_scale`` records the multiplier
        # the stored values carry, so a state dict says what it holds, and a load converts a basis saved with
        # another one (a state dict without the record holds the plain basis: multiplier 1). Without a stored
        # basis (identity sides) the branch multiplies B.
        self._folded_side: Optional[str] = next((s for s in ("right", "left") if self._bases[s] is not None), None)
        # This layer's GaLore scale (GaLoreConfig.layer_scale: under 'auto' from the sides its bases project).
        self.scale = config.layer_scale(
            (dim, rank) for side, rank, _, dim in sides if rank is not None and self._bases[side] is not None
        )
        self._branch_scale = 1.0 if self._folded_side is not None else self.scale
        if self._folded_side is not None:
            self.register_buffer("galore_folded_scale", torch.tensor(self.scale, dtype=torch.float32, device=device))
        for side, rank, _, dim in sides:
            if rank is not None and self._bases[side] is not None:
                self._set_basis(side, torch.zeros(self._basis_shape(dim, rank), device=device, dtype=torch.float32))

    def _init_step_state(
        self, config: GaLoreConfig, layer_index: int, device: torch.device, *, base_is_meta: bool
    ) -> None:
        """The layer's schedule state (counters, their host copies, alpha, the step clock), shared by every
        GaLore layer kind (GaLoreLinear, the expert stacks of :mod:`.experts`)."""

        def buf(value, dtype):
            return torch.tensor(value, dtype=dtype, device=device)

        seed = config.seed * 1_000_003 + layer_index
        # The host copies of the counter buffers (see COUNTER_NAMES), set with them.
        self._counts: dict[str, int] = {
            "galore_step": 0,
            "galore_last_refresh": -1,
            "galore_num_refreshes": 0,
            "galore_gap": config.update_proj_gap,
            "galore_agree_count": 0,
            "galore_seed": seed,
            "galore_rng_counter": 0,
            "galore_phase": 0,
        }

        self.register_buffer("base_multiplier", buf(1.0, torch.float32))
        # The value of base_multiplier, on the host: the eager forward passes it to its GEMM (a compiled
        # forward reads the buffer, so that it does not specialise on a value that moves every step).
        self._alpha = 1.0
        # Registered in this order (the state-dict layout of checkpoints).
        self.register_buffer("galore_step", buf(self._counts["galore_step"], torch.int64))
        self.register_buffer("galore_last_refresh", buf(self._counts["galore_last_refresh"], torch.int64))
        self.register_buffer("galore_num_refreshes", buf(self._counts["galore_num_refreshes"], torch.int64))
        self.register_buffer("galore_gap", buf(self._counts["galore_gap"], torch.int64))
        self.register_buffer("galore_agree_count", buf(self._counts["galore_agree_count"], torch.int64))
        self.register_buffer("galore_last_similarity", buf(float("nan"), torch.float32))
        # Randomness (stochastic rounding, randomized SVD) comes from (seed, layer, counter): the same on
        # every data-parallel rank, device independent, and exactly restored from a checkpoint.
        self.register_buffer("galore_seed", buf(seed, torch.int64))
        self.register_buffer("galore_rng_counter", buf(self._counts["galore_rng_counter"], torch.int64))
        # The step (modulo update_proj_gap) of this layer's calibration and refreshes under
        # refresh_schedule='staggered' (set for all layers at once by assign_refresh_phases); 0 = aligned.
        self.register_buffer("galore_phase", buf(self._counts["galore_phase"], torch.int64))
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
        self._built_on_meta = base_is_meta
        # Whether W0 holds values after to_empty(): set by a load of the weight and by initialize_base
        # (create_optimizer refuses a materialised layer without either).
        self._base_initialised = not base_is_meta
        # A new layer has no basis yet: it records on its first step (known without reading a buffer,
        # which on the meta device would fail).
        self._refresh_due_cache: Optional[bool] = self.needs_basis
        # A compiled forward reads this flag, not refresh_due (function.py, "the refresh record, compiled"):
        # True while any layer of the model may record this step. The step driver (api.after_step) sets it
        # alike on every layer of a model; a layer that finds itself due sets its own. A layer stepped
        # without the driver keeps it True (compiled, it pays the record ops' copies on every step).
        self._compiled_record = True
        self._recorder_id = register_recorder(self)
        # galore_step advances with a StepClock: the layer's own, or its model's, shared by every layer of the
        # model (api.after_step ticks it once a step, with no per-layer work on an ordinary step). The host
        # copy _counts["galore_step"] holds the value at clock step _clock_mark; the buffer is written when
        # it is read out (state_dict, a refresh), not at every step.
        self._clock = StepClock()
        self._clock_mark = 0
        self._step_written = 0  # the value last written to the galore_step buffer
        StepClock.generation += 1
        self.register_state_dict_pre_hook(_write_lazy_buffers)

    # ------------------------------------------------------------------ residual mode (Fira)
    def _init_residual(self, config: GaLoreConfig, device: torch.device) -> None:
        """The residual's state (config.residual), for a layer with one computed basis: config validation
        refuses two (``proj_type='full'``), and with none the subspace is the whole space and the residual zero."""
        sides = self._basis_sides()
        if not config.residual or len(sides) != 1:
            return
        side = sides[0][0]
        self._residual_side = side
        # Fira scales the residual per row of the projected gradient's dimension that the basis does not cut:
        # R = G Q (m x r) has one per output row of W, R = P^T G (r x n) one per input column.
        dim = self.out_features if side == "right" else self.in_features
        self.register_buffer("galore_residual_ratio", torch.zeros(dim, dtype=torch.float32, device=device))
        self.register_buffer("galore_residual_rate", torch.tensor(float("nan"), dtype=torch.float32, device=device))
        self.register_buffer("galore_residual_norm", torch.tensor(float("inf"), dtype=torch.float32, device=device))
        # This step's sum of the norms of the residuals applied so far (one per micro-batch): a 0-d tensor.
        self._residual_applied: Optional[torch.Tensor] = None
        self._residual_warned = False
        observe_updates(self.galore_factor, self)

    def _reset_residual(self) -> None:
        if self._residual_side is None:
            return
        self.galore_residual_ratio.zero_()
        self.galore_residual_rate.fill_(float("nan"))
        self.galore_residual_norm.fill_(float("inf"))
        self._residual_ready = False
        self._residual_applied = None
        observe_updates(self.galore_factor, self)

    def check_optimized(self, param: torch.Tensor) -> None:
        """Refuse, when an optimizer takes the factor, an engine's view of it whose Adam update has no rows
        (:class:`~hf_galore_plugin.engines.contract.UpdateObserver`)."""
        if is_dtensor(param):
            check_residual("fsdp2", residual=True)
        if hasattr(param, "ds_id"):
            check_residual("zero3", residual=True)
        expected = (self.left_rank or self.out_features, self.right_rank or self.in_features)
        if tuple(param.shape) != expected:
            if param.dim() == 1:
                check_residual("fsdp1", residual=True)
            raise ValueError(
                f"GaLore layer {self.out_features}x{self.in_features} (residual=True): the optimizer holds its factor "
                f"with shape {tuple(param.shape)}, expected {expected}; build the optimizer on the model's own "
                "parameters (hf_galore_plugin.create_optimizer)"
            )

    @torch.no_grad()
    def observe_update(self, grad: torch.Tensor, update: torch.Tensor, lr: float) -> None:
        """Record the scaling ratio of the residual the next step applies, from this step of the factor
        (:class:`~hf_galore_plugin.engines.contract.UpdateObserver`).

        Fira's ratio per row i (right basis; per column left): phi_i = ||psi(R)_i|| / ||R_i||, psi(R) the Adam
        update of the projected gradient R = G Q. The factor's gradient is scale * R (the scale is in the
        branch), and Adam's update of it is psi(R) (the group's eps is eps * scale), so R's norms are the
        gradient's divided by the scale. Also closes the step for the growth limiter."""
        if not self.calibrated:
            return  # before its first basis the factor's gradient is zero: there is no ratio to lag
        dim = 1 if self._residual_side == "right" else 0
        grad_norms = torch.linalg.vector_norm(grad.to(torch.float32), dim=dim).div_(self.scale).add_(_RESIDUAL_NORM_EPS)
        self.galore_residual_ratio.copy_(torch.linalg.vector_norm(update, dim=dim).div_(grad_norms))
        self.galore_residual_rate.fill_(lr)
        if self._residual_applied is not None:
            self.galore_residual_norm.copy_(self._residual_applied)
            self._residual_applied = None
        self._residual_ready = True

    def _residual_hook(self, dtype: torch.dtype) -> Optional[Callable[[torch.Tensor, torch.Tensor], None]]:
        """This forward's residual step for the backward (None before the first ratio, and without a backward:
        evaluation and generation run as without the residual), from the compute `dtype`."""
        if update_observer(self.galore_factor) is not self:
            observe_updates(self.galore_factor, self)  # a copied layer, or a factor a load replaced
        if not torch.is_grad_enabled():
            return None
        if dtype == torch.float16:
            raise ValueError(
                "GaLoreConfig.residual=True does not support float16 compute: the residual is written into W0 in the "
                "backward, where float16 gradients are still multiplied by the loss scale (GradScaler); use "
                "bfloat16 or float32, or residual=False"
            )
        if torch.compiler.is_compiling():
            raise NotImplementedError(
                "GaLoreConfig.residual=True runs in eager mode only (its backward hook writes W0); do not compile the "
                "model, or use residual=False"
            )
        if not self._residual_ready:
            counts = self._counts
            if (
                self.calibrated
                and not self._residual_warned
                and self.counter("galore_step") > counts["galore_last_refresh"] + 2
            ):
                self._residual_warned = True
                warnings.warn(
                    f"GaLore layer {self.out_features}x{self.in_features} (residual=True): its optimizer has not "
                    "reported a step of the factor since the first basis, so no residual is applied. Build the "
                    "optimizer with hf_galore_plugin.create_optimizer (its AdamW reports the Adam update); the "
                    "residual runs in one process and under DDP only",
                    RuntimeWarning,
                    stacklevel=4,
                )
            return None
        return self._apply_residual

    @torch.no_grad()
    def _apply_residual(self, dy: torch.Tensor, x: torch.Tensor) -> None:
        """W0 <- W0 - rate * c * phi S / alpha for this micro-batch (dy: N x m, x: N x n), run once the layer's
        backward has used W0 (dX).

        S = dy^T x - (dy^T x Q) Q^T = dy^T (x - x Q Q^T) (right basis; (dy - dy P P^T)^T x left), formed in fp32
        as one m x n GEMM and averaged over data-parallel ranks (DDP averages gradients so). phi: the ratio
        the previous optimizer step recorded (:meth:`observe_update`), on S's rows (right; columns left), folded
        into dy's (x's) columns before the GEMM. rate: that step's learning rate. c: Fira's growth limiter.
        alpha: W0's decay multiplier, since the layer computes with alpha * W0.

        Lag: Fira computes phi from the same step's Adam update, which exists only after this backward; the
        previous step's is the one the backward can apply, per micro-batch, without keeping S. Likewise the
        rate: the previous step's, as that step used it (GaLoreCallback's lr_scale included). With a scheduler
        the residual of step t moves at lr_{t-1}, a relative error of |lr_{t-1} / lr_t - 1| (none at a
        constant rate).

        Gradient accumulation: phi and rate are the same for every micro-batch of a step, so the residuals
        applied add up to the residual of the step's summed gradient, with two differences. (1) The limiter is
        not linear. Fira's caps ||phi S|| at 1.01 times the previous step's; here each micro-batch k gets
        c_k = min(1, (1.01 N_prev - A_{k-1}) / ||phi S_k||), A_k = A_{k-1} + c_k ||phi S_k||, and N_prev of the
        next step is A_K: the norm of what a step applies stays within 1.01 N_prev (triangle inequality), the
        step equals the summed residual's exactly whenever the sum of the micro-batch norms is within it (with
        one micro-batch, always: Fira's limiter), and otherwise it is cut more than Fira's by at most the ratio
        sum_k ||phi S_k|| / ||sum_k phi S_k||. (2) Later micro-batches run their forward with W0 already moved
        by the earlier ones' residuals: their gradients differ from those at the step's starting weights by
        the change of the gradient over a move of at most rate * 1.01 N_prev / alpha, second order in the rate.
        """
        weight = self.weight
        if weight is not None and is_dtensor(weight):
            check_residual("fsdp2", residual=True)
        if weight is not None and hasattr(weight, "ds_id"):
            check_residual("zero3", residual=True)
        side = self._residual_side
        assert side is not None
        # The stored basis carries the scale (scale * Q, see _set_basis): x Q Q^T = (x Qs) Qs^T / scale^2.
        basis = self._step_bases(torch.float32)[0 if side == "left" else 1]
        assert basis is not None
        dy32, x32 = dy.to(torch.float32), x.to(torch.float32)
        ratio, unfold = self.galore_residual_ratio, -1.0 / self.scale**2
        if side == "right":
            outside = torch.addmm(x32, x32 @ basis, basis.mT, alpha=unfold)
            scaled = (dy32 * ratio).mT @ outside
        else:
            outside = torch.addmm(dy32, dy32 @ basis, basis.mT, alpha=unfold)
            scaled = outside.mT @ (x32 * ratio)
        del outside
        scaled = all_reduce_mean(scaled)
        norm = torch.linalg.vector_norm(scaled)
        # c = min(1, room / norm), 0 once the room is spent; room = inf before the first residual step (no limit).
        applied = self._residual_applied
        room = self.galore_residual_norm * RESIDUAL_GROWTH_LIMIT
        if applied is not None:
            room = room - applied
        limit = (room / norm.clamp_min(torch.finfo(torch.float32).tiny)).clamp_(0.0, 1.0)
        self._residual_applied = limit * norm if applied is None else applied + limit * norm
        self._write_residual(scaled, limit * self.galore_residual_rate, 1.0 / self._alpha)

    def _write_residual(self, scaled: torch.Tensor, step: torch.Tensor, unscale: float) -> None:
        """W0 <- W0 - step * unscale * scaled (`step` a 0-d tensor: no host read). A quantized W0 is stored again, a
        bf16 one rounded, both stochastically with config.stochastic_rounding, so that updates below a rounding
        step are not lost (Q-GaLore's reason for stochastic rounding of its int8 weights)."""
        weight = self.weight
        if weight is None:
            value = self.base_weight(torch.float32)  # a fresh dequantized copy
            # No quantization error measured here (a host read per layer and micro-batch); the refresh's fold
            # measures it.
            self._store_weight(value.addcmul_(scaled, step, value=-unscale), measure=False)
        elif weight.dtype == torch.float32:
            weight.addcmul_(scaled, step, value=-unscale)
        else:
            value = weight.to(torch.float32).addcmul_(scaled, step, value=-unscale)
            if weight.dtype == torch.bfloat16 and self.config.stochastic_rounding:
                value = stochastic_round_to_bf16(value, self._next_generator(value.device))
            weight.copy_(value)

    # ------------------------------------------------------------------ initialisation
    @torch.no_grad()
    def reset_galore_state(self) -> None:
        """Set the layer's own state (factor, bases, multiplier, counters, seed) to that of a new layer;
        W0 and the bias are left as they are (loaded weights). For a model prepared on the meta device
        and materialised with ``to_empty()``."""
        _rank_mod.reset(self)
        self.galore_factor.zero_()
        for side, dim, rank, identity in (
            ("left", self.out_features, self.left_rank, self.left_identity),
            ("right", self.in_features, self.right_rank, self.right_identity),
        ):
            if rank is not None and not identity:
                shape = self._basis_shape(dim, rank)
                self._set_basis(side, torch.zeros(shape, device=self.galore_factor.device, dtype=torch.float32))
        if self._folded_side is not None:
            self.galore_folded_scale.fill_(self.scale)
        self._reset_base()
        self._set_counter("galore_step", 0)
        self._set_counter("galore_last_refresh", -1)
        self._set_counter("galore_num_refreshes", 0)
        self._set_counter("galore_gap", self.config.update_proj_gap)
        self._set_counter("galore_agree_count", 0)
        self.galore_last_similarity.fill_(float("nan"))
        self._set_counter("galore_seed", self.config.seed * 1_000_003 + self._layer_index)
        self._set_counter("galore_rng_counter", 0)
        self._set_counter("galore_phase", self._phase)
        self._pending_grad = None
        self._reset_residual()
        self._update_refresh_due()
        self._built_on_meta = False

    def _basis_shape(self, dim: int, rank: int) -> tuple[int, ...]:
        """The shape of a basis of a side of dimension `dim` (an expert stack adds the expert dimension)."""
        return (dim, rank)

    def merged_weight_key(self, name: str) -> str:
        """The state-dict key of the merged weight of the layer at module path `name` (nn.Linear's)."""
        return f"{name}.weight" if name else "weight"

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """A fresh layer as ``nn.Linear.reset_parameters`` initialises one (W0, bias), with new GaLore state:
        the hook torch (FSDP's meta-device init) and users call on every module after ``to_empty()``."""
        self.initialize_base(nn.Linear.reset_parameters)

    @torch.no_grad()
    def initialize_base(self, init: Callable[[nn.Linear], None]) -> None:
        """Initialise W0 and the bias as `init` initialises a plain ``nn.Linear`` of this shape (a model's own
        initialisation: transformers' ``_init_weights``, torch's ``nn.Linear.reset_parameters``), then give
        the layer a new layer's GaLore state. `init` sees ``weight`` and ``bias`` as this layer's own tensors
        (a quantized W0 is stored from the initialised weight, rounded to nearest as when a layer is built),
        so it draws the same random numbers as for the ``nn.Linear`` this layer replaced."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        weight = self.weight
        if weight is None:
            shape, device = (self.out_features, self.in_features), self.galore_factor.device
            weight = nn.Parameter(torch.empty(shape, device=device, dtype=self.weight_dtype), requires_grad=False)
        linear.weight = weight
        if self.bias is not None:
            linear.bias = self.bias
        init(linear)
        if self._weight_store is not None:
            self._weight_store.store(linear.weight.detach())
        self.reset_galore_state()
        self._base_initialised = True

    # ------------------------------------------------------------------ counters
    def counter(self, name: str) -> int:
        """The value of the counter buffer `name` (one of :data:`COUNTER_NAMES`) from its host copy: no
        device sync."""
        if name == "galore_step":
            return self._counts[name] + self._clock.step - self._clock_mark
        try:
            return self._counts[name]
        except KeyError:
            raise ValueError(f"{name!r} is not a GaLore counter; the counters are {', '.join(COUNTER_NAMES)}") from None

    def _set_counter(self, name: str, value: int) -> None:
        # The buffer write stays asynchronous: fill_ with a Python scalar reads nothing back.
        value = int(value)
        getattr(self, name).fill_(value)
        self._counts[name] = value
        self._clock.edits += 1
        self._refresh_due_cache = None
        if name == "galore_step":
            self._clock_mark, self._step_written = self._clock.step, value

    def _add_counter(self, name: str, delta: int = 1) -> None:
        getattr(self, name).add_(delta)
        self._counts[name] += delta
        self._clock.edits += 1
        self._refresh_due_cache = None

    def _counter_buffers(self) -> list[torch.Tensor]:
        buffers = []
        for name in COUNTER_NAMES:
            value = self._buffers.get(name)
            if value is None or value.numel() != 1:
                held = "missing" if value is None else f"of shape {tuple(value.shape)}"
                raise ValueError(
                    f"GaLore counter buffer {name!r} is {held}, a counter holds one value: the state loaded into "
                    "this GaLoreLinear is not one a GaLoreLinear saved; load a GaLoreLinear's own state_dict()"
                )
            buffers.append(value)
        return buffers

    def sync_counters(self) -> None:
        """Re-read the host copies of the counters from the buffers (one device sync) and re-evaluate
        ``refresh_due``. ``load_state_dict`` does it; call it after writing a counter buffer directly.
        Buffers on the meta device or fake tensors hold no values: the host copies are kept then.

        ``galore_step``'s buffer is written when the layer's state is read out (``state_dict()``, a
        refresh), not at every step: here it is taken only if it holds another value than the layer last
        wrote to it (a direct write); a load always takes it."""
        self._read_counter_buffers(loaded=False)

    @torch.no_grad()
    def _read_counter_buffers(self, *, loaded: bool) -> None:
        buffers = self._counter_buffers()
        # Meta and fake tensors (the memory planner's trace) hold no values to read.
        if not any(value.is_meta or is_fake(value) for value in buffers):
            device = buffers[0].device
            stacked = torch.stack(
                [value.detach().reshape(()).to(device=device, dtype=torch.int64) for value in buffers]
            )
            values = dict(zip(COUNTER_NAMES, stacked.tolist()))
            if not loaded and values["galore_step"] == self._step_written:
                values["galore_step"] = self.counter("galore_step")
            self._counts = values
            self._step_written = values["galore_step"] if loaded else self._step_written
            self._clock_mark = self._clock.step
            self._clock.edits += 1
            self._alpha = float(self.base_multiplier.detach().reshape(()).item())
        self._update_refresh_due()

    def _adopt_counter_writes(self) -> None:
        """Called where the device syncs anyway (a refresh): take counter values written to the buffers
        without :meth:`sync_counters`, and say so (decisions since that write used the old values)."""
        before = {name: self.counter(name) for name in COUNTER_NAMES}
        self.sync_counters()
        after = {name: self.counter(name) for name in COUNTER_NAMES}
        changed = [f"{name} {before[name]} -> {after[name]}" for name in COUNTER_NAMES if before[name] != after[name]]
        if changed:
            warnings.warn(
                f"GaLore layer {self.out_features}x{self.in_features}: counter buffers were written without "
                f"sync_counters() ({'; '.join(changed)}); the buffers' values are taken from this refresh on. "
                "Call layer.sync_counters() after writing galore_* counter buffers directly",
                RuntimeWarning,
                stacklevel=4,
            )

    # ------------------------------------------------------------------ storage
    def _next_generator(self, device: torch.device) -> torch.Generator:
        generator = torch.Generator(device=device)
        generator.manual_seed(self._counts["galore_seed"] * 1_000_033 + self._counts["galore_rng_counter"])
        self._add_counter("galore_rng_counter")
        return generator

    def _store_weight(self, value: torch.Tensor, *, measure: bool = True) -> None:
        """Quantize `value` into W0's buffers; stochastically rounded (config.stochastic_rounding) once the
        layer has its random stream, i.e. for every W0 but the one it was built from. `measure`: record the
        quantization error (a host read)."""
        stochastic = self.config.stochastic_rounding and hasattr(self, "galore_seed")
        assert self._weight_store is not None, "W0 is a plain parameter: assign it, there is nothing to quantize"
        generator = self._next_generator(value.device) if stochastic else None
        self._weight_store.store(value, generator=generator, measure=measure)

    def base_weight(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """W0 (without the decay multiplier) in `dtype`; a fresh dequantized copy for int8/NF4."""
        dtype = dtype or self.weight_dtype
        weight = self.weight
        if weight is not None:
            return weight if weight.dtype == dtype else weight.to(dtype)
        return self._weight_store.value(dtype)

    def _set_basis(self, side: str, basis: torch.Tensor) -> None:
        """Store the (orthonormal) basis of `side`; the folded side stores ``scale * basis``."""
        store = self._bases.get(side)
        if store is None:
            raise ValueError(f"GaLoreLinear has no computed basis on side {side!r} (sides: {self._basis_sides()})")
        store.store(basis * self.scale if side == self._folded_side else basis)

    def basis(self, side: str, dtype: Optional[torch.dtype] = None) -> Optional[torch.Tensor]:
        """The basis of `side` ('left' P: m x r, 'right' Q: n x r), orthonormal (the stored values divided by the
        folded scale); None for no basis or the identity."""
        store = self._bases.get(side)
        if store is None:
            if side not in self._bases:
                raise ValueError(f"basis side must be 'left' or 'right', got {side!r}")
            return None
        dtype = dtype or self.weight_dtype
        if side != self._folded_side:
            return store.value(dtype)
        # Divided in fp32 (a refresh or merge, not the step): one rounding into `dtype`.
        return (store.value(torch.float32) / self.scale).to(dtype)

    def _step_bases(self, dtype: torch.dtype) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(P, Q) in `dtype` as the step multiplies with them: the folded side's stored values carry the scale,
        so P B Q^T times ``_branch_scale`` is scale * P B Q^T (None: no basis, or the identity)."""
        left, right = self._bases["left"], self._bases["right"]
        return None if left is None else left.value(dtype), None if right is None else right.value(dtype)

    @torch.no_grad()
    def _convert_folded_basis(self, carried: float) -> None:
        """The stored basis carries the multiplier `carried` (what a loaded state dict recorded): make it carry
        this layer's ``scale``. Exact when the ratio is a power of two (plain: one multiply; quantized: the same
        codes, block scales times the ratio)."""
        side = self._folded_side
        assert side is not None
        store = self._bases[side]
        assert store is not None
        scale = self.scale
        if carried != scale:
            if not store.quantized:
                buffer = self._buffers[store.name]
                assert buffer is not None
                buffer.copy_(buffer.to(torch.float32) * (scale / carried))
            else:
                store.store(store.value(torch.float32) * (scale / carried))
        self.galore_folded_scale.fill_(scale)

    # ------------------------------------------------------------------ low-rank branch, merged weight
    def lowrank_delta(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """scale * (P) B (Q^T) as a full m x n tensor (formed only when merging or refreshing).

        A sharded factor (FSDP2 DTensor) is gathered first: a collective, every rank must call it.
        """
        self._check_factor_layout()
        p, q = self._step_bases(dtype)
        delta = full_tensor(self.galore_factor.detach()).to(dtype)
        if q is None and p is None:
            return delta * self._branch_scale
        if q is not None:
            delta = delta @ q.mT
        if p is not None:
            delta = p @ delta
        # A stored basis carries the scale: the product is the delta, with no pass over the m x n tensor.
        return delta

    def _local_lowrank_delta(self, like: torch.Tensor) -> torch.Tensor:
        """This rank's part of the low-rank delta, for a W0 sharded as the DTensor `like` (FSDP2: Shard(0) rows)."""
        factor = self.galore_factor.detach()
        if (self.left_rank is None or self.left_identity) and same_layout(factor, like):
            # B (m x r) and W0 (m x n) share their rows and are cut the same way: the right-basis fold
            # W0 += scale * B Q^T is local to each shard and needs no communication.
            delta = local_shard(factor).to(torch.float32)
            q = self._step_bases(torch.float32)[1]
            return delta * self._branch_scale if q is None else delta @ q.mT
        # A left basis mixes all rows of B into each row of W0: gather B (small), form the delta, keep
        # this rank's rows (cut locally, without communication).
        return local_shard(shard_like(like, self.lowrank_delta(torch.float32)))

    def effective_weight(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """alpha * W0 + scale * lowrank(B): the weight the layer computes with, in fp32 by default.

        When W0 is a sharded DTensor (FSDP2) the result is a DTensor placed like W0 (``full_tensor()``
        gathers it); otherwise a full tensor (gathering a sharded factor: every rank must call it).
        """
        dtype = dtype or torch.float32
        w = self.weight
        if w is not None and is_dtensor(w):
            local = local_shard(w).to(torch.float32) * self._alpha + self._local_lowrank_delta(w)
            return from_local(local.to(dtype), w)
        # A fresh tensor (the product), so the delta is added in place: the same sum, one m x n fp32
        # temporary fewer at a refresh's fold (the peak of a refresh step with a quantized W0).
        base = self.base_weight(torch.float32) * self._alpha
        base.add_(self.lowrank_delta(torch.float32))
        return base.to(dtype)

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
        device_type = x.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
        p, q = self._step_bases(dtype)
        residual = self._residual_hook(dtype) if self._residual_side is not None else None
        if torch.compiler.is_compiling():
            # W0's multiplier as a tensor (a graph input), and the record through the record ops, decided by
            # the model-wide flag rather than by this layer's refresh_due (no guard per layer and phase).
            alpha: float | torch.Tensor = self.base_multiplier
            record, traced = None, (self._recorder_id, -1) if self._compiled_record else None
        else:
            alpha, traced = self._alpha, None
            record = self._record_gradient if self.refresh_due else None
        return galore_linear(
            x,
            self.galore_factor,
            self.bias,
            self.weight,
            self._weight_value,
            p,
            q,
            alpha,
            self._branch_scale,
            record,
            residual,
            traced,
        )

    def __setstate__(self, state: dict) -> None:
        # A copy (copy.deepcopy, pickle) is a layer of its own: the compiled record ops must find it, not the
        # layer it was copied from, under its id.
        super().__setstate__(state)
        self._recorder_id = register_recorder(self)

    def _record_traced(self, part: int, dy: torch.Tensor, x: torch.Tensor) -> None:
        """The compiled forward's record (function.record_gradient): record (dy, x) if this layer is due."""
        if self.refresh_due:
            self._record_gradient(dy, x)

    def _weight_value(self, dtype: torch.dtype) -> torch.Tensor:
        return self._weight_store.value(dtype)  # type: ignore[union-attr]

    # ------------------------------------------------------------------ the decay multiplier alpha
    def scale_base(self, factor: float) -> None:
        """alpha *= `factor` (decoupled weight decay of the frozen W0); :func:`scale_bases` for many layers."""
        scale_bases([self], factor)

    def _reset_base(self) -> None:
        self.base_multiplier.fill_(1.0)
        self._alpha = 1.0

    @property
    def alpha(self) -> float:
        """The decay multiplier of W0 (the value of the buffer ``base_multiplier``, read without a sync)."""
        return self._alpha

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
        return not self.needs_basis or self._counts["galore_num_refreshes"] > 0

    @property
    def refresh_due(self) -> bool:
        """True while the current step's backward must record the layer gradient for a new basis.

        Cached as a Python bool, computed from the counters' host copies; re-evaluated whenever the
        counters change (step, refresh, load_state_dict, sync_counters).
        """
        if self._refresh_due_cache is None:
            self._update_refresh_due()
        return self._refresh_due_cache  # type: ignore[return-value]

    def _update_refresh_due(self) -> None:
        # A Python bool, read in every forward (a compiled forward guards on it, not on the step count): the
        # layer re-evaluates it when its own clock ticks; a model's step driver invalidates it on the steps
        # where a layer of the model may change between due and not due (api.after_step).
        due = self._refresh_due_cache = _schedule.refresh_due(self.counters(), self.schedule)
        if due:
            self._compiled_record = True  # only the step driver clears it, for all layers of a model at once

    def next_refresh_step(self) -> Optional[int]:
        """The first value of ``galore_step``, from the current one on, at which the layer is due (None:
        never, it has no basis); :func:`~.schedule.next_refresh_step`."""
        return _schedule.next_refresh_step(self.counters(), self.schedule)

    def counters(self) -> _schedule.Counters:
        """The refresh rule's counters now (host copies: no device sync)."""
        counts = self._counts
        return _schedule.Counters(
            step=self.counter("galore_step"),
            last_refresh=counts["galore_last_refresh"],
            num_refreshes=counts["galore_num_refreshes"],
            gap=counts["galore_gap"],
            phase=counts["galore_phase"],
        )

    @property
    def schedule(self) -> _schedule.Schedule:
        """The refresh rule's fixed settings of this layer (from its config and sides)."""
        config = self.config
        return _schedule.Schedule(
            staggered=config.refresh_schedule == "staggered",
            period=config.update_proj_gap,
            needs_basis=self.needs_basis,
        )

    def set_refresh_phase(self, phase: int, *, gap: Optional[int] = None) -> None:
        """Set the step (modulo ``update_proj_gap``) at which the layer refreshes under
        ``refresh_schedule='staggered'`` and, given `gap`, its current refresh gap; ``refresh_due`` follows.

        The hook for whatever assigns phases: :func:`~.schedule.assign_refresh_phases` at preparation and
        on a resume with other settings, and the memory planner, which stages which layers refresh on its
        traced steps. Host copies and buffers are written together (no device sync)."""
        if phase < 0:
            raise ValueError(f"refresh phase must be >= 0, got {phase}")
        if gap is not None and gap < 1:
            raise ValueError(f"refresh gap must be >= 1, got {gap}")
        self._set_counter("galore_phase", phase)
        self._phase = phase
        if gap is not None:
            self._set_counter("galore_gap", gap)
        self._update_refresh_due()

    def _basis_sides(self) -> list[tuple[str, int]]:
        """(side, rank) of every side with a computed (non-identity) basis."""
        sides = []
        if self.left_rank is not None and not self.left_identity:
            sides.append(("left", self.left_rank))
        if self.right_rank is not None and not self.right_identity:
            sides.append(("right", self.right_rank))
        return sides

    def _sketch_width(self, rank: int) -> int:
        if self._adaptive is not None:
            rank = _rank_mod.record_rank(self, rank)  # the calibration's spectrum, or the rank to take
        return min(rank + self.config.oversampling, self.out_features, self.in_features)

    def recorded_nbytes(self) -> int:
        """Bytes of refresh records this layer holds now (0 outside a refresh step's backward..refresh)."""
        record = self._pending_grad
        if record is None:
            return 0
        tensors = record.values() if isinstance(record, dict) else (record,)
        return sum(t.numel() * t.element_size() for t in tensors)

    def discard_recorded_gradient(self) -> None:
        """Forget what this step's backward recorded (its optimizer step was skipped)."""
        self._pending_grad = None

    def after_optimizer_step(self, optimizer: Optional[torch.optim.Optimizer] = None) -> Optional[float]:
        """Advance the layer's step counter and refresh the basis if this step recorded a gradient.

        Returns the subspace similarity of a refresh (NaN for the first basis), or None.
        """
        similarity = None
        due = self.refresh_due
        if due:
            if self._pending_grad is None:
                warnings.warn(
                    f"GaLore layer {self.out_features}x{self.in_features}: a basis refresh was due but no "
                    "backward ran through the layer this step; the refresh moves to the next step",
                    stacklevel=3,
                )
            else:
                similarity = self.refresh(optimizer)
        if not self._clock.shared:
            self._clock.step += 1
            self._update_refresh_due()
        return similarity

    def use_clock(self, clock: StepClock) -> None:
        """Advance ``galore_step`` with `clock` from now on (the model's, shared by its layers) instead of
        the layer's own; the current value is kept."""
        self._counts["galore_step"] = self.counter("galore_step")
        self._clock, self._clock_mark = clock, clock.step
        self._refresh_due_cache = None

    # The refresh's record and the refresh itself (hf_galore_plugin.layers.refresh), as methods.
    refresh_record_nbytes = _refresh_mod.refresh_record_nbytes
    sketch_test_matrix = _refresh_mod.sketch_test_matrix
    sketch_exchange_numel = _refresh_mod.sketch_exchange_numel
    refresh = _refresh_mod.refresh
    _record_gradient = _refresh_mod.record_gradient

    # ------------------------------------------------------------------ accounting
    def quantization_error(self) -> dict[str, float]:
        """Relative RMS error of the last quantization of W0 ('weight') and of each quantized basis
        ('basis_left', 'basis_right'), measured against the exact values when they were stored."""
        stores = {"weight": self._weight_store, "basis_left": self._bases["left"], "basis_right": self._bases["right"]}
        return {key: store.error for key, store in stores.items() if store is not None and store.error is not None}

    def state_nbytes(self) -> dict[str, int]:
        """Exact bytes of the layer's tensors by role."""
        weight = self._weight_store.nbytes() if self._weight_store is not None else 0
        if self.weight is not None:
            weight += self.weight.numel() * self.weight.element_size()
        basis = sum(store.nbytes() for store in self._bases.values() if store is not None)
        factor = self.galore_factor.numel() * self.galore_factor.element_size()
        bias = self.bias.numel() * self.bias.element_size() if self.bias is not None else 0
        return {"weight": weight, "basis": basis, "factor": factor, "bias": bias}

    # ------------------------------------------------------------------ state dict
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors):
        if self._adaptive is not None:
            _rank_mod.before_load(self, state_dict, prefix)  # the saved rank (rank_allocation='auto')
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
        if self._folded_side is not None:
            self._load_folded_scale(state_dict, prefix, missing_keys)
        if prefix + "galore_step" in state_dict:
            self._built_on_meta = False  # its own state came with the load
        if prefix + "galore_step" in state_dict or (self.weight is not None and prefix + "weight" in state_dict):
            self._base_initialised = True
        # The load copied into (or, with assign=True, replaced) the counter buffers: refresh the host
        # copies. Every load path ends here: load_state_dict, load_galore_state_dict, the engines' and
        # the Trainer integration's resumes, torch.distributed.checkpoint's set_model_state_dict.
        self._read_counter_buffers(loaded=True)
        self._pending_grad = None
        self._load_residual(state_dict, prefix, missing_keys, unexpected_keys)
        _rank_mod.after_load(self)

    _RESIDUAL_BUFFERS = ("galore_residual_ratio", "galore_residual_rate", "galore_residual_norm")

    def _load_residual(self, state_dict, prefix: str, missing_keys: list[str], unexpected_keys: list[str]) -> None:
        # A state saved with the other residual setting loads: a run may turn the residual on or off at a resume
        # (turned on, it starts as at the first basis: no ratio until a step is observed).
        names = [prefix + name for name in self._RESIDUAL_BUFFERS]
        if self._residual_side is None:
            unexpected_keys[:] = [key for key in unexpected_keys if key not in names]
            return
        if any(key in missing_keys for key in names):
            missing_keys[:] = [key for key in missing_keys if key not in names]
            self._reset_residual()
            return
        self._residual_applied = None
        observe_updates(self.galore_factor, self)  # the load may have assigned a new factor
        rate = self.galore_residual_rate
        if not (rate.is_meta or is_fake(rate)):
            self._residual_ready = not math.isnan(float(rate))  # a load syncs anyway

    def _load_folded_scale(self, state_dict, prefix: str, missing_keys: list[str]) -> None:
        # A basis came with the load: it carries the multiplier the state dict recorded (every state the layer
        # writes records it; a basis without it cannot be read).
        store = self._bases[self._folded_side]  # type: ignore[index]
        assert store is not None
        if not any(prefix + name in state_dict for name in store.buffer_names()):
            return
        key = prefix + "galore_folded_scale"
        recorded = state_dict.get(key)
        if recorded is None:
            raise ValueError(
                f"{key} is missing from the loaded state, which holds this layer's basis: the GaLore scale the "
                "stored basis carries is unknown. Load the whole state the layer saved (its state_dict())"
            )
        if recorded.is_meta or is_fake(recorded):
            return  # no values to convert (the memory planner's trace, a meta-device model)
        carried = float(recorded)
        if not (0.0 < carried < float("inf")):
            raise ValueError(
                f"{key} = {carried!r} in the loaded state: the multiplier a stored basis carries is the positive "
                "GaLore scale of the layer it was saved from; this state dict is damaged"
            )
        if recorded is not None and carried == float(torch.tensor(self.scale, dtype=recorded.dtype)):
            carried = self.scale  # this layer's scale as the buffer's dtype holds it: nothing to convert
        self._convert_folded_basis(carried)


# Keeps the sketch's test-matrix seeds apart from the counter-driven seeds of _next_generator.


if TYPE_CHECKING:  # mypy checks that the layer is what the refresh functions it binds expect

    def _refresh_target(layer: GaLoreLinear) -> _refresh_mod.RefreshTarget:
        return layer

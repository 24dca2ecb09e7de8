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
is decided in :mod:`.schedule`. What every layer kind holds (storage, counters, the refresh's plumbing) is
:class:`~.base.GaLoreLayerBase`'s; this module adds the ``nn.Linear`` constructor, the forward and the
residual mode.

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
import warnings
from typing import Callable, Optional

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from ..config import GaLoreConfig
from ..engines.capabilities import check_residual
from ..engines.collectives import all_reduce_mean, is_dtensor
from ..engines.contract import observe_updates, update_observer
from ..projection import resolve_sides
from . import rank as _rank_mod
from .base import GaLoreLayerBase
from .weights import TRACE_PLANS, TracePlan, check_base_weight, scale_bases
from .counters import COUNTER_NAMES
from .function import galore_linear
from .storage import read_spec, stochastic_round_to_bf16

# With GaLoreLinear, the names the rest of the package and the tests import from this module.
__all__ = [
    "GaLoreLinear",
    "COUNTER_NAMES",
    "RESIDUAL_GROWTH_LIMIT",
    "check_base_weight",
    "resolve_sides",
    "scale_bases",
]

# Fira's norm-growth limiter (arXiv 2410.01623, Sec. 4.2): the scaled residual's norm may grow by at most this
# factor from one step to the next; a sudden jump of the gradient outside the subspace (a loss spike) is held back.
RESIDUAL_GROWTH_LIMIT = 1.01
# Added to the projected gradient's row norms in the residual's scaling ratio (Fira's own 1e-8): a row without
# gradient gets ratio 0, not NaN.
_RESIDUAL_NORM_EPS = 1e-8


class GaLoreLinear(GaLoreLayerBase):
    """Drop-in replacement of an ``nn.Linear`` whose weight is trained by GaLore / Q-GaLore.

    Parameters: ``galore_factor`` (trainable, small) and ``bias`` (as in the original layer).
    ``weight`` is the frozen base W0 when it is kept as loaded (same state-dict key as nn.Linear);
    a quantized W0 lives in buffers ``weight_q_*``, a basis in ``galore_basis_<side>`` (plain) or
    ``galore_basis_<side>_*`` (quantized), each owned by a :class:`~.storage.StoredTensor`. Counters and
    bases are buffers, so a ``state_dict()`` holds tensors only and restores the layer exactly.

    The counters (:data:`~.counters.COUNTER_NAMES`) are read from host copies (:meth:`counter`), never from the
    buffers, so a training step makes no device sync for them. The layer writes both at once and
    re-reads the buffers whenever a load replaces them (``load_state_dict``, including the engines' and
    the Trainer integration's loads). Code that writes a counter buffer directly (``fill_``, ``copy_``,
    an in-place ``torch.distributed.checkpoint`` load without ``load_state_dict``) must call
    :meth:`sync_counters` afterwards; a refresh compares the buffers with the host copies (it syncs the
    device anyway) and warns when they differ.
    """

    # Residual mode (config.residual, one-sided basis): the previous step's scaling ratio per row of the projected
    # gradient's unprojected dimension, the learning rate of that step, and the (limited) norm of that step's
    # scaled residual, for the growth limiter (NaN rate: no step observed yet; inf norm: no step of this basis
    # observed yet; the first observed step sets it to its projected update's norm, observe_update).
    galore_residual_ratio: torch.Tensor
    galore_residual_rate: torch.Tensor
    galore_residual_norm: torch.Tensor
    # The basis side the residual is taken against; None: no residual (off, or no computed basis, where it is
    # zero). Class defaults, so a layer kind that does not set up the residual (expert stacks) has none.
    _residual_side: Optional[str] = None
    # Whether a step of the factor has been observed since the first basis (the ratio to lag exists).
    _residual_ready = False
    # The compiled forward reads the layer's TracePlan (weights.py), not its storage objects.
    _traced_by_plan = True

    def __init__(
        self, base: nn.Linear, config: GaLoreConfig, *, layer_index: int = 0, rank: Optional[int] = None
    ) -> None:
        """`rank`: this layer's rank where it is not ``config.rank`` (a file of per-layer ranks:
        ``GaLoreConfig.rank_allocation``)."""
        if not isinstance(base, nn.Linear):
            raise TypeError(f"GaLoreLinear wraps nn.Linear, got {type(base).__name__}")
        rank = config.rank if rank is None else rank
        super().__init__(base.weight, config, rank=rank, layer_index=layer_index, bias=base.bias)
        self._init_residual(config, self.galore_factor.device)
        self._adaptive = _rank_mod.init_adaptive(self, config, self.basis_sides(), self.galore_factor.device)
        self._update_trace_key()  # the residual mode is known now

    # ------------------------------------------------------------------ residual mode (Fira)
    def _init_residual(self, config: GaLoreConfig, device: torch.device) -> None:
        """The residual's state (config.residual), for a layer with one computed basis: config validation
        refuses two (``proj_type='full'``), and with none the subspace is the whole space and the residual zero."""
        sides = self.basis_sides()
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
        else:
            # No residual step since this basis: the first one may be as large as this step's projected update
            # (norm scale * ||psi||: the basis is orthonormal), then grow by the limiter's factor per step. Fira
            # leaves the first step unlimited, which is safe only while the rate is small (its warm-up): a layer
            # that takes a basis at the full rate (a refresh, or a late staggered phase) would otherwise apply its
            # whole outside-the-subspace gradient at the ratio of Adam's first, sign-like step, and every later
            # limit would grow from that norm.
            first = torch.linalg.vector_norm(update.to(torch.float32)).mul_(self.scale)
            self.galore_residual_norm.copy_(
                torch.where(torch.isinf(self.galore_residual_norm), first, self.galore_residual_norm)
            )
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
            if (
                self.calibrated
                and not self._residual_warned
                and self.counter("galore_step") > self.counts.values["galore_last_refresh"] + 2
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
        # c = min(1, room / norm), 0 once the room is spent; before the first residual step of a basis the room is
        # the first projected update's norm (observe_update).
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
            self.store_weight(value.addcmul_(scaled, step, value=-unscale), measure=False)
        elif weight.dtype == torch.float32:
            weight.addcmul_(scaled, step, value=-unscale)
        else:
            value = weight.to(torch.float32).addcmul_(scaled, step, value=-unscale)
            if weight.dtype == torch.bfloat16 and self.config.stochastic_rounding:
                value = stochastic_round_to_bf16(value, self.next_generator(value.device))
            weight.copy_(value)

    def _reset_kind_state(self) -> None:
        self._reset_residual()

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

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compiling = torch.compiler.is_compiling()
        if compiling:
            key = self._trace_key
            if key is not None:
                return _traced_forward(self, x, TRACE_PLANS[key])
        device_type = x.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
        p, q = self._step_bases(dtype)
        residual = self._residual_hook(dtype) if self._residual_side is not None else None
        if compiling:  # a layer without a trace plan (residual mode, double-quantized scales)
            # W0's multiplier as a tensor (a graph input), and the record through the record ops, decided by
            # the model-wide flag rather than by this layer's refresh_due (no guard per layer and phase).
            alpha: float | torch.Tensor = self.base_multiplier
            record, traced = None, (self.recorder_id, -1) if self.compiled_record else None
        else:
            if self.pending_phase_packing is not None and self.training:
                self.pending_phase_packing.pack(x)  # the model's first training forward: before any record
            alpha, traced = self._alpha, None
            record = self.record_gradient if self.refresh_due else None
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

    def observe_traced_input(self, part: int, x: torch.Tensor) -> None:
        """The compiled forward's record tap (function.record_tap) on a record step: the phases waiting for
        the first training forward are packed here, with this input, before any layer records."""
        if self.pending_phase_packing is not None and self.training:
            self.pending_phase_packing.pack(x)

    def record_traced(self, part: int, dy: torch.Tensor, x: torch.Tensor) -> None:
        """The compiled forward's record (function.record_gradient): record (dy, x) if this layer is due."""
        if self.refresh_due:
            self.record_gradient(dy, x)

    def _load_kind_state(self, state_dict, prefix: str, missing_keys: list[str], unexpected_keys: list[str]) -> None:
        self._load_residual(state_dict, prefix, missing_keys, unexpected_keys)

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


def _traced_forward(layer: GaLoreLinear, x: torch.Tensor, plan: TracePlan) -> torch.Tensor:
    """The compiled forward of `layer` (as :meth:`GaLoreLinear.forward` when compiling, without the residual).

    Every Python value Dynamo reads from a layer is a guard checked before each call of the compiled model, per
    layer. So this reads from the layer only what differs between layers or steps: its tensors (through the
    module's own dicts, no method or storage object), the bias, the record flag (and, on record steps, the
    recorder id). What never changes for a layer (how its bases and W0 are stored, the branch's scale) comes
    from `plan`, shared by the layers with the same storage and shape and guarded through one string per layer
    (its ``_trace_key``). A module-level function: a method looked up on the layer is a guard too.
    """
    device_type = x.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
    buffers = layer._buffers
    p = None if plan.left is None else read_spec(buffers, plan.left, dtype)
    q = None if plan.right is None else read_spec(buffers, plan.right, dtype)
    weight_spec = plan.weight

    def read_weight(dtype: torch.dtype) -> torch.Tensor:
        assert weight_spec is not None
        return read_spec(buffers, weight_spec, dtype)

    # W0's multiplier as a tensor (a graph input), and the record through the record ops, decided by the
    # model-wide flag rather than by this layer's refresh_due (no guard per layer and phase).
    traced = (layer.recorder_id, -1) if layer.compiled_record else None
    alpha = buffers["base_multiplier"]
    assert alpha is not None
    return galore_linear(
        x,
        layer.galore_factor,
        layer.bias,
        None if weight_spec is not None else layer.weight,  # a quantized W0 has no parameter: no guard on it
        read_weight,
        p,
        q,
        alpha,
        plan.scale,
        None,
        None,
        traced,
    )

"""The tensors of a GaLore layer: W0, the bases and the factor in storage, the decay multiplier alpha.

:class:`GaLoreWeights` is built from a weight of shape (..., m, n): an ``nn.Linear``'s (m x n, the
:class:`~.linear.GaLoreLinear`) or a stack of them (E x m x n, the :class:`~.experts.GaLoreExpertStack`); the
factor and the bases take the weight's leading dimensions. W0 is the parameter ``weight`` as loaded, or
quantized in a :class:`~.storage.StoredTensor`; each computed basis side is a ``StoredTensor``, one of them
carrying the GaLore scale. It reads and writes them (the merged weight, a load's conversion of the carried
scale); the counters and the refresh plumbing are :class:`~.base.GaLoreLayerBase`'s, which builds on it.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple, Optional

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from ..config import GaLoreConfig
from ..engines.collectives import from_local, full_tensor, is_dtensor, local_shard, same_layout, shard_like
from ..projection import resolve_sides
from .storage import StoredTensor, StoreSpec

__all__ = ["TRACE_PLANS", "GaLoreWeights", "TracePlan", "check_base_weight", "scale_bases"]


class TracePlan(NamedTuple):
    """The Python values a compiled forward of a layer needs besides its tensors: how to read each basis and a
    quantized W0 (:func:`~.storage.read_spec`; None: no basis / W0 is the parameter ``weight``) and the branch's
    scale. Layers with the same plan share one object, found in :data:`TRACE_PLANS` by the layer's
    ``_trace_key``: Dynamo guards that one string per layer, where reading the storage objects' fields
    guards each of them per layer (docs/benchmarks/step-time.md, "compiled from the first step")."""

    left: Optional[StoreSpec]
    right: Optional[StoreSpec]
    weight: Optional[StoreSpec]
    scale: float


# key -> plan, for every plan a layer has had (a handful per model: one per shape and storage).
TRACE_PLANS: dict[str, TracePlan] = {}


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


def scale_bases(layers: "list[Any]", factor: float) -> None:
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


class GaLoreWeights(nn.Module):
    """W0, the bases, the factor and alpha of a GaLore layer of weight shape (..., m, n); see the module
    docstring."""

    # The buffers and parameters the class registers, for type checkers (nn.Module's attribute lookup
    # types them as Tensor | Module).
    galore_factor: nn.Parameter
    bias: Optional[nn.Parameter]
    weight: Optional[nn.Parameter]
    base_multiplier: torch.Tensor
    galore_folded_scale: torch.Tensor  # registered where a stored basis carries the scale

    def __init__(self, weight: torch.Tensor, config: GaLoreConfig, *, rank: int, bias: Optional[nn.Parameter]) -> None:
        """Rank `rank` over `weight` (..., m, n: each m x n slice an ``nn.Linear`` weight, out x in), taken over
        as W0, with `bias` (None: none)."""
        super().__init__()
        check_base_weight(weight, type(self).__name__)
        self.config = config
        *lead, m, n = (int(size) for size in weight.shape)
        self.stack_shape = tuple(lead)  # the leading dimensions of W0, the factor and the bases
        self.in_features, self.out_features = n, m
        self.weight_dtype = weight.dtype  # the dtype the model was loaded in; merges return to it
        has_left, has_right = resolve_sides(config.proj_type, m, n)
        # A side whose dimension the rank covers needs no basis: the subspace is the whole space and the
        # canonical basis makes the step exactly Adam on W (no rotation; Adam is not rotation-invariant).
        self.left_rank = min(rank, m) if has_left else None
        self.right_rank = min(rank, n) if has_right else None
        self.left_identity = has_left and rank >= m
        self.right_identity = has_right and rank >= n
        factor_rows = self.left_rank if self.left_rank is not None else m
        factor_cols = self.right_rank if self.right_rank is not None else n
        device = weight.device
        shape = (*self.stack_shape, factor_rows, factor_cols)
        self.galore_factor = nn.Parameter(torch.zeros(shape, device=device, dtype=weight.dtype))
        self.bias = bias
        self._init_storage(config, weight, device)
        self.register_buffer("base_multiplier", torch.tensor(1.0, dtype=torch.float32, device=device))
        # The value of base_multiplier, on the host: the eager forward passes it to its GEMM (a compiled
        # forward reads the buffer, so that it does not specialise on a value that moves every step).
        self._alpha = 1.0

    def _init_storage(self, config: GaLoreConfig, weight: torch.Tensor, device: torch.device) -> None:
        """W0 and the bases' storage, for a weight of this layer's shape."""
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
            self._weight_store.store(weight.detach())  # rounded to nearest: no random stream yet

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
                self.set_basis(side, torch.zeros(self.basis_shape(dim, rank), device=device, dtype=torch.float32))
        # The compiled forward's plan follows every store (a quantized store's layout changes with its shape).
        for store in (self._weight_store, *self._bases.values()):
            if store is not None:
                store.on_store = self._update_trace_key
        self._update_trace_key()

    # Kinds of layer whose compiled forward reads the trace plan (others keep _trace_key None).
    _traced_by_plan = False

    def _update_trace_key(self) -> None:
        """Set ``_trace_key``, the key of this layer's :class:`TracePlan` in :data:`TRACE_PLANS` (None: the compiled
        forward reads the storage objects themselves: a store without a spec, a layer in residual mode)."""
        key = None
        stores = (self._bases["left"], self._bases["right"], self._weight_store)
        left, right, weight = (None if store is None else store.spec() for store in stores)
        traceable = all(spec is not None for spec, store in zip((left, right, weight), stores) if store is not None)
        if self._traced_by_plan and traceable and getattr(self, "_residual_side", None) is None:
            plan = TracePlan(left, right, weight, self._branch_scale)
            key = repr(plan)
            TRACE_PLANS.setdefault(key, plan)
        self._trace_key: Optional[str] = key

    def basis_shape(self, dim: int, rank: int) -> tuple[int, ...]:
        """The shape of a basis of a side of dimension `dim` (with W0's leading dimensions)."""
        return (*self.stack_shape, dim, rank)

    # ------------------------------------------------------------------ W0, bases
    def weight_store(self) -> StoredTensor:
        """The storage of a quantized W0 (a layer whose ``weight`` is None)."""
        store = self._weight_store
        assert store is not None, "W0 is stored quantized exactly when the parameter `weight` is None"
        return store

    def base_weight(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """W0 (without the decay multiplier) in `dtype`; a fresh dequantized copy for int8/NF4."""
        dtype = dtype or self.weight_dtype
        weight = self.weight
        if weight is not None:
            return weight if weight.dtype == dtype else weight.to(dtype)
        return self.weight_store().value(dtype)

    def set_basis(self, side: str, basis: torch.Tensor) -> None:
        """Store the (orthonormal) basis of `side`; the folded side stores ``scale * basis``."""
        store = self._bases.get(side)
        if store is None:
            raise ValueError(f"GaLoreLinear has no computed basis on side {side!r} (sides: {self.basis_sides()})")
        store.store(basis * self.scale if side == self._folded_side else basis)

    _set_basis = set_basis  # also under the name the tests call

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

    @property
    def folded_side(self) -> Optional[str]:
        """The side whose stored basis carries the GaLore scale (None: no stored basis)."""
        return self._folded_side

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

    # ------------------------------------------------------------------ the decay multiplier alpha
    def scale_base(self, factor: float) -> None:
        """alpha *= `factor` (decoupled weight decay of the frozen W0); :func:`scale_bases` for many layers."""
        scale_bases([self], factor)

    def reset_alpha(self) -> None:
        """alpha <- 1 (W0 was folded or set)."""
        self.base_multiplier.fill_(1.0)
        self._alpha = 1.0

    @property
    def alpha(self) -> float:
        """The decay multiplier of W0 (the value of the buffer ``base_multiplier``, read without a sync)."""
        return self._alpha

    def basis_sides(self) -> list[tuple[str, int]]:
        """(side, rank) of every side with a computed (non-identity) basis."""
        sides = []
        if self.left_rank is not None and not self.left_identity:
            sides.append(("left", self.left_rank))
        if self.right_rank is not None and not self.right_identity:
            sides.append(("right", self.right_rank))
        return sides

    _basis_sides = basis_sides  # also under the name the tests call

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
    def _load_folded_scale(self, state_dict, prefix: str, missing_keys: list[str]) -> None:
        # A basis came with the load: it carries the multiplier the state dict recorded (every state the layer
        # writes records it; a basis without it cannot be read).
        side = self._folded_side
        assert side is not None, "called for a layer with a stored basis"
        store = self._bases[side]
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

    def _weight_value(self, dtype: torch.dtype) -> torch.Tensor:
        store = self._weight_store
        assert store is not None, "read for a W0 stored quantized (the parameter `weight` is None)"
        return store.value(dtype)

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

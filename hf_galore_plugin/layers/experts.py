"""GaLore for the fused expert weights of mixture-of-experts models.

transformers (5.x) keeps the experts of an MoE block in one ``*Experts`` module (``Qwen3MoeExperts``,
``MixtralExperts``, ``OlmoeExperts``, ...) with one 3-D parameter per projection: ``gate_up_proj``
(E x 2I x H) and ``down_proj`` (E x H x I), slice e being expert e's ``nn.Linear`` weight (out x in).
Each slice is a linear map, so GaLore applies to it as to an ``nn.Linear``:

    W_e = alpha * W0_e + scale * B_e Q_e^T     (right basis; left: scale * P_e B_e)

with one basis and one factor per expert, stacked along the expert dimension:
:class:`GaLoreExpertStack` holds W0 (E x m x n: plain, INT8 or NF4), the bases (E x dim x r) and the
factor (E x m x r or E x r x n: one ``nn.Parameter``, stepped by the package's AdamW like a linear
layer's factor), with a :class:`~.linear.GaLoreLinear`'s counters, schedule and state-dict layout (it
is a subclass, built by the layers' shared base :class:`~.base.GaLoreLayerBase` with its 3-D weight: the step
driver, checkpoints, weight decay and the planner treat it as one more layer).
:class:`GaLoreExperts` replaces the ``*Experts`` module and keeps its forward signature
``(hidden_states, top_k_index, top_k_weights)``, so the model's sparse-MoE block and router are untouched.

Forward and backward (:mod:`.grouped`): the (token, expert) pairs are sorted by expert once per block and
each projection is a few grouped GEMMs over all the rows, sized by a tensor of offsets (the rows of each
expert, cumulated), never by host ints: no step reads a routed count to the host, and a compiled model
traces the dispatch into its graph. Each expert's rows get the arithmetic of a ``GaLoreLinear`` with the same
W0 and basis (bit for bit on the CPU where W0's multiplier is 1), and the factor's gradient is one grouped
GEMM into E x (factor). No expert's m x n weight gradient is formed on a normal step.

Refresh (:mod:`.expert_refresh`): a refresh step records, per expert, the gradient (or sketch) of the tokens
routed to it (one grouped GEMM over the rows), and how many tokens it received. Each expert that received
tokens gets a new basis from its own record; an expert that received none in the recorded step keeps its
basis (the refresh log says how many).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn

from ..config import GaLoreConfig
from ..engines.collectives import full_tensor, local_rows, local_shard, same_layout
from ..engines.contract import param_changed as _param_changed
from . import expert_refresh as _expert_refresh
from . import grouped as _grouped
from . import rank as _rank_mod
from . import refresh as _refresh_mod
from .base import GaLoreLayerBase
from .linear import GaLoreLinear
from .storage import stochastic_round_to_bf16

__all__ = ["GaLoreExpertStack", "GaLoreExperts", "EXPERT_PROJECTIONS"]

# The projections of a gated expert block, in the order the forward applies them.
EXPERT_PROJECTIONS = ("gate_up_proj", "down_proj")


class GaLoreExpertStack(GaLoreLinear):
    """E linear maps of shape m x n (one per expert), trained by GaLore with one basis and factor each.

    Built from the 3-D expert parameter `weight` (E x m x n, each slice an ``nn.Linear`` weight: out x in).
    Buffers and parameters keep :class:`GaLoreLinear`'s names with an expert dimension in front
    (``weight`` or ``weight_q_*``, ``galore_factor``, ``galore_basis_<side>``), plus
    ``galore_expert_refreshes`` (E: how many refreshes gave each expert a basis from its own tokens).

    A :class:`GaLoreLinear` to the rest of the package (``isinstance`` finds every GaLore layer), built by the
    layers' shared base: ``GaLoreLinear.__init__`` takes an ``nn.Linear`` and adds what a stack does not have
    (the residual mode), so the stack calls :class:`~.base.GaLoreLayerBase`'s ``__init__``, which both
    constructors share, with its weight and ``expert_rank``, and sets up its own adaptive rank
    (``rank_allocation='auto'``: one rank for all its experts, :mod:`.rank`).
    """

    galore_expert_refreshes: torch.Tensor

    def __init__(
        self, weight: torch.Tensor, config: GaLoreConfig, *, layer_index: int = 0, rank: Optional[int] = None
    ) -> None:
        """`rank`: the stack's rank where it is not ``config.expert_rank`` (a file of per-layer ranks:
        ``GaLoreConfig.rank_allocation``)."""
        if weight.ndim != 3:
            raise TypeError(
                f"GaLoreExpertStack wraps a 3-D expert parameter (experts x out x in), got shape {tuple(weight.shape)}"
            )
        rank = config.expert_rank if rank is None else rank
        GaLoreLayerBase.__init__(self, weight, config, rank=rank, layer_index=layer_index, bias=None)
        self.num_experts = int(weight.shape[0])
        device = weight.device
        self.register_buffer("galore_expert_refreshes", torch.zeros(self.num_experts, dtype=torch.int64, device=device))
        # rank_allocation='auto': one rank for the stack, from its experts' spectra together (layers/rank.py)
        self._adaptive = _rank_mod.init_adaptive(self, config, self.basis_sides(), device)
        # Tokens each expert received in the recorded step (with refresh_record; never in a checkpoint).
        self.refresh_tokens: Optional[torch.Tensor] = None

    # ------------------------------------------------------------------ layout
    def merged_weight_key(self, name: str) -> str:
        # The stock *Experts module holds the merged 3-D weight as the parameter named after the projection.
        return name

    def _check_factor_layout(self) -> None:
        expected = (
            self.num_experts,
            self.left_rank or self.out_features,
            self.right_rank or self.in_features,
        )
        if tuple(self.galore_factor.shape) != expected:
            raise RuntimeError(
                f"GaLore expert factor has shape {tuple(self.galore_factor.shape)}, expected {expected}: an engine "
                "holds it as a flat 1-D shard and it was used outside a gather. Under DeepSpeed ZeRO-3 pass "
                "hf_galore_plugin.engines.deepspeed.DeepSpeedGaLoreOptimizer to after_step and merge inside "
                "deepspeed.zero.GatheredParameters; expert layers are tested under DDP, FSDP2 and ZeRO-2/3"
            )

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, " + super().extra_repr().replace(", bias=False", "")

    def reset_galore_state(self) -> None:
        super().reset_galore_state()
        self.galore_expert_refreshes.zero_()
        self.refresh_tokens = None

    @torch.no_grad()
    def initialize_base(self, init: Callable[[nn.Linear], None]) -> None:
        """Initialise each expert's W0 as `init` initialises a plain ``nn.Linear`` of its shape (torch's
        ``reset_parameters`` after ``to_empty()``), experts in order, then give the stack a new layer's GaLore
        state. A transformers model initialises the stock experts module instead (:meth:`GaLoreExperts.
        initialize_base`, the model's own rule for its 3-D weights)."""
        weight = torch.empty(
            self.num_experts, self.out_features, self.in_features, device=self.galore_factor.device,
            dtype=self.weight_dtype,
        )  # fmt: skip
        for expert in range(self.num_experts):
            linear = nn.Linear(self.in_features, self.out_features, bias=False, device="meta")
            linear.weight = nn.Parameter(weight[expert], requires_grad=False)
            init(linear)
        self.set_base(weight)

    @torch.no_grad()
    def set_base(self, weight: torch.Tensor) -> None:
        """W0 <- `weight` (E x m x n; stored as the config stores W0) and a new layer's GaLore state: what an
        initialisation after ``to_empty()`` gives the stack."""
        if self.weight is not None:
            self.weight.copy_(weight)
        else:
            self.weight_store().store(weight.detach())  # rounded to nearest, as when a stack is built
        self.reset_galore_state()
        self._base_initialised = True

    def discard_recorded_gradient(self) -> None:
        super().discard_recorded_gradient()
        self.refresh_tokens = None

    # ------------------------------------------------------------------ forward
    def forward(
        self, x: torch.Tensor, counts: Optional[list[int]] = None, *, offsets: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """The outputs of rows `x` (N x n) sorted by expert: `counts[e]` rows for expert e (a list of ints), or
        `offsets`, their int32 cumulative sums as a tensor (what :class:`GaLoreExperts` passes: no host ints).
        Rows past the last offset belong to no expert: their outputs are unspecified. One is required; the
        defaults only let the signature extend :meth:`GaLoreLinear.forward`'s."""
        if offsets is None:
            if counts is None:
                raise TypeError("GaLoreExpertStack.forward needs `counts` or `offsets`, the rows of `x` of each expert")
            if len(counts) != self.num_experts:
                raise ValueError(f"counts has {len(counts)} entries for {self.num_experts} experts")
            offsets = _grouped.offsets_of(counts, x.device)
        device_type = x.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
        p, q = self._step_bases(dtype)
        # Compiled: W0's multiplier as a tensor and the record through the record ops (as GaLoreLinear.forward).
        compiling = torch.compiler.is_compiling()
        alpha: float | torch.Tensor = self.base_multiplier if compiling else self._alpha
        if not compiling and self.pending_phase_packing is not None and self.training:
            # the model's first training forward: packed before any record, at this stack's rows per token
            self.pending_phase_packing.pack(x, rows_per_token=self.rows_per_token)
        record = self._record_grouped if not compiling and self.refresh_due else None
        return _grouped.grouped_galore(
            x,
            offsets,
            self.galore_factor,
            self.weight,
            self._weight_value,
            None if self._weight_store is None else self._weight_store.value_slice,
            p,
            q,
            alpha,
            self._branch_scale,
            dtype,
            record,
            traced_record=self.recorder_id if compiling and self.compiled_record else None,
        )

    def expert_weight(self, expert: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Expert `expert`'s effective weight alpha * W0_e + scale * lowrank(B_e) (m x n, fp32 by default)."""
        return self.effective_weight(dtype)[expert]

    # ------------------------------------------------------------------ refresh records
    def observe_traced_input(self, part: int, x: torch.Tensor) -> None:
        """The compiled forward's record tap (grouped.grouped_record_tap) on a record step: the phases waiting
        for the first training forward are packed here, with this stack's rows, before any layer records."""
        if self.pending_phase_packing is not None and self.training:
            self.pending_phase_packing.pack(x, rows_per_token=self.rows_per_token)

    def record_traced_grouped(self, dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> None:
        """The compiled forward's record (grouped.grouped_record_gradient): record if this stack is due."""
        if self.refresh_due:
            self._record_grouped(dy, x, offsets)

    def _record_grouped(self, dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> None:
        """Add the gradient (or sketches) of each expert's rows of this micro-batch to the record, and the rows
        each received to ``refresh_tokens``: grouped GEMMs over the rows (no count read to the host)."""
        device = dy.device
        counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).to(torch.float32)
        self.refresh_tokens = counts if self.refresh_tokens is None else self.refresh_tokens + counts
        dy32, x32 = dy.to(torch.float32), x.to(torch.float32)
        gmm_t = _grouped.grouped_mm_t
        if self.config.basis_method != "sketch":
            grad = gmm_t(dy32.mT, x32, offsets)  # E x m x n
            pending = self._pending_grad
            if pending is not None:
                assert isinstance(pending, torch.Tensor), "a dense record is one tensor"
                grad = pending.add_(grad)
            self._pending_grad = grad
            return
        record = self._pending_grad if isinstance(self._pending_grad, dict) else {}
        for side, _ in self.basis_sides():
            # One test matrix per side for all experts of the stack (drawn from the layer's seed and step).
            omega = self.sketch_test_matrix(side, device)
            sketch = gmm_t(dy32.mT, x32 @ omega, offsets) if side == "left" else gmm_t(x32.mT, dy32 @ omega, offsets)
            record[side] = sketch if side not in record else record[side].add_(sketch)
        self._pending_grad = record

    def refresh_record_nbytes(self) -> int:
        return self.num_experts * _refresh_mod.refresh_record_nbytes(self)

    def sketch_exchange_numel(self) -> int:
        return self.refresh_record_nbytes() // 4

    # ------------------------------------------------------------------ the refresh
    def refresh(self, optimizer: Optional[torch.optim.Optimizer] = None) -> Optional[float]:
        """Fold the factors into W0 and give every expert that received tokens in the recorded step a new
        basis from its own gradient; the others keep theirs (:func:`.expert_refresh.refresh`). Returns the mean
        subspace similarity of the experts that were refreshed and had a basis before (NaN when none had)."""
        return _expert_refresh.refresh(self, optimizer)

    # ------------------------------------------------------------------ merged weight
    # lowrank_delta is GaLoreLinear's: its matmuls batch over the expert dimension (E x m x n).

    @torch.no_grad()
    def fold_factor_into_base(self, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """W0_e <- alpha * W0_e + scale * lowrank(B_e) for every expert, one expert at a time (a refresh
        holds one expert's m x n fp32 temporaries, not the stack's), then alpha <- 1 and B <- 0: the
        effective weights are unchanged (up to the rounding of a quantized or bf16 W0)."""
        self._check_factor_layout()
        factor = full_tensor(self.galore_factor.detach())
        p, q = self._step_bases(torch.float32)  # the folded side carries the scale
        # FSDP2 shards W0 on the expert dimension: each rank folds the experts it holds (bases and the
        # gathered factor are whole on every rank).
        start, stop = (0, self.num_experts) if self.weight is None else local_rows(self.weight)
        weight = None if self.weight is None else local_shard(self.weight.detach())
        store = self._weight_store
        stochastic = self.config.stochastic_rounding
        error_sq = norm_sq = 0.0
        for expert in range(start, stop):
            delta = factor[expert].to(torch.float32)
            if q is not None:
                delta = delta @ q[expert].mT
            if p is not None:
                delta = p[expert] @ delta
            if self._branch_scale != 1.0:  # no stored basis carries the scale (identity sides)
                delta = delta * self._branch_scale
            if weight is not None:
                merged = weight[expert - start].to(torch.float32) * self._alpha + delta
                if weight.dtype == torch.bfloat16 and stochastic:
                    merged = stochastic_round_to_bf16(merged, self.next_generator(merged.device))
                weight[expert - start].copy_(merged)
            else:
                assert store is not None
                merged = store.value_slice(expert, torch.float32) * self._alpha + delta
                generator = self.next_generator(merged.device) if stochastic else None
                err, norm = store.store_slice(expert, merged, generator=generator)
                error_sq, norm_sq = error_sq + err, norm_sq + norm
        if store is not None and norm_sq > 0:
            store.error = (error_sq / norm_sq) ** 0.5
        self.reset_alpha()
        local_shard(self.galore_factor.detach()).zero_()
        _param_changed(optimizer, self.galore_factor)

    def _local_lowrank_delta(self, like: torch.Tensor) -> torch.Tensor:
        """The low-rank deltas of the experts this rank holds of W0 (the DTensor `like`, sharded by expert)."""
        start, stop = local_rows(like)
        if not same_layout(self.galore_factor, like):
            return self.lowrank_delta(torch.float32)[start:stop]  # gathers the factor (a collective)
        # Each expert's delta P_e B_e Q_e^T needs only its own factor: local to the shard, whatever the side.
        delta = local_shard(self.galore_factor.detach()).to(torch.float32)
        p, q = self._step_bases(torch.float32)  # the folded side carries the scale
        if q is not None:
            delta = delta @ q[start:stop].mT
        if p is not None:
            delta = p[start:stop] @ delta
        # A stored basis carries the scale (branch scale 1): no pass over the delta for it.
        return delta if self._branch_scale == 1.0 else delta * self._branch_scale

    def state_nbytes(self) -> dict[str, int]:
        nbytes = super().state_nbytes()
        refreshes = self.galore_expert_refreshes
        nbytes["basis"] += refreshes.numel() * refreshes.element_size()
        return nbytes


class GaLoreExperts(nn.Module):
    """Stands in for a transformers ``*Experts`` module (gated: ``gate_up_proj`` then ``down_proj``) whose
    expert weights are trained by GaLore: one :class:`GaLoreExpertStack` per projection, under the
    projection's name. Same forward signature as the module it replaces; the stock module (without its
    expert weights) is kept for its gate function and to put back merged weights
    (:meth:`merged_module`)."""

    def __init__(
        self,
        experts: nn.Module,
        config: GaLoreConfig,
        *,
        layer_index: int = 0,
        ranks: Optional[dict[str, int]] = None,
    ) -> None:
        """`ranks`: the rank of a projection ('gate_up_proj', 'down_proj') where it is not ``config.expert_rank``."""
        super().__init__()
        gate_up, down = experts._parameters["gate_up_proj"], experts._parameters["down_proj"]
        if gate_up is None or down is None:
            raise ValueError(f"{type(experts).__name__} holds no gate_up_proj and down_proj expert parameters")
        ranks = ranks or {}
        self.num_experts = int(gate_up.shape[0])
        self.gate_up_proj = GaLoreExpertStack(gate_up, config, layer_index=layer_index, rank=ranks.get("gate_up_proj"))
        self.down_proj = GaLoreExpertStack(down, config, layer_index=layer_index + 1, rank=ranks.get("down_proj"))
        # The stock module keeps its activation and gate function, not its expert weights (W0 lives in the
        # stacks now); it is not a submodule, so its tensors are not the model's.
        for name in EXPERT_PROJECTIONS:
            experts._parameters[name] = None
        object.__setattr__(self, "stock", experts)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        num_experts = self.num_experts
        top_k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        with torch.no_grad():
            # (token, expert) pairs sorted by expert (stable: tokens in order within an expert); an index of
            # num_experts or more (a slot routed to no local expert) sorts last, past the last offset.
            experts, order = torch.sort(flat, stable=True)
            bounds = torch.arange(1, num_experts + 1, device=flat.device, dtype=experts.dtype)
            offsets = torch.searchsorted(experts, bounds, out_int32=True)  # rows of experts 0..e, cumulated
            tokens = order // top_k
            routed = (experts < num_experts).unsqueeze(-1)
        # The rows of unrouted slots: zeros in, and their outputs (which the grouped GEMMs leave unwritten, any
        # value) and, in the backward, their input gradients (idem) dropped by the two `where`s, the output's
        # before the routing weights multiply it (a weight's gradient would read the unwritten rows).
        rows = torch.where(routed, hidden_states[tokens], 0.0)
        for stack in (self.gate_up_proj, self.down_proj):
            if stack.rows_per_token != top_k:
                stack.rows_per_token = top_k  # the routing in force
        hidden = self.gate_up_proj(rows, offsets=offsets)
        hidden = self._gate(hidden)
        out = self.down_proj(hidden, offsets=offsets)
        out = torch.where(routed, out, 0.0) * top_k_weights.reshape(-1)[order, None]
        final = torch.zeros_like(hidden_states)
        final.index_add_(0, tokens, out.to(final.dtype))
        return final

    def _gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        apply_gate = getattr(self.stock, "_apply_gate", None)
        if apply_gate is not None:
            return apply_gate(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        stock: Any = self.stock
        return stock.act_fn(gate) * up

    @torch.no_grad()
    def initialize_base(self, init: Callable[[nn.Module], None]) -> None:
        """Initialise both stacks' W0 as `init` (the model's own ``_init_weights``) initialises the stock experts
        module it stands in for, with the same random draws in the same order, then give them a new layer's
        GaLore state: a model prepared on the meta device, after ``to_empty()`` and ``init_weights()``."""
        stock: Any = self.stock
        for name in EXPERT_PROJECTIONS:
            stack: GaLoreExpertStack = getattr(self, name)
            shape = (stack.num_experts, stack.out_features, stack.in_features)
            empty = torch.empty(shape, device=stack.galore_factor.device, dtype=stack.weight_dtype)
            stock._parameters[name] = nn.Parameter(empty, requires_grad=False)
        try:
            init(stock)
            for name in EXPERT_PROJECTIONS:
                getattr(self, name).set_base(stock._parameters[name])
        finally:
            for name in EXPERT_PROJECTIONS:
                stock._parameters[name] = None

    @torch.no_grad()
    def merged_module(self) -> nn.Module:
        """The stock ``*Experts`` module holding the merged 3-D weights (dtype as loaded), as parameters."""
        stock: Any = self.stock
        for name in EXPERT_PROJECTIONS:
            stack: GaLoreExpertStack = getattr(self, name)
            stock._parameters[name] = nn.Parameter(stack.effective_weight(stack.weight_dtype))
        return stock

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, replaces={type(self.stock).__name__}"


if TYPE_CHECKING:  # mypy checks that a stack is what the expert refresh expects

    def _expert_refresh_target(stack: GaLoreExpertStack) -> _expert_refresh.ExpertRefreshTarget:
        return stack

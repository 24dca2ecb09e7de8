"""Trace training steps of a real transformers model under fake tensors and count live bytes.

One trace per method: the model is built from its config inside ``FakeTensorMode`` (no memory is
allocated, shapes and dtypes are exact), the method's real code prepares it, and training steps run
(forward, backward, optimizer step, the method's after-step hook, zero_grad). Methods without a basis
refresh run two: step 0 creates the optimizer state, step 1 is a normal step. Methods with one run
four with a refresh gap of 2: step 0 is the first basis (GaLore's calibration), step 1 the first
step of every factor's state, step 2 a refresh with all state alive, step 3 a normal step (refresh
timing does not change what a refresh step holds). The peak of live bytes within each step is measured by
:class:`~hf_galore_plugin.plan.tracker.LiveBytes`; the live set at the peak is split into parts
by identity: model parameters and buffers (weights; GaLore bases apart), gradients, optimizer
state, tensors made in the forward and still alive (activations), and the rest (temporaries).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .layouts import LAYOUT_METHODS, layout_optimizer
from .tracker import LiveBytes

__all__ = ["StepPeak", "MethodTrace", "trace_method", "build_fake_model", "DTYPES"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PHASES = ("forward", "backward", "optimizer", "after_step")
PARTS = ("weights", "grads", "optimizer_state", "bases", "activations", "other")


@dataclass
class StepPeak:
    peak_bytes: int
    parts: dict[str, int]
    phase: str  # forward / backward / optimizer / after_step: where the peak happened
    largest: list[dict[str, Any]]  # the largest tensors alive at the peak


@dataclass
class MethodTrace:
    method: str
    traced: bool
    # per traced step (see the module docstring): the peak of every run (phase, decoder layer or -1)
    steps: list[list[tuple[str, int, StepPeak]]]
    notes: list[str] = field(default_factory=list)
    trainable_grad_bytes: int = 0  # gradients of every trainable parameter (DDP bucket size)
    largest_layer_param_bytes: int = 0  # one decoder layer's parameters (FSDP/ZeRO-3 gather unit)
    largest_layer_grad_bytes: int = 0
    # optimizer state kept in host memory (state_offload='cpu'): never part of a device peak
    host_state_bytes: int = 0
    # refresh_schedule='staggered': a refresh step refreshes one phase, not every layer. The trace
    # calibrates every layer at step 0 and refreshes only the phase's heaviest layer at step 2 (its record,
    # kept input and basis computation traced); what the phase's other layers hold, computed from the
    # full-depth packing of assign_refresh_phases at the planned tokens, is added to step 2's peak: their
    # records (`phase_extra_bytes`) and the inputs they keep from forward to backward
    # (`phase_extra_input_bytes`, activations).
    staggered: bool = False
    phase_extra_bytes: int = 0
    phase_extra_input_bytes: int = 0

    def step_peak(self, step: int) -> StepPeak:
        return max((run[2] for run in self.steps[step]), key=lambda p: p.peak_bytes)

    @property
    def normal(self) -> StepPeak:
        """A normal step: step 3 (every state exists, no refresh); for methods without refresh, the larger
        of steps 0 and 1 (step 0 creates the state)."""
        if self.has_refresh:
            return self.step_peak(3)
        return max((self.step_peak(0), self.step_peak(1)), key=lambda p: p.peak_bytes)

    @property
    def refresh(self) -> StepPeak:
        """A refresh step: the larger of step 0 (the first basis) and step 2 (a refresh with state)."""
        if not self.has_refresh:
            return self.normal
        if self.staggered:
            # Step 0's every-layer calibration is the trace's set-up, not a staggered run's step: there a
            # step calibrates or refreshes one phase, which is what step 2 holds.
            peak = self.step_peak(2)
            parts = dict(peak.parts)
            parts["other"] += self.phase_extra_bytes
            parts["activations"] += self.phase_extra_input_bytes
            extra = self.phase_extra_bytes + self.phase_extra_input_bytes
            return StepPeak(peak.peak_bytes + extra, parts, peak.phase, peak.largest)
        return max((self.step_peak(0), self.step_peak(2)), key=lambda p: p.peak_bytes)

    @property
    def has_refresh(self) -> bool:
        return self.method not in NO_REFRESH


# ---------------------------------------------------------------------- model
def build_fake_model(config, dtype: torch.dtype, *, gradient_checkpointing: bool) -> nn.Module:
    """The causal LM of `config` in `dtype`, with fake (shape-only) tensors. Call inside FakeTensorMode."""
    from transformers import AutoModelForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    finally:
        torch.set_default_dtype(previous)
    model.train()
    if gradient_checkpointing:
        kwargs = {"use_reentrant": False}
        # transformers 5.x names it activation checkpointing and deprecates `gradient_checkpointing_enable`,
        # the only name 4.x has.
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            return list(module)
    return []


_DECODER_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _decoder_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The decoder's linear layers (attention and MLP): the targets of LoRA/QLoRA and galore-torch."""
    from ..loss import output_head

    head = output_head(model)
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and m is not head and ".layers." in f".{name}"
    ]


# ---------------------------------------------------------------------- LoRA / QLoRA layers
class _NF4LinearFunction(torch.autograd.Function):
    """y = x W^T with W stored as NF4: the bf16 weight is dequantized in forward and again in
    backward and never saved (what bitsandbytes' 4-bit matmul does for a frozen base)."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        weight = layer.base.dequantize(x.dtype)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_out):
        weight = ctx.layer.base.dequantize(grad_out.dtype)
        return grad_out @ weight, None


class LoRALinear(nn.Module):
    """The memory layout of peft's LoRA ``Linear`` (``result + B(A(x)) * scaling``, no dropout):
    frozen base (as loaded, or NF4 with 64-value blocks and double-quantized scales, QLoRA's
    layout), fp32 adapters (peft's default ``autocast_adapter_dtype=True``) and the input cast to
    the adapter dtype before the adapter branch, as peft's forward does."""

    def __init__(self, linear: nn.Linear, rank: int, *, nf4: bool) -> None:
        super().__init__()
        self.scaling = 2.0
        self.nf4 = nf4
        if nf4:
            from ..quant import quantize

            self.base = quantize(linear.weight.detach(), scheme="nf4", bits=4, block_size=64, double_quant=True)
            for key, tensor in self.base.to_state()[0].items():
                self.register_buffer(f"base_{key}", tensor)
            self.weight = None
        else:
            self.weight = linear.weight
            self.weight.requires_grad_(False)
        self.bias = linear.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        device = linear.weight.device
        self.lora_A = nn.Parameter(torch.zeros(rank, linear.in_features, device=device, dtype=torch.float32))
        self.lora_B = nn.Parameter(torch.zeros(linear.out_features, rank, device=device, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.nf4:
            result = _NF4LinearFunction.apply(x, self)
            if self.bias is not None:
                result = result + self.bias
        else:
            assert self.weight is not None, "a plain LoRA layer keeps its weight"
            result = F.linear(x, self.weight, self.bias)
        h = x.to(self.lora_A.dtype)
        return result + ((h @ self.lora_A.mT) @ self.lora_B.mT * self.scaling).to(result.dtype)


def _apply_lora(model: Any, rank: int, *, nf4: bool) -> None:
    """`model`: a transformers PreTrainedModel (its enable_input_require_grads)."""
    from ..inject import swap_submodule

    for p in model.parameters():
        p.requires_grad_(False)
    for name, linear in _decoder_linears(model):
        swap_submodule(model, name, LoRALinear(linear, rank, nf4=nf4))
    # transformers does this for peft models under gradient checkpointing (enable_input_require_grads):
    # without it the checkpointed blocks get no input that requires grad.
    model.enable_input_require_grads()


# ---------------------------------------------------------------------- methods
@dataclass
class Settings:
    seq_len: int
    batch_size: int
    dtype: torch.dtype
    gradient_checkpointing: bool
    device: str  # "cuda": what runs on a GPU; "cpu": exactly what runs on CPU
    rank: int
    lora_rank: int
    optim_args: dict[str, Any]
    full_layers: int | None = None  # decoder layers of the model planned (a scaled trace runs fewer)
    liger: bool = False  # the loss of TrainingArguments(use_liger_kernel=True): Liger's fused linear cross-entropy


NO_REFRESH = ("adamw_torch", "adamw_8bit", "lora", "qlora", *LAYOUT_METHODS)
LR = 1e-4


def _setup(method: str, model: nn.Module, settings: Settings):
    """(optimizer, after_step, traced, notes) for `method` on `model` (modified in place)."""
    notes: list[str] = []
    if method == "adamw_torch":
        # foreach is torch's default on CUDA; on CPU torch picks the per-tensor loop.
        foreach = settings.device == "cuda"
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=foreach)
        notes.append(f"torch.optim.AdamW(foreach={foreach}): state in the parameters' dtype")
        return optimizer, (lambda: None), True, notes
    if method == "adamw_8bit":
        from ..optim import AdamW

        # bitsandbytes AdamW8bit's documented layout: two uint8 moments per value, one fp32 absmax per
        # 256-value block, 32-bit state below 4096 values (min_8bit_size), a fused in-place kernel.
        optimizer = AdamW(model.parameters(), lr=LR, state_bits=8, block_size=256, min_8bit_numel=4096)
        notes.append("bitsandbytes layout (2 B/value + fp32 absmax per 256), stepped by this package's AdamW")
        return optimizer, (lambda: None), False, notes
    if method in LAYOUT_METHODS:
        targets = {id(m.weight) for _, m in _decoder_linears(model)}
        optimizer, note = layout_optimizer(method, list(model.parameters()), lr=LR, targets=targets, rank=settings.rank)
        notes.append(note)
        return optimizer, (lambda: None), False, notes
    if method == "galore_torch":
        from galore_torch import GaLoreAdamW

        targets = {id(m.weight) for _, m in _decoder_linears(model)}
        galore = [p for p in model.parameters() if id(p) in targets]
        regular = [p for p in model.parameters() if id(p) not in targets]
        groups = [
            {"params": regular},
            {"params": galore, "rank": settings.rank, "update_proj_gap": 2, "scale": 0.25, "proj_type": "std"},
        ]
        optimizer = GaLoreAdamW(groups, lr=LR)
        notes.append("galore_torch.GaLoreAdamW on the decoder's linear layers, dense gradients every step")
        return optimizer, (lambda: None), True, notes
    if method in ("lora", "qlora"):
        _apply_lora(model, settings.lora_rank, nf4=method == "qlora")
        foreach = settings.device == "cuda"
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, foreach=foreach)
        notes.append(
            f"LoRA rank {settings.lora_rank} on every decoder linear layer (peft's layout re-implemented"
            + (", NF4 base with double-quantized scales" if method == "qlora" else "")
            + "); embeddings and head frozen"
        )
        return optimizer, (lambda: None), False, notes
    # a registered optimizer name (registry: this package's presets or another package's), with the overrides
    from ..api import after_step, create_optimizer, prepare_model
    from ..registry import load_optimizer_preset

    overrides = {"rank": settings.rank, **settings.optim_args, "update_proj_gap": 2}
    overrides.pop("max_proj_gap", None)
    preset = load_optimizer_preset(method)
    config = preset.replace(**overrides)
    with warnings.catch_warnings():
        # The trace's gap of 2 packs the staggered phases for the trace only (it warns whenever more than
        # two phases are needed); the run's packing, under the user's gap, is _staggered_trace_phases'.
        warnings.filterwarnings("ignore", message="refresh_schedule='staggered'", category=UserWarning)
        prepare_model(model, config)
    optimizer = create_optimizer(model, config, lr=LR)
    notes.append(f"traced: hf_galore_plugin layers and {type(optimizer).__name__}")
    if config.rank_allocation == "auto":
        notes.append(_auto_rank_note(model, config))
    if config.refresh_schedule != "staggered":
        return optimizer, (lambda: after_step(model, optimizer)), True, notes
    user = preset.replace(**{"rank": settings.rank, **settings.optim_args})
    from ..layers.schedule import StepTokens

    inputs = StepTokens(settings.batch_size * settings.seq_len, settings.dtype.itemsize)
    member_layer, member, extra, extra_inputs = _staggered_trace_phases(model, user, settings.full_layers, inputs)
    notes.append(
        f"staggered: a refresh step holds one phase's records and kept inputs "
        f"({(member + extra + extra_inputs) / 2**20:.1f} MiB at most, update_proj_gap={user.update_proj_gap}); "
        "its heaviest layer's refresh is traced, the other layers' added"
    )
    calls = [0]

    def after() -> None:
        after_step(model, optimizer)
        calls[0] += 1
        if calls[0] == 1:  # after step 0 (every layer calibrated): only the traced member refreshes at step 2
            _restage(model, member_layer)

    after.phase_extra_bytes = extra  # type: ignore[attr-defined]
    after.phase_extra_input_bytes = extra_inputs  # type: ignore[attr-defined]
    return optimizer, after, True, notes


def liger_chunk_tokens(tokens: int, vocab: int, hidden: int) -> int:
    """Tokens per chunk of Liger-Kernel's fused linear cross-entropy (its documented rule: chunks whose logits
    are about as large as the N x H hidden states, a power of two, at most N)."""
    factor = -(-vocab // hidden)
    chunk = 1 << max(0, (-(-tokens // factor) - 1).bit_length())
    return min(chunk, tokens)


def _loss_notes(model: Any, settings: Settings, notes: list[str]) -> None:
    """The chunked loss of `chunked_loss=true` (installed by prepare_model) or, with `settings.liger`, Liger's fused
    linear cross-entropy, laid out as our chunked loss at Liger's chunk size (both compute the gradients in the
    forward, chunk by chunk, into an N x H and a V x H buffer; per chunk Liger holds one chunk x V buffer in
    the model's dtype where ours holds an fp32 one and its model-dtype copy: 3 x chunk x V bytes more, 24 MiB
    at Llama-3-8B's 64-token chunks)."""
    from ..layers import GaLoreLinear
    from ..loss import chunked_loss_settings, default_chunk_tokens, enable_chunked_loss

    head = model.get_output_embeddings()
    if settings.liger:
        if isinstance(head, GaLoreLinear):
            raise ValueError(
                "use_liger_kernel: Liger's fused linear cross-entropy reads lm_head.weight, and the head is a GaLore "
                "layer here (target_modules selects it); plan it with chunked_loss=true instead"
            )
        chunk = liger_chunk_tokens(settings.batch_size * settings.seq_len, head.out_features, head.in_features)
        enable_chunked_loss(model, chunk_tokens=chunk)
        notes.append(f"use_liger_kernel: Liger's fused linear cross-entropy ({chunk}-token chunks), laid out as the "
                     "chunked loss; Liger's other kernels (RMSNorm, SwiGLU, RoPE) are not modelled")  # fmt: skip
        return
    installed = chunked_loss_settings(model)
    if installed is not None:
        chunk = installed["chunk_tokens"] or default_chunk_tokens(head.out_features)
        notes.append(f"chunked loss ({chunk}-token chunks): the head's gradients are made in the forward (counted "
                     "as activations until the backward hands them over)")  # fmt: skip


def _galore_layers(model: nn.Module) -> list[tuple[int, Any]]:
    """(decoder layer index or -1, layer) of every GaLoreLinear, in module order."""
    from ..layers import GaLoreLinear

    out = []
    for name, module in model.named_modules():
        if isinstance(module, GaLoreLinear):
            parts = f".{name}.".split(".layers.")
            index = int(parts[1].split(".")[0]) if len(parts) > 1 and parts[1].split(".")[0].isdigit() else -1
            out.append((index, module))
    return out


def _staggered_trace_phases(
    model: nn.Module, user_config, full_layers: int | None, inputs: Any
) -> tuple[Any, int, int, int]:
    """Set every layer's phase to 0 (all calibrate at step 0; the phases set stand: the packing at the first
    forward is the run's, not the trace's) and pick the traced member: the layer of decoder layer 0 that
    holds the most on its refresh step. Returns (the member, what it holds, the records and the kept inputs
    the rest of the heaviest phase holds) of the full-depth packing under the user's update_proj_gap and
    budget at the planned tokens `inputs` (identical decoder layers), after the member itself."""
    from ..layers import pack_refresh_phases, refresh_phase_capacity
    from ..layers.schedule import refresh_hold_nbytes

    layers = _galore_layers(model)
    for _, layer in layers:
        layer.set_refresh_phase(0)
    traced_layers = max((i for i, _ in layers), default=-1) + 1
    depth = full_layers or traced_layers
    outside = [layer for i, layer in layers if i < 0]
    first = [layer for i, layer in layers if i == 0]
    full = outside + first * depth
    costs = [refresh_hold_nbytes(layer, inputs) for layer in full]
    if not costs or not first:
        return None, 0, 0, 0
    capacity = refresh_phase_capacity(user_config, full, costs)
    phase_of, _ = pack_refresh_phases(costs, capacity, user_config.update_proj_gap)
    loads: dict[int, int] = {}
    records: dict[int, int] = {}
    for layer, cost, phase in zip(full, costs, phase_of):
        loads[phase] = loads.get(phase, 0) + cost
        records[phase] = records.get(phase, 0) + layer.refresh_record_nbytes()
    heaviest = max(loads, key=lambda phase: (loads[phase], -phase))
    member_layer = max(first, key=lambda layer: refresh_hold_nbytes(layer, inputs))
    member = refresh_hold_nbytes(member_layer, inputs)
    member_record = member_layer.refresh_record_nbytes()
    extra_records = max(records[heaviest] - member_record, 0)
    extra_inputs = max(loads[heaviest] - records[heaviest] - (member - member_record), 0)
    return member_layer, member, extra_records, extra_inputs


def _restage(model: nn.Module, member) -> None:
    """Phases for steps 1-3 of the trace (gap 2): the member at phase 0 (due at step 2), every other
    layer at phase 1 with a gap beyond the trace (never due again)."""
    for _, layer in _galore_layers(model):
        if layer is member:
            layer.set_refresh_phase(0)
        else:
            layer.set_refresh_phase(1, gap=1 << 20)


@contextlib.contextmanager
def _private_tensor_caches():
    """Give the trace empty module-level tensor caches (the 0-d addmm inputs of layers.function, the
    nibble tables of quant.functional) and restore the caller's afterwards, so that every trace counts
    the bytes of the entries it makes, whichever trace of the process came first."""
    from ..layers import function
    from ..quant import functional

    saved = dict(function._ZEROS)
    function._ZEROS.clear()
    functional._byte_table.cache_clear()
    try:
        yield
    finally:
        function._ZEROS.clear()
        function._ZEROS.update(saved)
        functional._byte_table.cache_clear()


@contextlib.contextmanager
def _device_semantics(device: str):
    """Make the traced code take the code path of `device`'s kernels.

    cuda: the custom ops `torch.ops.hf_galore.*` trace through their fake registrations, which
    allocate what the Triton kernels allocate (their outputs; the 8-bit step nothing: it updates in
    place in registers). cpu: the torch twins run inline (`KERNEL_DISPATCH.inline_twins`), so the
    dispatch mode counts their temporaries as a CPU run makes them.
    """
    from ..codes import grid_table
    from ..quant.dynamic import dynamic_code_book
    from ..utils import KERNEL_DISPATCH

    # Code books are cached per device on first use: build them from real tensors before any fake
    # tensor exists, so the cache never holds a fake tensor (fake mode reads real constants).
    grid_table(torch.device("cpu"))
    dynamic_code_book(signed=True)
    dynamic_code_book(signed=False)
    old_inline = KERNEL_DISPATCH.inline_twins
    KERNEL_DISPATCH.inline_twins = device == "cpu"
    try:
        yield
    finally:
        KERNEL_DISPATCH.inline_twins = old_inline


def _state_tensors(state: dict) -> list:
    out: list = []
    for item in state.values():
        _tensors_in(item.ortho_matrix if hasattr(item, "ortho_matrix") else item, out)
    return out


def _tensors_in(obj, out: list) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors_in(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors_in(v, out)


class _Roles:
    """Serial numbers of the storages that play each role, collected around every step."""

    def __init__(self, tracker: LiveBytes) -> None:
        self.tracker = tracker
        self.sets: dict[str, set[int]] = {k: set() for k in ("weights", "bases", "grads", "optimizer_state")}

    def _add(self, role: str, tensors) -> None:
        for t in tensors:
            serial = self.tracker.serial_of(t)
            if serial is not None:
                self.sets[role].add(serial)

    def _regions(self, model: nn.Module, optimizer, grads_of) -> None:
        owner: dict[int, int] = {}
        for index, layer in enumerate(_decoder_layers(model)):
            tensors: list[Any] = list(layer.parameters()) + list(layer.buffers())
            tensors += [getattr(m, "_pending_grad", None) for m in layer.modules()]
            for p in layer.parameters():
                tensors.append(p.grad)
                _tensors_in(_state_tensors(optimizer.state.get(p, {})), tensors)
            for t in tensors:
                serial = self.tracker.serial_of(t)
                if serial is not None:
                    owner[serial] = index
        self.tracker.region_of.update(owner)
        others = list(model.parameters()) + list(model.buffers()) + grads_of
        for p in model.parameters():
            _tensors_in(_state_tensors(optimizer.state.get(p, {})), others)
        for t in others:
            serial = self.tracker.serial_of(t)
            if serial is not None and serial not in owner:
                self.tracker.unowned.add(serial)

    def collect(self, model: nn.Module, optimizer) -> None:
        bases: list[torch.Tensor] = []
        weights: list[torch.Tensor] = []
        for name, buf in model.named_buffers():
            (bases if "galore_basis_" in name else weights).append(buf)
        weights += list(model.parameters())
        grads: list[Any] = [p.grad for p in model.parameters() if p.grad is not None]
        grads += [getattr(m, "_pending_grad", None) for m in model.modules()]
        state: list[torch.Tensor] = []
        projector_bases: list[torch.Tensor] = []
        for value in optimizer.state.values():
            for item in value.values():
                if hasattr(item, "ortho_matrix"):  # galore-torch keeps its projection basis in the state
                    _tensors_in(item.ortho_matrix, projector_bases)
                else:
                    _tensors_in(item, state)
        self._add("bases", bases + projector_bases)
        self._add("weights", weights)
        self._add("grads", grads)
        # Offloaded state is host memory (the tracker keeps it out of the device total); its device
        # share is the two staging slots the step streams it through (made and freed inside the
        # step, so they show among the optimizer phase's temporaries, "other").
        self._add("optimizer_state", state)
        self._regions(model, optimizer, grads)

    def split(self, live) -> dict[str, int]:
        parts = dict.fromkeys(PARTS, 0)
        for entry in live.values():
            for role in ("bases", "weights", "grads", "optimizer_state"):
                if entry.serial in self.sets[role]:
                    parts[role] += entry.nbytes
                    break
            else:
                parts["activations" if entry.phase == "forward" else "other"] += entry.nbytes
        return parts

    def largest(self, live, count: int = 5) -> list[dict[str, Any]]:
        rows = sorted(live.values(), key=lambda e: -e.nbytes)[:count]
        out = []
        for e in rows:
            role = next((r for r in self.sets if e.serial in self.sets[r]), None)
            role = role or ("activations" if e.phase == "forward" else "other")
            out.append({"shape": list(e.shape), "dtype": str(e.dtype).removeprefix("torch."), "bytes": e.nbytes,
                        "part": role, "made_in": e.phase})  # fmt: skip
        return out


def _auto_rank_note(model, config) -> str:
    """How a plan of rank_allocation='auto' stands for the run: the trace keeps every layer at its starting rank
    (a traced spectrum has no values to allocate from), with the calibration's wider sketches."""
    from ..api import galore_layers, rank_budget

    layers = galore_layers(model)
    states = [layer._adaptive for _, layer in layers if layer._adaptive is not None]
    values = sum(state.cost * state.start for state in states)
    starts = sorted({state.start for state in states})
    high = max(state.high for state in states)
    return (
        f"rank_allocation='auto': planned at the starting rank {'/'.join(map(str, starts))} ({values:,} factor "
        f"values, within the budget of {rank_budget(layers):,}); calibration records sketched at up to "
        f"rank_max={high} (+ oversampling). The allocation keeps the factors and their optimizer state within the "
        "budget, so the peak follows the total, not the split"
    )


def trace_method(config, method: str, settings: Settings, *, fake: bool = True) -> MethodTrace:
    """Trace steps 0-1 (0-3 with a basis refresh) of `method` on the model of `config`; see the module docstring.

    fake=False runs the same steps on real tensors (a real CPU run measured by the same
    accounting: what the planner is validated against).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    tracker = LiveBytes(scalar_fallback=fake)
    roles = _Roles(tracker)
    steps: list[list[tuple[str, int, StepPeak]]] = []
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    if not fake:
        torch.manual_seed(0)
    with _private_tensor_caches(), _device_semantics(settings.device), mode, tracker:
        model = build_fake_model(config, settings.dtype, gradient_checkpointing=settings.gradient_checkpointing)
        for t in list(model.parameters()) + list(model.buffers()):
            tracker.track(t)
        optimizer, after, traced, notes = _setup(method, model, settings)
        _loss_notes(model, settings, notes)
        ids = torch.randint(0, config.vocab_size, (settings.batch_size, settings.seq_len))
        # Methods without a basis refresh need steps 0 (state created) and 1 (normal) only.
        for _ in range(2 if method in NO_REFRESH else 4):
            roles.collect(model, optimizer)
            tracker.runs = []

            def phase(name: str) -> None:
                tracker.close_run()
                tracker.phase = name

            phase("forward")
            loss = model(input_ids=ids, labels=ids).loss
            phase("backward")
            loss.backward()
            del loss
            roles.collect(model, optimizer)
            phase("optimizer")
            optimizer.step()
            roles.collect(model, optimizer)
            phase("after_step")
            after()
            roles.collect(model, optimizer)
            phase("zero_grad")
            steps.append([
                (name, region, StepPeak(peak, roles.split(live), name, roles.largest(live)))
                for name, region, peak, live in tracker.runs if name in PHASES
            ])  # fmt: skip
            optimizer.zero_grad(set_to_none=True)
        trainable_grad = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        layers = _decoder_layers(model)
        layer_params = max((sum(_nbytes(t) for t in m.parameters()) + sum(_nbytes(b) for b in m.buffers())
                            for m in layers), default=0)  # fmt: skip
        layer_grads = max(
            (sum(p.numel() * p.element_size() for p in m.parameters() if p.requires_grad) for m in layers), default=0
        )
    if tracker.host_peak:
        notes.append("state_offload='cpu': optimizer state in host memory; the device holds two staging slots")
    extra = getattr(after, "phase_extra_bytes", None)
    return MethodTrace(
        method, traced, steps, notes, trainable_grad, layer_params, layer_grads, tracker.host_peak,
        staggered=extra is not None, phase_extra_bytes=extra or 0,
        phase_extra_input_bytes=getattr(after, "phase_extra_input_bytes", 0),
    )  # fmt: skip


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _affine(a: int, b: int, extra: int) -> int:
    return b + extra * (b - a)


def _keyed_runs(runs, layers: int) -> dict[tuple, StepPeak]:
    """Runs keyed by what they are in any layer count: phase, number of non-layer runs before it in
    the phase, and position: 'x' (no layer), first/second/second-last/last layer ('i0', 'i1', 'j1',
    'j0'); middle layers ('mid') are affine in their index, so they never exceed the ends."""
    keyed: dict[tuple, StepPeak] = {}
    x_count: dict[str, int] = {}
    for phase, region, peak in runs:
        if region < 0:
            position = "x"
            x_count[phase] = x_count.get(phase, 0) + 1
        else:
            position = {0: "i0", 1: "i1", layers - 2: "j1", layers - 1: "j0"}.get(region, "mid")
            if position == "mid":
                continue
        key = (phase, x_count.get(phase, 0), position)
        if key not in keyed or peak.peak_bytes > keyed[key].peak_bytes:
            keyed[key] = peak
    return keyed


def scaled_trace(config, method: str, settings: Settings, *, base_layers: int = 4) -> MethodTrace:
    """The trace of the full model computed from traces with `base_layers` and `base_layers + 1`
    decoder layers.

    Decoder layers are identical (same shapes, same code, run one after another), so the bytes
    alive at a given point of a step are affine in the number of layers L: per-layer tensors
    (weights, gradients, state, checkpoints, recorded refresh gradients) add a fixed amount per
    layer, everything else (embeddings, head, loss, the temporaries of the layer at work) does
    not depend on L. The tracker splits each step into runs by phase and by the decoder layer
    whose tensors the ops read; the peak of each run that exists in every layer count (non-layer
    runs, the first two and last two layers) is extrapolated from the two traces, and the step's
    peak is the largest of them. tests/test_plan.py checks the result against full traces.
    """
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers <= base_layers + 1:
        return trace_method(config, method, settings)
    import dataclasses

    at_depth = dataclasses.replace(settings, full_layers=layers)
    small = [trace_method(_with_layers(config, n), method, at_depth) for n in (base_layers, base_layers + 1)]
    extra = layers - base_layers - 1
    steps = []
    for a_runs, b_runs in zip(small[0].steps, small[1].steps):
        a_keyed, b_keyed = _keyed_runs(a_runs, base_layers), _keyed_runs(b_runs, base_layers + 1)
        if set(a_keyed) != set(b_keyed):
            # The step is not the same sequence of runs at both depths (a model whose layers differ):
            # scaling does not apply, so the whole model is traced.
            full = trace_method(config, method, settings)
            full.notes.append(
                f"layers are not identical ({base_layers} vs {base_layers + 1} layers differ): full trace"
            )
            return full
        step = []
        for key, b_run in b_keyed.items():
            a_run = a_keyed[key]
            parts = {k: _affine(a_run.parts[k], b_run.parts[k], extra) for k in b_run.parts}
            peak = _affine(a_run.peak_bytes, b_run.peak_bytes, extra)
            step.append((key[0], -1, StepPeak(peak, parts, key[0], b_run.largest)))
        steps.append(step)
    a_trace, b = small
    notes = b.notes + [
        f"traced with {base_layers} and {base_layers + 1} decoder layers, scaled to {layers} (identical layers)"
    ]
    return MethodTrace(
        method, b.traced, steps, notes, _affine(a_trace.trainable_grad_bytes, b.trainable_grad_bytes, extra),
        b.largest_layer_param_bytes, b.largest_layer_grad_bytes,
        _affine(a_trace.host_state_bytes, b.host_state_bytes, extra),
        staggered=b.staggered, phase_extra_bytes=b.phase_extra_bytes,
        phase_extra_input_bytes=b.phase_extra_input_bytes,
    )  # fmt: skip


def _with_layers(config, layers: int):
    import copy

    config = copy.deepcopy(config)
    config.num_hidden_layers = layers
    for key in ("layer_types",):  # per-layer lists (e.g. attention kinds) follow the layer count
        value = getattr(config, key, None)
        if isinstance(value, list) and value:
            setattr(config, key, value[:layers])
    return config

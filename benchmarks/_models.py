"""What every benchmark builds and counts: the table of named Llama shapes, the one builder of those
models, the preset names the package declares, and the one accountant of training-state bytes.

Importing this module loads only the standard library; torch, transformers and hf_galore_plugin are
imported inside the functions. Unlike `_common` it does not set HF_GALORE_PLUGIN_NO_TAKEOVER, so the
scripts that must not change how the plugin serves transformers' optimizer names (plan_validate.py,
which the test process imports; memory.py; step.py) and the test of this table can import it.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterable, Union

# Llama shapes by name: the LlamaConfig fields each benchmark sets (the same fields, numbers and order
# as its report shows them). Fields not given keep LlamaConfig's defaults; llama_config pins the two
# that decide the parameter count and memory (tie_word_embeddings, max_position_embeddings).
# fmt: off
SHAPES: dict[str, dict[str, int]] = {
    # memory.py and step.py --quick: seconds on a CPU
    "quick": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=2,
                  vocab_size=2000),
    # step.py's default (the GaLore paper's 60M width and depth)
    "60m": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
                vocab_size=32000),
    # step.py --speed-targets
    "h1024": dict(hidden_size=1024, intermediate_size=2752, num_hidden_layers=4, num_attention_heads=16,
                  vocab_size=30000),
    # memory.py's measured model
    "350m": dict(hidden_size=1024, intermediate_size=2736, num_hidden_layers=24, num_attention_heads=16,
                 vocab_size=32000),
    # Llama-2-7B (memory.py, on the meta device)
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               vocab_size=32000),
    # TinyLlama-1.1B (gpu_step.py)
    "1.1b": dict(hidden_size=2048, intermediate_size=5504, num_hidden_layers=22, num_attention_heads=32,
                 num_key_value_heads=4, vocab_size=32000),
    # gpu_step.py --tiny and quality.py --quick (quality replaces the vocabulary by its tokenizer's)
    "tiny-h64": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, vocab_size=512),
    # quality.py's CPU grid (also ablations.py, refresh_memory.py)
    "tiny-h128": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=1024),
    # quality.py's GPU sizes
    "20m": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6,
                num_key_value_heads=6, vocab_size=4096),
    "50m": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=12, num_attention_heads=8,
                num_key_value_heads=8, vocab_size=8192),
    # plan_validate.py: planner vs real CPU step, ~5M to ~350M parameters
    "validate-5m": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=4, vocab_size=8000),
    "validate-30m": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=6, num_attention_heads=8,
                         num_key_value_heads=8, vocab_size=16000),
    "validate-100m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12,
                          num_key_value_heads=12, vocab_size=32000),
    "validate-350m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=22, num_attention_heads=16,
                          num_key_value_heads=16, vocab_size=32000),
}
# fmt: on

# Mixture-of-experts shapes by name: the Qwen3MoeConfig fields (transformers' Qwen3-MoE: one fused
# `Qwen3MoeExperts` per decoder layer, every layer sparse). The experts keep Qwen3-30B-A3B's proportions,
# moe_intermediate / hidden = 768 / 2048 = 0.375, so each expert's gate_up (2I x H) and down (H x I)
# matrices have the full model's aspect ratios and an expert rank r here stands for r x 2048 / hidden
# there at the same r / min(m, n).
# fmt: off
MOE_SHAPES: dict[str, dict[str, int]] = {
    # quality.py --size tiny-moe: hidden 128 as tiny-h128, 8 experts of 48 (1/16 of Qwen3-30B-A3B's 768), top 2
    "tiny-moe-h128": dict(hidden_size=128, moe_intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
                          vocab_size=1024),
    # quality.py --quick-moe: seconds on a CPU
    "tiny-moe-h64": dict(hidden_size=64, moe_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
                         vocab_size=512),
}
# fmt: on

Shape = Union[str, dict[str, int]]


def scaled_shape(hidden: int, layers: int, *, vocab_size: int) -> dict[str, int]:
    """A Llama of any width: 64-dimensional heads (no grouped queries) and Llama-2-7B's intermediate /
    hidden ratio (11008 / 4096 = 2.6875) rounded down to a multiple of 8 (distributed.py's --hidden)."""
    return dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
                num_key_value_heads=hidden // 64, intermediate_size=int(hidden * 2.6875) // 8 * 8,
                vocab_size=vocab_size)  # fmt: skip


def llama_config(shape: Shape, **overrides: Any):
    """The LlamaConfig of `shape` (a name in SHAPES or a dict of LlamaConfig fields) with `overrides`.

    Every benchmark model has an untied head and 2048 positions unless a field says otherwise."""
    from transformers import LlamaConfig

    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ValueError(f"unknown Llama shape {shape!r}; choose one of {sorted(SHAPES)} or pass a dict of fields")
        shape = SHAPES[shape]
    fields = {"max_position_embeddings": 2048, "tie_word_embeddings": False, **shape, **overrides}
    # LlamaConfig keeps any keyword as an attribute: a misspelt field would be ignored silently.
    known = set(inspect.signature(LlamaConfig.__init__).parameters)
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"{unknown} are not LlamaConfig fields; spell them as transformers.LlamaConfig does")
    return LlamaConfig(**fields)


def build_llama(shape: Shape, *, seed: int, init_device=None, device=None, dtype=None, **overrides: Any):
    """LlamaForCausalLM of `shape` (see llama_config; `overrides` are config fields).

    torch.manual_seed(seed) runs right before construction. The weights are created on `init_device`
    (default: torch's default device; "meta" allocates nothing), then moved to `device` and `dtype`
    when given. Initialising on the target device and moving there afterwards draw different random
    weights on CUDA, so each benchmark keeps the one it reports."""
    import torch
    from transformers import LlamaForCausalLM

    config = llama_config(shape, **overrides)
    torch.manual_seed(seed)
    with torch.device(init_device) if init_device is not None else contextlib.nullcontext():
        model = LlamaForCausalLM(config)
    if device is not None or dtype is not None:
        model = model.to(device=device, dtype=dtype)
    return model


def qwen3_moe_config(shape: Shape, **overrides: Any):
    """The Qwen3MoeConfig of `shape` (a name in MOE_SHAPES or a dict of Qwen3MoeConfig fields) with
    `overrides`: every layer sparse (decoder_sparse_step 1, no dense mlp_only_layers), an untied head and
    2048 positions unless a field says otherwise."""
    from transformers import Qwen3MoeConfig

    if isinstance(shape, str):
        if shape not in MOE_SHAPES:
            raise ValueError(
                f"unknown MoE shape {shape!r}; choose one of {sorted(MOE_SHAPES)} or pass a dict of fields"
            )
        shape = MOE_SHAPES[shape]
    fields = {"max_position_embeddings": 2048, "tie_word_embeddings": False, "decoder_sparse_step": 1,
              "mlp_only_layers": [], **shape, **overrides}  # fmt: skip
    known = set(inspect.signature(Qwen3MoeConfig.__init__).parameters)
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"{unknown} are not Qwen3MoeConfig fields; spell them as transformers.Qwen3MoeConfig does")
    return Qwen3MoeConfig(**fields)


def build_qwen3_moe(shape: Shape, *, seed: int, device=None, dtype=None, **overrides: Any):
    """Qwen3MoeForCausalLM of `shape` (see qwen3_moe_config); torch.manual_seed(seed) right before
    construction, then moved to `device` and `dtype` when given (as build_llama)."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    config = qwen3_moe_config(shape, **overrides)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    if device is not None or dtype is not None:
        model = model.to(device=device, dtype=dtype)
    return model


def preset_names(*, every: bool = False) -> tuple[str, ...]:
    """The AdamW-based optimizer presets hf_galore_plugin declares (GaLoreConfig.preset names), in its order;
    with `every`, all of them (Adafactor and Muon on the factor too).

    A function, not a constant: importing the plugin when this module loads would register its
    optimizer names before `_common` sets HF_GALORE_PLUGIN_NO_TAKEOVER."""
    from hf_galore_plugin import PRESETS, GaLoreConfig

    # The AdamW-based presets: the benchmarks' tables and their accounting (_models.training_state_bytes) are
    # those of Adam's state; galore_adafactor's rows are not in them yet.
    return tuple(name for name in PRESETS if every or GaLoreConfig.preset(name).inner_optimizer == "adamw")


# ---------------------------------------------------------------------- byte accounting
def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the tensors among `tensors` (other values are skipped: optimizer state holds ints)."""
    import torch

    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def training_state_bytes(model, optimizer, *, error_feedback_apart: bool = False) -> dict[str, int]:
    """Exact bytes training holds besides activations, read while the gradients exist: parameters and
    buffers (frozen and quantized weights included), gradients, optimizer state, projection bases (our
    layers' `galore_basis_` buffers; galore-torch's projector matrices, which live in its optimizer
    state). With `error_feedback_apart`, the error-feedback residuals (state keys containing
    "residual") are an "error_feedback" part of their own instead of optimizer state. Works on meta
    tensors (sizes only)."""
    buffers = list(model.named_buffers())
    state, projectors = [], []
    for per_param in optimizer.state.values():
        for key, value in per_param.items():
            if hasattr(value, "ortho_matrix"):
                projectors.append(value.ortho_matrix)
            else:
                state.append((key, value))
    residual = [error_feedback_apart and "residual" in key for key, _ in state]
    parts = {
        "weights": tensor_bytes(model.parameters()) + tensor_bytes(b for n, b in buffers if "galore_basis_" not in n),
        "grads": tensor_bytes(p.grad for p in model.parameters() if p.grad is not None),
        "optimizer_state": tensor_bytes(v for (_, v), r in zip(state, residual) if not r),
    }
    if error_feedback_apart:
        parts["error_feedback"] = tensor_bytes(v for (_, v), r in zip(state, residual) if r)
    parts["bases"] = tensor_bytes(b for n, b in buffers if "galore_basis_" in n) + tensor_bytes(projectors)
    return parts

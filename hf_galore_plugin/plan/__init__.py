"""Memory planner: the peak memory of one training step of a causal LM, per method, without a GPU.

    python -m hf_galore_plugin.plan --model llama-3-8b --seq-len 2048 --gradient-checkpointing
    python -m hf_galore_plugin.plan --config path/to/config.json --methods adamw_torch,qgalore_adamw_8bit --json

    from hf_galore_plugin.plan import estimate
    plan = estimate(model="llama-2-7b", methods=["qgalore_adamw_8bit"], seq_len=2048, gradient_checkpointing=True)

The real transformers model code and each method's real code (this package's layers, quantized
storage and AdamW; torch AdamW; galore-torch) run under ``FakeTensorMode``, and a dispatch mode
counts live tensor bytes (see ``plan.trace``). bitsandbytes' 8-bit AdamW, LoRA and QLoRA cannot
run under fake tensors, and torchao's low-bit AdamW, FlashOptim and APOLLO are not installed here: their
state follows their documented layout (``traced: false``; ``plan.layouts``), the rest of their step
(model, activations, gradients) is traced.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
from typing import Any, Optional, Sequence

from .layouts import LAYOUT_METHODS

__all__ = ["estimate", "PlanError", "MODEL_NAMES", "METHODS", "GPU_SIZES_GB", "known_methods", "registered_methods"]

_MODELS_FILE = pathlib.Path(__file__).with_name("models.json")
# The methods plan.trace sets up itself besides the registered ones (and those counted by layout).
_BASELINES = ("adamw_torch", "adamw_8bit", "galore_torch", "lora", "qlora")


def registered_methods() -> tuple[str, ...]:
    """The optimizer names of entry-point group ``hf_galore_plugin.optimizers`` (this package's presets and
    any another installed package declares), each planned through the GaLoreConfig its entry point returns."""
    from ..registry import list_optimizer_entry_points

    return tuple(sorted(list_optimizer_entry_points()))


def known_methods() -> tuple[str, ...]:
    """Every method the planner plans, read now (a package installed later in the process is seen)."""
    return tuple(dict.fromkeys((*_BASELINES, *registered_methods(), *LAYOUT_METHODS)))


METHODS = known_methods()
ENGINES = ("ddp", "fsdp2", "zero2", "zero3")
GPU_SIZES_GB = (24, 40, 48, 80, 141)


class PlanError(ValueError):
    """Bad planner input; the message names the value and the fix."""


def _models() -> dict[str, dict]:
    data = json.loads(_MODELS_FILE.read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}


MODEL_NAMES = tuple(_models())
# Config keys that hold a size or a count (hidden_size, head_dim, num_hidden_layers, n_routed_experts, ...):
# a negative one is a typo that transformers passes on to torch as a tensor shape.
_SIZE_KEY = re.compile(r"(_size|_dim|_heads|_layers|_experts|_positions|_tok)$|^(num|n)_")


def load_config(model: Optional[str] = None, config: Optional[str] = None):
    """The transformers config of a named shape (``model``) or a config.json file or folder (``config``)."""
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if (model is None) == (config is None):
        raise PlanError("give exactly one of --model NAME or --config PATH")
    if model is not None:
        shapes = _models()
        if model not in shapes:
            raise PlanError(
                f"unknown model {model!r}; known shapes: {', '.join(shapes)} (or pass --config config.json)"
            )
        fields = dict(shapes[model])
        cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
        source = f"--model {model}"
    else:
        assert config is not None  # exactly one of the two is given (checked above)
        path = pathlib.Path(config)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise PlanError(f"config file {str(path)!r} does not exist; pass a transformers config.json")
        try:
            fields = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise PlanError(f"config file {str(path)!r} is not valid JSON ({exc})") from exc
        if not isinstance(fields, dict) or "model_type" not in fields:
            raise PlanError(f"config file {str(path)!r} has no 'model_type'; pass a transformers config.json")
        model_type = fields.pop("model_type")
        try:
            cfg = AutoConfig.for_model(model_type, **fields)
        except (ValueError, KeyError) as exc:
            raise PlanError(f"config file {str(path)!r}: unknown model_type {model_type!r} ({exc})") from exc
        assert isinstance(cfg, PretrainedConfig)
        source = f"config file {str(path)!r}"
    if cfg.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise PlanError(
            f"model_type {cfg.model_type!r} is not a causal language model in transformers; the planner "
            "traces AutoModelForCausalLM (e.g. llama, mistral, qwen2)"
        )
    for key, value in cfg.to_dict().items():
        if isinstance(value, int) and not isinstance(value, bool) and value < 0 and _SIZE_KEY.search(key):
            raise PlanError(
                f"{source}: {key}={value} is negative; a size or count must be a positive integer: correct it in "
                "the config.json"
            )
    return cfg


def _parse_optim_args(optim_args) -> dict[str, Any]:
    """GaLoreConfig overrides from a dict or an optim_args string ('rank=256,weight_storage=nf4')."""
    from ..config import GaLoreConfig

    if optim_args is None or optim_args == "":
        return {}
    if isinstance(optim_args, dict):
        values = dict(optim_args)
    else:
        from ..integrations.optim_args import parse_optim_args

        try:
            values = parse_optim_args(optim_args)
        except ValueError as exc:
            raise PlanError(f"--optim-args {optim_args!r}: {exc}") from exc
    unknown = set(values) - set(GaLoreConfig.field_names())
    if unknown:
        raise PlanError(
            f"--optim-args: unknown GaLoreConfig field(s) {sorted(unknown)}; valid: {GaLoreConfig.field_names()}"
        )
    try:
        GaLoreConfig(**values)
    except (ValueError, TypeError) as exc:
        raise PlanError(f"--optim-args: {exc}") from exc
    return values


def _per_rank(parts: dict[str, int], trace, engine: str, world: int) -> tuple[dict[str, int], int]:
    """Per-rank parts and the bytes an engine adds, by rule from the traced parts."""
    parts = dict(parts)
    added = 0
    if world <= 1:
        return parts, 0
    if engine == "ddp":
        # DDP keeps a flat bucket copy of every trainable gradient (gradient_as_bucket_view=False).
        added = trace.trainable_grad_bytes
    else:
        sharded = ("grads", "optimizer_state") if engine == "zero2" else ("weights", "grads", "optimizer_state")
        for key in sharded:
            parts[key] = math.ceil(parts[key] / world)
        if engine in ("fsdp2", "zero3"):
            # One decoder layer gathered whole, the next prefetched, and one layer's full gradients
            # before their reduce-scatter.
            added = 2 * trace.largest_layer_param_bytes + trace.largest_layer_grad_bytes
    return parts, added


def estimate(
    *,
    model: Optional[str] = None,
    config: Optional[str] = None,
    methods: Optional[Sequence[str]] = None,
    seq_len: int = 2048,
    batch_size: int = 1,
    gradient_checkpointing: bool = False,
    dtype: str = "bf16",
    rank: int = 256,
    lora_rank: int = 64,
    optim_args=None,
    world_size: int = 1,
    engine: Optional[str] = None,
    device: str = "cuda",
    full_trace: bool = False,
    liger: bool = False,
) -> dict[str, Any]:
    """The plan as the ``--json`` object: model, params, settings and, per method, peak bytes of a
    normal and a refresh step, the parts at the peak, the largest tensors and whether it was traced.

    `liger`: the loss of ``TrainingArguments(use_liger_kernel=True)`` (Liger's fused linear cross-entropy).
    `engine`: how `world_size` > 1 processes share the model (None: ddp); refused with one process."""
    from .trace import DTYPES, Settings, scaled_trace, trace_method

    known = known_methods()
    methods = list(methods or known)
    for name in methods:
        if name not in known:
            raise PlanError(f"unknown method {name!r}; choose from {', '.join(known)}")
    for name, value in (("seq-len", seq_len), ("batch-size", batch_size), ("rank", rank), ("lora-rank", lora_rank),
                        ("world-size", world_size)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"--{name} must be a positive integer, got {value!r}")
    if dtype not in DTYPES:
        raise PlanError(f"--dtype {dtype!r} is not supported; choose from {', '.join(DTYPES)}")
    if engine is not None and engine not in ENGINES:
        raise PlanError(f"--engine {engine!r} is not supported; choose from {', '.join(ENGINES)}")
    if engine is not None and world_size == 1:
        raise PlanError(
            f"--engine {engine!r} without --world-size: an engine only changes a run of several processes; give "
            "--world-size N (N > 1, the number of GPUs), or drop --engine to plan one process"
        )
    engine = engine or "ddp"
    if device not in ("cuda", "cpu"):
        raise PlanError(f"--device {device!r}: choose cuda (GPU code paths) or cpu")
    overrides = _parse_optim_args(optim_args)
    if overrides.get("state_offload", "none") != "none":
        from ..engines.capabilities import UnsupportedByEngine, check_state_offload

        try:
            check_state_offload(engine if world_size > 1 else "single", state_offload=overrides["state_offload"])
        except UnsupportedByEngine as exc:
            raise PlanError(f"--optim-args state_offload={overrides['state_offload']}: {exc}") from exc
    cfg = load_config(model, config)
    given = f"--rank {rank}" if "rank" not in overrides else ""
    given += f" --optim-args {optim_args!r}" if overrides else ""
    settings = Settings(seq_len, batch_size, DTYPES[dtype], gradient_checkpointing, device,
                        overrides.pop("rank", rank), lora_rank, overrides, liger=liger)  # fmt: skip
    meta = _meta_model(cfg, f"--model {model}" if model is not None else f"config file {config!r}")
    for name in methods:
        _check_targets(meta, name, settings, given.strip())
    result: dict[str, Any] = {
        "model": model or str(config),
        "params": sum(p.numel() for p in meta.parameters()),
        "settings": {
            "seq_len": seq_len,
            "batch_size": batch_size,
            "gradient_checkpointing": gradient_checkpointing,
            "dtype": dtype,
            "rank": settings.rank,
            "lora_rank": lora_rank,
            "optim_args": overrides,
            "world_size": world_size,
            "engine": engine,
            "device": device,
            "liger": liger,
            "per_rank_rule": _RULES[engine] if world_size > 1 else "one process: nothing sharded",
        },  # fmt: skip
        "methods": {},
    }
    trace = trace_method if full_trace else scaled_trace
    for name in methods:
        try:
            t = trace(cfg, name, settings)
        except ValueError as exc:
            if "use_liger_kernel" not in str(exc) and "chunked loss" not in str(exc):
                raise
            raise PlanError(f"{name}: {exc}") from exc
        entry: dict[str, Any] = {"traced": t.traced}
        for key, peak in (("", t.normal), ("refresh_", t.refresh)):
            parts, added = _per_rank(peak.parts, t, engine, world_size)
            parts["other"] += added
            total = sum(parts.values())
            entry[f"{key}peak_bytes"] = total
            entry[f"{key}parts"] = parts
            entry[f"{key}peak_phase"] = peak.phase
            if not key:
                entry["largest_tensors"] = peak.largest
        if name == "flash_adamw":  # its gradient-release mode steps inside backward: no gradient is held
            entry["gradient_release_peak_bytes"] = entry["peak_bytes"] - entry["parts"]["grads"]
        entry["fits_gpus_gb"] = [
            g for g in GPU_SIZES_GB if max(entry["peak_bytes"], entry["refresh_peak_bytes"]) <= g * 10**9
        ]
        # Host memory (state_offload='cpu'): per process, whatever the engine (refused where it shards state).
        entry["host_state_bytes"] = t.host_state_bytes
        entry["notes"] = t.notes
        result["methods"][name] = entry
    return result


_RULES = {
    "ddp": "DDP: every rank holds the whole step; plus a flat bucket copy of all trainable gradients",
    "fsdp2": "FSDP2: weights, gradients and optimizer state / world size; plus two decoder layers' weights "
             "gathered and one layer's full gradients",
    "zero3": "ZeRO-3: weights, gradients and optimizer state / world size; plus two decoder layers' weights "
             "gathered and one layer's full gradients",
    "zero2": "ZeRO-2: gradients and optimizer state / world size; weights replicated",
}  # fmt: skip


def _meta_model(cfg, source: str):
    """The model of `cfg` on the meta device (no memory); `source` names the config in an error."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(cfg)
    except (RuntimeError, ValueError, TypeError, KeyError, IndexError, ZeroDivisionError) as exc:
        # Any failure here comes from the config's values (the code is transformers' own model class).
        raise PlanError(f"{source}: transformers cannot build this model ({type(exc).__name__}: {exc}); check "
                        "the config's sizes") from exc  # fmt: skip


def _check_targets(meta, method: str, settings, given: str) -> None:
    """Refuse, before any trace, a GaLore method whose settings select nothing or a layer they cannot project
    on the model `meta` (the selection prepare_model makes, on the meta device); `given` names the arguments."""
    from ..inject import select_expert_targets, select_targets
    from ..registry import load_optimizer_preset

    if method not in registered_methods():
        return
    try:
        config = load_optimizer_preset(method).replace(rank=settings.rank, **settings.optim_args)
        _, report = select_targets(meta, config)
        select_expert_targets(meta, config, report)
    except ValueError as exc:
        raise PlanError(f"{method} with {given}: {exc}") from exc

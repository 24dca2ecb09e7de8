"""hf_galore_plugin: GaLore and Q-GaLore for Hugging Face Trainer, accelerate and DeepSpeed.

Importing the package is cheap: it imports torch and the quantization types (so quantized
tensors load with ``torch.load(weights_only=True)``), nothing from triton, transformers or
deepspeed. Public names are resolved lazily on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import quant as quant  # registers the quantized-tensor type as a safe global for torch.load
from .config import PRESETS, GaLoreConfig

__version__ = "0.1.0"

_LAZY = {
    "prepare_model": ".api",
    "create_optimizer": ".api",
    "after_step": ".api",
    "merge_and_unload": ".api",
    "merged_state_dict": ".api",
    "galore_layers": ".api",
    "galore_param_groups": ".api",
    "galore_state_dict": ".api",
    "load_galore_state_dict": ".api",
    "galore_stats": ".api",
    "rank_report": ".api",
    "save_rank_report": ".api",
    "state_of": ".state",
    "GaLoreState": ".state",
    "enable_chunked_loss": ".loss",
    "disable_chunked_loss": ".loss",
    "linear_cross_entropy": ".loss",
    "GaLoreLinear": ".layers",
    "AdamW": ".optim",
    "Adafactor": ".optim",
    "list_optimizer_entry_points": ".registry",
    "load_optimizer_preset": ".registry",
}

__all__ = ["GaLoreConfig", "PRESETS", "quant", "__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hf_galore_plugin' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


from . import integrations as integrations  # noqa: E402  registers the optimizer names with transformers (now, or when it is imported)

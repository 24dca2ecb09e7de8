"""Small shared helpers: optional-dependency checks and the Triton dispatch rule.

Nothing here imports triton, transformers or deepspeed at module import time.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

__all__ = ["is_triton_available", "use_triton", "is_package_available", "require", "EXTRAS"]

# Optional dependency -> the extra of this package that installs it.
EXTRAS = {"deepspeed": "deepspeed", "peft": "peft", "triton": "triton"}


@functools.lru_cache(maxsize=None)
def is_package_available(name: str) -> bool:
    """True when `name` can be imported (checked once, without importing it)."""
    return importlib.util.find_spec(name) is not None


def require(name: str, *, feature: str) -> None:
    """Raise an ImportError naming the extra to install when `feature` needs the missing package `name`.

    Call it right before the lazy ``import name`` of a feature that cannot fall back to anything else.
    """
    if name not in EXTRAS:
        raise ValueError(f"{name!r} is not an optional dependency of hf_galore_plugin; known: {sorted(EXTRAS)}")
    if not is_package_available(name):
        raise ImportError(
            f"{feature} needs {name}, which is not installed: pip install 'hf-galore-plugin[{EXTRAS[name]}]' "
            f"(from a clone: pip install '.[{EXTRAS[name]}]')"
        )


@functools.lru_cache(maxsize=None)
def is_triton_available() -> bool:
    return is_package_available("triton")


def _interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether an op on `tensor` should run its Triton kernel instead of its torch twin.

    Triton kernels run on CUDA tensors. On CPU they run only under the Triton interpreter
    (`TRITON_INTERPRET=1`, which tests set); everywhere else the torch twin is the CPU path.
    `HF_GALORE_DISABLE_TRITON=1` forces the torch twins (for debugging a kernel suspicion).
    """
    if os.environ.get("HF_GALORE_DISABLE_TRITON", "0") == "1" or not is_triton_available():
        return False
    if tensor.is_cuda:
        return True
    return _interpret_mode() and tensor.device.type == "cpu"

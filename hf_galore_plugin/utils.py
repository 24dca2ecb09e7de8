"""Small shared helpers: optional-dependency checks and the kernel dispatch setting.

Nothing here imports triton, transformers or deepspeed at module import time.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os

import torch

__all__ = [
    "is_triton_available",
    "use_triton",
    "KernelDispatch",
    "KERNEL_DISPATCH",
    "is_package_available",
    "require",
    "EXTRAS",
]

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


@dataclasses.dataclass
class KernelDispatch:
    """Which implementation the `torch.ops.hf_galore` custom ops and AdamW's fp32 step run, set once at import.

    Each op is registered with one implementation for every device, which runs the Triton kernel on
    CUDA tensors and the torch twin on the others (`use_triton`). The exceptions, read from the
    environment when this module is imported (never per call):

    - `triton_disabled` (`HF_GALORE_DISABLE_TRITON=1`): CUDA tensors run the torch twins too
      (for debugging a kernel suspicion).
    - `triton_on_cpu` (`TRITON_INTERPRET=1`, which must be set before triton is imported anyway):
      CPU tensors run the Triton kernels in Triton's interpreter (how the tests run the kernels).
    - `fused_adamw` (True unless `HF_GALORE_FUSED_ADAMW=0`): `optim.AdamW` steps the fp32 state of
      fp32 CPU tensors in torch's fused AdamW kernel; off, in torch's single-tensor AdamW arithmetic
      (which bf16 and non-contiguous tensors take anyway).

    `inline_twins`: the Python entry points (`quant.ops.*`, `optim.adamw8bit.adamw8bit_step`) call
    the torch twins as plain torch code instead of the custom ops, so a dispatch mode sees their
    temporaries (the memory planner's CPU trace; off by default).

    Change the setting in a process by assigning the attributes of `KERNEL_DISPATCH` (in tests:
    `monkeypatch.setattr(KERNEL_DISPATCH, "triton_disabled", True)`, which restores it afterwards).
    """

    triton_disabled: bool = False
    triton_on_cpu: bool = False
    fused_adamw: bool = True
    inline_twins: bool = False


KERNEL_DISPATCH = KernelDispatch(
    triton_disabled=os.environ.get("HF_GALORE_DISABLE_TRITON", "0") == "1",
    triton_on_cpu=os.environ.get("TRITON_INTERPRET", "0") == "1",
    fused_adamw=os.environ.get("HF_GALORE_FUSED_ADAMW", "1") != "0",
)


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether an op on `tensor` runs its Triton kernel instead of its torch twin (`KERNEL_DISPATCH`):
    CUDA tensors, and CPU tensors with `triton_on_cpu`; never with `triton_disabled` or without triton."""
    if KERNEL_DISPATCH.triton_disabled or not is_triton_available():
        return False
    if tensor.is_cuda:
        return True
    return KERNEL_DISPATCH.triton_on_cpu and tensor.device.type == "cpu"

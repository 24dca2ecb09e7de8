"""The C++ CPU form of the 8-bit AdamW step (`adamw8bit_cpu.cpp`): built ahead of time, loaded only
when built, never compiled inside a training step.

    python -m hf_galore_plugin.optim.build_cpu        # build once per machine (one to three minutes)

On the CPU the torch step (`optim.adamw8bit.adamw8bit_step_torch`) is about 40 torch operations over
memory and the C++ step one pass: 20-80x faster, from a small model's tensors to one tensor of 16M values
(docs/benchmarks/step-time.md, "The 8-bit step's CPU implementations"). The build needs a C++ compiler and takes minutes, so it is a separate command (or
`build()`), not a side effect of a user's first step: where no build is cached, the op runs the torch
step, which gives bit-identical results, and one log line names the command.

The build lives under torch's extension cache (`TORCH_EXTENSIONS_DIR`, else
`torch.utils.cpp_extension.get_default_build_root()`), in a folder whose name hashes everything the
binary depends on (source, flags, torch and Python versions, the CPU's instruction-set flags:
`-march=native`), so a cached build of another source, torch or machine is never loaded.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import sys
from collections.abc import Sequence
from types import ModuleType

import torch

from hf_galore_plugin.codes import table_cache
from hf_galore_plugin.quant.dynamic import (
    LOOKUP_BASE,
    LOOKUP_BUCKETS,
    LOOKUP_SHIFT,
    code_lookup_table,
    dynamic_code_book,
)

logger = logging.getLogger(__name__)

__all__ = [
    "SOURCE", "BUILD_COMMAND", "build", "load_built", "extension_name", "library_path", "run", "packed_lookup_table",
]  # fmt: skip

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "adamw8bit_cpu.cpp")
BUILD_COMMAND = "python -m hf_galore_plugin.optim.build_cpu"
# -march=native: the build is per machine (its folder name hashes the CPU flags); vector division and
# sqrt round exactly as scalar ones. -ffp-contract=off, no -ffast-math: every product and sum rounds on
# its own, as in the torch step.
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fopenmp")
LDFLAGS = ("-fopenmp",)

_loaded: ModuleType | None = None
_looked_up = False


def _cpu_flags() -> str:
    """The instruction-set flags of this CPU (Linux), which a `-march=native` binary depends on."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


@functools.lru_cache(maxsize=None)
def extension_name() -> str:
    """The module name of this source's build for this torch, Python and CPU (a valid identifier)."""
    digest = hashlib.sha256()
    with open(SOURCE, "rb") as source:
        digest.update(source.read())
    for part in (*CFLAGS, *LDFLAGS, torch.__version__, sys.version, platform.machine(), _cpu_flags()):
        digest.update(part.encode())
    return f"hf_galore_adamw8bit_cpu_{digest.hexdigest()[:16]}"


def build_directory() -> str:
    """The folder of this build (see the module's docstring)."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return os.path.join(root, extension_name())


def library_path() -> str | None:
    folder, name = build_directory(), extension_name()
    for suffix in (".so", ".pyd"):  # the suffixes torch.utils.cpp_extension gives a built extension
        path = os.path.join(folder, name + suffix)
        if os.path.exists(path):
            return path
    return None


def build(*, verbose: bool = False) -> ModuleType:
    """Build the C++ step for this machine (cached; a second call loads the cached build) and use it from
    now on in this process. Raises what the build raises (no compiler, no ninja)."""
    global _loaded, _looked_up
    from torch.utils.cpp_extension import load

    # The source's lookup constants must be the ones the tables were built with.
    if (LOOKUP_SHIFT, LOOKUP_BASE, LOOKUP_BUCKETS) != (15, (127 - 32) << 8, 33 << 8):
        raise AssertionError("adamw8bit_cpu.cpp: its lookup constants differ from quant.dynamic's; update kShift etc.")
    folder = build_directory()
    os.makedirs(folder, exist_ok=True)
    module = load(
        name=extension_name(),
        sources=[SOURCE],
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        build_directory=folder,
        verbose=verbose,
    )
    _loaded, _looked_up = module, True
    return module


def load_built() -> ModuleType | None:
    """The built C++ step, or None where none is built for this machine (looked up once per process; never
    builds). A build that fails to load is reported once and not used."""
    global _loaded, _looked_up
    if _looked_up:
        return _loaded
    _looked_up = True
    path = library_path()
    if path is None:
        logger.warning(
            "hf_galore_plugin: the CPU 8-bit AdamW step runs as torch operations (same results, 20-80x "
            "slower than its C++ form). Build the C++ form once for this machine with `%s` (one to three "
            "minutes; cached under %s).",
            BUILD_COMMAND,
            os.path.dirname(build_directory()),
        )
        return None
    try:
        spec = importlib.util.spec_from_file_location(extension_name(), path)
        if spec is None or spec.loader is None:
            raise ImportError(f"no loader for {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as error:  # a damaged file, a missing runtime library
        logger.warning(
            "hf_galore_plugin: the built C++ 8-bit AdamW step at %s does not load (%s); using the torch step. "
            "Rebuild it with `%s`.",
            path,
            f"{type(error).__name__}: {error}".splitlines()[0],
            BUILD_COMMAND,
        )
        return None
    _loaded = module
    return module


@table_cache
def packed_lookup_table(signed: bool) -> torch.Tensor:
    """int32 [2 * LOOKUP_BUCKETS] for the C++ step: first | threshold << 8 per bucket, where first is
    `code_lookup_table`'s entry and `midpoints[first] < y` equals z(y) > threshold, z(y) being the low
    LOOKUP_SHIFT bits of y's pattern, complemented for negative y. This holds because a bucket holds
    at most one midpoint, and one inside y's bucket shares every higher bit with y; where the bucket
    holds none, midpoints[first] is above every y of it and threshold = 2**LOOKUP_SHIFT - 1 is never
    exceeded. One table read per value instead of two dependent ones."""
    table, padded = code_lookup_table(signed=signed)
    first = table.long()
    mid = padded[first]
    bits = mid.view(torch.int32).long()
    key = ((bits & 0x7FFFFFFF) >> LOOKUP_SHIFT) - LOOKUP_BASE
    key = key.clamp(0, LOOKUP_BUCKETS - 1) + torch.where(bits < 0, LOOKUP_BUCKETS, 0)
    low_mask = (1 << LOOKUP_SHIFT) - 1
    negative = torch.arange(2 * LOOKUP_BUCKETS) >= LOOKUP_BUCKETS
    inside = torch.isfinite(mid) & (key == torch.arange(2 * LOOKUP_BUCKETS))
    low = bits & low_mask
    threshold = torch.where(inside, torch.where(negative, low ^ low_mask, low), low_mask)
    return (first | (threshold << 8)).to(torch.int32)


def run(module: ModuleType, lists: Sequence[Sequence[torch.Tensor]], scalars: torch.Tensor, block_size: int) -> None:
    """One step of every parameter of `lists` (the op's ten tensor lists, residual lists empty without error
    feedback; fp32 contiguous CPU parameters and gradients) with `scalars` [parameters, 9] (row i: parameter
    i's `AdamW8bitHyper.scalars`)."""
    module.adamw8bit_step_cpu(
        [list(column) for column in lists],
        scalars,
        dynamic_code_book(signed=True)[0],
        packed_lookup_table(True),
        dynamic_code_book(signed=False)[0],
        packed_lookup_table(False),
        block_size,
    )

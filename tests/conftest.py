"""Test-session setup.

Triton kernels run on CPU only through the interpreter, and the variable must be set before
any `@triton.jit` function is defined, so it is set here, before test modules import kernels.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_sessionstart(session):
    # Settings that change which optimizer a name selects must not leak into the suite from the shell.
    os.environ.pop("HF_GALORE_PLUGIN_NO_TAKEOVER", None)

"""Test-session setup.

Triton kernels run on CPU only through Triton's interpreter, and Triton decides between interpreting
and compiling a kernel when its `@triton.jit` runs, reading TRITON_INTERPRET then. The kernel modules
are therefore imported here, once, with the variable set; then it is removed again, so that only the
tests marked `triton` (the kernel tests, which turn the CPU route on for themselves through the
`triton_kernels_on_cpu` fixture) pay for the interpreter, and every other test, and every process a
test starts, runs the torch twins, the CPU path users get.
"""

import os
import sys
from typing import Any, Optional

_USER_INTERPRET = os.environ.get("TRITON_INTERPRET")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _threads_per_xdist_worker() -> Optional[int]:
    """Under pytest-xdist with N > 1 workers (scripts/test.sh runs `-n 2`): the cores divided among them,
    at least one; None outside xdist or where OMP_NUM_THREADS is set by the caller. N processes that
    each start one torch thread per core ask for N x the cores: every parallel op then waits for
    descheduled threads (on this project's loaded 2-core machine a small training took 9-20 s with two
    threads and ~2 s with one: tests/test_optim.py, `_torch_twin_single_thread`)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1 or "OMP_NUM_THREADS" in os.environ:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // workers)


_WORKER_THREADS = _threads_per_xdist_worker()
if _WORKER_THREADS is not None:
    # Set before torch is imported (its OpenMP pool reads it then) and inherited by every process a
    # test starts, so a subprocess computes with the same thread count as the test that compares with it.
    os.environ["OMP_NUM_THREADS"] = str(_WORKER_THREADS)


def pytest_sessionstart(session):
    # Settings that change which optimizer a name selects must not leak into the suite from the shell.
    os.environ.pop("HF_GALORE_PLUGIN_NO_TAKEOVER", None)


# ---------------------------------------------------------------------- shared helpers and fixtures
import io  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import textwrap  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from hf_galore_plugin.utils import KERNEL_DISPATCH, is_triton_available  # noqa: E402

if _WORKER_THREADS is not None:
    torch.set_num_threads(_WORKER_THREADS)  # in case a plugin imported torch before this file set the variable

if sys.platform == "linux" and is_triton_available():
    os.environ["TRITON_INTERPRET"] = "1"
    import hf_galore_plugin.kernels.adamw8bit  # noqa: E402,F401
    import hf_galore_plugin.kernels.quant  # noqa: E402,F401
if _USER_INTERPRET is None:
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ["TRITON_INTERPRET"] = _USER_INTERPRET
# `utils` read the variable at import, while it was set for the kernel modules: the default route is the twins.
KERNEL_DISPATCH.triton_on_cpu = _USER_INTERPRET == "1"


@pytest.fixture
def triton_kernels_on_cpu(monkeypatch):
    """Route CPU tensors through the Triton kernels (in the interpreter) until `monkeypatch` undoes it, in
    this process and in the processes the test starts."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("HF_GALORE_DISABLE_TRITON", raising=False)
    monkeypatch.setattr(KERNEL_DISPATCH, "triton_on_cpu", True)
    monkeypatch.setattr(KERNEL_DISPATCH, "triton_disabled", False)


@pytest.fixture(autouse=True)
def _kernel_tests_use_the_interpreter(request):
    if request.node.get_closest_marker("triton") is not None:
        request.getfixturevalue("triton_kernels_on_cpu")


# The tiny Llama of the Trainer and engine tests; a test changes only what it needs (keyword overrides).
TINY_LLAMA = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False,
)  # fmt: skip


def build_tiny_llama(*, seed: Optional[int] = 0, **overrides: Any):
    """A randomly initialized ``LlamaForCausalLM`` (``TINY_LLAMA`` with `overrides`), seeded with `seed`
    right before the weights are drawn (None: the global generator as it is)."""
    import transformers

    config = transformers.LlamaConfig(**{**TINY_LLAMA, **overrides})
    if seed is not None:
        torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def token_data(n: int = 64, length: int = 16, *, vocab: int = 256, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """`n` rows of `length` random token ids below `vocab` (a fixed generator), as causal-LM examples."""
    ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": row, "labels": row} for row in ids]


# The optimizer settings of the Trainer tests: with update_proj_gap=3, bases at steps 0 and 3.
RANK_ARGS = "rank=8,update_proj_gap=3"


def training_args(tmp_path, **overrides: Any):
    """``TrainingArguments`` of the Trainer tests: galore_adamw, 4 steps of batch 4, CPU, seeded, no saves,
    a loss logged every step; `overrides` replace any of them. ``activation_checkpointing=True`` is
    passed under the name the installed transformers reads (see :func:`activation_checkpointing_field`)."""
    from transformers import TrainingArguments

    kwargs = dict(
        output_dir=str(tmp_path), optim="galore_adamw", optim_args=RANK_ARGS, max_steps=4,
        per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    kwargs.update(overrides)
    if "activation_checkpointing" in kwargs:
        kwargs[activation_checkpointing_field()] = kwargs.pop("activation_checkpointing")
    return TrainingArguments(**kwargs)


def activation_checkpointing_field() -> str:
    """The ``TrainingArguments`` field that switches activation checkpointing on: transformers 5.x renamed
    ``gradient_checkpointing`` to ``activation_checkpointing`` and deprecates the old name (a FutureWarning,
    an error under this suite's warning filters); the 4.x line knows only the old one."""
    import dataclasses

    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def logged_losses(trainer) -> dict[int, float]:
    """The training losses a Trainer logged, by step."""
    return {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no process listens on now: tests run in parallel (pytest-xdist), so a
    fixed port would be taken by another worker's process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_python(code: str, *, env: Optional[dict] = None, timeout: int = 120, check: bool = True, cwd=None):
    """Run `code` (dedented) in a fresh interpreter, offline, in `cwd`; with `check`, a failure shows its
    stderr."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full_env, timeout=timeout,
        cwd=None if cwd is None else str(cwd),
    )  # fmt: skip
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def torch_round_trip(obj: Any) -> Any:
    """``obj`` through ``torch.save`` and ``torch.load(weights_only=True)`` (what a checkpoint does to it)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def use_torch_twins(monkeypatch) -> None:
    """Run the torch twins instead of the Triton kernels until `monkeypatch` undoes it: in this process
    (`KERNEL_DISPATCH`, which reads HF_GALORE_DISABLE_TRITON once at import) and in the processes the
    test starts (the environment variable)."""
    from hf_galore_plugin.utils import KERNEL_DISPATCH

    monkeypatch.setenv("HF_GALORE_DISABLE_TRITON", "1")
    monkeypatch.setattr(KERNEL_DISPATCH, "triton_disabled", True)


@pytest.fixture
def tiny_llama():
    """:func:`build_tiny_llama`: ``tiny_llama(hidden_size=256, seed=1)``."""
    return build_tiny_llama


@pytest.fixture
def python_subprocess():
    """:func:`run_python`."""
    return run_python


@pytest.fixture
def round_trip():
    """:func:`torch_round_trip`."""
    return torch_round_trip


# ---------------------------------------------------------------------- skips in CI
# With HF_GALORE_STRICT_SKIPS=1 (set by .ci/run) a skip fails the run unless its reason starts with
# "platform:": a missing dependency or oracle must show up as a failure, not as a green skip.
STRICT_SKIPS = os.environ.get("HF_GALORE_STRICT_SKIPS", "0") == "1"
PLATFORM_SKIP = "platform:"


def _undocumented_skip(report) -> Optional[str]:
    if not report.skipped or hasattr(report, "wasxfail"):
        return None
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    return None if reason.startswith(PLATFORM_SKIP) else reason


def _fail_undocumented_skip(report) -> None:
    reason = _undocumented_skip(report) if STRICT_SKIPS else None
    if reason is not None:
        report.outcome = "failed"
        report.longrepr = (
            f"skipped without a documented platform reason ({reason!r}); HF_GALORE_STRICT_SKIPS=1 turns such "
            f"skips into failures: install what is missing, or start the reason with {PLATFORM_SKIP!r}"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_undocumented_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_undocumented_skip(outcome.get_result())

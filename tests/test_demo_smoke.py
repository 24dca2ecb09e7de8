"""The demo and the two benchmarks run end to end (tiny settings) and their numbers say what they should.

Each runs in a subprocess as a user would run it, with an environment without TRITON_INTERPRET (which
the kernel tests set for themselves): on CPU the kernels' torch twins run, as in the demo.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
from _plots import assert_drawn_png

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.benchmark]


def _run(script: str, *args: str, timeout: int = 300, stderr: Optional[list] = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", MPLBACKEND="Agg")
    proc = subprocess.run(
        [sys.executable, str(REPO / script), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    if stderr is not None:
        stderr.append(proc.stderr)
    return proc.stdout


def test_demo_trains_every_method_and_writes_its_report(tmp_path):
    methods = ["adamw_torch", "galore_adamw", "qgalore_adamw_8bit"]
    stderr: list[str] = []
    # A 2-layer, hidden-64 Llama on 6 steps of 4 x 32 tokens; update_proj_gap = steps // 5 = 1, so the
    # Q-GaLore run also goes through basis refreshes.
    stdout = _run(
        "examples/demo.py",
        *("--steps", "6", "--methods", ",".join(methods), "--out", str(tmp_path)),
        *("--hidden", "64", "--layers", "2", "--heads", "2", "--intermediate", "176"),
        *("--seq-len", "32", "--batch-size", "4", "--vocab-size", "300", "--eval-blocks", "8"),
        stderr=stderr,
    )
    for name in ("results.md", "results.json", "loss_curves.png", "memory.png"):
        assert str(tmp_path / name) in stdout  # the demo says where it wrote
    assert_drawn_png(tmp_path / "loss_curves.png")
    assert_drawn_png(tmp_path / "memory.png")
    summary = json.loads((tmp_path / "results.json").read_text())
    rows = {row["method"]: row for row in summary["results"]}
    assert list(rows) == methods
    for method, row in rows.items():
        losses = [loss for _, loss in row["loss_history"]]
        assert len(losses) == 6 and all(math.isfinite(x) for x in losses), (method, losses)
        assert losses[-1] < losses[0], (method, losses)  # it learned something in 6 steps
        # a model that learned something beats a uniform guess over the 300-token vocabulary
        assert math.isfinite(row["heldout_loss"]) and row["heldout_perplexity"] < 300, row["heldout_perplexity"]
        assert f"| {method} |" in (tmp_path / "results.md").read_text()
    # Each method's seconds per step (1 / steps_per_second) is at most the sum of its own timed steps, and
    # every step of every method ran inside the demo's wall time.
    step_seconds = [1 / row["steps_per_second"] for row in rows.values()]
    assert 0 < min(step_seconds) and sum(step_seconds) <= summary["wall_seconds"], (step_seconds, summary)
    adamw, qgalore = rows["adamw_torch"], rows["qgalore_adamw_8bit"]
    # AdamW holds fp32 weights, grads and two fp32 moments of every parameter: 16 bytes each.
    params = adamw["trainable_params"]
    assert adamw["state_bytes"]["grads"] == 4 * params and adamw["state_bytes"]["optimizer_state"] >= 8 * params
    assert qgalore["state_bytes_total"] < adamw["state_bytes_total"]
    assert qgalore["state_bytes"]["bases"] > 0 and qgalore["galore_refreshes"] > 0
    # one rate, the user's, for every method; the GaLore runs leave scale at its default ('auto')
    assert {row["learning_rate"] for row in rows.values()} == {3e-3}
    assert all("scale" not in (row["optim_args"] or "") for row in rows.values())

    # The console: one progress bar per method (on stderr, named after it), no printed log line per step,
    # and a closing paragraph that names the table's best method with its held-out loss.
    assert "{'loss'" not in stdout and "'galore/" not in stdout
    for method in methods:
        assert f"{method}: 100%|" in stderr[0], stderr[0][-2000:]
    best = min(rows.values(), key=lambda row: row["heldout_loss"])
    reading = stdout.rstrip().splitlines()[-1]
    assert reading == summary["reading"] and reading in (tmp_path / "results.md").read_text()
    assert reading.startswith(
        f"Reading the table: {best['method']} reached the lowest held-out loss, {best['heldout_loss']:.3f}"
    ), reading
    runner = sorted(rows.values(), key=lambda row: row["heldout_loss"])[1]
    assert f"{runner['heldout_loss'] - best['heldout_loss']:.3f} below the next best, {runner['method']}" in reading
    assert f"Against AdamW, adamw_torch ({adamw['heldout_loss']:.3f}): galore_adamw " in reading, reading


def test_memory_benchmark_quick(tmp_path):
    stdout = _run("benchmarks/memory.py", "--quick", "--out", str(tmp_path))
    report = (tmp_path / "memory.md").read_text().strip()
    assert "| qgalore_adamw_8bit |" in report and report in stdout  # the file holds the table it printed
    assert_drawn_png(tmp_path / "memory_bytes_per_param.png")
    summary = json.loads((tmp_path / "memory.json").read_text())
    # The 7B layout formulas reproduce the bytes of the measured run exactly.
    assert summary["formula_errors"] == {}
    for size in ("measured", "7b"):
        total = {method: row["total"] for method, row in summary[size].items()}
        assert total["qgalore_adamw_8bit"] < total["galore_adamw_8bit"] < total["galore_adamw"] < total["adamw_torch"]
        assert total["galore_adamw"] < total["galore_torch"], (size, total)
        # no full-size gradient of a GaLore weight: only factors, embeddings, head and norms have one
        assert summary[size]["galore_adamw"]["parts"]["grads"] < summary[size]["galore_torch"]["parts"]["grads"]
    # 7B in bf16: AdamW holds weights, grads and two moments of every parameter in bf16.
    big = summary["7b"]["adamw_torch"]
    assert big["total"] == pytest.approx(8 * big["params"], rel=1e-6)
    assert summary["7b"]["galore_adamw"]["parts"]["grads"] < big["parts"]["grads"] / 5


def test_step_benchmark_quick(tmp_path):
    started = time.perf_counter()
    stdout = _run("benchmarks/step.py", "--quick", "--steps", "20", "--measure-gap", "32", "--out", str(tmp_path))
    wall = time.perf_counter() - started
    report = (tmp_path / "step.md").read_text().strip()
    assert "| qgalore_adamw_8bit |" in report and report in stdout  # the file holds the table it printed
    result = json.loads((tmp_path / "step.json").read_text())
    rows = result["rows"]
    assert set(rows) == {"adamw_torch", "galore_adamw", "galore_adamw_8bit", "qgalore_adamw_8bit"}
    assert rows["adamw_torch"]["refresh_steps"] == 0
    # every timed ordinary step of every method ran inside the benchmark's process
    samples = [t for row in rows.values() for t in row["step_samples_s"]]
    assert 0 < min(samples) and sum(samples) < wall, (samples, wall)
    for method in ("galore_adamw", "galore_adamw_8bit", "qgalore_adamw_8bit"):
        row = rows[method]
        # the default staggered schedule packs the small Llama's 14 layers into P phases at the first
        # training step (records and kept inputs against the budget): steps 0 (untimed) to P-1 calibrate;
        # rounds 1..20 are steps 1..20, of which 1..P-1 calibrate (the next refresh is at step 32)
        phases = row["phases"]
        assert 2 <= phases <= 14, row
        assert (row["ordinary_steps"], row["refresh_steps"]) == (20 - (phases - 1), phases - 1), row
        assert 0 < row["median_step_s"] < wall and 0 < row["median_refresh_step_s"] < wall, row
        # an average over one refresh gap (P of its steps refresh) lies between its ordinary
        # and its refresh step times
        low, high = sorted((row["median_step_s"], row["median_refresh_step_s"]))
        assert low <= row["amortized_step_s"] <= high, row
        assert 0 < row["ratio_vs_adamw"] < math.inf
        # the spread is that of the ordinary steps alone; the ratio is to the baseline of the same rounds
        assert row["min_step_s"] <= row["median_step_s"] <= row["max_step_s"], row
        assert sorted(row["step_samples_s"])[0] == row["min_step_s"] and len(row["step_samples_s"]) == 21 - phases, row
        assert row["baseline_step_s"] == rows["adamw_torch"]["median_step_s"], row
        assert row["ratio_vs_adamw"] == pytest.approx(row["median_step_s"] / row["baseline_step_s"]), row
    assert "normal step ms (min-max, n)" in stdout


def test_step_benchmark_ranks_group_by_rank(tmp_path):
    # issue 13's layout on the tiny model: several ranks, fused AdamW, each preset against its own rounds
    # 16 rounds: the staggered phases (packed at the first step) calibrate on the first steps, which are
    # refresh steps; the rounds after them are the ordinary ones
    stdout = _run("benchmarks/step.py", "--quick", "--steps", "16", "--measure-gap", "1000", "--ranks", "32", "16",
                  "--baseline", "adamw_fused", "--out", str(tmp_path))  # fmt: skip
    rows = json.loads((tmp_path / "step.json").read_text())["rows"]
    presets = ("galore_adamw", "galore_adamw_8bit", "qgalore_adamw_8bit")
    assert list(rows) == ["adamw_fused"] + [f"{m} (rank {r})" for r in (32, 16) for m in presets]
    # the baseline steps once per round of every rank group; its row pools them
    assert rows["adamw_fused"]["ordinary_steps"] == 32 and rows["adamw_fused"]["refresh_steps"] == 0
    baselines = {rows[f"{m} (rank {r})"]["baseline_step_s"] for r in (32, 16) for m in presets}
    assert len(baselines) <= 2 and all(b > 0 for b in baselines)
    assert "| galore_adamw (rank 16) |" in stdout

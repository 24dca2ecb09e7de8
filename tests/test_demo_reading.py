"""The demo's report logic on made-up results: every method compared with AdamW (adamw_torch), which all
methods share one learning rate with."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest


DEMO_PATH = Path(__file__).resolve().parent.parent / "examples" / "demo.py"


def _load_demo():
    if "demo" in sys.modules:  # benchmarks/_common.py imports it under this name too
        return sys.modules["demo"]
    spec = importlib.util.spec_from_file_location("demo", DEMO_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["demo"] = module
    spec.loader.exec_module(module)
    return module


demo = _load_demo()

MB = 2**20


def _result(method: str, heldout: float, *, state_mb: float = 16.0, steps_per_second: float = 1.0) -> dict:
    state = {"weights": state_mb / 4 * MB, "grads": state_mb / 4 * MB, "optimizer_state": state_mb / 2 * MB, "bases": 0}
    return {
        "method": method,
        "final_train_loss": heldout - 0.1,
        "heldout_loss": heldout,
        "heldout_perplexity": math.exp(heldout),
        "state_bytes": state,
        "state_bytes_total": sum(state.values()),
        "peak_memory_bytes": None,
        "peak_memory_kind": "peak RSS over baseline (sampled, 1 ms)",
        "steps_per_second": steps_per_second,
    }


def _results(adamw: float) -> list[dict]:
    return [
        _result("adamw_torch", adamw),
        _result("galore_adamw", 4.383, state_mb=10.0),
        _result("galore_adamw_8bit", 4.340, state_mb=8.0),
        _result("qgalore_adamw_8bit", 4.398, state_mb=5.0),
        _result("lora", 4.969, state_mb=9.0),
    ]


def _table_cell(table: str, method: str, column: str) -> str:
    lines = table.splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == method:
            return cells[header.index(column)]
    raise KeyError(method)


@pytest.mark.parametrize(
    "adamw, gaps",
    [
        (4.360, "galore_adamw 0.023 above, galore_adamw_8bit 0.020 below, qgalore_adamw_8bit 0.038 above, lora 0.609 above"),
        (4.300, "galore_adamw 0.083 above, galore_adamw_8bit 0.040 above, qgalore_adamw_8bit 0.098 above, lora 0.669 above"),
    ],
)  # fmt: skip
def test_reading_and_table_compare_with_adamw(adamw, gaps):
    results = _results(adamw)
    reading = demo.plain_reading(results, steps=120)
    assert f"Against AdamW, adamw_torch ({adamw:.3f}): {gaps}." in reading, reading

    table = demo.results_table(results)
    assert _table_cell(table, "adamw_torch", "held-out vs AdamW") == "baseline"
    assert _table_cell(table, "galore_adamw_8bit", "held-out vs AdamW") == f"{4.340 - adamw:+.3f}"
    assert _table_cell(table, "galore_adamw_8bit", "vs AdamW") == "50%"


def test_reading_with_one_adamw_baseline_names_it():
    results = [_result("adamw_torch", 5.070), _result("qgalore_adamw_8bit", 4.398, state_mb=5.0)]
    reading = demo.plain_reading(results, steps=120)
    assert "Against AdamW, adamw_torch (5.070): qgalore_adamw_8bit 0.672 below." in reading, reading
    assert "baseline" in demo.results_table(results)


def test_reading_without_an_adamw_baseline_compares_nothing():
    results = [_result("galore_adamw", 4.383), _result("lora", 4.969)]
    reading = demo.plain_reading(results, steps=120)
    assert "Against" not in reading
    assert _table_cell(demo.results_table(results), "lora", "held-out vs AdamW") == "n/a"

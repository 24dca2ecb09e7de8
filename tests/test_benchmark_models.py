"""benchmarks/_models.py, the benchmarks' one model library: its shapes against published parameter counts
and the planner's model table, its builder against transformers' own construction, its byte accountant
against the package's own accounting, and the rule that no benchmark builds a Llama of its own.

Runs in the default suite (no subprocess, no training beyond two steps of a three-layer model).
"""

from __future__ import annotations

import ast
import json
import math
import pathlib
import sys

import pytest
import torch
from torch import nn

REPO = pathlib.Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
# Appended: benchmarks/distributed.py must not shadow the tests' own `distributed` package.
sys.path.append(str(BENCHMARKS))

import _models  # noqa: E402  (imports neither the plugin nor transformers, and sets no environment variable)

# Llama-2-7B's parameter count as Meta publishes it (the model card's "7B" is 6,738,415,616 weights).
LLAMA_2_7B_PARAMS = 6_738_415_616


def test_7b_shape_has_llama_2_7b_parameter_count():
    model = _models.build_llama("7b", seed=0, init_device="meta")
    assert sum(p.numel() for p in model.parameters()) == LLAMA_2_7B_PARAMS


def test_7b_shape_matches_the_planner_table():
    # The planner's models.json copies each model's published config.json; the benchmarks' "7b" must agree.
    published = json.loads((REPO / "hf_galore_plugin" / "plan" / "models.json").read_text())["llama-2-7b"]
    ours = _models.llama_config("7b")
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "vocab_size", "tie_word_embeddings"):  # fmt: skip
        assert getattr(ours, field) == published[field], field


def test_builder_draws_the_weights_transformers_draws_at_that_seed():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    expected = LlamaForCausalLM(LlamaConfig(**_models.SHAPES["tiny-h64"], max_position_embeddings=64))
    model = _models.build_llama("tiny-h64", seed=7, max_position_embeddings=64)
    assert model.config.max_position_embeddings == 64 and model.config.tie_word_embeddings is False
    got, want = model.state_dict(), expected.state_dict()
    assert list(got) == list(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_unknown_shape_or_field_is_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown Llama shape '7B'.*'7b'"):
        _models.llama_config("7B")
    with pytest.raises(ValueError, match=r"\['hiden_size'\] are not LlamaConfig fields"):
        _models.llama_config({"hiden_size": 64})


def test_training_state_bytes_agrees_with_the_package_accounting():
    import hf_galore_plugin as hgp

    torch.manual_seed(0)
    # Factors of 4096 and 4352 values: the smallest that get 8-bit state (min_8bit_numel 4096), one of
    # them not a whole number of 256-value blocks.
    model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 136), nn.ReLU(), nn.Linear(136, 8))
    config = hgp.GaLoreConfig.preset(
        "qgalore_adamw_8bit", rank=32, update_proj_gap=10, error_feedback=True, target_modules=["0", "2"]
    )
    model = hgp.prepare_model(model, config)
    optimizer = hgp.create_optimizer(model, lr=1e-3)
    x = torch.randn(4, 128)
    for _ in range(2):  # step 0 computes the first bases; step 1 creates the factors' 8-bit state
        model(x).square().mean().backward()
        optimizer.step()
        hgp.after_step(model, optimizer)
    apart = _models.training_state_bytes(model, optimizer, error_feedback_apart=True)
    together = _models.training_state_bytes(model, optimizer)
    assert list(apart) == ["weights", "grads", "optimizer_state", "error_feedback", "bases"]
    assert list(together) == ["weights", "grads", "optimizer_state", "bases"]
    # The optimizer's own count of its state (step counters included), split or not.
    assert apart["optimizer_state"] + apart["error_feedback"] == together["optimizer_state"] == optimizer.state_nbytes()
    # Error feedback: per 8-bit moment, int8 residual codes (one byte a value) and an fp32 scale per
    # 256-value block (optim/adamw.py's state layout); 8-bit state holds the two GaLore factors here.
    factors = [p.numel() for p, state in optimizer.state.items() if "exp_avg_codes" in state]
    assert len(factors) == 2
    assert apart["error_feedback"] == sum(2 * (n + 4 * math.ceil(n / 256)) for n in factors)
    # The layers' own count of their (INT4) bases.
    assert apart["bases"] == sum(layer.state_nbytes()["basis"] for _, layer in hgp.galore_layers(model))
    assert apart["grads"] == sum(4 * p.numel() for p in model.parameters() if p.requires_grad)


def _builds_a_llama(path: pathlib.Path) -> list[str]:
    """Calls of LlamaConfig / LlamaForCausalLM (plain or as an attribute) in the file, as 'name:line'."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if name in ("LlamaConfig", "LlamaForCausalLM"):
                found.append(f"{name}:{node.lineno}")
    return found


def test_no_benchmark_builds_its_own_llama():
    scripts = sorted(p for p in BENCHMARKS.glob("*.py") if p.name != "_models.py")
    assert len(scripts) >= 10  # the glob found the benchmarks
    own = {p.name: calls for p in scripts if (calls := _builds_a_llama(p))}
    assert not own, f"build Llama models with _models.llama_config / build_llama, not directly: {own}"
    assert _builds_a_llama(BENCHMARKS / "_models.py")  # the checker sees the one builder that does


# ------------------------------------------------------------------ benchmarks/_engines.py: engine wrapping
import _engines  # noqa: E402  (standard library only at import)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)


def _nested() -> nn.Module:
    outer = _Block()
    outer.inner = _Block()
    return nn.Sequential(outer, _Block())


def _toy() -> nn.Module:
    return nn.Sequential(_Block(), _Block(), _Block(), nn.Linear(4, 2))


@pytest.mark.parametrize(
    "engine, kwargs, message",
    [
        ("fsdp3", {}, r"engine='fsdp3' is not one of \('single', 'ddp', 'fsdp1', 'fsdp2'\)"),
        ("fsdp2", {"comm_hook": print}, r"comm_hook=.*engine='fsdp2' has none, pass None"),
        ("ddp", {"use_orig_params": False}, r"use_orig_params=False is an FSDP1 option; engine='ddp'"),
        ("fsdp2", {}, r"engine='fsdp2' shards block by block: pass block_class=.*got None"),
        ("fsdp2", {"block_class": nn.Conv2d}, r"block_class=Conv2d matches no submodule of Sequential"),
        ("fsdp2", {"block_class": _Block, "_nested": True}, r"block_class=_Block nests"),
    ],
)
def test_wrap_for_engine_refuses_bad_arguments_by_name(engine, kwargs, message):
    model = _nested() if kwargs.pop("_nested", False) else _toy()
    with pytest.raises(ValueError, match=message):
        _engines.wrap_for_engine(model, engine, **kwargs)


def test_wrap_for_engine_makes_the_calls_the_callers_made(monkeypatch):
    """Oracle: the calls each caller made inline before the wrapping was shared (per block in module
    order, then the root; FSDP1 with the CPU device and the block class as its wrap policy; DDP with the
    hook registered on the wrapper). The engines are replaced by recorders: no process group needed."""
    import torch.distributed.fsdp as fsdp

    calls = []
    monkeypatch.setattr(fsdp, "fully_shard", lambda module: calls.append(("fully_shard", module)))

    class RecordingFSDP:
        def __init__(self, module, **kwargs):
            calls.append(("FSDP", module, kwargs))

    class RecordingDDP:
        def __init__(self, module):
            calls.append(("DDP", module))

        def register_comm_hook(self, state, hook):
            calls.append(("hook", state, hook))

    monkeypatch.setattr(fsdp, "FullyShardedDataParallel", RecordingFSDP)
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", RecordingDDP)

    model = _toy()
    assert _engines.wrap_for_engine(model, "single") == (model, model) and calls == []

    assert _engines.wrap_for_engine(model, "fsdp2", block_class=_Block) == (model, model)
    assert calls == [("fully_shard", m) for m in (model[0], model[1], model[2], model)]

    calls.clear()
    for use_orig_params in (True, False):
        wrapped, forward = _engines.wrap_for_engine(model, "fsdp1", block_class=_Block, use_orig_params=use_orig_params)
        assert isinstance(wrapped, RecordingFSDP) and forward is wrapped
        ((kind, module, kwargs),) = calls
        assert kind == "FSDP" and module is model
        assert kwargs.pop("auto_wrap_policy")._module_classes == {_Block}
        assert kwargs == {"use_orig_params": use_orig_params, "device_id": torch.device("cpu")}
        calls.clear()
    wrapped, forward = _engines.wrap_for_engine(model, "fsdp1")  # no block class: the whole model as one unit
    ((kind, module, kwargs),) = calls
    assert module is model and kwargs == {"use_orig_params": True, "device_id": torch.device("cpu")}
    calls.clear()

    for hook in (None, print):
        optimized, forward = _engines.wrap_for_engine(model, "ddp", comm_hook=hook)
        assert optimized is model and isinstance(forward, RecordingDDP)
        assert calls == [("DDP", model)] + ([("hook", None, hook)] if hook else [])
        calls.clear()


def test_no_distributed_script_wraps_a_model_itself():
    """One wrapping helper: a second copy of the wrapping code in a distributed test or the benchmark
    worker fails here."""
    scripts = sorted((REPO / "tests" / "distributed").glob("*.py")) + [BENCHMARKS / "_distributed_worker.py"]
    assert len(scripts) >= 6  # the glob found the distributed scripts
    calls = ("fully_shard(", "FullyShardedDataParallel(", "DistributedDataParallel(")
    own = {p.name: [c for c in calls if c in p.read_text()] for p in scripts}
    own = {name: found for name, found in own.items() if found}
    assert not own, f"wrap models with benchmarks/_engines.py's wrap_for_engine, not directly: {own}"
    assert all(c in (BENCHMARKS / "_engines.py").read_text() for c in calls)  # the checker sees the one that does

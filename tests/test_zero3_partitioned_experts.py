"""A mixture-of-experts model that ZeRO-3 partitions at load (``from_pretrained`` under a stage-3 DeepSpeed config,
accelerate's ``zero3_init_flag: true``) is prepared as ``prepare_model`` prepares it in one process: the same
target replacement, expert stacks included, one gathered module at a time.

Runs tests/distributed/moe_zero3_load.py: ``Trainer`` + galore_adamw ``experts=true`` on a tiny pretrained
Qwen3-MoE, 2 gloo ranks under ZeRO-3 against the same Trainer run in one process (the oracle).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from distributed._launch import LOSS_RTOL, assert_weights_match, run_one_process, run_two_ranks

transformers = pytest.importorskip("transformers", reason="platform: transformers is a dependency of the tests")
pytest.importorskip("deepspeed", reason="platform: deepspeed is the [deepspeed] extra, which dev installs")

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).parent / "distributed" / "moe_zero3_load.py"


def _tiny_qwen3_moe():
    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(config)


def _reloaded_state_dicts(folders: list[str], python_subprocess, tmp_path: Path) -> list[dict[str, torch.Tensor]]:
    """The merged models in `folders` as the stock class loads them, in a process without the plugin."""
    outs = [str(tmp_path / f"reloaded_{i}.pt") for i in range(len(folders))]
    python_subprocess(
        f"""
        import sys, torch
        from transformers import Qwen3MoeForCausalLM
        for folder, out in zip({folders!r}, {outs!r}):
            model, info = Qwen3MoeForCausalLM.from_pretrained(folder, output_loading_info=True)
            assert type(model.model.layers[0].mlp.experts).__name__ == "Qwen3MoeExperts"
            assert not any(info.values()), info  # no key missing, unexpected or mismatched
            torch.save(model.state_dict(), out)
        assert not any(name.startswith("hf_galore_plugin") for name in sys.modules)
        """
    )
    return [torch.load(out, weights_only=True) for out in outs]


def test_zero3_partitioned_load_projects_experts_as_one_process(tmp_path, python_subprocess):
    pretrained = tmp_path / "pretrained"
    _tiny_qwen3_moe().save_pretrained(pretrained)
    for engine in ("single", "zero3"):
        (tmp_path / engine).mkdir()

    single = run_one_process(tmp_path / "single" / "out.pt", str(pretrained), script=WORKER, ENGINE="single")
    assert single.returncode == 0, single.stderr[-4000:]
    multi = run_two_ranks(tmp_path / "zero3" / "out.pt", str(pretrained), script=WORKER, ENGINE="zero3")
    assert multi.returncode == 0, multi.stderr[-4000:]
    one = torch.load(tmp_path / "single" / "out.pt", weights_only=True)
    run = torch.load(tmp_path / "zero3" / "out.pt", weights_only=True)

    assert run["partitioned_at_load"] and not one["partitioned_at_load"]
    # The experts are projected (2 layers x gate_up_proj and down_proj) and reported as in one process.
    assert len(one["stacks"]) == 4
    assert run["stacks"] == one["stacks"]
    assert "experts: 2 expert modules" in one["summary"]
    assert run["summary"] == one["summary"]
    # fp32 sums in another order (two halves reduced vs one batch): the ZeRO-3 tests' bound (LOSS_RTOL).
    steps = sorted(one["losses"])
    assert sorted(run["losses"]) == steps == list(range(1, 9))
    torch.testing.assert_close(
        torch.tensor([run["losses"][s] for s in steps]),
        torch.tensor([one["losses"][s] for s in steps]),
        rtol=LOSS_RTOL,
        atol=0,
    )
    # save_model() wrote plain merged models; the stock class loads them with no key missing or left over.
    expected, got = _reloaded_state_dicts([one["final"], run["final"]], python_subprocess, tmp_path)
    start = _tiny_qwen3_moe().state_dict()
    assert got.keys() == expected.keys() == start.keys()
    moved = 0.0
    for key, value in expected.items():
        # The bound of the Trainer engine tests (tests/test_distributed_trainer.py): dense AdamW rows with
        # nearly-zero gradients turn last-bit gradient differences into ~6e-6 absolute ones.
        assert_weights_match(got[key], value, key=key, rtol=1e-6, atol=1e-5)
        if ".experts." in key:
            moved = max(moved, float((value - start[key]).abs().max()))
    assert moved > 1e-4  # the expert weights move far beyond the bound they are compared within

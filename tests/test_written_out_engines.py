"""The one-node layer (`WrittenOutLinear`) for a plain W0 under every engine: 2 gloo ranks against one process.

A plain-W0 layer runs as one autograd node from `WRITTEN_OUT_MIN_VALUES` activation values per call, far above this
run's layers (tests/distributed/sharded_galore.py: 30 steps, gradient accumulation 2, refreshes at steps 0, 10, 20);
WRITTEN_OUT_MIN_VALUES=0 sends every call through it, in the engine's run and in the one-process oracle alike. The
node saves W0 for its backward as autograd's own GEMM does, from the tensor the engine gave the forward (FSDP2 and
ZeRO-3 gather W0 for the forward and release it after).
"""

import pytest
import torch

from distributed._launch import assert_matches, run_one_process, run_two_ranks

pytestmark = pytest.mark.distributed

NODE = dict(PRESET="galore_adamw", PROJ_TYPE="std", WRITTEN_OUT_MIN_VALUES="0")


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("written_out") / "single.pt"
    result = run_one_process(out, ENGINE="single", **NODE)
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("engine", ["ddp", "fsdp1", "fsdp2", "zero3"])
def test_written_out_layers_under_an_engine_match_one_process(tmp_path, single, engine):
    out = tmp_path / f"{engine}.pt"
    result = run_two_ranks(out, ENGINE=engine, **NODE)
    assert result.returncode == 0, result.stderr[-4000:]
    multi = torch.load(out, weights_only=True)
    # three GaLore layers, two micro-batches a step, 30 steps: every forward of the oracle went through the node
    assert single["written_out"] == 3 * 2 * 30, single["written_out"]
    assert multi["written_out"] == single["written_out"], multi["written_out"]
    assert_matches(single, multi)

"""DDP at the torch level: 2 gloo ranks against one process over the same global batch.

The run (tests/distributed/sharded_galore.py, ENGINE=ddp) has 30 steps, gradient accumulation 2
(`no_sync` on the first micro-batch), refreshes at steps 0, 10 and 20, and checks after every
refresh that all ranks hold the same bases (each rank records its local gradient; the refresh
averages them before the SVD, or averages the randomized range finder's sketches).
"""

import pytest
import torch

from distributed._launch import assert_matches, int8_folds, run_two_ranks, single_process_run

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize(
    "preset, basis_method",
    [
        ("galore_adamw", "svd"),  # the averaged layer gradient, one layer at a time
        ("qgalore_adamw_8bit", "svd"),
        # the randomized range finder averages its sketches over the ranks, never the gradient (every
        # layer's sketches are smaller than its gradient at this rank: asserted in the worker)
        ("galore_adamw", "randomized"),
        ("galore_adafactor", "svd"),  # Adafactor's factored moments: replicated like Adam's
    ],
)
def test_ddp_two_ranks_match_single_process(tmp_path, preset, basis_method):
    out = tmp_path / "ddp.pt"
    result = run_two_ranks(out, ENGINE="ddp", PRESET=preset, PROJ_TYPE="std", BASIS_METHOD=basis_method)
    assert result.returncode == 0, result.stderr[-4000:]
    single = single_process_run(preset, "std", basis_method=basis_method)
    assert_matches(single, torch.load(out, weights_only=True), int8_folds=int8_folds(preset, single))

"""GaLore under FSDP2 (fully_shard) and FSDP1 at the torch level: 2 gloo ranks against one process.

FSDP2 holds W0 and the factor as DTensors sharded on rows; bases and counters are plain buffers.
The run has 30 steps, gradient accumulation 2, refreshes at steps 0 (calibration), 10 and 20, odd
layer sizes so shards are uneven, and checks after every refresh that all ranks hold the same bases.
"""

import pytest
import torch

from distributed._launch import assert_matches, run_two_ranks, single_process_run

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize(
    "preset, proj_type, fake_step",
    [
        ("galore_adamw", "std", "0"),  # right basis (33x16, row-local fold) and left bases (gathered factor)
        ("qgalore_adamw_8bit", "std", "0"),  # INT8 W0 in replicated buffers, INT4 bases, lazy refresh
        # two-sided bases, after the zero-gradient lr-0 step that distributed checkpointing runs on a fresh
        # optimizer (get_optimizer_state_dict): it must not move W0's decay multiplier or the layer counters
        ("galore_adamw", "full", "1"),
    ],
)
def test_fsdp2_two_ranks_match_single_process(tmp_path, preset, proj_type, fake_step):
    out = tmp_path / "fsdp2.pt"
    result = run_two_ranks(out, ENGINE="fsdp2", PRESET=preset, PROJ_TYPE=proj_type, FAKE_STEP=fake_step)
    assert result.returncode == 0, result.stderr[-4000:]
    assert_matches(single_process_run(preset, proj_type, fake_step), torch.load(out, weights_only=True))


def test_fsdp1_fails_before_the_first_step_with_a_clear_message(tmp_path):
    # FSDP1 (use_orig_params=True) turns every parameter into a 1-D view of a flat shard: the refresh
    # cannot fold a 1-D slice of B into W0, so create_optimizer refuses and names what to use instead.
    result = run_two_ranks(tmp_path / "fsdp1.pt", ENGINE="fsdp1")
    assert result.returncode != 0
    assert "an engine flattened it (FSDP1" in result.stderr
    assert "use FSDP2" in result.stderr
    assert not (tmp_path / "fsdp1.pt").exists()

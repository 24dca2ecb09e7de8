"""GaLore under FSDP2 (fully_shard) and FSDP1 at the torch level: 2 gloo ranks against one process.

FSDP2 holds W0 and the factor as DTensors sharded on rows; bases and counters are plain buffers.
FSDP1 (use_orig_params=True) holds them as 1-D views of each unit's flat shard.
The run has 30 steps, gradient accumulation 2, refreshes at steps 0 (calibration), 10 and 20, odd
layer sizes so shards are uneven, and checks after every refresh that all ranks hold the same bases.
"""

import pytest
import torch

from distributed._launch import assert_matches, int8_folds, run_two_ranks, single_process_run

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
    single = single_process_run(preset, proj_type, fake_step)
    assert_matches(single, torch.load(out, weights_only=True), int8_folds=int8_folds(preset, single))


@pytest.mark.parametrize(
    "preset, proj_type",
    [
        ("galore_adamw", "std"),  # 1-D views of flat shards; a shard may hold part of W0 and none of B
        ("qgalore_adamw_8bit", "std"),  # INT8 W0 in replicated buffers, 8-bit state on 1-D views
        ("galore_adamw", "full"),  # two-sided bases
    ],
)
def test_fsdp1_two_ranks_match_single_process(tmp_path, preset, proj_type):
    # FullyShardedDataParallel(use_orig_params=True): each refresh gathers the layer's unit
    # (summon_full_params(unit, recurse=False, writeback=True)) to fold B into W0 and zero B.
    out = tmp_path / "fsdp1.pt"
    result = run_two_ranks(out, ENGINE="fsdp1", PRESET=preset, PROJ_TYPE=proj_type)
    assert result.returncode == 0, result.stderr[-4000:]
    single = single_process_run(preset, proj_type)
    assert_matches(single, torch.load(out, weights_only=True), int8_folds=int8_folds(preset, single))


@pytest.mark.parametrize(
    "env, message",
    [
        # INT8 W0 is a buffer, so FSDP1 itself accepts the unit without use_orig_params; we refuse it
        (
            {"USE_ORIG_PARAMS": "0", "PRESET": "qgalore_adamw_8bit"},
            "needs FullyShardedDataParallel(use_orig_params=True)",
        ),
        # a frozen W0 next to a trainable factor: FSDP1 refuses the unit itself
        ({"USE_ORIG_PARAMS": "0", "PRESET": "galore_adamw"}, "when use_orig_params=False"),
        ({"MOMENT_HANDLING": "project"}, "FSDP1 keeps them as 1-D slices of a flat shard"),
    ],
)
def test_fsdp1_refuses_what_it_cannot_do_before_the_first_step(tmp_path, env, message):
    result = run_two_ranks(tmp_path / "fsdp1.pt", ENGINE="fsdp1", **env)
    assert result.returncode != 0
    assert message in result.stderr
    assert not (tmp_path / "fsdp1.pt").exists()

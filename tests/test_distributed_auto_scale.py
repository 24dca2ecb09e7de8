"""The default scale='auto' under every engine: 2 gloo ranks against one process.

Each layer's scale is sqrt(projected side / rank) of its own shape (about 2-3 in the harness's odd-sized layers),
so the engines must resolve the same per-layer scale on every rank, from the layer's full shape, not from the
shard a rank holds, and fold it into W0 at the refresh as one process does. The run is
tests/distributed/sharded_galore.py with SCALE=auto at lr 1e-3, the step size the engine tolerances are counted at
(see SCALE there), 30 steps, gradient accumulation 2, refreshes at steps 0, 10 and 20.
"""

import math

import pytest
import torch

from distributed._launch import assert_matches, int8_folds, run_two_ranks, single_process_run

pytestmark = pytest.mark.distributed

# The harness's GaLore layers (out x in: 33 x 16, 25 x 33, 12 x 25) at rank 4, proj_type 'std': the basis
# projects the smaller side, so the scale is sqrt(smaller side / 4).
EXPECTED_SCALES = {"0.proj": math.sqrt(16 / 4), "1.proj": math.sqrt(25 / 4), "2.proj": math.sqrt(12 / 4)}


@pytest.mark.parametrize(
    "engine, preset",
    [
        ("ddp", "galore_adamw"),
        ("fsdp2", "galore_adamw"),  # row shards of W0 and the factor: the scale from the full shape
        ("fsdp2", "qgalore_adamw_8bit"),  # INT8 W0 and INT4 bases: the scale folded into a quantized basis
        ("fsdp1", "galore_adamw"),  # 1-D views of flat shards
        ("zero2", "galore_adamw"),
        ("zero3", "galore_adamw"),  # partitioned W0 and factor, gathered per layer at the refresh
    ],
)
def test_engines_under_auto_scale_match_single_process(tmp_path, engine, preset):
    out = tmp_path / f"{engine}.pt"
    result = run_two_ranks(out, ENGINE=engine, PRESET=preset, PROJ_TYPE="std", SCALE="auto")
    assert result.returncode == 0, result.stderr[-4000:]
    single = single_process_run(preset, "std", scale="auto")
    multi = torch.load(out, weights_only=True)
    assert single["scales"] == pytest.approx(EXPECTED_SCALES, rel=1e-12)
    assert multi["scales"] == single["scales"]
    assert_matches(single, multi, int8_folds=int8_folds(preset, single))

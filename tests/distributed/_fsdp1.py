"""Helpers of the FSDP1 tests of galore_muon and galore_adafactor (tests/distributed/fsdp1_fragments.py)."""

import functools
import tempfile
from pathlib import Path

import torch
from distributed._launch import LOSS_RTOL, SCRIPT, WEIGHT_ATOL, WEIGHT_RTOL, run_one_process, run_two_ranks

FSDP1_SCRIPT = SCRIPT.with_name("fsdp1_fragments.py")


@functools.lru_cache(maxsize=None)
def reference(preset: str, model: str = "one_unit", engine: str = "single") -> dict:
    """The oracle: fsdp1_fragments.py in one process, or under DDP on 2 ranks (cached: several checkpoint kinds
    compare against it)."""
    out = Path(tempfile.mkdtemp(prefix="galore_fsdp1_reference_")) / "reference.pt"
    run = run_one_process if engine == "single" else run_two_ranks
    result = run(out, script=FSDP1_SCRIPT, ENGINE=engine, PRESET=preset, MODEL=model)
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(out, weights_only=True)


def fsdp1_run(tmp_path: Path, preset: str, model: str = "one_unit", **env: str) -> dict:
    out = tmp_path / "fsdp1.pt"
    result = run_two_ranks(out, script=FSDP1_SCRIPT, ENGINE="fsdp1", PRESET=preset, MODEL=model, **env)
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(out, weights_only=True)


def assert_one_unit_layout(layouts: list) -> None:
    """MODEL=one_unit's cut (fsdp1_fragments.py): rank 1 holds none of the first factor, and the second is cut
    inside a row between the ranks."""
    (first, *_), (first_1, *_) = [[f for f in layout if f[0].endswith("galore_factor")] for layout in layouts]
    assert first[2:] == (0, 132) and first_1[2] == first_1[3], (first, first_1)  # rank 1: [start, start): none
    second = [next(f for f in layout if f[0] == "1.proj.galore_factor") for layout in layouts]
    (_, shape, start, stop), (_, _, start_1, stop_1) = second
    assert start == 0 < stop == start_1 < stop_1 == shape[0] * shape[1], second  # cut between the ranks ...
    assert stop % shape[1] != 0, second  # ... inside a row


def assert_matches_one_process(single: dict, multi: dict) -> tuple[float, float]:
    """Losses and merged weights within the engines' tolerances (distributed/_launch.py); returns the largest
    relative loss and absolute weight differences."""
    torch.testing.assert_close(torch.tensor(multi["losses"]), torch.tensor(single["losses"]), rtol=LOSS_RTOL, atol=0)
    assert single["weights"].keys() == multi["weights"].keys()
    for key, expected in single["weights"].items():
        torch.testing.assert_close(multi["weights"][key], expected, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL,
                                   msg=lambda text, key=key: f"{key}: {text}")  # fmt: skip
    loss = max(abs(a - b) / abs(b) for a, b in zip(multi["losses"], single["losses"]))
    weight = max(float((multi["weights"][k] - v).abs().max()) for k, v in single["weights"].items())
    return loss, weight


def assert_resumed_exactly(run: dict) -> None:
    """The run resumed from its checkpoint at RESUME_AT ended bit for bit where the straight run did."""
    for key, value in run["weights"].items():
        assert torch.equal(run["resumed"][key], value), key


def assert_fsdp1_trains_as_reference(
    tmp_path: Path, preset: str, model: str, checkpoint: str, reference_engine: str, state_bound: float
) -> None:
    """`preset` under FSDP1 on `model` against `reference_engine` ('single' or 'ddp'): the one-unit layout (a
    factor cut inside a row, a rank holding none of one), the engines' tolerances, a bit-exact resume from
    `checkpoint` at step 12, and rank 0's state below `state_bound` times the reference's."""
    expected = reference(preset, model, reference_engine)
    run = fsdp1_run(tmp_path, preset, model, RESUME_AT="12", CHECKPOINT=checkpoint)
    if model == "one_unit":
        assert_one_unit_layout(run["layouts"])
    assert_matches_one_process(expected, run)
    assert_resumed_exactly(run)
    assert run["state_nbytes"] < state_bound * expected["state_nbytes"], (run["state_nbytes"], expected["state_nbytes"])

"""galore_muon and galore_adafactor under DeepSpeed ZeRO-1/2/3 (deepspeed.initialize, gloo, CPU, fp32, 2 ranks).

ZeRO hands the client optimizer one flat fp32 partition per parameter group (ZeRO-3: per sub-group), cut across
parameter boundaries. `DeepSpeedGaLoreOptimizer` registers on each flat of a GaLore group the fragments of the
factors it holds (`engines.fragments`), so that Muon and Adafactor find their rows and columns. The mapping
tests check those fragments against the factors' values on both ranks (tests/distributed/zero_fragments.py).
"""

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from distributed._launch import SCRIPT, assert_matches, run_one_process, run_two_ranks, single_process_run
from hf_galore_plugin import GaLoreConfig, create_optimizer, prepare_model
from hf_galore_plugin.engines.capabilities import UnsupportedByEngine

import deepspeed  # noqa: F401  (the [deepspeed] extra, which the dev extra installs)

pytestmark = pytest.mark.distributed

FRAGMENTS = SCRIPT.with_name("zero_fragments.py")


def _fragments(tmp_path, stage: int, **env: str) -> dict:
    out = tmp_path / f"zero{stage}_fragments.pt"
    result = run_two_ranks(out, script=FRAGMENTS, ZERO_STAGE=str(stage), **env)
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(out, weights_only=True)


def _assert_each_param_covered_once(mapping: dict) -> list[tuple[str, int, int]]:
    """Every parameter's fragments over both ranks hold each of its elements exactly once, and each rank
    registers every parameter once; returns the GaLore factors' cuts (name, rank, first element) where a rank's
    fragment begins or ends inside a row."""
    covered = {name: torch.zeros(math.prod(shape), dtype=torch.int64) for name, shape in mapping["params"].items()}
    cuts = []
    for rank, flats in enumerate(mapping["ranks"]):
        seen = []
        for fragments in flats:
            for name, shape, start, stop, offset, flat_numel, galore in fragments:
                assert tuple(shape) == tuple(mapping["params"][name]), (name, shape)
                assert 0 <= offset and offset + (stop - start) <= flat_numel, (name, offset, flat_numel)
                covered[name][start:stop] += 1
                seen.append(name)
                row = shape[-1]
                if galore and start < stop and (start % row or stop % row):
                    cuts.append((name, rank, start))
        # ZeRO-1/2 register every parameter of a group on its flat, also one the rank holds nothing of; ZeRO-3
        # each on the flat of its sub-group: on every rank, each parameter once
        assert sorted(seen) == sorted(mapping["params"]), (rank, sorted(seen))
    for name, counts in covered.items():
        assert bool((counts == 1).all()), f"{name}: elements held {counts.unique().tolist()} times over the ranks"
    return cuts


@pytest.mark.parametrize(
    "stage, env",
    [
        (1, {}),
        (2, {}),
        (2, {"ROUND_ROBIN": "1", "ALIGN": "1"}),  # the round-robin order, padding between the parameters
        (3, {}),
        (3, {"SUB_GROUP_SIZE": "60"}),  # several sub-groups (flats) per group
    ],
    ids=["zero1", "zero2", "zero2-round-robin-aligned", "zero3", "zero3-sub-groups"],
)
def test_fragments_hold_the_factor_values_and_cover_each_factor_once(tmp_path, stage, env):
    """Factors 33x3 (right basis), 3x33 and 3x25 (left bases): 99 + 99 + 75 elements. ZeRO-1/2 cut the group's
    flat (273, padded to 276) at 138, inside the second factor's rows (138 - 99 = 39 = 1 row + 6); ZeRO-3 cuts
    each factor at half its elements rounded up (50 of 99: 16 rows + 2 of the first factor), the last rank's part
    padded. Every rank's fragments hold exactly the parameter's elements (checked in the script on every rank, for
    the other groups' parameters too), and together they cover each parameter once."""
    mapping = _fragments(tmp_path, stage, **env)
    cuts = _assert_each_param_covered_once(mapping)
    assert cuts, "no fragment begins or ends inside a row: the sizes no longer exercise a mid-row cut"
    if stage == 3 and "SUB_GROUP_SIZE" in env:
        galore_flats = [fragments for fragments in mapping["ranks"][0] if fragments and fragments[0][-1]]
        assert len(galore_flats) > 1, "one flat for the factors: the sub-groups were not exercised"


@pytest.mark.parametrize("bug", ["offset", "skip"])
def test_a_wrong_registration_is_caught(tmp_path, bug):
    """The mapping checks catch a fragment one element late (its values are another element's) and a left-out
    fragment (its factor's elements are not covered)."""
    out = tmp_path / "broken.pt"
    result = run_two_ranks(out, script=FRAGMENTS, ZERO_STAGE="2", BREAK=bug)
    if bug == "offset":
        assert result.returncode != 0 and "AssertionError" in result.stderr, result.stderr[-2000:]
        return
    assert result.returncode == 0, result.stderr[-4000:]
    with pytest.raises(AssertionError):
        _assert_each_param_covered_once(torch.load(out, weights_only=True))


# ---------------------------------------------------------------------- training against one process
@pytest.mark.parametrize("preset", ["galore_muon", "galore_adafactor"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_two_ranks_match_single_process(tmp_path, stage, preset):
    """sharded_galore.py's run (30 steps, refreshes at 0, 10, 20) under ZeRO-1/2/3 against one process, within the
    engines' tolerances: Muon orthogonalises each factor gathered from its fragments, Adafactor sums its row and
    column statistics and its update's RMS over them, and steps every other parameter as its own tensor (the
    other groups' flats carry fragments too). Measured: losses within 1.3e-7 relative, merged weights within
    9e-8 absolute, for both presets and every stage."""
    out = tmp_path / f"zero{stage}.pt"
    result = run_two_ranks(out, ENGINE=f"zero{stage}", PRESET=preset, PROJ_TYPE="std")
    assert result.returncode == 0, result.stderr[-4000:]
    assert_matches(single_process_run(preset, "std"), torch.load(out, weights_only=True))


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_muon_staggered_resets_match_single_process(tmp_path, stage):
    """refresh_schedule='staggered' with moment_handling='reset': every refresh restarts the momentum of some
    factors of a flat partition only. Muon keeps no step count on them, so zeroing this rank's elements of the
    factor's momentum is one process's restart exactly (first calibrations: the momentum is zero already).
    Measured: losses within 2.3e-7 relative, weights within 4e-7 absolute."""
    env = {"PRESET": "galore_muon", "PROJ_TYPE": "std", "MOMENT_HANDLING": "reset", "REFRESH_SCHEDULE": "staggered"}
    result = run_one_process(tmp_path / "single.pt", ENGINE="single", **env)
    assert result.returncode == 0, result.stderr[-4000:]
    result = run_two_ranks(tmp_path / "zero.pt", ENGINE=f"zero{stage}", **env)
    assert result.returncode == 0, result.stderr[-4000:]
    single = torch.load(tmp_path / "single.pt", weights_only=True)
    assert single["refreshes"] == 9  # 3 phases x steps {p, p + 10, p + 20}
    assert_matches(single, torch.load(tmp_path / "zero.pt", weights_only=True))


# ---------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize(
    "stage, preset, load_first",
    [
        (1, "galore_muon", False),
        (2, "galore_adafactor", False),
        (3, "galore_muon", False),
        (3, "galore_adafactor", False),
        # DeepSpeed's load before the adapter registers the fragments, as in the Trainer (its DeepSpeed resume
        # runs before on_train_begin)
        (2, "galore_muon", True),
        (3, "galore_adafactor", True),
    ],
)
def test_zero_checkpoint_round_trip_resumes_bit_exact(tmp_path, stage, preset, load_first):
    """engine.save_checkpoint after 15 steps (ZeRO saves the client optimizer's state dict per rank: Muon's
    momentum, Adafactor's per-fragment statistics and step count), load_checkpoint into a fresh engine over a
    fresh model (and the GaLore layers' state), 15 more steps (a refresh among them): the same losses and
    weights, bit for bit, as the run that went on."""
    env = {"LOAD_FIRST": "1"} if load_first else {}
    out = tmp_path / "resume.pt"
    result = run_two_ranks(out, script=SCRIPT.with_name("zero_resume.py"), ENGINE=f"zero{stage}", PRESET=preset, **env)
    assert result.returncode == 0, result.stderr[-4000:]
    run = torch.load(out, weights_only=True)
    assert run["resumed_losses"] == run["losses"]
    assert run["resumed_weights"].keys() == run["weights"].keys()
    for key, value in run["weights"].items():
        assert torch.equal(run["resumed_weights"][key], value), key


# ---------------------------------------------------------------------- what runs, what is refused
def test_the_trainer_accepts_both_optimizers_under_every_zero_stage():
    from hf_galore_plugin.integrations.construction import check_training_args

    class ZeRO:
        fsdp = None

        def __init__(self, stage):
            self.deepspeed = {"zero_optimization": {"stage": stage}}

    for inner in ("muon", "adafactor"):
        for stage in (1, 2, 3):
            check_training_args(ZeRO(stage), f"galore_{inner}", GaLoreConfig.preset(f"galore_{inner}"))


def _stand_in_engine(model, optimizer, stage=2):
    """A DeepSpeed engine as the adapter reads it, whose optimizer is not one of DeepSpeed's ZeRO optimizers."""
    return SimpleNamespace(
        zero_optimization_stage=lambda: stage, module=model, optimizer=SimpleNamespace(optimizer=optimizer)
    )


def _prepared(preset: str, **config):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 33), nn.Tanh(), nn.Linear(33, 25), nn.Tanh(), nn.Linear(25, 8))
    return prepare_model(model, GaLoreConfig.preset(preset, rank=4, target_modules=["0", "2"], **config))


@pytest.mark.parametrize("schedule, refused", [("staggered", True), ("aligned", False)])
def test_adafactor_staggered_reset_refreshes_are_refused_at_the_adapter(schedule, refused):
    """Adafactor keeps row and column statistics per fragment and one step count per flat partition: a staggered
    reset refresh restarts some factors of a flat only, many steps into the run, which would need its own reset
    of one matrix: refused at the adapter, naming the settings and what runs instead. Aligned, every factor of a
    flat restarts together (the client's own reset_state of the flat): not refused here (the stand-in engine is
    then refused for its unknown layout, the next check)."""
    from hf_galore_plugin.engines.deepspeed import DeepSpeedGaLoreOptimizer

    model = _prepared("galore_adafactor", moment_handling="reset", refresh_schedule=schedule)
    engine = _stand_in_engine(model, create_optimizer(model, lr=1e-3))
    named = "moment_handling='reset' with refresh_schedule='staggered' under DeepSpeed ZeRO.*'adafactor'"
    with pytest.raises(NotImplementedError, match=named if refused else "in a way GaLore does not know"):
        DeepSpeedGaLoreOptimizer(engine)


def test_an_unknown_partition_layout_is_refused_for_muon_and_adafactor():
    """Without DeepSpeed's ZeRO optimizer (whose layout the adapter reads) nothing says where the factors' rows
    are: Muon and Adafactor are refused by name, galore_adamw (elementwise) runs."""
    from hf_galore_plugin.engines.deepspeed import DeepSpeedGaLoreOptimizer

    for preset in ("galore_muon", "galore_adafactor"):
        model = _prepared(preset)
        with pytest.raises(
            NotImplementedError, match=f"inner_optimizer='{preset[7:]}' under DeepSpeed ZeRO.*galore_adamw"
        ):
            DeepSpeedGaLoreOptimizer(_stand_in_engine(model, create_optimizer(model, lr=1e-3)))
    model = _prepared("galore_adamw")
    assert DeepSpeedGaLoreOptimizer(_stand_in_engine(model, create_optimizer(model, lr=1e-3))).registered_flats == []


def test_parameters_tagged_for_deepspeeds_own_muon_are_refused():
    """DeepSpeed's ZeRO-1/2 orthogonalise the gradient of a parameter tagged use_muon themselves when the client
    optimizer's class name contains "muon" (``_is_muon_group``): with the GaLore Muon that would orthogonalise
    twice. deepspeed.initialize tags parameters only for its config's own Muon ("optimizer": {"type": "Muon"}),
    never with a client optimizer; a tag set by hand is refused."""
    from hf_galore_plugin.engines.deepspeed import DeepSpeedGaLoreOptimizer

    model = _prepared("galore_muon")
    optimizer = create_optimizer(model, lr=1e-3)
    assert "muon" in type(optimizer).__name__.lower()  # what DeepSpeed's detection reads
    model[4].weight.use_muon = True
    with pytest.raises(ValueError, match=r"use_muon=True \(4.weight\).*its own Muon"):
        DeepSpeedGaLoreOptimizer(_stand_in_engine(model, optimizer))


@pytest.mark.parametrize("preset", ["galore_muon", "galore_adafactor"])
def test_project_stays_refused_under_zero(preset):
    from hf_galore_plugin.engines.deepspeed import DeepSpeedGaLoreOptimizer

    model = _prepared(preset, moment_handling="project")
    with pytest.raises(UnsupportedByEngine, match="moment_handling='project' is not supported under DeepSpeed ZeRO-2"):
        DeepSpeedGaLoreOptimizer(_stand_in_engine(model, create_optimizer(model, lr=1e-3)))

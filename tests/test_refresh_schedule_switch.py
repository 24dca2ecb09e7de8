"""A `refresh_schedule` changed on resume takes effect at the resumed step, in both directions.

Oracles: a run of the same settings switched by hand at that step (below), bit for bit; the refresh steps
the rule in docs/guides/checkpoints.md "What may change between runs" gives, written out per case; the unchanged run, which the switched run must differ from.

"Switched by hand at step k": the same Trainer run, where at the end of optimizer step k (``global_step ==
k``, before step k's forward) every GaLore layer is given the new configuration and the phases are assigned
anew with ``hf_galore_plugin.layers.assign_refresh_phases``, as ``prepare_model`` does with a configuration.
The resumed run instead resumes ``checkpoint-k`` of the unchanged run with the new ``optim_args``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")
from conftest import build_tiny_llama, token_data, training_args  # noqa: E402
from transformers import Trainer  # noqa: E402

import hf_galore_plugin as hgp  # noqa: E402
from hf_galore_plugin.layers import assign_refresh_phases  # noqa: E402
from hf_galore_plugin.layers import schedule  # noqa: E402

SMALL_LLAMA = dict(
    hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
    vocab_size=128, max_position_embeddings=32,
)  # fmt: skip
GAP = 6
STEPS = 19  # optimizer steps 0-18: three grid steps of the gap after the switch (6, 12, 18)
# On its refresh step each of the 7 linears holds a 1536-byte sketch (rank 4 + 8 columns x 32) and its input
# of 32 fp32 tokens (refresh_tokens: 4 x 8): 5632 bytes (input width 32) or 9728 (down_proj, width 64). A
# budget of two of the first packs them into 4 phases (0-3), so the two schedules refresh on different steps.
BUDGET_MB = 2 * 5632 / 2**20
STAGGERED = f"rank=4,update_proj_gap={GAP},refresh_schedule=staggered,refresh_budget_mb={BUDGET_MB!r},refresh_tokens=32"
ALIGNED = f"rank=4,update_proj_gap={GAP},refresh_schedule=aligned"
NEW_CONFIG = {
    "aligned": {"refresh_schedule": "aligned", "refresh_budget_mb": None, "refresh_tokens": None},
    "staggered": {"refresh_schedule": "staggered", "refresh_budget_mb": BUDGET_MB, "refresh_tokens": 32},
}


class _RefreshLog(transformers.TrainerCallback):
    """(layer, galore step) of every refresh (GaLoreCallback, which the plugin puts first, has stepped the
    layers); with `switch`, the hand switch at global step `switch[0]` to the settings `switch[1]`."""

    def __init__(self, switch=None):
        self.events: set[tuple[str, int]] = set()
        self.switch = switch

    def on_step_end(self, args, state, control, model=None, **kwargs):
        for name, layer in hgp.galore_layers(model):
            step = layer.counter("galore_step") - 1  # after_step has counted the step it refreshed in
            if layer.counter("galore_last_refresh") == step:
                self.events.add((name, step))
        if self.switch is not None and state.global_step == self.switch[0]:
            prepared = hgp.state_of(model)
            config = prepared.config = prepared.config.replace(**self.switch[1])
            layers = [layer for _, layer in hgp.galore_layers(model)]
            for layer in layers:
                layer.config = config
            assign_refresh_phases(layers)


def _trainer(output_dir, optim_args, **overrides) -> Trainer:
    args = training_args(output_dir, optim_args=optim_args, max_steps=STEPS, **overrides)
    return Trainer(model=build_tiny_llama(seed=0, **SMALL_LLAMA), args=args, train_dataset=token_data(32, 8, vocab=128))


def _train(trainer: Trainer, **train_kwargs) -> _RefreshLog:
    log = trainer.callback_handler.callbacks[-1]
    trainer.train(**train_kwargs)
    return log


@pytest.mark.parametrize(
    "before, after, switch, expected",
    [
        # staggered (phase p: calibration at p, refresh at 6 + p) -> aligned at step 8: a layer refreshes on
        # the first multiple of the gap at least the gap after its last refresh (phase 1: 7 -> 18, the others
        # 12), then every layer on every multiple: 18 holds all of them.
        ("staggered", "aligned", 8, {0: [12, 18], 1: [18], 2: [12, 18], 3: [12, 18]}),
        # ... at step 2, before phases 2 and 3 calibrated: those calibrate at once (aligned: the first step).
        ("staggered", "aligned", 2, {0: [6, 12, 18], 1: [12, 18], 2: [2, 12, 18], 3: [2, 12, 18]}),
        # aligned (refreshes at 0 and 6) -> staggered at step 8: phase p refreshes next at 12 + p.
        ("aligned", "staggered", 8, {0: [12, 18], 1: [13], 2: [14], 3: [15]}),
    ],
)
def test_schedule_changed_on_resume_equals_the_run_switched_by_hand(tmp_path, before, after, switch, expected):
    args = {"staggered": STAGGERED, "aligned": ALIGNED}
    unchanged = _trainer(tmp_path / "unchanged", args[before], save_strategy="steps", save_steps=switch)
    unchanged.add_callback(_RefreshLog())
    unchanged_log = _train(unchanged)
    by_hand = _trainer(tmp_path / "by_hand", args[before])
    by_hand.add_callback(_RefreshLog(switch=(switch, NEW_CONFIG[after])))
    by_hand_log = _train(by_hand)
    resumed = _trainer(tmp_path / "resumed", args[after])
    resumed.add_callback(_RefreshLog())
    resumed_log = _train(resumed, resume_from_checkpoint=str(tmp_path / "unchanged" / f"checkpoint-{switch}"))

    # The layers' phases under the staggered settings (the same packing in every run).
    staggered_model = unchanged.model if before == "staggered" else resumed.model
    phases = {name: layer.counter("galore_phase") for name, layer in hgp.galore_layers(staggered_model)}
    assert sorted(set(phases.values())) == [0, 1, 2, 3]
    want = {(name, step) for name, phase in phases.items() for step in expected[phase]}
    assert resumed_log.events == want
    assert {event for event in by_hand_log.events if event[1] >= switch} == want
    if after == "aligned":
        assert all(layer.counter("galore_phase") == 0 for _, layer in hgp.galore_layers(resumed.model))
    assert {event for event in unchanged_log.events if event[1] >= switch} != want  # the switch changes the steps

    expected_state = by_hand.model.state_dict()
    unchanged_state = unchanged.model.state_dict()
    for key, value in resumed.model.state_dict().items():
        assert torch.equal(value, expected_state[key]), key
    assert not all(torch.equal(value, unchanged_state[key]) for key, value in resumed.model.state_dict().items())


# ---------------------------------------------------------------------- the rule (pure functions)
def test_aligned_rule_keeps_to_the_multiples_of_the_gap_whatever_the_last_refresh_and_phase_counter():
    aligned = schedule.Schedule(staggered=False, period=6, needs_basis=True)
    # Last refresh at 7 (a staggered phase-1 layer), its phase counter still 1 or already 0: the next
    # refresh is the first multiple of 6 at least 6 steps later, 18, not 13.
    for phase in (0, 1):
        counters = schedule.Counters(step=8, last_refresh=7, num_refreshes=2, gap=6, phase=phase)
        due = [s for s in range(8, 30) if schedule.refresh_due(dataclasses.replace(counters, step=s), aligned)]
        assert due[0] == 18 and all(s % 6 == 0 for s in due)
        assert schedule.next_refresh_step(counters, aligned) == 18
    # A last refresh on the grid (every aligned run from its start): the gap itself, as before.
    counters = schedule.Counters(step=7, last_refresh=6, num_refreshes=2, gap=6, phase=0)
    assert schedule.next_refresh_step(counters, aligned) == 12

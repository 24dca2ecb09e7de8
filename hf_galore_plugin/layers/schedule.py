"""When a GaLore layer refreshes its basis: the refresh-due rule and the staggered phases.

A calibrated layer refreshes only on the steps of its schedule's grid, once its (lazy) gap has passed
since its last refresh: under ``refresh_schedule='aligned'`` the grid is the multiples of update_proj_gap
(the same steps for every layer), under ``'staggered'`` the steps == the layer's phase (``galore_phase``)
modulo update_proj_gap; :func:`assign_refresh_phases` packs the layers' refresh records into phases so that
one step holds at most the budget (docs/guides/options.md "Refresh memory"). The grid is read from the schedule
in force, not from the counters, so a run whose schedule changed (a resume with other settings) keeps to
the new grid from then on, whatever steps its last refreshes fell on.

What a phase holds is everything its recording layers keep on the refresh step beyond an ordinary step:
their records (``refresh_record_nbytes()``) and the inputs kept for them (a recording layer keeps its whole
input x from its forward to its backward, where an ordinary step keeps x Q), whose bytes depend on the tokens
of one forward. ``refresh_tokens`` gives them; without it the phases are packed by the records when the model
is prepared and again at its first training forward (:class:`PendingPacking`, the largest token count of the
data-parallel ranks), before any layer of that step records. A load of saved phases keeps them instead.

The rule is two pure functions of a :class:`Counters` snapshot and a layer's fixed :class:`Schedule`
(testable without a layer); the phase assignment takes the layers (their ``refresh_record_nbytes()``,
``kept_input_nbytes()`` and :meth:`~hf_galore_plugin.layers.GaLoreLinear.set_refresh_phase`). Only the one
packing at the first training forward runs inside a training step; an ordinary step reads one attribute.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = [
    "Counters",
    "PendingPacking",
    "Schedule",
    "StepClock",
    "StepTokens",
    "assign_refresh_phases",
    "grid_phase",
    "next_refresh_step",
    "pack_refresh_phases",
    "refresh_due",
    "refresh_hold_nbytes",
    "refresh_phase_capacity",
]


class StepClock:
    """The optimizer steps taken, counted once for every layer that reads it. A layer owns one until its
    model's step driver (``api.after_step``) gives all its layers one shared clock (`shared`), which the
    driver ticks once a step: an ordinary step then costs one addition, whatever the number of layers."""

    __slots__ = ("edits", "shared", "step")

    # Bumped whenever a GaLore layer is built or a module of a model is swapped (inject.swap_submodule): a
    # step driver that cached a model's layers re-reads them when it changed.
    generation = 0

    def __init__(self, *, shared: bool = False) -> None:
        self.step = 0
        self.shared = shared
        # Bumped whenever a layer's counters are set outside the clock's ticks (a refresh, a load, a
        # changed setting): the driver's earliest due step is recomputed then.
        self.edits = 0


@dataclass(frozen=True)
class Schedule:
    """What the refresh rule reads besides the counters; fixed for a layer (from its config and shape)."""

    staggered: bool  # refresh_schedule == "staggered"
    period: int  # update_proj_gap: the staggered phases repeat with it
    needs_basis: bool  # False for a layer whose every side is the identity (nothing to refresh)


@dataclass(frozen=True)
class Counters:
    """The counters the refresh rule reads, as their host copies hold them now (``GaLoreLinear.counters()``)."""

    step: int  # galore_step
    last_refresh: int  # galore_last_refresh (-1: never)
    num_refreshes: int  # galore_num_refreshes (0: not calibrated yet)
    gap: int  # galore_gap: the lazy gap, a multiple of period under staggered
    phase: int  # galore_phase (0 under aligned)


def grid_phase(counters: Counters, schedule: Schedule) -> int:
    """The step (modulo ``schedule.period``) on which a calibrated layer may refresh: its phase under
    'staggered', 0 under 'aligned' (every layer on the same steps). Taken from the schedule, not from the
    phase counter alone: a layer whose last refreshes followed another schedule refreshes next on this
    schedule's steps."""
    return counters.phase if schedule.staggered else 0


def refresh_due(counters: Counters, schedule: Schedule) -> bool:
    """Whether the step `counters.step` must record the layer's gradient for a new basis.

    Calibration: aligned at the first step that reaches the layer; staggered (docs/guides/options.md "Refresh
    memory") at step == phase or the first step after it that reaches the layer. Then a refresh only at
    steps == :func:`grid_phase` (mod period) at least the (lazy) gap after the last refresh. Staggered phases
    come from :func:`assign_refresh_phases`, which packs the layers so that one phase's records fit the
    budget: holding to the phase keeps every step within it (a lazily grown gap, or one clipped to a
    max_proj_gap that is no multiple of the gap, waits for the next step of its phase). Aligned layers hold to
    the multiples of the period in the same way, so they refresh together, also after a switch from
    'staggered' (a layer whose last refresh fell between them waits for the first one at least its gap
    later). With every phase 0 the staggered rule is the aligned one."""
    if not schedule.needs_basis:
        return False
    step = counters.step
    if counters.num_refreshes == 0:
        return step >= counters.phase if schedule.staggered else True
    if (step - grid_phase(counters, schedule)) % schedule.period != 0:
        return False
    return step - counters.last_refresh >= counters.gap


def next_refresh_step(counters: Counters, schedule: Schedule) -> Optional[int]:
    """The first step from `counters.step` on at which :func:`refresh_due` holds if only the step advances
    (None: never). The step driver skips a model's layers until the earliest of these (tests check it
    against the rule step by step)."""
    if not schedule.needs_basis:
        return None
    step = counters.step
    if counters.num_refreshes == 0:
        return max(step, counters.phase) if schedule.staggered else step
    first = max(step, counters.last_refresh + counters.gap)
    return first + (grid_phase(counters, schedule) - first) % schedule.period


@dataclass(frozen=True)
class StepTokens:
    """The size of one forward's input to the layers: what a recording layer keeps until its backward."""

    tokens: int  # rows of a linear layer's input in one forward (micro-batch x sequence) on one rank
    itemsize: int  # bytes per value of the input as the layer receives it


def refresh_hold_nbytes(layer: Any, inputs: Optional[StepTokens]) -> int:
    """Bytes a refresh step holds for `layer` beyond an ordinary step: its record (the fp32 gradient or
    sketches, from its backward to the refresh) and, given `inputs`, the input it keeps for the record
    (``layer.kept_input_nbytes``). A layer with nothing to refresh holds nothing. Layers that read the same
    input (q, k and v) each count it: a bound, never an underestimate."""
    record = layer.refresh_record_nbytes()
    if record == 0 or inputs is None:
        return record
    return record + layer.kept_input_nbytes(inputs.tokens, inputs.itemsize)


def refresh_phase_capacity(config, layers: list[Any], costs: list[int]) -> int:
    """Most bytes one staggered phase may hold (`costs`: :func:`refresh_hold_nbytes` per layer):
    ``refresh_budget_mb``, by default the largest targeted layer's dense fp32 gradient; never less than
    the largest single layer's."""
    if config.refresh_budget_mb is not None:
        budget = int(config.refresh_budget_mb * 2**20)
    else:
        budget = max((4 * layer.out_features * layer.in_features for layer in layers if layer.needs_basis), default=0)
    return max(budget, *costs) if costs else budget


def pack_refresh_phases(costs: list[int], capacity: int, gap: int) -> tuple[list[int], bool]:
    """Phases for records of `costs` bytes (0: no record): first-fit decreasing into the fewest phases of
    `capacity` bytes, then spread largest-first onto the lightest phase where that still fits. Returns
    (phase per cost, overflow): with more phases than `gap` the records are balanced over `gap` phases
    and overflow is True. Deterministic: ties are broken by position."""
    order = sorted((i for i in range(len(costs)) if costs[i] > 0), key=lambda i: (-costs[i], i))

    def pack_first_fit() -> list[int]:
        loads: list[int] = []
        phase_of = [0] * len(costs)
        for i in order:
            phase = next((p for p, load in enumerate(loads) if load + costs[i] <= capacity), len(loads))
            if phase == len(loads):
                loads.append(0)
            loads[phase] += costs[i]
            phase_of[i] = phase
        return phase_of

    def pack_balanced(count: int) -> list[int]:
        loads, phase_of = [0] * count, [0] * len(costs)
        for i in order:
            phase = min(range(count), key=lambda p: (loads[p], p))
            loads[phase] += costs[i]
            phase_of[i] = phase
        return phase_of

    def peak(phase_of: list[int]) -> int:
        loads: dict[int, int] = {}
        for i, phase in enumerate(phase_of):
            loads[phase] = loads.get(phase, 0) + costs[i]
        return max(loads.values(), default=0)

    phase_of = pack_first_fit()
    count = max(phase_of, default=0) + 1
    if count > gap:
        return pack_balanced(gap), True
    balanced = pack_balanced(count)
    return (balanced if peak(balanced) <= capacity else phase_of), False


def assign_refresh_phases(layers: list[Any], inputs: Optional[StepTokens] = None) -> list[int]:
    """Give each layer its refresh phase (``galore_phase``) under refresh_schedule='staggered'; returns the
    phases in the layers' order (all 0 under 'aligned'), readable also for layers on the meta device.

    Rule: what each layer holds on its refresh step (:func:`refresh_hold_nbytes`: its record and its kept
    input at `inputs`, else at ``refresh_tokens``) is packed into the fewest phases that fit the budget
    (``refresh_budget_mb``; default the largest layer's dense fp32 gradient; a layer above it gets a phase to
    itself) by first-fit decreasing, then spread over that many phases by largest-first onto the lightest
    phase when that still fits, so the steps carry about equal bytes. More phases than update_proj_gap steps
    cannot exist: the layers are then balanced over update_proj_gap phases and the budget is exceeded (a
    warning says by how much). Deterministic (ties broken by the layers' order), so every data-parallel rank
    computes the same phases from the same tokens.

    Without either token count the phases are packed by the records for now and packed again at the first
    training forward of any of the layers (:class:`PendingPacking`), with the tokens and dtype of its input.
    """
    layers = list(layers)
    if not layers:
        return []
    PendingPacking.cancel(layers)
    config = layers[0].config
    if config.refresh_schedule != "staggered":
        for layer in layers:
            layer.set_refresh_phase(0)
        return [0] * len(layers)
    if inputs is None and config.refresh_tokens is not None:
        inputs = StepTokens(config.refresh_tokens, layers[0].galore_factor.element_size())
    costs = [refresh_hold_nbytes(layer, inputs) for layer in layers]
    capacity = refresh_phase_capacity(config, layers, costs)
    phase_of, overflow = pack_refresh_phases(costs, capacity, config.update_proj_gap)
    if overflow:
        loads: dict[int, int] = {}
        for i, phase in enumerate(phase_of):
            loads[phase] = loads.get(phase, 0) + costs[i]
        held = "records" if inputs is None else f"records and inputs of {inputs.tokens} tokens"
        warnings.warn(
            f"refresh_schedule='staggered': the {held} of {sum(c > 0 for c in costs)} layers do not fit "
            f"update_proj_gap={config.update_proj_gap} phases of {capacity / 2**20:.1f} MiB; the largest phase "
            f"holds {max(loads.values()) / 2**20:.1f} MiB. Raise refresh_budget_mb or update_proj_gap, or use "
            "basis_method='sketch' (smaller records) or fewer tokens per micro-batch (smaller inputs)",
            stacklevel=2,
        )
    for layer, phase in zip(layers, phase_of):
        layer.set_refresh_phase(phase)
    if inputs is None:
        pending = PendingPacking(layers)
        for layer in layers:
            layer.pending_phase_packing = pending
    return phase_of


class PendingPacking:
    """The layers of one :func:`assign_refresh_phases` whose phases wait for the first training forward.

    Every layer of the group holds it as ``pending_phase_packing`` until the packing: a layer's training
    forward (or, compiled, its record op) calls :meth:`pack` with its input, which packs the whole group
    with that input's tokens, agreed across data-parallel ranks (their largest), and clears the attribute on
    every layer. An explicit phase (``set_refresh_phase``) or a load of saved phases cancels it."""

    def __init__(self, layers: list[Any]) -> None:
        self.layers = layers

    def pack(self, x: torch.Tensor, *, rows_per_token: int = 1) -> None:
        """Pack with the size of `x`, an input of `rows_per_token` rows per token (an expert stack's
        share of the rows routed to all experts)."""
        rows = x.numel() // max(x.shape[-1], 1) if x.dim() else 1
        tokens = _largest_across_ranks(max(rows // max(rows_per_token, 1), 1), x.device)
        assign_refresh_phases(self.layers, StepTokens(tokens, x.element_size()))

    @staticmethod
    def cancel(layers: list[Any]) -> None:
        """Cancel the pending packing of every group a layer of `layers` belongs to (its phases stand)."""
        for layer in layers:
            pending = getattr(layer, "pending_phase_packing", None)
            if pending is not None:
                for member in pending.layers:
                    member.pending_phase_packing = None


def _largest_across_ranks(tokens: int, device: torch.device) -> int:
    # The phases pair the ranks' refresh collectives, so every rank packs with the same count: the largest
    # (each rank's first batch may be padded to another length). Memory is per rank, so it is a rank's count.
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return tokens
    backend = dist.get_backend()
    on = device if backend != "gloo" else torch.device("cpu")
    value = torch.tensor([tokens], dtype=torch.int64, device=on)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())

"""What every GaLore layer kind holds besides its tensors: the schedule counters and the refresh's plumbing.

:class:`GaLoreLayerBase` builds on :class:`~.weights.GaLoreWeights` (W0, the bases, the factor, alpha) and adds
the counters (:class:`~.counters.LayerCounters`), the refresh record, when the layer is due (:mod:`.schedule`'s
rule), the step (:meth:`GaLoreLayerBase.after_optimizer_step`), a new layer's state, and the load of a state
dict. The layer kinds (:class:`~.linear.GaLoreLinear`, :class:`~.experts.GaLoreExpertStack`) call its
``__init__`` with their weight and rank; the refreshers (:mod:`.refresh`, :mod:`.expert_refresh`) and the
rank (:mod:`.rank`) use its public members.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Optional, Union

import torch
from torch import nn

from ..config import GaLoreConfig
from . import rank as _rank_mod
from . import refresh as _refresh_mod
from . import schedule as _schedule
from .counters import LayerCounters
from .function import register_recorder
from .schedule import StepClock
from .weights import GaLoreWeights

__all__ = ["GaLoreLayerBase"]

# What a refresh step's backward records for the next basis: the dense fp32 gradient, or with
# basis_method='sketch' a dict side -> sketch.
Record = Optional[Union[torch.Tensor, dict[str, torch.Tensor]]]


def _write_lazy_buffers(layer: "GaLoreLayerBase", prefix: str, keep_vars: bool) -> None:
    # state_dict pre-hook: the buffer of galore_step is written when it is read out (every save path calls
    # state_dict(): torch, the engines, the Trainer integration).
    layer.counts.write_step()


class GaLoreLayerBase(GaLoreWeights):
    """The counters and the refresh plumbing of a GaLore layer; see the module docstring.

    The counters (:data:`~.counters.COUNTER_NAMES`) are read from host copies (:meth:`counter`), never from the
    buffers, so a training step makes no device sync for them. The layer writes both at once and re-reads
    the buffers whenever a load replaces them (``load_state_dict``, including the engines' and the Trainer
    integration's loads). Code that writes a counter buffer directly (``fill_``, ``copy_``, an in-place
    ``torch.distributed.checkpoint`` load without ``load_state_dict``) must call :meth:`sync_counters`
    afterwards; a refresh compares the buffers with the host copies (it syncs the device anyway) and warns
    when they differ.
    """

    # The counter buffers and the other buffers the class registers, for type checkers.
    galore_step: torch.Tensor
    galore_last_refresh: torch.Tensor
    galore_num_refreshes: torch.Tensor
    galore_gap: torch.Tensor
    galore_agree_count: torch.Tensor
    galore_last_similarity: torch.Tensor
    galore_seed: torch.Tensor
    galore_rng_counter: torch.Tensor
    galore_phase: torch.Tensor
    # rank_allocation='auto' (layers/rank.py): the calibration gradient's squared singular values and whole
    # energy, and the rank the allocator gave the layer (0: none yet). Registered on adaptive layers only.
    galore_spectrum: torch.Tensor
    galore_spectrum_total: torch.Tensor
    galore_rank_target: torch.Tensor
    # rank_allocation='auto': the layer's rank state (layers/rank.py); None: the rank is fixed.
    _adaptive: Optional[_rank_mod.AdaptiveRank] = None

    def __init__(
        self,
        weight: torch.Tensor,
        config: GaLoreConfig,
        *,
        rank: int,
        layer_index: int,
        bias: Optional[nn.Parameter],
    ) -> None:
        """A layer of rank `rank` taking over `weight` (..., m, n: each m x n slice an ``nn.Linear`` weight, out x
        in) as its W0, with `bias` (None: none); `layer_index` seeds its random stream."""
        super().__init__(weight, config, rank=rank, bias=bias)
        self._init_step_state(config, layer_index, weight.device, base_is_meta=weight.is_meta)

    def _init_step_state(
        self, config: GaLoreConfig, layer_index: int, device: torch.device, *, base_is_meta: bool
    ) -> None:
        """The layer's schedule state: the counters (buffers, host copies, step clock), the refresh record."""

        def buf(value, dtype):
            return torch.tensor(value, dtype=dtype, device=device)

        seed = config.seed * 1_000_003 + layer_index
        initial = {
            "galore_step": 0,
            "galore_last_refresh": -1,
            "galore_num_refreshes": 0,
            "galore_gap": config.update_proj_gap,
            "galore_agree_count": 0,
            "galore_seed": seed,
            "galore_rng_counter": 0,
            "galore_phase": 0,
        }
        # A new layer has no basis yet: it records on its first step (known without reading a buffer,
        # which on the meta device would fail).
        self.counts = LayerCounters(self, initial, due=self.needs_basis)

        # Registered in this order (the state-dict layout of checkpoints).
        self.register_buffer("galore_step", buf(initial["galore_step"], torch.int64))
        self.register_buffer("galore_last_refresh", buf(initial["galore_last_refresh"], torch.int64))
        self.register_buffer("galore_num_refreshes", buf(initial["galore_num_refreshes"], torch.int64))
        self.register_buffer("galore_gap", buf(initial["galore_gap"], torch.int64))
        self.register_buffer("galore_agree_count", buf(initial["galore_agree_count"], torch.int64))
        self.register_buffer("galore_last_similarity", buf(float("nan"), torch.float32))
        # Randomness (stochastic rounding, randomized SVD) comes from (seed, layer, counter): the same on
        # every data-parallel rank, device independent, and exactly restored from a checkpoint.
        self.register_buffer("galore_seed", buf(seed, torch.int64))
        self.register_buffer("galore_rng_counter", buf(initial["galore_rng_counter"], torch.int64))
        # The step (modulo update_proj_gap) of this layer's calibration and refreshes under
        # refresh_schedule='staggered' (set for all layers at once by assign_refresh_phases); 0 = aligned.
        self.register_buffer("galore_phase", buf(initial["galore_phase"], torch.int64))
        self._phase = 0  # the phase as a Python int, to restore the buffer after to_empty() (meta device)
        # Set while the staggered phases wait for the model's first training forward to be packed with its
        # tokens (schedule.PendingPacking, shared by the layers packed together); None otherwise.
        self.pending_phase_packing: Optional[_schedule.PendingPacking] = None
        # What this step's backward recorded for the next basis: the dense fp32 gradient (m x n), or with
        # basis_method='sketch' a dict side -> sketch (the basis side's dimension x k). It lives from the
        # step's first backward to its after_optimizer_step, so a checkpoint (taken between steps) never
        # holds one; it is not a buffer because DDP broadcasts buffers from rank 0 at every forward, which
        # would overwrite the other ranks' partial records during gradient accumulation.
        self._pending_grad: Record = None
        self._layer_index = layer_index
        # Built on the meta device: after to_empty() every buffer holds uninitialised memory until
        # reset_galore_state() (create_optimizer calls it) or a load of the layer's own state.
        self._built_on_meta = base_is_meta
        # Whether W0 holds values after to_empty(): set by a load of the weight and by initialize_base
        # (create_optimizer refuses a materialised layer without either).
        self._base_initialised = not base_is_meta
        # A compiled forward reads this flag, not refresh_due (function.py, "the refresh record, compiled"):
        # True while any layer of the model may record this step. The step driver (api.after_step) sets it
        # alike on every layer of a model; a layer that finds itself due sets its own. A layer stepped
        # without the driver keeps it True (compiled, it pays the record ops' copies on every step).
        self.compiled_record = True
        self.recorder_id = register_recorder(self)
        StepClock.generation += 1
        self.register_state_dict_pre_hook(_write_lazy_buffers)

    # ------------------------------------------------------------------ initialisation
    @torch.no_grad()
    def reset_galore_state(self) -> None:
        """Set the layer's own state (factor, bases, multiplier, counters, seed) to that of a new layer;
        W0 and the bias are left as they are (loaded weights). For a model prepared on the meta device
        and materialised with ``to_empty()``."""
        _rank_mod.reset(self)
        self.galore_factor.zero_()
        for side, dim, rank, identity in (
            ("left", self.out_features, self.left_rank, self.left_identity),
            ("right", self.in_features, self.right_rank, self.right_identity),
        ):
            if rank is not None and not identity:
                shape = self.basis_shape(dim, rank)
                self.set_basis(side, torch.zeros(shape, device=self.galore_factor.device, dtype=torch.float32))
        if self._folded_side is not None:
            self.galore_folded_scale.fill_(self.scale)
        self.reset_alpha()
        counts = self.counts
        counts.set("galore_step", 0)
        counts.set("galore_last_refresh", -1)
        counts.set("galore_num_refreshes", 0)
        counts.set("galore_gap", self.config.update_proj_gap)
        counts.set("galore_agree_count", 0)
        self.galore_last_similarity.fill_(float("nan"))
        counts.set("galore_seed", self.config.seed * 1_000_003 + self._layer_index)
        counts.set("galore_rng_counter", 0)
        counts.set("galore_phase", self._phase)
        self._pending_grad = None
        self._reset_kind_state()
        self.update_refresh_due()
        self._built_on_meta = False

    def _reset_kind_state(self) -> None:
        """A new layer's state of what a layer kind adds (reset_galore_state, after the counters)."""

    # ------------------------------------------------------------------ counters
    def counter(self, name: str) -> int:
        """The value of the counter buffer `name` (one of :data:`~.counters.COUNTER_NAMES`) from its host copy:
        no device sync."""
        return self.counts.get(name)

    # The writes of LayerCounters under the layer's own names (a resume with changed settings uses them).
    def _set_counter(self, name: str, value: int) -> None:
        self.counts.set(name, value)

    def _add_counter(self, name: str, delta: int = 1) -> None:
        self.counts.add(name, delta)

    def sync_counters(self) -> None:
        """Re-read the host copies of the counters from the buffers (one device sync) and re-evaluate
        ``refresh_due``. ``load_state_dict`` does it; call it after writing a counter buffer directly.
        Buffers on the meta device or fake tensors hold no values: the host copies are kept then.

        ``galore_step``'s buffer is written when the layer's state is read out (``state_dict()``, a
        refresh), not at every step: here it is taken only if it holds another value than the layer last
        wrote to it (a direct write); a load always takes it. A phase written this way stands: the packing
        at the first training forward (:class:`~.schedule.PendingPacking`) is cancelled."""
        phase = self.counts.values["galore_phase"]
        self._read_counter_buffers(loaded=False)
        if self.counts.values["galore_phase"] != phase:
            _schedule.PendingPacking.cancel([self])

    @torch.no_grad()
    def _read_counter_buffers(self, *, loaded: bool) -> None:
        if self.counts.read_buffers(loaded=loaded):
            self._alpha = float(self.base_multiplier.detach().reshape(()).item())
        self.update_refresh_due()

    def adopt_counter_writes(self) -> None:
        """Called where the device syncs anyway (a refresh): take counter values written to the buffers
        without :meth:`sync_counters`, and say so (decisions since that write used the old values)."""
        before = self.counts.snapshot()
        self.sync_counters()
        changed = self.counts.changes(before)
        if changed:
            warnings.warn(
                f"GaLore layer {self.out_features}x{self.in_features}: counter buffers were written without "
                f"sync_counters() ({'; '.join(changed)}); the buffers' values are taken from this refresh on. "
                "Call layer.sync_counters() after writing galore_* counter buffers directly",
                RuntimeWarning,
                stacklevel=4,
            )

    def use_clock(self, clock: StepClock) -> None:
        """Advance ``galore_step`` with `clock` (the model's, shared by its layers) from now on instead of the
        layer's own; the current value is kept."""
        self.counts.use_clock(clock)

    @property
    def _clock(self) -> StepClock:
        # The clock galore_step advances with (the step driver checks that its layers share its own).
        return self.counts.clock

    @property
    def _refresh_due_cache(self) -> Optional[bool]:
        # refresh_due as last evaluated (None: to be re-evaluated), read by the step driver.
        return self.counts.due

    # ------------------------------------------------------------------ random stream, W0
    def next_generator(self, device: torch.device) -> torch.Generator:
        """The layer's next random generator (stochastic rounding, randomized SVD), from its seed and counter."""
        values = self.counts.values
        generator = torch.Generator(device=device)
        generator.manual_seed(values["galore_seed"] * 1_000_033 + values["galore_rng_counter"])
        self.counts.add("galore_rng_counter")
        return generator

    def store_weight(self, value: torch.Tensor, *, measure: bool = True) -> None:
        """Quantize `value` into W0's buffers; stochastically rounded (config.stochastic_rounding) once the
        layer has its random stream, i.e. for every W0 but the one it was built from. `measure`: record the
        quantization error (a host read)."""
        stochastic = self.config.stochastic_rounding and hasattr(self, "galore_seed")
        assert self._weight_store is not None, "W0 is a plain parameter: assign it, there is nothing to quantize"
        generator = self.next_generator(value.device) if stochastic else None
        self._weight_store.store(value, generator=generator, measure=measure)

    _store_weight = store_weight  # also under the name the tests call

    # ------------------------------------------------------------------ the refresh
    @property
    def needs_basis(self) -> bool:
        return (self.left_rank is not None and not self.left_identity) or (
            self.right_rank is not None and not self.right_identity
        )

    @property
    def calibrated(self) -> bool:
        return not self.needs_basis or self.counts.values["galore_num_refreshes"] > 0

    @property
    def refresh_due(self) -> bool:
        """True while the current step's backward must record the layer gradient for a new basis.

        Cached as a Python bool, computed from the counters' host copies; re-evaluated whenever the
        counters change (step, refresh, load_state_dict, sync_counters).
        """
        due = self.counts.due
        if due is None:
            due = self.update_refresh_due()
        return due

    def update_refresh_due(self) -> bool:
        """Re-evaluate :attr:`refresh_due` from the counters (returned)."""
        # A Python bool, read in every forward (a compiled forward guards on it, not on the step count): the
        # layer re-evaluates it when its own clock ticks; a model's step driver invalidates it on the steps
        # where a layer of the model may change between due and not due (api.after_step).
        due = self.counts.due = _schedule.refresh_due(self.counters(), self.schedule)
        if due:
            self.compiled_record = True  # only the step driver clears it, for all layers of a model at once
        return due

    _update_refresh_due = update_refresh_due  # also under the name the step driver and a resume call

    def next_refresh_step(self) -> Optional[int]:
        """The first value of ``galore_step``, from the current one on, at which the layer is due (None:
        never, it has no basis); :func:`~.schedule.next_refresh_step`."""
        return _schedule.next_refresh_step(self.counters(), self.schedule)

    def counters(self) -> _schedule.Counters:
        """The refresh rule's counters now (host copies: no device sync)."""
        counts = self.counts
        return _schedule.Counters(
            step=counts.get("galore_step"),
            last_refresh=counts.values["galore_last_refresh"],
            num_refreshes=counts.values["galore_num_refreshes"],
            gap=counts.values["galore_gap"],
            phase=counts.values["galore_phase"],
        )

    @property
    def schedule(self) -> _schedule.Schedule:
        """The refresh rule's fixed settings of this layer (from its config and sides)."""
        config = self.config
        return _schedule.Schedule(
            staggered=config.refresh_schedule == "staggered",
            period=config.update_proj_gap,
            needs_basis=self.needs_basis,
        )

    def set_refresh_phase(self, phase: int, *, gap: Optional[int] = None) -> None:
        """Set the step (modulo ``update_proj_gap``) at which the layer refreshes under
        ``refresh_schedule='staggered'`` and, given `gap`, its current refresh gap; ``refresh_due`` follows.

        The hook for whatever assigns phases: :func:`~.schedule.assign_refresh_phases` at preparation and
        on a resume with other settings, and the memory planner, which stages which layers refresh on its
        traced steps. Host copies and buffers are written together (no device sync). The phase set stands: a
        packing waiting for the first training forward is cancelled (for every layer it would have packed)."""
        if phase < 0:
            raise ValueError(f"refresh phase must be >= 0, got {phase}")
        if gap is not None and gap < 1:
            raise ValueError(f"refresh gap must be >= 1, got {gap}")
        _schedule.PendingPacking.cancel([self])
        self.counts.set("galore_phase", phase)
        self._phase = phase
        if gap is not None:
            self.counts.set("galore_gap", gap)
        self.update_refresh_due()

    def sketch_width(self, rank: int) -> int:
        """Columns of a refresh's sketch for a basis of rank `rank` (with the oversampling)."""
        if self._adaptive is not None:
            rank = _rank_mod.record_rank(self, rank)  # the calibration's spectrum, or the rank to take
        return min(rank + self.config.oversampling, self.out_features, self.in_features)

    def kept_input_nbytes(self, tokens: int, itemsize: int) -> int:
        """Bytes of the input x a recording layer keeps from its forward to its backward for its record, at
        `tokens` tokens of `itemsize` bytes per value (an expert stack: its rows_per_token rows per token)."""
        return tokens * self.rows_per_token * self.in_features * itemsize

    # Rows of this layer's input per token of the model's forward: 1, an expert stack's routed share.
    rows_per_token = 1

    @property
    def rank_state(self) -> Optional[_rank_mod.AdaptiveRank]:
        """The layer's own rank state under ``rank_allocation='auto'`` (None: its rank is fixed)."""
        return self._adaptive

    @property
    def refresh_record(self) -> Record:
        """What this step's backward recorded for the next basis (None outside a refresh step's
        backward..refresh): the dense fp32 gradient, or with basis_method='sketch' a dict side -> sketch."""
        return self._pending_grad

    @refresh_record.setter
    def refresh_record(self, record: Record) -> None:
        self._pending_grad = record

    def recorded_nbytes(self) -> int:
        """Bytes of refresh records this layer holds now (0 outside a refresh step's backward..refresh)."""
        record = self._pending_grad
        if record is None:
            return 0
        tensors = record.values() if isinstance(record, dict) else (record,)
        return sum(t.numel() * t.element_size() for t in tensors)

    def discard_recorded_gradient(self) -> None:
        """Forget what this step's backward recorded (its optimizer step was skipped)."""
        self._pending_grad = None

    def after_optimizer_step(self, optimizer: Optional[torch.optim.Optimizer] = None) -> Optional[float]:
        """Advance the layer's step counter and refresh the basis if this step recorded a gradient.

        Returns the subspace similarity of a refresh (NaN for the first basis), or None.
        """
        similarity = None
        due = self.refresh_due
        if due:
            if self._pending_grad is None:
                warnings.warn(
                    f"GaLore layer {self.out_features}x{self.in_features}: a basis refresh was due but no "
                    "backward ran through the layer this step; the refresh moves to the next step",
                    stacklevel=3,
                )
            else:
                similarity = self.refresh(optimizer)
        clock = self.counts.clock
        if not clock.shared:
            clock.step += 1
            self.update_refresh_due()
        return similarity

    # The refresh's record and the refresh itself (hf_galore_plugin.layers.refresh), as methods.
    refresh_record_nbytes = _refresh_mod.refresh_record_nbytes
    sketch_test_matrix = _refresh_mod.sketch_test_matrix
    sketch_exchange_numel = _refresh_mod.sketch_exchange_numel
    refresh = _refresh_mod.refresh
    record_gradient = _refresh_mod.record_gradient

    # ------------------------------------------------------------------ state dict
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors):
        if self._adaptive is not None:
            _rank_mod.before_load(self, state_dict, prefix)  # the saved rank (rank_allocation='auto')
        # Quantized parts may change shape between save and load only if the config changed: make the
        # buffers match what is being loaded so a resume restores them bit-exactly.
        for name in list(self._buffers):
            key = prefix + name
            if (
                key in state_dict
                and self._buffers[name] is not None
                and state_dict[key].shape != self._buffers[name].shape
            ):
                self._buffers[name] = torch.empty_like(state_dict[key], device=self._buffers[name].device)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors)
        if self._folded_side is not None:
            self._load_folded_scale(state_dict, prefix, missing_keys)
        if prefix + "galore_step" in state_dict:
            self._built_on_meta = False  # its own state came with the load
        if prefix + "galore_phase" in state_dict:
            # Phases packed by the run that saved them (with its tokens) stand: a resumed run refreshes on the
            # steps of the run it continues.
            _schedule.PendingPacking.cancel([self])
        if prefix + "galore_step" in state_dict or (self.weight is not None and prefix + "weight" in state_dict):
            self._base_initialised = True
        # The load copied into (or, with assign=True, replaced) the counter buffers: refresh the host
        # copies. Every load path ends here: load_state_dict, load_galore_state_dict, the engines' and
        # the Trainer integration's resumes, torch.distributed.checkpoint's set_model_state_dict.
        self._read_counter_buffers(loaded=True)
        self._pending_grad = None
        self._load_kind_state(state_dict, prefix, missing_keys, unexpected_keys)
        _rank_mod.after_load(self)

    def _load_kind_state(self, state_dict, prefix: str, missing_keys: list[str], unexpected_keys: list[str]) -> None:
        """Load what a layer kind adds (its part of a load, after the counters)."""

    def __setstate__(self, state: dict) -> None:
        # A copy (copy.deepcopy, pickle) is a layer of its own: the compiled record ops must find it, not the
        # layer it was copied from, under its id.
        super().__setstate__(state)
        self.recorder_id = register_recorder(self)


if TYPE_CHECKING:  # mypy checks that the layer is what the refresh functions it binds expect

    def _refresh_target(layer: GaLoreLayerBase) -> _refresh_mod.RefreshTarget:
        return layer

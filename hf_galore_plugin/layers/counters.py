"""A GaLore layer's schedule counters: the int64 buffers, their host copies and the step clock, in one object.

The counters (:data:`COUNTER_NAMES`) are int64 scalar buffers of the layer, so they travel with every state
dict and engine checkpoint; :class:`LayerCounters` keeps a host copy of each, which every read in the step
path uses. Reading the buffer itself (``int(layer.galore_step)``) is a device-to-host sync on a GPU; the host
copies keep the step driver free of them (about four per layer per step otherwise).

DDP with broadcast_buffers copies rank 0's buffers into every rank at each forward, behind the layer's back;
the copy changes no counter: every rank starts from the same values (same seed, same state dict) and runs the
same schedule (refreshes are collectives that all ranks take at the same steps), so the counters agree across
ranks by construction and the host copies stay valid.

``galore_step`` advances with a :class:`~.schedule.StepClock`: the layer's own, or its model's, shared by every
layer of the model (``api.after_step`` ticks it once a step, with no per-layer work on an ordinary step). The
host copy of ``galore_step`` holds the value at clock step `mark`; the buffer is written when it is read out
(``state_dict``, a refresh), not at every step.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from .schedule import StepClock

__all__ = ["COUNTER_NAMES", "LayerCounters"]

COUNTER_NAMES = (
    "galore_step",
    "galore_last_refresh",
    "galore_num_refreshes",
    "galore_gap",
    "galore_agree_count",
    "galore_seed",
    "galore_rng_counter",
    "galore_phase",
)


class LayerCounters:
    """The counters of one layer (`module`, which holds them as buffers under :data:`COUNTER_NAMES`): their
    host copies, the step clock ``galore_step`` advances with, and the layer's cached refresh-due flag.

    Every write goes to the buffer and the host copy at once (the buffer write stays asynchronous: ``fill_``
    and ``add_`` with a Python scalar read nothing back), bumps the clock's ``edits`` (the step driver
    recomputes its earliest due step) and clears `due` (the layer re-evaluates it)."""

    __slots__ = ("module", "values", "clock", "mark", "written", "due")

    def __init__(self, module: nn.Module, values: dict[str, int], *, due: Optional[bool]) -> None:
        self.module = module
        # The host copies, one per name of COUNTER_NAMES.
        self.values = values
        self.clock = StepClock()
        # The clock step at which values["galore_step"] was taken.
        self.mark = 0
        # The value last written to the galore_step buffer.
        self.written = values["galore_step"]
        # The layer's refresh_due, computed from the host copies; None: to be re-evaluated.
        self.due = due

    def get(self, name: str) -> int:
        """The value of the counter buffer `name` from its host copy: no device sync."""
        if name == "galore_step":
            return self.values[name] + self.clock.step - self.mark
        try:
            return self.values[name]
        except KeyError:
            raise ValueError(f"{name!r} is not a GaLore counter; the counters are {', '.join(COUNTER_NAMES)}") from None

    def set(self, name: str, value: int) -> None:
        """Counter `name` <- `value` (buffer and host copy)."""
        value = int(value)
        getattr(self.module, name).fill_(value)
        self.values[name] = value
        self.clock.edits += 1
        self.due = None
        if name == "galore_step":
            self.mark, self.written = self.clock.step, value

    def add(self, name: str, delta: int = 1) -> None:
        """Counter `name` += `delta` (buffer and host copy)."""
        getattr(self.module, name).add_(delta)
        self.values[name] += delta
        self.clock.edits += 1
        self.due = None

    def write_step(self) -> None:
        """Write ``galore_step``'s current value into its buffer (the state is being read out)."""
        name = "galore_step"
        step = self.get(name)
        getattr(self.module, name).fill_(step)
        self.written = step

    def use_clock(self, clock: StepClock) -> None:
        """Advance ``galore_step`` with `clock` from now on instead of the current one; the value is kept."""
        self.values["galore_step"] = self.get("galore_step")
        self.clock, self.mark = clock, clock.step
        self.due = None

    def buffers(self) -> list[torch.Tensor]:
        """The counter buffers in the order of :data:`COUNTER_NAMES`, each checked to hold one value."""
        buffers = []
        for name in COUNTER_NAMES:
            value = self.module._buffers.get(name)
            if value is None or value.numel() != 1:
                held = "missing" if value is None else f"of shape {tuple(value.shape)}"
                raise ValueError(
                    f"GaLore counter buffer {name!r} is {held}, a counter holds one value: the state loaded into "
                    "this GaLoreLinear is not one a GaLoreLinear saved; load a GaLoreLinear's own state_dict()"
                )
            buffers.append(value)
        return buffers

    @torch.no_grad()
    def read_buffers(self, *, loaded: bool) -> bool:
        """Take the host copies from the buffers (one device sync); False where the buffers hold no values
        (meta and fake tensors: the memory planner's trace), which keeps the host copies.

        ``galore_step``'s buffer is written when the state is read out, not at every step: unless `loaded` (a
        load always takes it) it is taken only if it holds another value than the one last written to it."""
        buffers = self.buffers()
        if any(value.is_meta or is_fake(value) for value in buffers):
            return False
        device = buffers[0].device
        stacked = torch.stack([value.detach().reshape(()).to(device=device, dtype=torch.int64) for value in buffers])
        values = dict(zip(COUNTER_NAMES, stacked.tolist()))
        if not loaded and values["galore_step"] == self.written:
            values["galore_step"] = self.get("galore_step")
        self.values = values
        self.written = values["galore_step"] if loaded else self.written
        self.mark = self.clock.step
        self.clock.edits += 1
        return True

    def changes(self, before: dict[str, int]) -> list[str]:
        """``"name old -> new"`` for every counter whose value differs from `before` (name -> value)."""
        return [
            f"{name} {before[name]} -> {self.get(name)}" for name in COUNTER_NAMES if before[name] != self.get(name)
        ]

    def snapshot(self) -> dict[str, int]:
        """Every counter's value now, by name."""
        return {name: self.get(name) for name in COUNTER_NAMES}

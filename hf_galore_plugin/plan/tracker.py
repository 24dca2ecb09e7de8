"""Live tensor bytes of a program: a dispatch mode that counts every storage while it is alive.

Every tensor is made by an aten op; the mode registers the storages of each op's outputs (views
share their base's storage, so they count once) and a weakref finalizer on the storage object
subtracts its bytes when the last tensor using it dies. The peak of the running total over the
program is what a caching allocator's ``max_memory_allocated`` reports, without the allocator's
rounding (512 B on CUDA). Under ``FakeTensorMode`` the same accounting runs without allocating.

The live set at the peak is kept exactly and cheaply: a new peak only sets a flag, and the set is
copied when the first free after it happens (until then only allocations occur, so the live set
at the first free is the live set at the peak).
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..optim.offload import allocating_on_host

__all__ = ["LiveBytes", "Entry"]


@dataclass
class Entry:
    serial: int
    nbytes: int
    phase: str
    shape: tuple
    dtype: torch.dtype


class LiveBytes(TorchDispatchMode):
    """Counts live storage bytes. ``phase`` labels what is allocated (forward, backward, ...)."""

    def __init__(self, *, scalar_fallback: bool = False) -> None:
        super().__init__()
        self.live: dict[int, Entry] = {}
        self.total = 0
        self.peak = 0
        self.peak_phase = ""
        self.phase = "setup"
        self._serials = itertools.count()
        self._peak_live: Optional[dict[int, Entry]] = None
        self._peak_pending = False
        # Under FakeTensorMode a Python scalar read of a tensor whose value is unknown (an
        # optimizer's step counter, a finiteness check) cannot be answered; with scalar_fallback
        # such reads return a neutral value (True, 1, 1.0). Memory never depends on them.
        self.scalar_fallback = scalar_fallback
        # Regions: storages owned by decoder layer i map to i; an op that reads a tensor of exactly
        # one layer moves the current region there (it stays there until another layer's tensor,
        # or a tensor of no layer is read), so a step's timeline splits into runs by layer.
        self.region_of: dict[int, int] = {}
        self.unowned: set[int] = set()  # model / optimizer tensors of no layer (embeddings, head)
        self.region = -1
        self.runs: list[tuple[str, int, int, dict[int, Entry]]] = []  # (phase, region, peak, live at peak)
        # Storages made under `optim.offload.host_allocation()` (offloaded optimizer state): host
        # memory, counted apart from the device total, and never part of a device peak.
        self.host_keys: dict[int, int] = {}
        self.host_total = 0
        self.host_peak = 0

    # ------------------------------------------------------------------ accounting
    def track(self, tensor: torch.Tensor) -> Optional[Entry]:
        """Count `tensor`'s storage (once); returns its entry."""
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            return None
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.host_keys:
            return None
        entry = self.live.get(key)
        if entry is not None:
            return entry
        entry = Entry(next(self._serials), storage.nbytes(), self.phase, tuple(tensor.shape), tensor.dtype)
        self.live[key] = entry
        self.total += entry.nbytes
        weakref.finalize(storage, self._free, key, entry.serial)
        if self.total > self.peak:
            self.peak = self.total
            self.peak_phase = self.phase
            self._peak_pending = True
        return entry

    def track_host(self, tensor: torch.Tensor) -> None:
        """Count `tensor`'s storage (once) as host memory."""
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.host_keys or key in self.live:
            return
        self.host_keys[key] = storage.nbytes()
        self.host_total += storage.nbytes()
        self.host_peak = max(self.host_peak, self.host_total)
        weakref.finalize(storage, self._free_host, key)

    def _free_host(self, key: int) -> None:
        self.host_total -= self.host_keys.pop(key, 0)

    def _free(self, key: int, serial: int) -> None:
        entry = self.live.get(key)
        if entry is None or entry.serial != serial:
            return
        if self._peak_pending:
            self._peak_live = dict(self.live)
            self._peak_pending = False
        del self.live[key]
        self.total -= entry.nbytes

    def reset_peak(self) -> None:
        """Start a new peak window at the current live bytes (e.g. at the start of a step)."""
        self.peak = self.total
        self.peak_phase = self.phase
        self._peak_live = None
        self._peak_pending = True

    def peak_live(self) -> dict[int, Entry]:
        """The live set at the current window's peak (storage key -> entry)."""
        if self._peak_pending or self._peak_live is None:
            return dict(self.live)
        return self._peak_live

    def serial_of(self, tensor: Optional[torch.Tensor]) -> Optional[int]:
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            return None
        entry = self.live.get(tensor.untyped_storage()._cdata)
        return None if entry is None else entry.serial

    def close_run(self) -> None:
        """End the current run (phase, region): record its peak and live set; start the next one."""
        self.runs.append((self.phase, self.region, self.peak, self.peak_live()))
        self.reset_peak()

    def _update_region(self, args, kwargs) -> None:
        regions = set()
        owned = False
        live, region_of, unowned = self.live, self.region_of, self.unowned
        for leaf in _tensors((args, kwargs)):
            if leaf.layout == torch.strided:
                entry = live.get(leaf.untyped_storage()._cdata)
                if entry is None:
                    continue
                region = region_of.get(entry.serial)
                if region is not None:
                    regions.add(region)
                elif entry.serial in unowned:
                    owned = True
        if len(regions) == 1 and not owned:
            region = regions.pop()
        elif regions or owned:
            region = -1
        else:
            return
        if region != self.region:
            self.close_run()
            self.region = region

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.region_of:
            self._update_region(args, kwargs)
        if self.scalar_fallback and func is torch.ops.aten._local_scalar_dense.default:
            try:
                return func(*args, **kwargs)
            except Exception:  # DataDependentOutputException: the fake value is unknown
                dtype = args[0].dtype
                if dtype == torch.bool:
                    return True
                return 1.0 if dtype.is_floating_point else 1
        out = func(*args, **kwargs)
        track = self.track_host if allocating_on_host() else self.track
        if isinstance(out, torch.Tensor):
            track(out)
        else:
            for leaf in _tensors(out):
                track(leaf)
        return out


def _tensors(obj):
    """The tensors in an op's arguments or outputs (nested tuples, lists and dicts: the containers aten
    signatures use), in order. A direct walk: the tracker runs it for every op, where torch's generic
    pytree flattening costs more than the bookkeeping itself."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            if isinstance(item, torch.Tensor):
                yield item
            elif isinstance(item, (tuple, list, dict)):
                yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)

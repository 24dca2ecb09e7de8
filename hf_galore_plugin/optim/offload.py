"""Host-resident optimizer state, streamed through the parameter's device in chunks.

With ``state_offload="cpu"`` every state tensor of a parameter (fp32 moments, or 8-bit codes, block
scales and error-feedback residuals) lives in host memory, pinned when CUDA is available so copies
can run asynchronously. A step cuts each parameter's flattened values into chunks, copies a chunk's
state into one of two device staging buffers, runs the same per-parameter update function as the
resident optimizer on that chunk, and copies the state back.

Double buffering: while chunk i is updated in slot i % 2, chunk i+1 is loaded into the other slot.
On CUDA the loads and write-backs run on a side stream, ordered by events (a load waits for nothing
but the write-back of the chunk that used its slot before, which precedes it on the same stream; the
update waits for its load; the write-back waits for its update), so copies overlap the updates. On
the CPU the same code path runs with plain copies in the same order.

Device memory bound: the two staging slots, each at most `chunk_bytes` (default 16 MiB, so 32 MiB
per device; less when the largest chunk is smaller), alive during the optimizer step only, exceeded only when one aligned unit of one
parameter needs more (a chunk is at least `lcm(64, block_size)` values, a few KiB of state).
Nothing else is allocated on the device for state; the update's own temporaries are those of the
resident path on one chunk instead of one whole tensor.

Why the results are bit-identical to the resident optimizer: the update is elementwise for fp32
state, and blockwise for 8-bit state; chunk boundaries are multiples of the quantization block and
of 64 values (the unit at which torch's fused CPU kernel rounds the same wherever a tensor is cut,
see `adamw._FUSED_ALIGN`), so every value sees the same arithmetic.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator

import torch


__all__ = [
    "STATE_OFFLOAD",
    "DEFAULT_CHUNK_MB",
    "StateStreamer",
    "chunk_bounds",
    "host_copy",
    "host_allocation",
    "allocating_on_host",
]

# The values of GaLoreConfig.state_offload (the config unit sits beside this one, not below it, so the
# tuple is repeated there; tests/test_state_offload.py checks that both agree).
STATE_OFFLOAD = ("none", "cpu")

DEFAULT_CHUNK_MB = 16.0
_ALIGN_BYTES = 64  # every staged tensor starts at a multiple of 64 bytes of its slot
_HOST = threading.local()


@contextlib.contextmanager
def host_allocation() -> Iterator[None]:
    """Marks the tensors made inside as host-resident optimizer state. Nothing changes for the
    allocation itself; the memory planner (`plan.tracker.LiveBytes`) reads the mark to count
    those bytes as host memory, not device memory (its traced parameters are fake CPU tensors
    that stand for device tensors, so the device alone cannot tell)."""
    previous = getattr(_HOST, "active", False)
    _HOST.active = True
    try:
        yield
    finally:
        _HOST.active = previous


def allocating_on_host() -> bool:
    return getattr(_HOST, "active", False)


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of `tensor`, pinned when CUDA is available (asynchronous copies need pinned pages)."""
    out = tensor.detach().to("cpu")
    return out.pin_memory() if torch.cuda.is_available() and not out.is_pinned() else out


def _elementwise(key: str) -> bool:
    return not key.endswith("scales")


def _block_size_of(key: str, block_size: int | None) -> int:
    """The block size that 8-bit state key `key` (a scale: one value per block) needs."""
    if block_size is None:
        raise ValueError(f"state key {key!r} holds one value per block: pass the state's block_size")
    return block_size


def bytes_per_value(state: dict[str, torch.Tensor], block_size: int | None) -> float:
    """State bytes per parameter value: codes/moments/residuals, plus each scale's share of a block."""
    total = 0.0
    for key, value in state.items():
        if key == "step" or not isinstance(value, torch.Tensor):
            continue
        total += value.element_size() / (1 if _elementwise(key) else _block_size_of(key, block_size))
    return total


def chunk_bounds(numel: int, per_value: float, chunk_bytes: int, align: int) -> list[tuple[int, int]]:
    """[start, end) ranges covering `numel` values, each a multiple of `align` values long (the last
    one excepted) and at most `chunk_bytes` of state where one aligned unit fits."""
    per_chunk = max(align, int(chunk_bytes // per_value) // align * align)
    return [(start, min(start + per_chunk, numel)) for start in range(0, numel, per_chunk)]


def state_slices(
    state: dict[str, torch.Tensor], start: int, end: int, block_size: int | None
) -> dict[str, torch.Tensor]:
    """The 1-D slices of `state`'s tensors that chunk [start, end) of the flattened parameter owns."""
    out = {}
    for key, value in state.items():
        if key == "step" or not isinstance(value, torch.Tensor):
            continue
        flat = value.view(-1)
        if _elementwise(key):
            out[key] = flat[start:end]
        else:
            block = _block_size_of(key, block_size)
            out[key] = flat[start // block : math.ceil(end / block)]
    return out


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN_BYTES) * _ALIGN_BYTES


def slot_bytes_needed(host: dict[str, torch.Tensor]) -> int:
    return sum(_aligned(t.numel() * t.element_size()) for t in host.values())


class StateStreamer:
    """Two staging slots on one device and, on CUDA, a side stream for the copies."""

    def __init__(self, device: torch.device, chunk_bytes: int) -> None:
        self.device = device
        self.chunk_bytes = chunk_bytes
        self.slots: list[torch.Tensor] = []
        self.slot_bytes = 0  # the largest slot so far (slots are freed after each step)
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def nbytes(self) -> int:
        """Device bytes of the two slots at their largest so far: the staging bound actually reached."""
        return 2 * self.slot_bytes

    def _reserve(self, needed: int) -> None:
        # Sized by the step's largest chunk (at most chunk_bytes but for one aligned unit), so a model
        # with less state than a chunk stages only what it has.
        self.slot_bytes = max(self.slot_bytes, needed)
        self.slots = [torch.empty(needed, dtype=torch.uint8, device=self.device) for _ in range(2)]

    def _carve(self, slot: int, host: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        views, offset, buffer = {}, 0, self.slots[slot]
        for key, value in host.items():
            nbytes = value.numel() * value.element_size()
            views[key] = buffer[offset : offset + nbytes].view(value.dtype)
            offset += _aligned(nbytes)
        return views

    def run(self, chunks: list[tuple[dict[str, torch.Tensor], Callable[[dict[str, torch.Tensor]], None]]]) -> None:
        """For each (host slices, update) in order: load the slices, run `update` on their device
        copies, write them back. Returns once every write-back has landed in host memory."""
        if not chunks:
            return
        self._reserve(max(slot_bytes_needed(host) for host, _ in chunks))
        stream = self.copy_stream
        if stream is None:
            for host, update in chunks:
                views = self._carve(0, host)
                for key, view in views.items():
                    view.copy_(host[key])
                update(views)
                for key, view in views.items():
                    host[key].copy_(view)
            self.slots = []
            return
        compute = torch.cuda.current_stream(self.device)
        # The slots come from the caching allocator, ordered on the compute stream: their memory
        # may still be in use by queued compute work, so the copy stream starts after it.
        stream.wait_stream(compute)

        def load(index: int) -> tuple[dict[str, torch.Tensor], torch.cuda.Event]:
            host = chunks[index][0]
            views = self._carve(index % 2, host)
            with torch.cuda.stream(stream):
                for key, view in views.items():
                    view.copy_(host[key], non_blocking=True)
                loaded = torch.cuda.Event()
                loaded.record(stream)
            return views, loaded

        pending = load(0)
        for index, (host, update) in enumerate(chunks):
            views, loaded = pending
            if index + 1 < len(chunks):
                # Issued before this chunk's update: on CUDA it overlaps it; its slot's previous user
                # (chunk index - 1) was written back earlier on the same stream.
                pending = load(index + 1)
            compute.wait_event(loaded)
            update(views)
            updated = torch.cuda.Event()
            updated.record(compute)
            with torch.cuda.stream(stream):
                stream.wait_event(updated)
                for key, view in views.items():
                    host[key].copy_(view, non_blocking=True)
        stream.synchronize()
        # Freed between steps: the device holds staging only while the optimizer steps (on CUDA the
        # caching allocator keeps the blocks, so the next step's slots cost no cudaMalloc).
        self.slots = []

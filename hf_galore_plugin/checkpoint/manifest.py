"""Checkpoint manifests: a checksum of every file of a checkpoint, written last, checked before a resume.

torch's zip reader does not verify its CRCs (a flipped data byte loads), safetensors has no checksum, and
right after a refresh the factor is zero, so the merged-weight comparison cannot see a damaged basis: only
a checksum of the bytes as written can tell that a file changed since. ``galore_manifest.json`` holds, for
every file under the checkpoint folder, its size and the CRC-32 of each of its parts; it is written after
every other file (``galore_state.pt`` included), atomically, and marks the checkpoint complete.

Parts: a ``.safetensors`` file is cut at its header and at each tensor's bytes, a torch zip file
(``torch.save``: ``optimizer.pt``, ``galore_state.pt``, ...) at each zip entry, any other file is one part;
so a damaged part names the tensor (for a zip entry, found by loading the file memory-mapped: the entry's
offset is its storage's). CRC-32 (``zlib.crc32``) because it is the fastest checksum of the standard
library (docs/benchmarks/step-time.md "Checkpoint manifests": 4.0 GB/s on one core, 2.9x sha256, 5.5x blake2b): it
misses a random change of a part with probability 2^-32 and detects every burst of up to 32 bits; it
guards against damage and mix-ups, not against someone forging files. Parts are hashed by a thread pool
(zlib releases the GIL on large buffers).

Pure Python and torch: no transformers import (the Trainer integration writes and checks them).
"""

from __future__ import annotations

import json
import os
import re
import struct
import threading
import time
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from .files import GaLoreCheckpointError, write_atomically

__all__ = [
    "MANIFEST_NAME",
    "MANIFEST_FORMAT",
    "CheckpointIntegrityError",
    "checkpoint_files",
    "is_own_temporary",
    "remove_stale_temporaries",
    "write_manifest",
    "read_manifest",
    "verify_manifest",
]

MANIFEST_NAME = "galore_manifest.json"
MANIFEST_FORMAT = "hf_galore_plugin.manifest.v1"
# Read size per call; a thread works on runs of parts of at most _ITEM_BYTES (one part may be larger).
_CHUNK = 16 << 20
_ITEM_BYTES = 256 << 20
_THREADS = max(1, min(8, os.cpu_count() or 1))
# What this package writes under a temporary name (``<name>.tmp-<pid>``) before renaming it.
_OWN_TEMPORARY = re.compile(r"^(galore_state\.pt|galore_manifest\.json)\.tmp-(\d+)$")


class CheckpointIntegrityError(GaLoreCheckpointError):
    """A checkpoint whose files are not the ones its manifest lists: missing, of another size, or with
    other bytes (damaged, truncated, or copied from another checkpoint)."""


def is_own_temporary(name: str) -> bool:
    """Whether `name` is a temporary file of this package (``galore_state.pt.tmp-<pid>``, ...)."""
    return _OWN_TEMPORARY.match(name) is not None


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # a temporary of this process outlived its write: the write failed
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def remove_stale_temporaries(folder: str) -> list[str]:
    """Remove this package's temporary files in `folder` whose writer (the PID in the name) no longer runs
    on this machine: what a process killed during a write leaves. Returns the removed paths."""
    removed: list[str] = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        match = _OWN_TEMPORARY.match(name)
        if match is None or _pid_alive(int(match.group(2))):
            continue
        path = os.path.join(folder, name)
        try:
            os.remove(path)
        except FileNotFoundError:
            continue
        removed.append(path)
    return removed


def checkpoint_files(folder: str) -> list[str]:
    """Every regular file under `folder` (relative, '/'-separated, sorted) but the manifest and this
    package's temporaries."""
    files = []
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        for name in names:
            path = os.path.join(root, name)
            if name == MANIFEST_NAME or is_own_temporary(name) or not os.path.isfile(path) or os.path.islink(path):
                continue
            files.append(os.path.relpath(path, folder).replace(os.sep, "/"))
    return sorted(files)


# ---------------------------------------------------------------------- parts of a file
def _safetensors_parts(path: str, size: int) -> Optional[list[tuple[int, str]]]:
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            return None
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            return None
        header = json.loads(handle.read(length))
    parts = [(0, "header")]
    for name, info in header.items():
        if name != "__metadata__" and isinstance(info, dict) and "data_offsets" in info:
            parts.append((8 + length + int(info["data_offsets"][0]), f"tensor {name}"))
    return parts


def _zip_parts(path: str) -> Optional[list[tuple[int, str]]]:
    with zipfile.ZipFile(path) as archive:
        parts = [(info.header_offset, f"zip entry {info.filename}") for info in archive.infolist()]
        directory = getattr(archive, "start_dir", None)
    parts.append((0, "file start"))
    if directory is not None:
        parts.append((int(directory), "zip directory"))
    return parts


def _parts(path: str, size: int) -> list[tuple[int, str]]:
    """(start, label) of each part of the file, sorted, the first at 0; the parts cover the file."""
    found: Optional[list[tuple[int, str]]] = None
    try:
        if path.endswith(".safetensors"):
            found = _safetensors_parts(path, size)
        elif zipfile.is_zipfile(path):
            found = _zip_parts(path)
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile, struct.error):
        found = None
    starts: dict[int, str] = {0: "whole file"}
    for start, label in found or ():
        if 0 <= start < size and (start not in starts or starts[start] in ("whole file", "file start")):
            starts[start] = label
    return sorted(starts.items())


def _crc_range(handle: Any, start: int, end: int, buffers: threading.local) -> int:
    buffer = getattr(buffers, "buffer", None)
    if buffer is None:
        buffer = buffers.buffer = memoryview(bytearray(_CHUNK))
    crc = 0
    handle.seek(start)
    remaining = end - start
    while remaining > 0:
        read = handle.readinto(buffer[: min(_CHUNK, remaining)])
        if not read:
            break
        crc = zlib.crc32(buffer[:read], crc)
        remaining -= read
    return crc


def _hash_files(folder: str, layouts: dict[str, tuple[int, list[tuple[int, str]]]]) -> dict[str, list[int]]:
    """CRC-32 of every part of every file: {file: [crc per part]}, the files' parts hashed in parallel."""
    items: list[tuple[str, list[tuple[int, int, int]]]] = []  # (file, [(part index, start, end)])
    for name, (size, parts) in layouts.items():
        run: list[tuple[int, int, int]] = []
        run_bytes = 0
        for index, (start, _) in enumerate(parts):
            end = parts[index + 1][0] if index + 1 < len(parts) else size
            if run and run_bytes + (end - start) > _ITEM_BYTES:
                items.append((name, run))
                run, run_bytes = [], 0
            run.append((index, start, end))
            run_bytes += end - start
        items.append((name, run))
    buffers = threading.local()

    def work(item: tuple[str, list[tuple[int, int, int]]]) -> tuple[str, list[tuple[int, int]]]:
        name, run = item
        with open(os.path.join(folder, name), "rb", buffering=0) as handle:
            return name, [(index, _crc_range(handle, start, end, buffers)) for index, start, end in run]

    crcs = {name: [0] * len(parts) for name, (_, parts) in layouts.items()}
    with ThreadPoolExecutor(max_workers=_THREADS) as pool:
        for name, results in pool.map(work, items):
            for index, crc in results:
                crcs[name][index] = crc
    return crcs


def _manifest_checksum(body: dict[str, Any]) -> int:
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


# ---------------------------------------------------------------------- write
def write_manifest(folder: str, *, global_step: Optional[int]) -> dict[str, float]:
    """Write ``galore_manifest.json`` of every file under `folder` (after they are all written and
    flushed): to a temporary name, fsync, rename, fsync of the folder. Returns {"bytes", "seconds"}."""
    started = time.perf_counter()
    layouts = {}
    for name in checkpoint_files(folder):
        path = os.path.join(folder, name)
        size = os.path.getsize(path)
        layouts[name] = (size, _parts(path, size))
    crcs = _hash_files(folder, layouts)
    body = {
        "format": MANIFEST_FORMAT,
        "global_step": None if global_step is None else int(global_step),
        "algorithm": "crc32",
        "files": {
            name: {"size": size, "parts": [[start, label, crc] for (start, label), crc in zip(parts, crcs[name])]}
            for name, (size, parts) in layouts.items()
        },
    }
    manifest = {**body, "checksum": _manifest_checksum(body)}
    path = os.path.join(folder, MANIFEST_NAME)
    data = json.dumps(manifest, indent=1).encode()
    write_atomically(path, lambda handle: handle.write(data))
    total = sum(size for size, _ in layouts.values())
    return {"bytes": float(total), "seconds": time.perf_counter() - started}


# ---------------------------------------------------------------------- read and verify
def read_manifest(folder: str, *, advice: str = "") -> dict[str, Any]:
    """The manifest of `folder`; a damaged one raises :class:`CheckpointIntegrityError` naming it, ending
    with `advice` (what to do instead; else a resume's)."""
    path = os.path.join(folder, MANIFEST_NAME)
    try:
        with open(path, "rb") as handle:
            manifest = json.loads(handle.read())
        body = {key: value for key, value in manifest.items() if key != "checksum"}
        valid = manifest.get("format") == MANIFEST_FORMAT and manifest.get("checksum") == _manifest_checksum(body)
    except (ValueError, AttributeError, UnicodeDecodeError):
        valid = False
    if not valid:
        raise CheckpointIntegrityError(
            f"checkpoint {folder}: its manifest {MANIFEST_NAME} is damaged (not the JSON this version writes, or "
            "its own checksum does not match), so none of the checkpoint's files can be verified. "
            + (advice or "Resume from an earlier complete checkpoint of this run, or restore the file.")
        )
    return manifest


def _zip_entry_tensors(path: str, entries: list[str]) -> dict[str, list[str]]:
    """For zip entries ``<archive>/data/<key>`` of a torch file: the names of the tensors stored in them
    ({entry: [key path, ...]}), found by loading the file memory-mapped (no data is read): a storage's
    address minus the lowest one is its entry's data offset minus the lowest one. Empty when the file
    does not load or the addresses do not line up."""
    import torch

    try:
        with zipfile.ZipFile(path) as archive:
            infos = [info for info in archive.infolist() if "/data/" in info.filename and info.file_size > 0]
        offsets = {}
        with open(path, "rb") as handle:
            for info in infos:
                handle.seek(info.header_offset + 26)
                name_length, extra_length = struct.unpack("<HH", handle.read(4))
                offsets[info.header_offset + 30 + name_length + extra_length] = info.filename
        loaded = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except Exception:  # noqa: BLE001 - naming the tensor is a courtesy; the file is reported damaged anyway
        return {}
    tensors: list[tuple[str, Any]] = []

    def walk(value: Any, key: str) -> None:
        if isinstance(value, torch.Tensor):
            tensors.append((key, value))
        elif isinstance(value, dict):
            for sub, item in value.items():
                walk(item, f"{key}.{sub}" if key else str(sub))
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(item, f"{key}.{index}" if key else str(index))

    walk(loaded, "")
    stored = [(key, t.untyped_storage().data_ptr()) for key, t in tensors if t.untyped_storage().nbytes() > 0]
    if not stored or not offsets:
        return {}
    base = min(ptr for _, ptr in stored) - min(offsets)
    names: dict[str, list[str]] = {}
    for key, ptr in stored:
        entry = offsets.get(ptr - base)
        if entry is None:
            return {}
        names.setdefault(entry, []).append(key)
    return {entry: names.get(entry, []) for entry in entries}


def _damaged_parts(folder: str, name: str, labels: list[str]) -> str:
    entries = [label.removeprefix("zip entry ") for label in labels if label.startswith("zip entry ")]
    tensors = _zip_entry_tensors(os.path.join(folder, name), entries) if entries else {}
    described = []
    for label in labels:
        entry = label.removeprefix("zip entry ")
        if tensors.get(entry):
            described.append(f"tensor {', '.join(tensors[entry][:3])} ({label})")
        else:
            described.append(label)
    more = f" and {len(described) - 4} more parts" if len(described) > 4 else ""
    return "; ".join(described[:4]) + more


def verify_manifest(folder: str, *, hint: str = "") -> dict[str, float]:
    """Check every file `folder`'s manifest lists: present, of its size, with the same CRC-32 per part.
    Raises :class:`CheckpointIntegrityError` naming each bad file (and the tensor, where the file says)
    and the checkpoint; `hint` is appended (what to do instead: which checkpoint to resume from, or what a
    load of the checkpoint for another purpose should do). Returns {"bytes", "seconds"}."""
    started = time.perf_counter()
    manifest = read_manifest(folder, advice=hint)
    step = manifest.get("global_step")
    problems = []
    layouts = {}
    for name, info in sorted(manifest["files"].items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            problems.append(f"checkpoint {folder} has no {name}, which its manifest lists (the file was removed)")
            continue
        size = os.path.getsize(path)
        if size != info["size"]:
            problems.append(
                f"{path} is {size} bytes, {info['size']} when it was written (truncated, or replaced by another file)"
            )
            continue
        layouts[name] = (size, [(start, label) for start, label, _ in info["parts"]])
    crcs = _hash_files(folder, layouts)
    for name, (_, parts) in layouts.items():
        expected = [crc for _, _, crc in manifest["files"][name]["parts"]]
        bad = [label for (_, label), crc, want in zip(parts, crcs[name], expected) if crc != want]
        path = os.path.join(folder, name)
        if len(bad) > 4 and 2 * len(bad) > len(parts):
            problems.append(
                f"{path} differs from the file written at step {step} in {len(bad)} of its {len(parts)} parts "
                "(replaced by another file, e.g. from another checkpoint)"
            )
        elif bad == ["whole file"]:
            problems.append(f"{path} is damaged: its bytes differ from those written at step {step}")
        elif bad:
            problems.append(
                f"{path} is damaged: its bytes differ from those written at step {step} in "
                f"{_damaged_parts(folder, name, bad)}"
            )
    if problems:
        raise CheckpointIntegrityError(
            f"checkpoint {folder} failed its integrity check ({MANIFEST_NAME}): "
            + "; ".join(problems)
            + ". Its files are not the ones written together at that step (damaged on disk or in a copy, "
            "truncated, or copied from another checkpoint), so it cannot be restored exactly."
            + (f" {hint}" if hint else " Resume from an earlier complete checkpoint, or restore the files.")
        )
    total = sum(size for size, _ in layouts.values())
    return {"bytes": float(total), "seconds": time.perf_counter() - started}

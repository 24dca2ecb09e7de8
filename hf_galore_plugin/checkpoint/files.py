"""Writing checkpoint files safely: atomic replacement, fsync, one error for a full disk.

A reader of a checkpoint folder sees the previous version of a file or the complete new one, never a
partial one (:func:`write_atomically`); a write that fails because the file system is full raises
:class:`CheckpointDiskFullError` naming the file, whichever writer (torch's zip writer, safetensors,
json) failed.
"""

from __future__ import annotations

import errno
import os
from typing import Any, Callable, Optional

__all__ = [
    "GaLoreCheckpointError",
    "CheckpointDiskFullError",
    "DISK_FULL_BYTES",
    "write_atomically",
    "checkpoint_write_error",
    "fsync_path",
    "fsync_folder",
]


class GaLoreCheckpointError(ValueError):
    """A checkpoint that cannot be used for this resume: a file unreadable, damaged or missing, from another
    step or model, or saved with settings this run cannot take over exactly."""


def write_atomically(path: str, write: Callable[[Any], None]) -> None:
    """`write(handle)` into a temporary file beside `path`, fsync, rename, fsync of the folder: a reader
    sees the previous file or the complete new one. A full disk raises :class:`CheckpointDiskFullError`
    naming the file; the temporary is removed."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        error = checkpoint_write_error(exc, path)  # before the temporary is removed: it fills the disk
        if os.path.exists(tmp):
            os.remove(tmp)
        if error is not None:
            raise error from None
        raise
    fsync_folder(os.path.dirname(os.path.abspath(path)))


class CheckpointDiskFullError(OSError):
    """A checkpoint file could not be written because its file system is full (errno ENOSPC); ``filename``
    is the file, ``writer_said`` the first line of the writer's own error."""

    writer_said: str = ""


# Below this many free bytes a failed write counts as a full disk even when the writer does not say so:
# torch's zip writer reports only "[enforce fail at inline_container.cc] unexpected pos ...".
DISK_FULL_BYTES = 1 << 20


def _disk_full(exc: BaseException, folder: str) -> bool:
    seen: Optional[BaseException] = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(seen) or "StorageFull" in str(seen):  # safetensors' Rust writer
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        stat = os.statvfs(folder)
    except (OSError, AttributeError):  # no statvfs on Windows
        return False
    return stat.f_bavail * stat.f_frsize < DISK_FULL_BYTES


def checkpoint_write_error(
    exc: BaseException, path: str, *, previous: Optional[str] = None
) -> Optional[CheckpointDiskFullError]:
    """The error to raise for `exc`, a failure while writing checkpoint file `path`: a
    :class:`CheckpointDiskFullError` naming the file when the file system is full (call it before removing
    partial files), None otherwise (re-raise `exc`). `previous`: the complete checkpoint left intact."""
    if isinstance(exc, CheckpointDiskFullError):  # raised by a writer below: name its file, add `previous`
        path, said = str(exc.filename), exc.writer_said
    else:
        if not isinstance(exc, Exception) or not _disk_full(exc, os.path.dirname(os.path.abspath(path))):
            return None
        said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    folder = os.path.dirname(os.path.abspath(path))
    kept = f"the previous complete checkpoint {previous} is intact" if previous else "no older checkpoint was touched"
    error = CheckpointDiskFullError(
        errno.ENOSPC,
        f"No space left on device: the checkpoint file {path} could not be written (the writer said: "
        f"{said[:200]}). The checkpoint in {folder} is incomplete and is skipped on resume; {kept}. Free space "
        "(delete the incomplete folder, or older checkpoints), then resume with resume_from_checkpoint=True",
        path,
    )
    error.writer_said = said
    return error


def fsync_path(path: str) -> None:
    """Flush a file, or a folder's entries (renames, new files), to disk; a no-op where the path cannot
    be opened or the file system does not sync it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_folder(folder: str) -> None:
    """Make renames and new files in `folder` durable (no-op where folders cannot be opened)."""
    fsync_path(folder)

"""The checkpoint-folder rule the callback and the patches share (a leaf: it imports no other module of
``integrations``): the Trainer writes step N of a run into ``<run dir>/checkpoint-N``
(``PREFIX_CHECKPOINT_DIR``), and a GaLore checkpoint is complete once its manifest exists.
"""

from __future__ import annotations

import os
from typing import Optional

from ..checkpoint.manifest import MANIFEST_NAME

__all__ = [
    "checkpoint_folder",
    "checkpoint_steps",
    "step_of",
    "checkpoint_is_complete",
    "latest_complete_checkpoint",
]


def checkpoint_folder(run_dir: str, step: int) -> str:
    """The folder the Trainer writes step `step` of the run in `run_dir` into."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    return os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")


def checkpoint_steps(output_dir: str) -> list[tuple[int, str]]:
    """(step, folder) of every ``checkpoint-N`` folder in `output_dir`, newest first."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    found: list[tuple[int, str]] = []
    if not os.path.isdir(output_dir):
        return found
    for entry in os.listdir(output_dir):
        head, _, step = entry.rpartition("-")
        path = os.path.join(output_dir, entry)
        if head == PREFIX_CHECKPOINT_DIR and step.isdigit() and os.path.isdir(path):
            found.append((int(step), path))
    return sorted(found, reverse=True)


def step_of(folder: str) -> int:
    """The step of checkpoint folder `folder` (``checkpoint-N`` -> N), -1 for a folder not named so."""
    step = os.path.basename(os.path.normpath(folder)).rpartition("-")[2]
    return int(step) if step.isdigit() else -1


def checkpoint_is_complete(folder: str) -> bool:
    """A GaLore checkpoint is complete when its manifest exists: the integration writes it (atomically)
    after every other file of the checkpoint, ``galore_state.pt`` included, and removes a stale one first."""
    return os.path.isfile(os.path.join(folder, MANIFEST_NAME))


def latest_complete_checkpoint(output_dir: str) -> Optional[str]:
    """The newest complete GaLore checkpoint folder of `output_dir`, or None."""
    for _, folder in checkpoint_steps(output_dir):
        if checkpoint_is_complete(folder):
            return folder
    return None

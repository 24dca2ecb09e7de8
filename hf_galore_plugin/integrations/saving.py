"""Saving: a checkpoint of a prepared model is a plain merged model plus ``galore_state.pt``.

``save_pretrained`` of a prepared model (what ``Trainer.save_model`` and every checkpoint call) writes
the merged plain weights (standard keys, dtype as loaded), also from the state dict an engine gathered
and passes in (DeepSpeed ZeRO-3, FSDP full state dict); peft's ``save_pretrained`` sees plain
``modules_to_save`` (:func:`merged_view`). ``Trainer._save_checkpoint`` adds ``galore_state.pt`` and
then the manifest, before the Trainer's rotation deletes anything (docs/architecture.md, "Checkpoints").
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import os
import weakref
import zipfile
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from ..api import galore_layers, merged_state_dict
from ..checkpoint.files import checkpoint_write_error, fsync_folder, fsync_path
from ..checkpoint.manifest import MANIFEST_NAME, remove_stale_temporaries, write_manifest
from ..checkpoint.state import GALORE_STATE_NAME, save_galore_checkpoint
from ..inject import plain_linear, restore_experts, state_dict_name, swap_in_merged_experts, swap_submodule
from ..state import GaLoreState, state_of
from .common import checkpoint_folder, latest_complete_checkpoint
from .distributed import gathered_galore_state_dict, merged_state_dict_from
from .names import served_name
from .patching import internals_missing, mark

logger = logging.getLogger(__name__)

__all__ = [
    "wrap_save_checkpoint",
    "save_galore_state",
    "saved_step",
    "merged_view",
    "merged_linears",
    "wrap_save_pretrained",
    "wrap_peft_save_pretrained",
]


def wrap_save_checkpoint(original: Callable) -> Callable:
    """A GaLore checkpoint is complete before anything older is deleted.

    transformers writes the model, optimizer, scheduler, RNG and trainer state, then rotates (deletes
    checkpoints beyond ``save_total_limit``) inside ``_save_checkpoint``; ``on_save`` only comes after.
    Here: a stale manifest and ``galore_state.pt`` in the target folder (left by an earlier run) and our
    temporaries there are removed first; rotation is held back during the Trainer's own writes; every file
    of the new checkpoint is fsynced; ``galore_state.pt`` and then the manifest of every file are written
    atomically (the manifest marks the checkpoint complete, :func:`checkpoint_is_complete`); only then does
    the Trainer's rotation run. A crash at any instant leaves the previous complete checkpoint, or the new
    one complete; a full disk raises one error naming the file and leaves the previous one too.
    """

    @functools.wraps(original)
    def _save_checkpoint(self, model, trial, *args, **kwargs):
        prepared = state_of(self.model)
        if prepared is None:
            return original(self, model, trial, *args, **kwargs)
        run_dir = self._get_output_dir(trial=trial)
        folder = checkpoint_folder(run_dir, self.state.global_step)
        if self.args.should_save:
            _mark_incomplete(folder)
        limit = self.args.save_total_limit
        self.args.save_total_limit = None
        try:
            try:
                original(self, model, trial, *args, **kwargs)
            finally:
                self.args.save_total_limit = limit
            save_galore_state(self, prepared, folder)
        except Exception as exc:
            error = checkpoint_write_error(
                exc, _file_being_written(folder, exc), previous=latest_complete_checkpoint(run_dir)
            )
            if error is not None:
                raise error from None
            raise
        if self.args.should_save and limit is not None and limit > 0:
            _rotate(self, run_dir)

    return mark(_save_checkpoint)


def _mark_incomplete(folder: str) -> None:
    """Make a checkpoint folder about to be (re)written incomplete: its manifest first, then its
    ``galore_state.pt`` and our temporaries (a run killed while writing them) are removed."""
    removed = False
    for name in (MANIFEST_NAME, GALORE_STATE_NAME):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            os.remove(path)
            removed = True
    if remove_stale_temporaries(folder) or removed:
        fsync_folder(folder)


def _file_being_written(folder: str, exc: BaseException) -> str:
    """The file under `folder` a failed save was writing. safetensors removes what it could not finish, so
    its error means the model file; otherwise the newest file its format says is unfinished (file times
    tie within a clock tick, and the Trainer writes small files right around the model), else the newest
    file, else `folder` itself."""
    weights = os.path.join(folder, "model.safetensors")
    if type(exc).__module__.startswith("safetensors") and not os.path.exists(weights):
        return weights
    found = []
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            try:
                found.append((os.stat(path).st_mtime_ns, _unfinished(path), path))
            except OSError:
                continue
    if not found:
        return folder
    unfinished = [entry for entry in found if entry[1]]
    return max(unfinished or found)[2]


def _unfinished(path: str) -> bool:
    """Whether the file is cut short by its own format: a safetensors file shorter than its header says, a
    zip (torch.save) without its directory, JSON that does not parse; other files count as finished."""
    size = os.path.getsize(path)
    try:
        if path.endswith(".safetensors"):
            with open(path, "rb") as handle:
                length = int.from_bytes(handle.read(8), "little")
                header = json.loads(handle.read(length))
            end = max((info["data_offsets"][1] for key, info in header.items() if key != "__metadata__"), default=0)
            return size < 8 + length + end
        if path.endswith((".pt", ".pth", ".bin")):
            return not zipfile.is_zipfile(path)
        if path.endswith(".json"):
            with open(path, "rb") as handle:
                json.loads(handle.read())
    except (OSError, ValueError, KeyError, TypeError):
        return True
    return False


# Trainer -> the step of the last galore_state.pt written for it (GaLoreCallback.on_save skips that step).
_SAVED_STEP: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def saved_step(trainer: Any) -> Optional[int]:
    """The global step whose ``galore_state.pt`` :func:`save_galore_state` last wrote for `trainer`, or None."""
    return _SAVED_STEP.get(trainer)


def save_galore_state(trainer: Any, prepared: GaLoreState, folder: str) -> None:
    """Gather (every rank) and write ``galore_state.pt`` of `trainer`'s current step into `folder`
    (process zero), after fsyncing the checkpoint's other files, then the checkpoint's manifest."""
    galore_state = gathered_galore_state_dict(prepared.model, root=trainer.model)  # collectives: ZeRO-3, FSDP
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank's files of this checkpoint are written
    _SAVED_STEP[trainer] = trainer.state.global_step
    if not trainer.args.should_save:
        return
    if not os.path.isdir(folder):
        raise RuntimeError(
            f"GaLore: checkpoint folder {folder} was not written by the Trainer; cannot save GaLore state"
        )
    _fsync_tree(folder)
    optim = served_name(getattr(trainer.args, "optim", None))
    save_galore_checkpoint(
        os.path.join(folder, GALORE_STATE_NAME),
        galore_state,
        prepared.config,
        global_step=trainer.state.global_step,
        optimizer_name=optim,
    )
    timing = write_manifest(folder, global_step=trainer.state.global_step)
    logger.debug("GaLore: manifest of %s: %.1f MB hashed in %.2f s", folder, timing["bytes"] / 1e6, timing["seconds"])


def _fsync_tree(folder: str) -> None:
    """Flush every file of a checkpoint to disk: the completeness marker written after them must not
    reach the disk before they do (power loss). transformers itself does not fsync."""
    for root, _, files in os.walk(folder):
        for name in files:
            fsync_path(os.path.join(root, name))
        fsync_folder(root)


def _rotate(trainer: Any, run_dir: str) -> None:
    """The Trainer's own rotation (transformers 4.57: a method; 5.x: trainer_utils.rotate_checkpoints)."""
    method = getattr(trainer, "_rotate_checkpoints", None)
    if callable(method):
        method(use_mtime=False, output_dir=run_dir)
        return
    from transformers import trainer as trainer_module

    rotate = getattr(trainer_module, "rotate_checkpoints", None)
    if rotate is None:
        raise internals_missing("transformers.trainer.rotate_checkpoints / Trainer._rotate_checkpoints")
    rotate(
        output_dir=run_dir,
        save_total_limit=trainer.args.save_total_limit,
        best_model_checkpoint=trainer.state.best_model_checkpoint,
        use_mtime=True,
    )


@contextlib.contextmanager
def merged_view(model: nn.Module) -> Iterator[nn.Module]:
    """Temporarily swap every GaLore layer for a plain ``nn.Linear`` holding its merged weight.

    For savers that walk the modules themselves (peft's ``get_peft_model_state_dict`` asks each
    ``modules_to_save`` copy for its own keys): they see a plain model; the GaLore layers (and
    everything they hold) are put back afterwards, untouched.
    """
    with merged_linears(model):
        yield model


@contextlib.contextmanager
def merged_linears(model: nn.Module) -> Iterator[dict[str, nn.Linear]]:
    """:func:`merged_view`, yielding the plain layers put in place of the GaLore layers (by layer name)."""
    merged = merged_state_dict(model)
    swapped, linears = [], {}
    expert_swaps = swap_in_merged_experts(model, merged)  # the stock experts modules, merged, meanwhile
    try:
        for layer_name, layer in galore_layers(model):
            linear = plain_linear(layer, merged[f"{state_dict_name(layer_name)}.weight"], requires_grad=False)
            linears[layer_name] = linear
            swapped.append((*swap_submodule(model, layer_name, linear), layer))
        yield linears
    finally:
        for parent, child, layer in swapped:
            setattr(parent, child, layer)
        restore_experts(expert_swaps)


def wrap_save_pretrained(original: Callable) -> Callable:
    """The patch of ``PreTrainedModel.save_pretrained``: a prepared model saves its merged plain weights,
    merged from the engine's gathered tensors when a ``state_dict`` is passed in."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_pretrained(self, *args, **kwargs):
        if state_of(self) is not None:
            bound = signature.bind(self, *args, **kwargs)
            given = bound.arguments.get("state_dict")
            if given is None:
                bound.arguments["state_dict"] = merged_state_dict(self)
            elif any(key.endswith(".galore_factor") for key in given):
                # gathered by an engine (DeepSpeed ZeRO, FSDP full state dict): merge from its tensors
                bound.arguments["state_dict"] = merged_state_dict_from(self, given)
            return original(*bound.args, **bound.kwargs)
        return original(self, *args, **kwargs)

    return mark(save_pretrained)


def wrap_peft_save_pretrained(original: Callable) -> Callable:
    """The patch of ``PeftModel.save_pretrained``: a prepared peft model saves merged ``modules_to_save``."""

    @functools.wraps(original)
    def save_pretrained(self, *args, **kwargs):
        if state_of(self) is None:
            return original(self, *args, **kwargs)
        with merged_view(self):
            return original(self, *args, **kwargs)

    return mark(save_pretrained)

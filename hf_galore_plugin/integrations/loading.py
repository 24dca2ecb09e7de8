"""Loading and resume: the Trainer's loads restore every GaLore layer exactly from ``galore_state.pt``.

``train(resume_from_checkpoint=True)`` picks the newest complete checkpoint and every file of the
checkpoint is verified against its manifest before anything loads; ``_load_from_checkpoint`` and
``_load_best_model`` give each GaLore layer its own tensors from ``galore_state.pt`` while the Trainer
loads the merged model file, and check that both belong together. The engines' own resume paths are in
:mod:`.engine_resume`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..api import galore_layers, load_galore_state_dict
from ..checkpoint.manifest import MANIFEST_NAME, remove_stale_temporaries, verify_manifest
from ..checkpoint.state import apply_mutable_changes, check_merged_weights, read_checkpoint_state
from ..state import state_of
from .common import checkpoint_is_complete, checkpoint_steps, latest_complete_checkpoint, step_of
from .engine_resume import load_fsdp_galore_state
from .names import trainer_optimizer_name
from .patching import mark
from .saving import merged_linears

logger = logging.getLogger(__name__)

__all__ = ["verify_checkpoint", "wrap_load_from_checkpoint", "wrap_load_best_model", "wrap_train"]


@contextlib.contextmanager
def _galore_state_injected(
    model: nn.Module, galore_state: dict[str, torch.Tensor], checkpoint_weights: dict[str, torch.Tensor]
) -> Iterator[None]:
    """While the Trainer loads a checkpoint's weights, GaLore layers receive their exact state.

    The checkpoint's ``weight`` of a GaLore layer is the merged W0 + scale*B Q^T (the checkpoint
    is a plain model); each layer's pre-hook replaces it by the layer's own tensors from
    ``galore_state.pt`` (W0, possibly quantized, factor, basis, counters), so no key is reported
    missing and nothing merged is copied into W0. The merged weights it takes out are kept in
    `checkpoint_weights` (by layer name) to check that the state belongs to this checkpoint.
    """
    per_layer: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in galore_state.items():
        layer_name, _, sub_key = key.rpartition(".")
        per_layer.setdefault(layer_name, {})[sub_key] = value
    handles = []
    for layer_name, layer in galore_layers(model):
        hook = _injecting_hook(layer_name, per_layer.get(layer_name, {}), checkpoint_weights)
        handles.append(layer._register_load_state_dict_pre_hook(hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _injecting_hook(
    layer_name: str, layer_state: dict[str, torch.Tensor], checkpoint_weights: dict[str, torch.Tensor]
) -> Callable[..., None]:
    """The load pre-hook of one GaLore layer (:func:`_galore_state_injected`)."""

    def inject(state_dict: dict[str, Any], prefix: str, *unused: Any) -> None:
        merged = state_dict.pop(prefix + "weight", None)
        if merged is not None:
            checkpoint_weights[layer_name] = merged
        state_dict.update({prefix + sub_key: value for sub_key, value in layer_state.items()})

    return inject


def _resolve_resume(output_dir: str, resume: Any) -> Any:
    """The checkpoint a GaLore run resumes from: ``True`` picks the newest *complete* one (a folder that
    a crash left without its manifest is skipped, with a warning); an explicit incomplete folder is
    refused, naming the complete one to use."""
    if resume is True:
        checkpoints = checkpoint_steps(output_dir)
        if not checkpoints:
            return resume  # the Trainer reports that there is no checkpoint
        complete = latest_complete_checkpoint(output_dir)
        if complete is None:
            raise ValueError(
                f"resume_from_checkpoint=True: no complete GaLore checkpoint in {output_dir}: "
                f"{[folder for _, folder in checkpoints]} lack {MANIFEST_NAME} (a run stopped while writing "
                "them). Start a new run, or pass a complete checkpoint folder of another output_dir."
            )
        skipped = [folder for step, folder in checkpoints if step > step_of(complete)]
        if skipped:
            logger.warning(
                "resume_from_checkpoint=True: skipping incomplete checkpoint(s) %s (no %s: the run stopped while "
                "writing them); resuming from %s",
                skipped,
                MANIFEST_NAME,
                complete,
            )
        return complete
    if (
        isinstance(resume, (str, os.PathLike))
        and os.path.isdir(resume)
        and not checkpoint_is_complete(os.fspath(resume))
    ):
        raise ValueError(
            f"checkpoint {resume} is incomplete: it has no {MANIFEST_NAME}, which a GaLore run writes last (the "
            f"run stopped while writing the checkpoint, or a GaLore run did not write it); "
            f"{_earlier_complete_hint(resume)}"
        )
    return resume


def _earlier_complete_hint(folder: Any) -> str:
    """What to resume from instead of `folder`: the newest complete checkpoint before it, next to it."""
    parent = os.path.dirname(os.path.abspath(folder))
    earlier = [
        path for step, path in checkpoint_steps(parent) if step < step_of(folder) and checkpoint_is_complete(path)
    ]
    if earlier:
        return f"resume from {earlier[0]} (pass it as resume_from_checkpoint)."
    return "no complete checkpoint is next to it: restore its files, or start a new run."


def verify_checkpoint(folder: Any) -> None:
    """Check every file of checkpoint `folder` against its manifest, before anything of it is loaded
    (:func:`~hf_galore_plugin.checkpoint.manifest.verify_manifest`)."""
    hint = _earlier_complete_hint(folder)
    timing = verify_manifest(str(folder), hint=hint[:1].upper() + hint[1:])
    logger.debug("GaLore: checkpoint %s verified: %.1f MB in %.2f s", folder, timing["bytes"] / 1e6, timing["seconds"])


def _load_peft_with_galore_state(load: Callable[[], Any], model: nn.Module, folder: str, trainer: Any) -> Any:
    """peft models load a checkpoint through ``load_adapter`` (``set_peft_model_state_dict``), which asks each
    ``modules_to_save`` copy for its own keys: it sees plain layers holding the merged weights meanwhile
    (:func:`merged_view`), and the GaLore layers get their exact state from ``galore_state.pt`` after."""
    payload = read_checkpoint_state(folder, model, trainer_optimizer_name(trainer))
    with merged_linears(model) as linears:
        result = load()
        checkpoint_weights = {name: linear.weight.detach().clone() for name, linear in linears.items()}
    load_galore_state_dict(model, payload["state"])
    check_merged_weights(model, checkpoint_weights, folder)
    apply_mutable_changes(model, payload["changed"], where=f"checkpoint {folder}")
    return result


def _is_peft_model(model: Any) -> bool:
    return any(cls.__module__.startswith("peft.") for cls in type(model).__mro__)


def _load_with_galore_state(load: Callable[[], Any], model: nn.Module, folder: str, trainer: Any = None) -> Any:
    """Run `load` (the Trainer's load of the merged model file) while each GaLore layer takes its own tensors
    from ``galore_state.pt``, then check that both files belong together."""
    if trainer is not None and _is_peft_model(trainer.model):
        return _load_peft_with_galore_state(load, model, folder, trainer)
    payload = read_checkpoint_state(folder, model, trainer_optimizer_name(trainer))
    checkpoint_weights: dict[str, torch.Tensor] = {}
    with _galore_state_injected(model, payload["state"], checkpoint_weights):
        result = load()
    # strict: every layer and every key must be there (the injected load above is not strict)
    load_galore_state_dict(model, payload["state"])
    check_merged_weights(model, checkpoint_weights, folder)
    apply_mutable_changes(model, payload["changed"], where=f"checkpoint {folder}")
    return result


def _load_with_galore_checkpoint(trainer: Any, original: Callable[[], Any], folder: str) -> Any:
    """Run the Trainer's own load of checkpoint `folder`, restoring the GaLore layers from its
    ``galore_state.pt``. Under DeepSpeed the load goes through ``deepspeed_load_checkpoint``, which
    restores the GaLore state itself. Under FSDP the checkpoint is the engine's own (distributed
    checkpoint) and holds the layers' own tensors, not merged weights: nothing to inject;
    galore_state.pt is loaded shard by shard afterwards."""
    state = state_of(trainer.model)
    if state is None or getattr(trainer, "is_deepspeed_enabled", False):
        return original()
    prepared = state.model
    if getattr(trainer, "is_fsdp_enabled", False):
        return load_fsdp_galore_state(trainer, prepared, original, folder)
    return _load_with_galore_state(original, prepared, folder, trainer)


def wrap_load_from_checkpoint(original: Callable) -> Callable:
    """The patch of ``Trainer._load_from_checkpoint`` (resume): the GaLore layers are restored too."""

    @functools.wraps(original)
    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        return _load_with_galore_checkpoint(
            self, lambda: original(self, resume_from_checkpoint, model), resume_from_checkpoint
        )

    return mark(_load_from_checkpoint)


def wrap_load_best_model(original: Callable) -> Callable:
    """The patch of ``Trainer._load_best_model``: the best checkpoint is verified, its GaLore layers restored."""

    @functools.wraps(original)
    def _load_best_model(self):
        folder = self.state.best_model_checkpoint
        if state_of(self.model) is not None and folder is not None and checkpoint_is_complete(folder):
            verify_checkpoint(folder)
        return _load_with_galore_checkpoint(self, lambda: original(self), folder)

    return mark(_load_best_model)


def wrap_train(original: Callable) -> Callable:
    """``train(resume_from_checkpoint=True)`` of a GaLore model picks the newest complete checkpoint;
    an explicit incomplete one is refused (:func:`_resolve_resume`)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def train(self, *args, **kwargs):
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:
            return original(self, *args, **kwargs)
        resume = bound.arguments.get("resume_from_checkpoint")
        if self.model is not None and state_of(self.model) is not None:
            if self.args.should_save:
                _remove_stale_temporaries(self.args.output_dir)
            if resume not in (None, False):
                resume = bound.arguments["resume_from_checkpoint"] = _resolve_resume(self.args.output_dir, resume)
                if isinstance(resume, (str, os.PathLike)) and os.path.isdir(resume):
                    verify_checkpoint(resume)
        return original(*bound.args, **bound.kwargs)

    return mark(train)


def _remove_stale_temporaries(output_dir: str) -> None:
    """Our temporaries in the checkpoint folders of `output_dir` whose writer died (a kill during a write)."""
    for _, folder in checkpoint_steps(output_dir):
        for path in remove_stale_temporaries(folder):
            logger.info("GaLore: removed %s, left by a run that stopped while writing it", path)

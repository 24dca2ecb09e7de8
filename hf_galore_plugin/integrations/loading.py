"""Loading and resume: the Trainer's loads restore every GaLore layer exactly from ``galore_state.pt``.

``train(resume_from_checkpoint=True)`` picks the newest complete checkpoint and every file of the
checkpoint is verified against its manifest before anything loads; ``_load_from_checkpoint`` and
``_load_best_model`` give each GaLore layer its own tensors from ``galore_state.pt`` while the Trainer
loads the merged model file, and check that both belong together. ``load_best_model_at_end`` verifies the
best checkpoint as a resume does (complete, manifest, ``galore_state.pt``, merged weights), and its
refusals say what to do about loading the best model, not about resuming. The engines' own resume paths
are in :mod:`.engine_resume`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from ..api import galore_layers, load_galore_state_dict
from ..checkpoint.files import GaLoreCheckpointError
from ..checkpoint.manifest import MANIFEST_NAME, remove_stale_temporaries, verify_manifest
from ..checkpoint.state import SavedLayout, apply_mutable_changes, check_merged_weights, read_checkpoint_state
from ..inject import state_dict_name
from ..layers import GaLoreLinear
from ..layers import rank as layer_rank
from ..registry import LAYERWISE_ALIASES
from ..state import state_of
from .common import checkpoint_is_complete, checkpoint_steps, latest_complete_checkpoint, step_of
from .engine_resume import LOAD_ADVICE, load_fsdp_galore_state
from .names import trainer_optimizer_name
from .patching import mark
from .saving import merged_linears

logger = logging.getLogger(__name__)

__all__ = ["BEST_MODEL_ADVICE", "verify_checkpoint", "wrap_load_from_checkpoint", "wrap_load_best_model", "wrap_train"]

# What to do when load_best_model_at_end cannot load the best checkpoint. Training has finished by then and
# its checkpoints are on disk: nothing is to be resumed or started again.
BEST_MODEL_ADVICE = (
    "load_best_model_at_end cannot load it as the best model. Training itself finished and the run's checkpoints "
    "are on disk: set load_best_model_at_end=False, or pick another checkpoint of this run and load it yourself "
    "(from_pretrained of its folder gives its merged model)."
)


def _own_keys(key: str, merged: torch.Tensor) -> Optional[dict[str, torch.Tensor]]:
    return {key: merged}


def saved_layout(model: nn.Module) -> SavedLayout:
    """Where and how `model`'s ``save_pretrained`` (the merged save) puts a merged weight in the model file:
    transformers 5 writes the weights of a model it converts on load back in the model's checkpoint layout
    (``revert_weight_conversion``: renamed keys; a fused expert stack as one tensor per expert and projection,
    under the checkpoint's names), other models (and transformers 4) under the model's own keys. None where
    the conversion needs other weights with this one (several model weights fused into one file tensor)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: a checkpoint holds the model's own keys
        return _own_keys
    if getattr(model, "config", None) is None:  # not a transformers model: nothing converts its weights
        return _own_keys
    revert: Callable[[Any, dict[str, torch.Tensor]], Any] = revert_weight_conversion

    def layout(key: str, merged: torch.Tensor) -> Optional[dict[str, torch.Tensor]]:
        try:
            return dict(revert(model, {key: merged}))
        except Exception:  # noqa: BLE001 - a converter that needs weights besides this one: not comparable alone
            return None

    return layout


def _merged_shape(layer: GaLoreLinear) -> tuple[int, ...]:
    """The shape of `layer`'s merged weight: out x in, behind an expert stack's expert dimension."""
    return (*layer.galore_factor.shape[:-2], layer.out_features, layer.in_features)


@contextlib.contextmanager
def _galore_state_injected(
    model: nn.Module,
    galore_state: dict[str, torch.Tensor],
    checkpoint_weights: dict[str, torch.Tensor],
    layout: SavedLayout,
) -> Iterator[None]:
    """While the Trainer loads a checkpoint's weights, GaLore layers receive their exact state.

    The checkpoint's weight of a GaLore layer is the merged W0 + scale*B Q^T (the checkpoint is a plain
    model), under the keys `layout` gives (a linear layer's ``weight``; an expert stack's, as transformers
    writes it, one tensor per expert and projection). A pre-hook of `model` takes those keys out of what
    loads, into `checkpoint_weights` (by key), to check that the state belongs to this checkpoint; a
    pre-hook of each layer puts the layer's own tensors from ``galore_state.pt`` (W0, possibly quantized,
    factor, basis, counters) in their place, so no key is reported missing or unexpected and nothing
    merged is copied into W0.
    """
    per_layer: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in galore_state.items():
        layer_name, _, sub_key = key.rpartition(".")
        per_layer.setdefault(layer_name, {})[sub_key] = value
    file_keys: set[str] = set()
    handles = []
    for layer_name, layer in galore_layers(model):
        key = layer.merged_weight_key(state_dict_name(layer_name))
        planned = layout(key, torch.empty(_merged_shape(layer), device="meta"))
        file_keys.update(planned or ())
        handles.append(layer._register_load_state_dict_pre_hook(_injecting_hook(per_layer.get(layer_name, {}), layer)))

    def take_merged(state_dict: dict[str, Any], prefix: str, *unused: Any) -> None:
        # Runs before the layers' hooks (a module's own hook runs before its children load).
        for key in file_keys:
            value = state_dict.pop(prefix + key, None)
            if value is not None:
                checkpoint_weights[key] = value

    handles.append(model._register_load_state_dict_pre_hook(take_merged))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _injecting_hook(layer_state: dict[str, torch.Tensor], layer: GaLoreLinear) -> Callable[..., None]:
    """The load pre-hook of one GaLore layer (:func:`_galore_state_injected`): its own tensors replace what
    the model file holds under its prefix (and a layer of rank_allocation='auto' takes their rank first)."""

    def inject(state_dict: dict[str, Any], prefix: str, *unused: Any) -> None:
        state_dict.pop(prefix + "weight", None)  # a merged weight is never W0
        state_dict.update({prefix + sub_key: value for sub_key, value in layer_state.items()})
        if layer._adaptive is not None:
            # The layer's own check ran before this hook put the factor in: take the saved rank now.
            layer_rank.before_load(layer, state_dict, prefix)

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


def verify_checkpoint(folder: Any, *, advice: Optional[str] = None) -> None:
    """Check every file of checkpoint `folder` against its manifest, before anything of it is loaded
    (:func:`~hf_galore_plugin.checkpoint.manifest.verify_manifest`); a refusal ends with `advice`, else the
    complete checkpoint to resume from instead."""
    if advice is None:
        hint = _earlier_complete_hint(folder)
        advice = hint[:1].upper() + hint[1:]
    timing = verify_manifest(str(folder), hint=advice)
    logger.debug("GaLore: checkpoint %s verified: %.1f MB in %.2f s", folder, timing["bytes"] / 1e6, timing["seconds"])


def _read_state(folder: str, model: nn.Module, trainer: Any) -> dict[str, Any]:
    """:func:`~hf_galore_plugin.checkpoint.state.read_checkpoint_state` of a Trainer's load: transformers'
    layerwise names resume checkpoints of the names they run (and back), refusals advise :data:`LOAD_ADVICE`."""
    return read_checkpoint_state(
        folder,
        model,
        trainer_optimizer_name(trainer),
        optimizer_aliases=LAYERWISE_ALIASES,
        advice=LOAD_ADVICE.get(),
    )


def _load_peft_with_galore_state(load: Callable[[], Any], model: nn.Module, folder: str, trainer: Any) -> Any:
    """peft models load a checkpoint through ``load_adapter`` (``set_peft_model_state_dict``), which asks each
    ``modules_to_save`` copy for its own keys: it sees plain layers (and stock experts modules) holding the
    merged weights meanwhile (:func:`merged_view`), and the GaLore layers get their exact state from
    ``galore_state.pt`` after."""
    payload = _read_state(folder, model, trainer)
    # Meanwhile the merged view's plain layers and stock experts modules hold the loaded merged weights, each
    # at the module path of the layer's merged weight: {key in the model's state dict: path}.
    paths = {
        layer.merged_weight_key(state_dict_name(name)): layer.merged_weight_key(name)
        for name, layer in galore_layers(model)
    }
    with merged_linears(model):
        result = load()
        checkpoint_weights = {key: model.get_parameter(path).detach().clone() for key, path in paths.items()}
    load_galore_state_dict(model, payload["state"])
    check_merged_weights(model, checkpoint_weights, folder, advice=LOAD_ADVICE.get())
    apply_mutable_changes(model, payload["changed"], where=f"checkpoint {folder}")
    return result


def _is_peft_model(model: Any) -> bool:
    return any(cls.__module__.startswith("peft.") for cls in type(model).__mro__)


def _load_with_galore_state(load: Callable[[], Any], model: nn.Module, folder: str, trainer: Any = None) -> Any:
    """Run `load` (the Trainer's load of the merged model file) while each GaLore layer takes its own tensors
    from ``galore_state.pt``, then check that both files belong together."""
    if trainer is not None and _is_peft_model(trainer.model):
        return _load_peft_with_galore_state(load, model, folder, trainer)
    payload = _read_state(folder, model, trainer)
    checkpoint_weights: dict[str, torch.Tensor] = {}
    layout = saved_layout(model)
    with _galore_state_injected(model, payload["state"], checkpoint_weights, layout):
        result = load()
    # strict: every layer and every key must be there (the injected load above is not strict)
    load_galore_state_dict(model, payload["state"])
    check_merged_weights(model, checkpoint_weights, folder, advice=LOAD_ADVICE.get(), saved_layout=layout)
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


def _verify_best_checkpoint(folder: str) -> None:
    """The checks of a resume before anything of the best checkpoint `folder` loads: it exists, it is
    complete (its manifest is there) and its files are the ones the manifest lists; refusals advise
    :data:`BEST_MODEL_ADVICE`."""
    where = f"best checkpoint {folder} (TrainerState.best_model_checkpoint)"
    if not os.path.isdir(folder):
        raise GaLoreCheckpointError(
            f"{where} is not on this machine's disk (a multi-node run keeps checkpoints on its main node unless "
            f"save_on_each_node=True), so its GaLore layers cannot be restored. {BEST_MODEL_ADVICE}"
        )
    if not checkpoint_is_complete(folder):
        raise GaLoreCheckpointError(
            f"{where} is incomplete: it has no {MANIFEST_NAME}, which a GaLore run writes last, so its files "
            f"cannot be verified (the manifest was removed, or the save that wrote it did not finish). "
            f"{BEST_MODEL_ADVICE}"
        )
    verify_checkpoint(folder, advice=BEST_MODEL_ADVICE)


def wrap_load_best_model(original: Callable) -> Callable:
    """The patch of ``Trainer._load_best_model``: the best checkpoint is verified as a resume verifies one,
    its GaLore layers restored; a refusal says what to do about the best model (:data:`BEST_MODEL_ADVICE`)."""

    @functools.wraps(original)
    def _load_best_model(self):
        folder = self.state.best_model_checkpoint
        if state_of(self.model) is None or folder is None:
            return original(self)
        token = LOAD_ADVICE.set(BEST_MODEL_ADVICE)
        try:
            _verify_best_checkpoint(folder)
            return _load_with_galore_checkpoint(self, lambda: original(self), folder)
        finally:
            LOAD_ADVICE.reset(token)

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

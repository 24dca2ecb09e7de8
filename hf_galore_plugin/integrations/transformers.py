"""transformers integration: optimizer names, the Trainer flow, merged saves, exact checkpoints.

What is patched (each once, by :mod:`hf_galore_plugin.integrations` when the module is imported):

- ``transformers.training_args``: every name of entry-point group ``hf_galore_plugin.optimizers``
  becomes a real member of ``OptimizerNames`` (an ``Enum``: members are added to
  ``_member_map_``/``_value2member_map_``/``_member_names_`` and as class attributes, exactly where
  ``EnumType`` puts the members it creates), so ``TrainingArguments(optim=...)``,
  ``HfArgumentParser`` choices and ``--help``, ``to_dict``/``to_json_string`` and pickling work for
  ``TrainingArguments`` and every dataclass subclass of it (TRL's configs).
- ``transformers.trainer``: ``Trainer.get_optimizer_cls_and_kwargs`` serves those names;
  ``Trainer.__init__`` replaces the layers (before any accelerate/FSDP/DeepSpeed wrapping) and
  attaches :class:`GaLoreCallback` (and binds every GaLoreCallback to its Trainer, whose DeepSpeed
  engine it needs); ``_load_from_checkpoint`` and ``_load_best_model`` restore ``galore_state.pt``
  with the weights, and so does ``deepspeed_load_checkpoint`` (the DeepSpeed resume path) after the
  engine loaded its own checkpoint.
- ``transformers.modeling_utils`` / ``peft.peft_model``: ``save_pretrained`` of a prepared model
  (what ``Trainer.save_model`` and every checkpoint call) writes the merged plain weights
  (standard keys, dtype as loaded), also from the state dict an engine gathered and passes in
  (DeepSpeed ZeRO-3, FSDP full state dict).

Names transformers already owns (``galore_adamw``, ``galore_adamw_8bit``) are served by the plugin
(logged once); ``HF_GALORE_PLUGIN_NO_TAKEOVER=1`` leaves them to transformers.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import transformers
from torch import nn

from .. import api as _api
from ..api import create_optimizer, galore_layers, load_galore_state_dict, merged_state_dict, prepare_model
from ..config import GaLoreConfig
from ..inject import plain_linear, restore_experts, swap_in_merged_experts, swap_submodule
from ..registry import list_optimizer_entry_points, load_optimizer_preset
from . import NO_PATCH_ENV
from .chunked_loss import configure_trainer_loss
from .optim_args import config_from_training_args

logger = logging.getLogger(__name__)

__all__ = [
    "NO_TAKEOVER_ENV",
    "NO_PATCH_ENV",
    "SUPPORTED_TRANSFORMERS",
    "PatchTarget",
    "apply_patches",
    "check_transformers_version",
    "trainer_patch_targets",
    "trainer_is_patched",
    "GaLoreOptimizerFactory",
    "served_optimizer_names",
    "galore_config_for",
    "prepare_model_for_trainer",
    "patch_training_args",
    "patch_trainer",
    "patch_modeling_utils",
    "patch_peft",
    "merged_view",
]

NO_TAKEOVER_ENV = "HF_GALORE_PLUGIN_NO_TAKEOVER"
# transformers' per-layer (layerwise) low-rank variants: they hook a separate optimizer on every
# parameter and cannot drive the plugin's reparametrized layers.
_LAYERWISE_NAMES = ("galore_adamw_layerwise", "galore_adamw_8bit_layerwise", "galore_adafactor_layerwise")

_lock = threading.RLock()
_served: dict[str, str] = {}  # optimizer name -> "added" | "takeover"
_takeover_logged = False


# The transformers versions the patches are tested on (tests/test_integration_*.py on 5.24,
# scripts/test_transformers_457.sh on 4.57.6). Outside it the plugin still patches, with one warning.
SUPPORTED_TRANSFORMERS = ">=4.57,<5.25"
_version_checked = False


def _installed_transformers() -> str:
    return str(getattr(transformers, "__version__", "unknown"))


def _internals_missing(what: str) -> RuntimeError:
    return RuntimeError(
        f"hf_galore_plugin cannot patch transformers {_installed_transformers()}: missing {what}. "
        f"Supported: transformers{SUPPORTED_TRANSFORMERS}; install a version in that range, or set "
        f"{NO_PATCH_ENV}=1 and use the plugin without patching (README, 'Without patching transformers')."
    )


def check_transformers_version() -> bool:
    """True when the installed transformers is in :data:`SUPPORTED_TRANSFORMERS`; otherwise warns once
    (a ``UserWarning`` naming both) and returns False. The patches are applied either way: each target
    is checked before anything is changed (:func:`apply_patches`)."""
    global _version_checked
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    installed = _installed_transformers()
    try:
        supported = Version(installed) in SpecifierSet(SUPPORTED_TRANSFORMERS, prereleases=True)
    except InvalidVersion:
        supported = False
    if not supported and not _version_checked:
        warnings.warn(
            f"hf_galore_plugin is tested with transformers{SUPPORTED_TRANSFORMERS}; the installed "
            f"transformers {installed} is outside that range, so its patches of transformers may not fit "
            f"(set {NO_PATCH_ENV}=1 to patch nothing).",
            UserWarning,
            stacklevel=2,
        )
    _version_checked = True
    return supported


def served_optimizer_names() -> dict[str, str]:
    """The optimizer names the plugin serves: name -> 'added' (new member) or 'takeover'."""
    return dict(_served)


def _served_name(optim: Any) -> Optional[str]:
    value = getattr(optim, "value", optim)
    return value if isinstance(value, str) and value in _served else None


# ---------------------------------------------------------------------- OptimizerNames
def _optimizer_name_member(value: str):
    """Unpickling target of the plugin's members: registers the plugin in a fresh process first."""
    from transformers.training_args import OptimizerNames

    return OptimizerNames(value)


def _add_enum_member(enum_cls: type, member_name: str, value: str):
    for attribute in ("_member_map_", "_value2member_map_", "_member_names_"):
        if not hasattr(enum_cls, attribute):
            raise _internals_missing(f"{enum_cls.__name__}.{attribute} (enum internals)")
    if member_name in enum_cls._member_map_:
        raise RuntimeError(
            f"optimizer name {value!r} cannot be added to {enum_cls.__name__}: member {member_name} already "
            f"exists with value {enum_cls._member_map_[member_name].value!r}; rename the entry point"
        )
    member_type = enum_cls._member_type_ if enum_cls._member_type_ is not object else str
    member = member_type.__new__(enum_cls, value)
    member._value_ = value
    member._name_ = member_name
    member.__objclass__ = enum_cls
    member._sort_order_ = len(enum_cls._member_names_)
    # Pickling an Enum member stores (OptimizerNames, (value,)): loading that in a process that has
    # not imported the plugin fails. This reducer imports the plugin (which registers) first.
    member.__reduce_ex__ = lambda protocol: (_optimizer_name_member, (value,))
    # a class attribute first: EnumType.__setattr__ refuses names that are already members
    type.__setattr__(enum_cls, member_name, member)
    enum_cls._member_map_[member_name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(member_name)
    return member


def patch_training_args() -> None:
    """Make every entry-point optimizer name a member of ``OptimizerNames`` (idempotent)."""
    from transformers import training_args

    enum_cls = getattr(training_args, "OptimizerNames", None)
    if enum_cls is None:
        raise _internals_missing("transformers.training_args.OptimizerNames")
    takeover = os.environ.get(NO_TAKEOVER_ENV, "0").lower() not in ("1", "true", "yes")
    with _lock:
        check_transformers_version()
        for attribute in ("_member_map_", "_value2member_map_", "_member_names_"):
            if not hasattr(enum_cls, attribute):
                raise _internals_missing(f"transformers.training_args.OptimizerNames.{attribute} (enum internals)")
        names = [name for name in list_optimizer_entry_points() if name not in _served]
        new = [name for name in names if name not in enum_cls._value2member_map_]
        for name in new:  # every clash is found before the first member is added
            if name.upper() in enum_cls._member_map_:
                raise RuntimeError(
                    f"optimizer name {name!r} cannot be added to OptimizerNames: member {name.upper()} already "
                    f"exists with value {enum_cls._member_map_[name.upper()].value!r}; rename the entry point"
                )
        for name in names:
            if name in new:
                _add_enum_member(enum_cls, name.upper(), name)
                _served[name] = "added"
            elif takeover:
                _served[name] = "takeover"


# ---------------------------------------------------------------------- config and model preparation
def galore_config_for(args: Any, name: Optional[str] = None) -> GaLoreConfig:
    """The GaLoreConfig that ``TrainingArguments`` ask for: preset + optim_args + optim_target_modules."""
    name = name or _served_name(args.optim)
    if name is None:
        raise ValueError(f"optim={getattr(args.optim, 'value', args.optim)!r} is not served by hf_galore_plugin")
    return config_from_training_args(
        load_optimizer_preset(name),
        optim_args=args.optim_args,
        optim_target_modules=args.optim_target_modules,
        optimizer_name=name,
    )


def _check_training_args(args: Any, name: str) -> None:
    """Configurations that would silently train something else fail here, before the first step."""
    ds_config = getattr(getattr(args, "hf_deepspeed_config", None), "config", None)
    if ds_config is None and isinstance(getattr(args, "deepspeed", None), dict):
        ds_config = args.deepspeed
    if ds_config is None:
        ds_config = getattr(getattr(args, "deepspeed_plugin", None), "deepspeed_config", None)
    if isinstance(ds_config, dict) and "optimizer" in ds_config:
        raise ValueError(
            f"optim={name!r}: the DeepSpeed config has an 'optimizer' block "
            f"({ds_config['optimizer'].get('type', '?')!r}), which would replace the GaLore optimizer "
            "silently. Remove the 'optimizer' block from the DeepSpeed config (keep 'scheduler' if you like)."
        )


def _check_layerwise(args: Any) -> None:
    value = getattr(getattr(args, "optim", None), "value", getattr(args, "optim", None))
    if value in _LAYERWISE_NAMES and any(kind == "takeover" for kind in _served.values()):
        raise ValueError(
            f"optim={value!r} is transformers' layerwise GaLore (galore-torch), which cannot be combined with "
            f"hf_galore_plugin (it serves {sorted(_served)}). Use optim='galore_adamw' or 'galore_adamw_8bit': "
            "the plugin keeps only low-rank optimizer state, so no per-layer optimizer is needed. To use "
            f"transformers' implementation instead, set {NO_TAKEOVER_ENV}=1."
        )


def _is_galore_layer(module: nn.Module) -> bool:
    return hasattr(module, "galore_factor")


def _linear_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for module_name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not _is_galore_layer(module):
            yield module_name, module


def prepare_model_for_trainer(model: nn.Module, config: GaLoreConfig, name: str) -> nn.Module:
    """``prepare_model`` with the optimizer name and the model's linear layers in its errors.

    The core logs what was targeted and skipped, and why (``model.galore_report``). A model that
    DeepSpeed ZeRO-3 already partitioned (``from_pretrained`` under a stage-3 config) is prepared
    one gathered layer at a time and partitioned again with the same DeepSpeed config.
    """
    from .distributed import is_zero3_partitioned, prepare_zero3_model

    try:
        if is_zero3_partitioned(model):
            from transformers.integrations.deepspeed import deepspeed_config

            ds_config = deepspeed_config()
            if ds_config is None:
                raise ValueError(
                    "the model's parameters are partitioned by DeepSpeed ZeRO-3 but no DeepSpeed config is active; "
                    "create TrainingArguments(deepspeed=...) before loading the model"
                )
            return prepare_zero3_model(model, config, ds_config)
        return prepare_model(model, config)
    except ValueError as exc:
        linear_names = [module_name for module_name, _ in _linear_layers(model)]
        raise ValueError(
            f"optim={name!r} cannot prepare {type(model).__name__}: {exc} "
            f"(target_modules={config.target_modules!r}, rank={config.rank}; its nn.Linear layers: "
            f"{linear_names[:12]}{' ...' if len(linear_names) > 12 else ''})"
        ) from exc


# ---------------------------------------------------------------------- optimizer
class GaLoreOptimizerFactory(torch.optim.Optimizer):
    """What ``get_optimizer_cls_and_kwargs`` returns for the plugin's names.

    A ``torch.optim.Optimizer`` subclass so that every Trainer version calls it as
    ``cls(grouped_parameters, **kwargs)`` (5.x treats any other callable as a model factory);
    ``__new__`` returns the optimizer from :func:`hf_galore_plugin.create_optimizer` built on the
    Trainer's decay/no-decay groups, so ``__init__`` never runs.
    """

    def __new__(cls, params, *, galore_model, galore_config, lr, betas, eps, weight_decay):
        return create_optimizer(
            galore_model,
            galore_config,
            lr=lr,
            weight_decay=weight_decay,
            betas=betas,
            eps=eps,
            param_groups=list(params),
        )


def _galore_optimizer_cls_and_kwargs(args: Any, model: Optional[nn.Module], name: str):
    global _takeover_logged
    if model is None:
        raise ValueError(f"optim={name!r} needs the model: Trainer.get_optimizer_cls_and_kwargs(args, model)")
    if _served[name] == "takeover" and not _takeover_logged:
        _takeover_logged = True
        logger.warning(
            "optim=%r is served by hf_galore_plugin, not by transformers' galore-torch integration "
            "(set %s=1 to use transformers' implementation)",
            name,
            NO_TAKEOVER_ENV,
        )
    from .callback import galore_model_of

    prepared = galore_model_of(model)
    if prepared is None:
        if model is not getattr(model, "module", model):
            raise ValueError(
                f"optim={name!r}: the model is wrapped ({type(model).__name__}) but its layers were not "
                "replaced; construct the Trainer with the optimizer name (or call "
                "hf_galore_plugin.prepare_model) before wrapping"
            )
        prepared = prepare_model_for_trainer(model, galore_config_for(args, name), name)
    from .fsdp1 import fsdp1_units

    if prepared.galore_config.state_bits == 8 and fsdp1_units(model):
        # Found here, when the Trainer builds the optimizer after wrapping: before the first step.
        raise ValueError(
            f"optim={name!r} keeps 8-bit optimizer state, which FSDP1's checkpoints cannot hold "
            "(FSDP.optim_state_dict gathers state tensors shaped and typed like the parameter; 8-bit state adds "
            "block scales), so the first checkpoint would fail. Pass optim_args='state_bits=32' (fp32 moments, "
            "still low-rank), or use FSDP2 (fsdp_version: 2) or DeepSpeed ZeRO, which keep 8-bit state."
        )
    kwargs = {
        "lr": args.learning_rate,
        "betas": (args.adam_beta1, args.adam_beta2),
        "eps": args.adam_epsilon,
        "weight_decay": args.weight_decay,
        "galore_model": prepared,
        "galore_config": prepared.galore_config,
    }
    return GaLoreOptimizerFactory, kwargs


# ---------------------------------------------------------------------- checkpoints
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

        def inject(state_dict, prefix, *unused, layer_state=per_layer.get(layer_name, {}), layer_name=layer_name):
            merged = state_dict.pop(prefix + "weight", None)
            if merged is not None:
                checkpoint_weights[layer_name] = merged
            state_dict.update({prefix + sub_key: value for sub_key, value in layer_state.items()})

        handles.append(layer._register_load_state_dict_pre_hook(inject))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def checkpoint_is_complete(folder: str) -> bool:
    """A GaLore checkpoint is complete when its manifest exists: the integration writes it (atomically)
    after every other file of the checkpoint, ``galore_state.pt`` included, and removes a stale one first."""
    from .manifest import MANIFEST_NAME

    return os.path.isfile(os.path.join(folder, MANIFEST_NAME))


def _checkpoint_steps(output_dir: str) -> list[tuple[int, str]]:
    """(step, folder) of every ``checkpoint-N`` folder in `output_dir`, newest first."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    found = []
    if not os.path.isdir(output_dir):
        return found
    for entry in os.listdir(output_dir):
        head, _, step = entry.rpartition("-")
        path = os.path.join(output_dir, entry)
        if head == PREFIX_CHECKPOINT_DIR and step.isdigit() and os.path.isdir(path):
            found.append((int(step), path))
    return sorted(found, reverse=True)


def latest_complete_checkpoint(output_dir: str) -> Optional[str]:
    """The newest complete GaLore checkpoint folder of `output_dir`, or None."""
    for _, folder in _checkpoint_steps(output_dir):
        if checkpoint_is_complete(folder):
            return folder
    return None


def _resolve_resume(output_dir: str, resume: Any) -> Any:
    """The checkpoint a GaLore run resumes from: ``True`` picks the newest *complete* one (a folder that
    a crash left without its manifest is skipped, with a warning); an explicit incomplete folder is
    refused, naming the complete one to use."""
    from .manifest import MANIFEST_NAME

    if resume is True:
        checkpoints = _checkpoint_steps(output_dir)
        if not checkpoints:
            return resume  # the Trainer reports that there is no checkpoint
        complete = latest_complete_checkpoint(output_dir)
        if complete is None:
            raise ValueError(
                f"resume_from_checkpoint=True: no complete GaLore checkpoint in {output_dir}: "
                f"{[folder for _, folder in checkpoints]} lack {MANIFEST_NAME} (a run stopped while writing "
                "them). Start a new run, or pass a complete checkpoint folder of another output_dir."
            )
        skipped = [folder for step, folder in checkpoints if step > _step_of(complete)]
        if skipped:
            logger.warning(
                "resume_from_checkpoint=True: skipping incomplete checkpoint(s) %s (no %s: the run stopped while "
                "writing them); resuming from %s",
                skipped,
                MANIFEST_NAME,
                complete,
            )
        return complete
    if isinstance(resume, (str, os.PathLike)) and os.path.isdir(resume) and not checkpoint_is_complete(resume):
        from .callback import GALORE_STATE_NAME

        older = (
            f" (it has a {GALORE_STATE_NAME}: if a version without manifests wrote it and you trust its files, "
            "write one with hf_galore_plugin.integrations.manifest.write_manifest(folder, global_step=N))"
            if os.path.isfile(os.path.join(resume, GALORE_STATE_NAME))
            else ""
        )
        raise ValueError(
            f"checkpoint {resume} is incomplete: it has no {MANIFEST_NAME}, which a GaLore run writes last (the "
            f"run stopped while writing the checkpoint, or it was not written by a GaLore run of this "
            f"version{older}); {_earlier_complete_hint(resume)}"
        )
    return resume


def _earlier_complete_hint(folder: Any) -> str:
    """What to resume from instead of `folder`: the newest complete checkpoint before it, next to it."""
    parent = os.path.dirname(os.path.abspath(folder))
    earlier = [
        path for step, path in _checkpoint_steps(parent) if step < _step_of(folder) and checkpoint_is_complete(path)
    ]
    if earlier:
        return f"resume from {earlier[0]} (pass it as resume_from_checkpoint)."
    return "no complete checkpoint is next to it: restore its files, or start a new run."


def verify_checkpoint(folder: Any) -> None:
    """Check every file of checkpoint `folder` against its manifest, before anything of it is loaded
    (:func:`~hf_galore_plugin.integrations.manifest.verify_manifest`)."""
    from .manifest import verify_manifest

    hint = _earlier_complete_hint(folder)
    timing = verify_manifest(str(folder), hint=hint[:1].upper() + hint[1:])
    logger.debug("GaLore: checkpoint %s verified: %.1f MB in %.2f s", folder, timing["bytes"] / 1e6, timing["seconds"])


def _step_of(folder: str) -> int:
    step = os.path.basename(os.path.normpath(folder)).rpartition("-")[2]
    return int(step) if step.isdigit() else -1


def _saved_global_step(folder: str) -> Optional[int]:
    path = os.path.join(folder, "trainer_state.json")
    if not os.path.isfile(path):
        return None
    import json

    try:
        with open(path) as handle:
            return int(json.load(handle)["global_step"])
    except (ValueError, KeyError, TypeError, OSError):
        return None


def _read_galore_state(folder: str, prepared: Optional[nn.Module] = None, trainer: Any = None) -> dict[str, Any]:
    """Read and check a checkpoint's ``galore_state.pt``: its step against the checkpoint's own
    ``trainer_state.json``, its settings against the model's (:data:`hf_galore_plugin.api.FIXED_FIELDS`
    refused, the others returned as changes). Returns the file's dict plus ``"changed"``."""
    from ..api import GaLoreCheckpointError, check_galore_counters, compare_galore_config, read_galore_checkpoint
    from .callback import GALORE_STATE_NAME

    path = os.path.join(folder, GALORE_STATE_NAME)
    if not os.path.isfile(path):
        raise ValueError(
            f"checkpoint {folder} has no {GALORE_STATE_NAME}: the GaLore layers (base weight, factor, basis, "
            "counters) cannot be restored exactly. Resume from a checkpoint written by a GaLore run, or "
            "start a new run from the merged model with from_pretrained."
        )
    payload = read_galore_checkpoint(path, checkpoint=folder)
    step = _saved_global_step(folder)
    if step is not None and step != payload["global_step"]:
        raise GaLoreCheckpointError(
            f"{path} belongs to step {payload['global_step']}, but checkpoint {folder} is step {step} "
            f"(trainer_state.json): the file was copied from another checkpoint or left by another run. "
            "Resume from a checkpoint whose files were written together."
        )
    payload["changed"] = {}
    if prepared is not None:
        payload["changed"] = compare_galore_config(
            payload["config"], prepared.galore_config, where=f"checkpoint {folder}"
        )
        check_galore_counters(
            prepared,
            payload["state"],
            payload["config"],
            global_step=step if step is not None else payload["global_step"],
            where=f"checkpoint {folder} ({GALORE_STATE_NAME})",
        )
    name = _served_name(getattr(getattr(trainer, "args", None), "optim", None))
    # None: the run trained with its own optimizer (optimizers=(create_optimizer(...), None)), no name to compare
    if name is not None and payload["optimizer"] is not None and payload["optimizer"] != name:
        raise GaLoreCheckpointError(
            f"checkpoint {folder} was trained with optim={payload['optimizer']!r}, this run uses optim={name!r}: "
            "the optimizer state and GaLore layers differ between them. Resume with "
            f"optim={payload['optimizer']!r}, or start a new run from the merged model."
        )
    return payload


def _check_merged_weights(model: nn.Module, checkpoint_weights: dict[str, torch.Tensor], folder: str) -> None:
    """The merged weight the checkpoint's model file holds for every GaLore layer must be the one the
    loaded GaLore state gives (to rounding: both come from the same tensors when they belong together)."""
    from ..api import GaLoreCheckpointError
    from .callback import GALORE_STATE_NAME

    for layer_name, layer in galore_layers(model):
        saved = checkpoint_weights.get(layer_name)
        if saved is None or saved.is_meta:
            continue
        with torch.no_grad():
            loaded = layer.effective_weight(torch.float32)
            saved32 = saved.to(device=loaded.device, dtype=torch.float32)
            if saved32.shape != loaded.shape:
                raise GaLoreCheckpointError(
                    f"checkpoint {folder}: layer {layer_name!r} is {tuple(saved32.shape)} in the model file, "
                    f"{tuple(loaded.shape)} in {GALORE_STATE_NAME}"
                )
            rtol = max(1e-5, 2 * torch.finfo(saved.dtype).eps) if saved.is_floating_point() else 1e-5
            scale = float(saved32.abs().max())
            diff = float((loaded - saved32).abs().max())
            if not diff <= rtol * max(scale, 1e-12):
                raise GaLoreCheckpointError(
                    f"checkpoint {folder}: its model file and {GALORE_STATE_NAME} disagree: the merged weight of "
                    f"{layer_name!r} they give differs by {diff:.3g} (largest weight {scale:.3g}). They were not "
                    "written together (one was left by another run in the same output_dir, or copied from another "
                    "checkpoint), or one of them was damaged before the checkpoint's manifest was written. Resume "
                    "from a checkpoint whose files were written together."
                )


def _load_peft_with_galore_state(load: Callable[[], Any], model: nn.Module, folder: str, trainer: Any) -> Any:
    """peft models load a checkpoint through ``load_adapter`` (``set_peft_model_state_dict``), which asks each
    ``modules_to_save`` copy for its own keys: it sees plain layers holding the merged weights meanwhile
    (:func:`merged_view`), and the GaLore layers get their exact state from ``galore_state.pt`` after."""
    from ..api import apply_mutable_changes

    payload = _read_galore_state(folder, model, trainer)
    with _merged_linears(model) as linears:
        result = load()
        checkpoint_weights = {name: linear.weight.detach().clone() for name, linear in linears.items()}
    load_galore_state_dict(model, payload["state"])
    _check_merged_weights(model, checkpoint_weights, folder)
    apply_mutable_changes(model, payload["changed"], where=f"checkpoint {folder}")
    return result


def _is_peft_model(model: Any) -> bool:
    return any(cls.__module__.startswith("peft.") for cls in type(model).__mro__)


def _load_with_galore_state(load: Callable[[], Any], model: nn.Module, folder: str, trainer: Any = None) -> Any:
    from ..api import apply_mutable_changes

    if trainer is not None and _is_peft_model(trainer.model):
        return _load_peft_with_galore_state(load, model, folder, trainer)
    payload = _read_galore_state(folder, model, trainer)
    checkpoint_weights: dict[str, torch.Tensor] = {}
    with _galore_state_injected(model, payload["state"], checkpoint_weights):
        result = load()
    # strict: every layer and every key must be there (the injected load above is not strict)
    load_galore_state_dict(model, payload["state"])
    _check_merged_weights(model, checkpoint_weights, folder)
    apply_mutable_changes(model, payload["changed"], where=f"checkpoint {folder}")
    return result


# ---------------------------------------------------------------------- patches
@dataclass(frozen=True)
class PatchTarget:
    """One thing a patch replaces: ``owner.attribute`` (a class or a module), or ``owner[attribute]``
    when `owner` is a dict (a handler table; such a key may be absent and is then added)."""

    owner: Any
    attribute: Any
    wrap: Callable[[Any], Any]  # the original (None for an absent table key) -> the replacement
    name: str  # for errors, e.g. "transformers.Trainer._load_best_model"

    def exists(self) -> bool:
        if isinstance(self.owner, dict):
            return True
        if isinstance(self.owner, type):
            return self.attribute in self.owner.__dict__  # defined on the class itself, not inherited
        return callable(getattr(self.owner, self.attribute, None))

    def current(self) -> Any:
        if isinstance(self.owner, dict):
            return self.owner.get(self.attribute)
        if isinstance(self.owner, type):
            return self.owner.__dict__.get(self.attribute)
        return getattr(self.owner, self.attribute, None)

    def set(self, value: Any) -> None:
        if isinstance(self.owner, dict):
            if value is None:
                self.owner.pop(self.attribute, None)
            else:
                self.owner[self.attribute] = value
        else:
            setattr(self.owner, self.attribute, value)


def _is_marked(value: Any) -> bool:
    return getattr(getattr(value, "__func__", value), "_hf_galore_plugin_patch", False)


def _patched(cls: type, attribute: str) -> bool:
    return _is_marked(cls.__dict__.get(attribute))


def _mark(function: Callable) -> Callable:
    function._hf_galore_plugin_patch = True
    return function


def apply_patches(targets: list[PatchTarget], requires: tuple[PatchTarget, ...] = ()) -> bool:
    """Apply every patch of `targets`, or none: each target (and each of `requires`, attributes the
    patches call but do not replace) is checked first, and one error names every missing one with the
    installed transformers version and the supported range; every replacement is built before the first
    is set, and a failure while setting puts the originals back. Targets already patched are skipped
    (idempotent). Returns True when something was patched."""
    with _lock:
        check_transformers_version()
        missing = [target.name for target in (*requires, *targets) if not target.exists()]
        if missing:
            raise _internals_missing(", ".join(missing))
        todo = [target for target in targets if not _is_marked(target.current())]
        replacements = []
        for target in todo:
            replacement = target.wrap(target.current())
            if not _is_marked(replacement):
                raise TypeError(f"hf_galore_plugin: the patch of {target.name} is not marked (_mark)")
            replacements.append((target, replacement))
        applied: list[tuple[PatchTarget, Any]] = []
        try:
            for target, replacement in replacements:
                applied.append((target, target.current()))
                target.set(replacement)
        except BaseException:
            for target, original in reversed(applied):
                target.set(original)
            raise
        return bool(replacements)


def _optimizer_handler_table(trainer_module: Any) -> Optional[dict]:
    """transformers' own table of optimizer handlers (5.x: ``_OPTIMIZER_HANDLERS``, name -> handler(ctx),
    read by ``Trainer.get_optimizer_cls_and_kwargs``), or None where the version has none (4.57)."""
    table = getattr(trainer_module, "_OPTIMIZER_HANDLERS", None)
    return table if isinstance(table, dict) else None


def trainer_patch_targets(trainer_module: Any) -> list[PatchTarget]:
    """Everything :func:`patch_trainer` replaces in `trainer_module` (``transformers.trainer``)."""
    trainer_cls = getattr(trainer_module, "Trainer", None)
    if not isinstance(trainer_cls, type):
        raise _internals_missing("transformers.trainer.Trainer")
    targets = []
    table = _optimizer_handler_table(trainer_module)
    if table is not None:
        # the plugin's names get their own entries; get_optimizer_cls_and_kwargs stays transformers'
        from transformers.training_args import OptimizerNames

        for name in sorted(_served):
            targets.append(
                PatchTarget(
                    table,
                    OptimizerNames(name),
                    _optimizer_handler(name),
                    f"transformers.trainer._OPTIMIZER_HANDLERS[{name!r}]",
                )
            )
    else:
        targets.append(
            PatchTarget(
                trainer_cls,
                "get_optimizer_cls_and_kwargs",
                _wrap_optimizer_dispatch,
                "transformers.Trainer.get_optimizer_cls_and_kwargs",
            )
        )
    for attribute, wrap in (
        ("__init__", _wrap_init),
        ("_load_from_checkpoint", _wrap_load_from_checkpoint),
        ("_load_best_model", _wrap_load_best_model),
        ("_load_optimizer_and_scheduler", _wrap_load_optimizer_and_scheduler),
        ("_save_checkpoint", _wrap_save_checkpoint),
        ("train", _wrap_train),
    ):
        targets.append(PatchTarget(trainer_cls, attribute, wrap, f"transformers.Trainer.{attribute}"))
    targets.append(
        PatchTarget(
            trainer_module,
            "deepspeed_load_checkpoint",
            _wrap_deepspeed_load_checkpoint,
            "transformers.trainer.deepspeed_load_checkpoint",
        )
    )
    return targets


def _trainer_requires(trainer_module: Any) -> tuple[PatchTarget, ...]:
    """Trainer methods the patches call without replacing them."""
    trainer_cls = trainer_module.Trainer
    return (
        PatchTarget(trainer_cls, "_get_output_dir", lambda original: original, "transformers.Trainer._get_output_dir"),
    )


def trainer_is_patched() -> bool:
    """True when ``transformers.Trainer`` carries the plugin's patches (False without them, e.g. under
    ``HF_GALORE_PLUGIN_NO_PATCH=1``, or when transformers is not imported yet)."""
    trainer_module = sys.modules.get("transformers.trainer")
    trainer_cls = getattr(trainer_module, "Trainer", None)
    return isinstance(trainer_cls, type) and _patched(trainer_cls, "_save_checkpoint")


def patch_trainer() -> None:
    """Patch ``transformers.trainer`` (:func:`trainer_patch_targets`), all or nothing (idempotent)."""
    from transformers import trainer as trainer_module

    patch_training_args()
    with _lock:
        apply_patches(trainer_patch_targets(trainer_module), _trainer_requires(trainer_module))


def _optimizer_handler(name: str) -> Callable[[Any], Callable]:
    def wrap(original: Any) -> Callable:
        def galore_optimizer_handler(ctx):
            return _galore_optimizer_cls_and_kwargs(ctx.args, ctx.model, name)

        return _mark(galore_optimizer_handler)

    return wrap


def _wrap_optimizer_dispatch(original: Any) -> Any:
    original = getattr(original, "__func__", original)

    @functools.wraps(original)
    def get_optimizer_cls_and_kwargs(args, model=None):
        name = _served_name(args.optim)
        if name is None:
            return original(args, model)
        return _galore_optimizer_cls_and_kwargs(args, model, name)

    return staticmethod(_mark(get_optimizer_cls_and_kwargs))


def _wrap_init(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:
            return original(self, *args, **kwargs)  # let the Trainer report the bad call
        training_args = bound.arguments.get("args")
        _check_layerwise(training_args)
        from .callback import galore_model_of

        name = _served_name(getattr(training_args, "optim", None))
        if name is None:
            _check_foreign_optimizer(bound.arguments, training_args)
            original(*bound.args, **bound.kwargs)
            if getattr(self, "model", None) is not None and galore_model_of(self.model) is not None:
                # a GaLore model with the user's own optimizer: without the callback no layer would train
                _attach_callback(self, None)
            _bind_callbacks(self)
            return
        config = galore_config_for(training_args, name)
        _check_training_args(training_args, name)
        if bound.arguments.get("model") is not None:
            prepare_model_for_trainer(bound.arguments["model"], config, name)
        elif bound.arguments.get("model_init") is not None:
            bound.arguments["model_init"] = _preparing_model_init(bound.arguments["model_init"], config, name)
        original(*bound.args, **bound.kwargs)
        configure_trainer_loss(self, config)
        _attach_callback(self, config)
        _bind_callbacks(self)

    return _mark(__init__)


def _check_foreign_optimizer(arguments: dict[str, Any], training_args: Any) -> None:
    """A GaLore-prepared model given to a Trainer whose optimizer the Trainer builds from another name
    (``adamw_torch``): that optimizer has no GaLore groups (no eps scaling, no base decay) and nothing
    drives the layers' refreshes. Refused; an optimizer passed in ``optimizers=`` is the user's choice."""
    from .callback import galore_model_of

    model = arguments.get("model")
    optimizers = arguments.get("optimizers") or (None, None)
    has_optimizer = optimizers[0] is not None or arguments.get("optimizer_cls_and_kwargs") is not None
    if model is None or has_optimizer or galore_model_of(model) is None:
        return
    optim = getattr(getattr(training_args, "optim", None), "value", getattr(training_args, "optim", None))
    raise ValueError(
        f"the model holds GaLore layers (hf_galore_plugin.prepare_model) but TrainingArguments.optim={optim!r} "
        "builds an optimizer that cannot train them. Use one of the plugin's names, e.g. optim='galore_adamw' "
        "with optim_args matching the model's GaLoreConfig, or pass "
        "optimizers=(hf_galore_plugin.create_optimizer(model, lr=...), None)."
    )


def _bind_callbacks(trainer: Any) -> None:
    from .callback import GaLoreCallback

    for callback in list(trainer.callback_handler.callbacks):  # a copy: binding moves the callback
        if isinstance(callback, GaLoreCallback):
            callback.bind_trainer(trainer)


def _preparing_model_init(model_init: Callable, config: GaLoreConfig, name: str) -> Callable:
    @functools.wraps(model_init)  # keeps the signature: Trainer.call_model_init counts its arguments
    def galore_model_init(*args):
        return prepare_model_for_trainer(model_init(*args), config, name)

    return galore_model_init


def _attach_callback(trainer: Any, config: Optional[GaLoreConfig]) -> None:
    from .callback import GaLoreCallback

    handler = trainer.callback_handler
    if any(isinstance(callback, GaLoreCallback) for callback in handler.callbacks):
        return
    # first, so that the values it adds in on_log reach the reporting callbacks after it
    handler.callbacks.insert(0, GaLoreCallback(config))


def _load_with_galore_checkpoint(trainer: Any, original: Callable[[], Any], folder: str) -> Any:
    """Run the Trainer's own load of checkpoint `folder`, restoring the GaLore layers from its
    ``galore_state.pt``. Under DeepSpeed the load goes through ``deepspeed_load_checkpoint``, which
    restores the GaLore state itself. Under FSDP the checkpoint is the engine's own (distributed
    checkpoint) and holds the layers' own tensors, not merged weights: nothing to inject;
    galore_state.pt is loaded shard by shard afterwards."""
    from .callback import galore_model_of

    prepared = galore_model_of(trainer.model)
    if prepared is None or getattr(trainer, "is_deepspeed_enabled", False):
        return original()
    if getattr(trainer, "is_fsdp_enabled", False):
        from ..api import apply_mutable_changes
        from .distributed import load_gathered_galore_state_dict

        result = original()
        root = getattr(trainer, "model_wrapped", None) or trainer.model
        payload = _read_galore_state(folder, prepared, trainer)
        load_gathered_galore_state_dict(prepared, payload["state"], root=root)  # every rank
        apply_mutable_changes(prepared, payload["changed"], where=f"checkpoint {folder}")
        return result
    return _load_with_galore_state(original, prepared, folder, trainer)


def _wrap_load_from_checkpoint(original: Callable) -> Callable:
    @functools.wraps(original)
    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        return _load_with_galore_checkpoint(
            self, lambda: original(self, resume_from_checkpoint, model), resume_from_checkpoint
        )

    return _mark(_load_from_checkpoint)


def _wrap_load_best_model(original: Callable) -> Callable:
    @functools.wraps(original)
    def _load_best_model(self):
        from .callback import galore_model_of

        folder = self.state.best_model_checkpoint
        if galore_model_of(self.model) is not None and folder is not None and checkpoint_is_complete(folder):
            verify_checkpoint(folder)
        return _load_with_galore_checkpoint(self, lambda: original(self), folder)

    return _mark(_load_best_model)


def _wrap_load_optimizer_and_scheduler(original: Callable) -> Callable:
    """FSDP1 sharded checkpoints: accelerate's load_fsdp_optimizer reads the saved state into the
    structure of the current optimizer's FSDP.optim_state_dict, which is empty for an optimizer that has
    not stepped yet, so a resume silently restarts the Adam moments (torch's AdamW too, accelerate 1.x /
    torch 2.13). Our optimizer first gets zero state for every parameter so there is something to fill."""

    @functools.wraps(original)
    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is not None and _is_fsdp1(self):
            from .callback import unwrap_optimizer

            optimizer = unwrap_optimizer(self.optimizer)
            if hasattr(optimizer, "initialize_state"):
                optimizer.initialize_state()
        return original(self, checkpoint)

    return _mark(_load_optimizer_and_scheduler)


def _wrap_save_checkpoint(original: Callable) -> Callable:
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
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    from .callback import galore_model_of

    @functools.wraps(original)
    def _save_checkpoint(self, model, trial, *args, **kwargs):
        prepared = galore_model_of(self.model)
        if prepared is None:
            return original(self, model, trial, *args, **kwargs)
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
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
            error = _api.checkpoint_write_error(
                exc, _file_being_written(folder, exc), previous=latest_complete_checkpoint(run_dir)
            )
            if error is not None:
                raise error from None
            raise
        if self.args.should_save and limit is not None and limit > 0:
            _rotate(self, run_dir)

    return _mark(_save_checkpoint)


def _mark_incomplete(folder: str) -> None:
    """Make a checkpoint folder about to be (re)written incomplete: its manifest first, then its
    ``galore_state.pt`` and our temporaries (a run killed while writing them) are removed."""
    from .callback import GALORE_STATE_NAME
    from .manifest import MANIFEST_NAME, remove_stale_temporaries

    removed = False
    for name in (MANIFEST_NAME, GALORE_STATE_NAME):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            os.remove(path)
            removed = True
    if remove_stale_temporaries(folder) or removed:
        _api.fsync_folder(folder)


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
    import json
    import zipfile

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


def save_galore_state(trainer: Any, prepared: nn.Module, folder: str) -> None:
    """Gather (every rank) and write ``galore_state.pt`` of `trainer`'s current step into `folder`
    (process zero), after fsyncing the checkpoint's other files, then the checkpoint's manifest."""
    from .callback import GALORE_STATE_NAME
    from .distributed import gathered_galore_state_dict
    from .manifest import write_manifest

    galore_state = gathered_galore_state_dict(prepared, root=trainer.model)  # collectives under ZeRO-3 / FSDP
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank's files of this checkpoint are written
    trainer._galore_saved_step = trainer.state.global_step
    if not trainer.args.should_save:
        return
    if not os.path.isdir(folder):
        raise RuntimeError(
            f"GaLore: checkpoint folder {folder} was not written by the Trainer; cannot save GaLore state"
        )
    _fsync_tree(folder)
    optim = _served_name(getattr(trainer.args, "optim", None))
    _api.save_galore_checkpoint(
        os.path.join(folder, GALORE_STATE_NAME),
        galore_state,
        prepared.galore_config,
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
            _api.fsync_path(os.path.join(root, name))
        _api.fsync_folder(root)


def _rotate(trainer: Any, run_dir: str) -> None:
    """The Trainer's own rotation (transformers 4.57: a method; 5.x: trainer_utils.rotate_checkpoints)."""
    method = getattr(trainer, "_rotate_checkpoints", None)
    if callable(method):
        method(use_mtime=False, output_dir=run_dir)
        return
    from transformers import trainer as trainer_module

    rotate = getattr(trainer_module, "rotate_checkpoints", None)
    if rotate is None:
        raise _internals_missing("transformers.trainer.rotate_checkpoints / Trainer._rotate_checkpoints")
    rotate(
        output_dir=run_dir,
        save_total_limit=trainer.args.save_total_limit,
        best_model_checkpoint=trainer.state.best_model_checkpoint,
        use_mtime=True,
    )


def _wrap_train(original: Callable) -> Callable:
    """``train(resume_from_checkpoint=True)`` of a GaLore model picks the newest complete checkpoint;
    an explicit incomplete one is refused (:func:`_resolve_resume`)."""
    from .callback import galore_model_of

    signature = inspect.signature(original)

    @functools.wraps(original)
    def train(self, *args, **kwargs):
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:
            return original(self, *args, **kwargs)
        resume = bound.arguments.get("resume_from_checkpoint")
        if self.model is not None and galore_model_of(self.model) is not None:
            if self.args.should_save:
                _remove_stale_temporaries(self.args.output_dir)
            if resume not in (None, False):
                resume = bound.arguments["resume_from_checkpoint"] = _resolve_resume(self.args.output_dir, resume)
                if isinstance(resume, (str, os.PathLike)) and os.path.isdir(resume):
                    verify_checkpoint(resume)
        return original(*bound.args, **bound.kwargs)

    return _mark(train)


def _remove_stale_temporaries(output_dir: str) -> None:
    """Our temporaries in the checkpoint folders of `output_dir` whose writer died (a kill during a write)."""
    from .manifest import remove_stale_temporaries

    for _, folder in _checkpoint_steps(output_dir):
        for path in remove_stale_temporaries(folder):
            logger.info("GaLore: removed %s, left by a run that stopped while writing it", path)


def _is_fsdp1(trainer: Any) -> bool:
    if not getattr(trainer, "is_fsdp_enabled", False):
        return False
    plugin = getattr(getattr(trainer.accelerator, "state", None), "fsdp_plugin", None)
    return getattr(plugin, "fsdp_version", 1) == 1


def _wrap_deepspeed_load_checkpoint(original: Callable) -> Callable:
    """After the engine loaded its checkpoint (ZeRO partitions, fp32 masters, optimizer state), restore
    the GaLore layers from ``galore_state.pt``: ZeRO-3 does not restore frozen parameters such as W0,
    which refreshes change."""
    from .callback import galore_model_of
    from .distributed import load_gathered_galore_state_dict

    @functools.wraps(original)
    def deepspeed_load_checkpoint(deepspeed_engine, checkpoint_path, *args, **kwargs):
        result = original(deepspeed_engine, checkpoint_path, *args, **kwargs)
        prepared = galore_model_of(deepspeed_engine.module)
        if prepared is not None:
            from ..api import apply_mutable_changes

            payload = _read_galore_state(checkpoint_path, prepared)
            load_gathered_galore_state_dict(prepared, payload["state"])  # every rank
            apply_mutable_changes(prepared, payload["changed"], where=f"checkpoint {checkpoint_path}")
        return result

    return _mark(deepspeed_load_checkpoint)


@contextlib.contextmanager
def merged_view(model: nn.Module) -> Iterator[nn.Module]:
    """Temporarily swap every GaLore layer for a plain ``nn.Linear`` holding its merged weight.

    For savers that walk the modules themselves (peft's ``get_peft_model_state_dict`` asks each
    ``modules_to_save`` copy for its own keys): they see a plain model; the GaLore layers (and
    everything they hold) are put back afterwards, untouched.
    """
    with _merged_linears(model):
        yield model


@contextlib.contextmanager
def _merged_linears(model: nn.Module) -> Iterator[dict[str, nn.Linear]]:
    """:func:`merged_view`, yielding the plain layers put in place of the GaLore layers (by layer name)."""
    merged = merged_state_dict(model)
    swapped, linears = [], {}
    expert_swaps = swap_in_merged_experts(model, merged)  # the stock experts modules, merged, meanwhile
    for layer_name, layer in galore_layers(model):
        key = f"{layer_name}.weight"
        for wrapper in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module."):
            key = key.replace(wrapper, "")
        linear = plain_linear(layer, merged[key], requires_grad=False)
        linears[layer_name] = linear
        swapped.append((*swap_submodule(model, layer_name, linear), layer))
    try:
        yield linears
    finally:
        for parent, child, layer in swapped:
            setattr(parent, child, layer)
        restore_experts(expert_swaps)


def patch_peft() -> None:
    """``PeftModel.save_pretrained`` of a prepared peft model saves merged ``modules_to_save`` (idempotent)."""
    from peft import peft_model

    model_cls = getattr(peft_model, "PeftModel", None)
    if not isinstance(model_cls, type):
        raise _internals_missing("peft.PeftModel")

    def wrap(original: Callable) -> Callable:
        @functools.wraps(original)
        def save_pretrained(self, *args, **kwargs):
            if getattr(self, "galore_config", None) is None:
                return original(self, *args, **kwargs)
            with merged_view(self):
                return original(self, *args, **kwargs)

        return _mark(save_pretrained)

    apply_patches([PatchTarget(model_cls, "save_pretrained", wrap, "peft.PeftModel.save_pretrained")])


def _wrap_initialize_weights(original: Callable) -> Callable:
    """transformers initialises a model module by module (``initialize_weights`` -> ``_initialize_weights``
    -> the model's ``_init_weights``), which knows ``nn.Linear`` but not a GaLore layer: a model prepared on
    the meta device would keep uninitialised W0s after ``to_empty()`` + ``init_weights()``. A GaLore layer
    is initialised as the ``nn.Linear`` it replaced would be, by the model's own ``_init_weights`` (same
    rule, same random draws), and gets a new layer's GaLore state."""
    from ..layers import GaLoreLinear

    @functools.wraps(original)
    def _initialize_weights(self, module, *args, **kwargs):
        if not isinstance(module, GaLoreLinear):
            return original(self, module, *args, **kwargs)
        if getattr(module, "_is_hf_initialized", False):
            return None
        module.initialize_base(lambda linear: original(self, linear, *args, **kwargs))
        module._is_hf_initialized = True
        return None

    return _mark(_initialize_weights)


def patch_modeling_utils() -> None:
    """``save_pretrained`` of a GaLore-prepared model writes the merged plain weights; ``init_weights()``
    initialises GaLore layers through the model's own init (idempotent)."""
    from transformers import modeling_utils

    model_cls = getattr(modeling_utils, "PreTrainedModel", None)
    if not isinstance(model_cls, type):
        raise _internals_missing("transformers.PreTrainedModel")

    def wrap(original: Callable) -> Callable:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def save_pretrained(self, *args, **kwargs):
            if getattr(self, "galore_config", None) is not None:
                from .distributed import merged_state_dict_from

                bound = signature.bind(self, *args, **kwargs)
                given = bound.arguments.get("state_dict")
                if given is None:
                    bound.arguments["state_dict"] = merged_state_dict(self)
                elif any(key.endswith(".galore_factor") for key in given):
                    # gathered by an engine (DeepSpeed ZeRO, FSDP full state dict): merge from its tensors
                    bound.arguments["state_dict"] = merged_state_dict_from(self, given)
                return original(*bound.args, **bound.kwargs)
            return original(self, *args, **kwargs)

        return _mark(save_pretrained)

    apply_patches(
        [
            PatchTarget(model_cls, "save_pretrained", wrap, "transformers.PreTrainedModel.save_pretrained"),
            PatchTarget(
                model_cls,
                "_initialize_weights",
                _wrap_initialize_weights,
                "transformers.PreTrainedModel._initialize_weights",
            ),
        ]
    )

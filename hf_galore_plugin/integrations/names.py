"""The optimizer names: registered with ``TrainingArguments``, served to the Trainer.

Every name of entry-point group ``hf_galore_plugin.optimizers`` becomes a real member of
``transformers.training_args.OptimizerNames`` (an ``Enum``: members are added to
``_member_map_``/``_value2member_map_``/``_member_names_`` and as class attributes, exactly where
``EnumType`` puts the members it creates), so ``TrainingArguments(optim=...)``, ``HfArgumentParser``
choices and ``--help``, ``to_dict``/``to_json_string`` and pickling work for ``TrainingArguments`` and
every dataclass subclass of it (TRL's configs). The Trainer asks for the optimizer of such a name
through ``get_optimizer_cls_and_kwargs`` (its handler table on 5.x): :class:`GaLoreOptimizerFactory`
with the prepared model.

Names transformers already owns (``galore_adamw``, ``galore_adamw_8bit``) are served by the plugin
(logged once); ``HF_GALORE_PLUGIN_NO_TAKEOVER=1`` leaves them to transformers.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from ..api import create_optimizer, prepare_model
from ..config import GaLoreConfig
from ..engines.deepspeed import is_zero3_partitioned
from ..engines.fsdp1 import fsdp1_units, register_fsdp1_fragments
from ..registry import list_optimizer_entry_points, load_optimizer_preset
from ..state import state_of
from .distributed import prepare_zero3_model
from .layerwise import layerwise_served, log_layerwise
from .optim_args import config_from_training_args
from .patching import check_transformers_version, internals_missing, mark, patch_lock

logger = logging.getLogger(__name__)

__all__ = [
    "NO_TAKEOVER_ENV",
    "GaLoreOptimizerFactory",
    "served_optimizer_names",
    "served_name",
    "trainer_optimizer_name",
    "galore_config_for",
    "prepare_model_for_trainer",
    "register_optimizer_names",
    "optimizer_handler_table",
    "optimizer_handler",
    "wrap_optimizer_dispatch",
]

NO_TAKEOVER_ENV = "HF_GALORE_PLUGIN_NO_TAKEOVER"

_served: dict[str, str] = {}  # optimizer name -> "added" | "takeover" | "layerwise" (integrations/layerwise.py)
_takeover_logged = False


def served_optimizer_names() -> dict[str, str]:
    """The optimizer names the plugin serves: name -> 'added' (new member), 'takeover' or 'layerwise'."""
    return dict(_served)


def served_name(optim: Any) -> Optional[str]:
    """The plugin's name `optim` (a string or an ``OptimizerNames`` member) stands for, or None."""
    value = getattr(optim, "value", optim)
    return value if isinstance(value, str) and value in _served else None


def trainer_optimizer_name(trainer: Any) -> Optional[str]:
    """The plugin's optimizer name `trainer`'s arguments ask for; None for another name or no Trainer (a run
    with its own optimizer, ``optimizers=(create_optimizer(...), None)``)."""
    return served_name(getattr(getattr(trainer, "args", None), "optim", None))


def _optimizer_name_member(value: str):
    """Unpickling target of the plugin's members: registers the plugin in a fresh process first."""
    from transformers.training_args import OptimizerNames

    return OptimizerNames(value)


def _add_enum_member(enum_cls: Any, member_name: str, value: str) -> Any:  # Enum internals are untyped
    for attribute in ("_member_map_", "_value2member_map_", "_member_names_"):
        if not hasattr(enum_cls, attribute):
            raise internals_missing(f"{enum_cls.__name__}.{attribute} (enum internals)")
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


def register_optimizer_names() -> None:
    """Make every entry-point optimizer name a member of ``OptimizerNames`` (idempotent)."""
    from transformers import training_args

    enum_cls = getattr(training_args, "OptimizerNames", None)
    if enum_cls is None:
        raise internals_missing("transformers.training_args.OptimizerNames")
    takeover = os.environ.get(NO_TAKEOVER_ENV, "0").lower() not in ("1", "true", "yes")
    with patch_lock:
        check_transformers_version()
        for attribute in ("_member_map_", "_value2member_map_", "_member_names_"):
            if not hasattr(enum_cls, attribute):
                raise internals_missing(f"transformers.training_args.OptimizerNames.{attribute} (enum internals)")
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
        _served.update(layerwise_served(_served, enum_cls._value2member_map_))


def galore_config_for(args: Any, name: Optional[str] = None) -> GaLoreConfig:
    """The GaLoreConfig that ``TrainingArguments`` ask for: preset + optim_args + optim_target_modules."""
    name = name or served_name(args.optim)
    if name is None:
        raise ValueError(f"optim={getattr(args.optim, 'value', args.optim)!r} is not served by hf_galore_plugin")
    return config_from_training_args(
        load_optimizer_preset(name),
        optim_args=args.optim_args,
        optim_target_modules=args.optim_target_modules,
        optimizer_name=name,
    )


def _linear_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for module_name, module in model.named_modules():
        if isinstance(module, nn.Linear):  # a GaLoreLinear is not one
            yield module_name, module


def prepare_model_for_trainer(model: nn.Module, config: GaLoreConfig, name: str) -> nn.Module:
    """``prepare_model`` with the optimizer name and the model's linear layers in its errors.

    The core logs what was targeted and skipped, and why (``state_of(model).report``), at INFO; experts left
    to plain optimizer state that the user did not choose to leave out are also a WARNING. A model that
    DeepSpeed ZeRO-3 already partitioned (``from_pretrained`` under a stage-3 config) is prepared
    one gathered layer at a time and partitioned again with the same DeepSpeed config.
    """
    fresh = state_of(model) is None
    try:
        if is_zero3_partitioned(model):
            from transformers.integrations.deepspeed import deepspeed_config

            ds_config = deepspeed_config()
            if ds_config is None:
                raise ValueError(
                    "the model's parameters are partitioned by DeepSpeed ZeRO-3 but no DeepSpeed config is active; "
                    "create TrainingArguments(deepspeed=...) before loading the model"
                )
            prepared = prepare_zero3_model(model, config, ds_config)
        else:
            prepared = prepare_model(model, config)
    except ValueError as exc:
        linear_names = [module_name for module_name, _ in _linear_layers(model)]
        raise ValueError(
            f"optim={name!r} cannot prepare {type(model).__name__}: {exc} "
            f"(target_modules={config.target_modules!r}, rank={config.rank}; its nn.Linear layers: "
            f"{linear_names[:12]}{' ...' if len(linear_names) > 12 else ''})"
        ) from exc
    if fresh:
        _warn_unprojected_experts(prepared, name)
    return prepared


# Why an experts module was left to plain optimizer state (inject.select_expert_targets) that the user did not
# choose: the default experts=False, or a layout GaLore cannot project. Frozen experts, adapters and
# exclude_modules are left out on purpose and stay in the INFO summary only.
_UNCHOSEN_EXPERT_REASONS = ("experts=False", "unsupported")


def _warn_unprojected_experts(model: nn.Module, name: str) -> None:
    """A mixture-of-experts model whose experts stay unprojected keeps full-size AdamW moments for most of its
    parameters: a WARNING, which the Trainer's default verbosity shows (the core's summary line is INFO, which a
    library logger without a handler never shows)."""
    state = state_of(model)
    report = state.report if state is not None else None
    if report is None:
        return
    left = {n: r for n, r in report.unprojected_experts.items() if r.startswith(_UNCHOSEN_EXPERT_REASONS)}
    if not left:
        return
    # a ZeRO-3 partitioned parameter holds its full size in ds_numel
    params = sum(getattr(p, "ds_numel", p.numel()) for n in left for p in model.get_submodule(n).parameters())
    share = params / max(report.model_params, 1)
    kinds: dict[str, int] = {}
    for reason in left.values():
        kinds[reason] = kinds.get(reason, 0) + 1
    because = ", ".join(f"{count} {reason}" for reason, count in sorted(kinds.items()))
    fix = (
        "; pass optim_args experts=true to train them with GaLore (one basis per expert at expert_rank, default 16)"
        if "experts=False" in kinds
        else ""
    )
    logger.warning(
        "optim=%r: %d expert modules of %s are not projected by GaLore and keep full-size AdamW state "
        "(%s; %s expert parameters, %.0f%% of the model)%s",
        name, len(left), type(model).__name__, because, f"{params:,}", 100 * share, fix,
    )  # fmt: skip


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
    if not log_layerwise(name, NO_TAKEOVER_ENV) and _served[name] == "takeover" and not _takeover_logged:
        _takeover_logged = True
        logger.warning(
            "optim=%r is served by hf_galore_plugin, not by transformers' galore-torch integration "
            "(set %s=1 to use transformers' implementation)",
            name,
            NO_TAKEOVER_ENV,
        )
    state = state_of(model)
    if state is None:
        if model is not getattr(model, "module", model):
            raise ValueError(
                f"optim={name!r}: the model is wrapped ({type(model).__name__}) but its layers were not "
                "replaced; construct the Trainer with the optimizer name (or call "
                "hf_galore_plugin.prepare_model) before wrapping"
            )
        prepare_model_for_trainer(model, galore_config_for(args, name), name)
        state = state_of(model)
    assert state is not None  # prepare_model records it
    if state.config.state_bits == 8 and fsdp1_units(model):
        # Found here, when the Trainer builds the optimizer after wrapping: before the first step.
        raise ValueError(
            f"optim={name!r} keeps 8-bit optimizer state, which FSDP1's checkpoints cannot hold "
            "(FSDP.optim_state_dict gathers state tensors shaped and typed like the parameter; 8-bit state adds "
            "block scales), so the first checkpoint would fail. Pass optim_args='state_bits=32' (fp32 moments, "
            "still low-rank), or use FSDP2 (fsdp_version: 2) or DeepSpeed ZeRO, which keep 8-bit state."
        )
    if state.config.inner_optimizer != "adamw" and fsdp1_units(model):
        # Muon and Adafactor step FSDP1's 1-D views as fragments of their matrices. The Trainer builds the
        # optimizer from the wrapped model, whose root unit (embeddings, head, final norm) lies outside the
        # prepared model that create_optimizer registers.
        register_fsdp1_fragments(model)
    kwargs = {
        "lr": args.learning_rate,
        "betas": (args.adam_beta1, args.adam_beta2),
        "eps": args.adam_epsilon,
        "weight_decay": args.weight_decay,
        "galore_model": state.model,
        "galore_config": state.config,
    }
    return GaLoreOptimizerFactory, kwargs


def optimizer_handler_table(trainer_module: Any) -> Optional[dict]:
    """transformers' own table of optimizer handlers (5.x: ``_OPTIMIZER_HANDLERS``, name -> handler(ctx),
    read by ``Trainer.get_optimizer_cls_and_kwargs``), or None where the version has none (4.57)."""
    table = getattr(trainer_module, "_OPTIMIZER_HANDLERS", None)
    return table if isinstance(table, dict) else None


def optimizer_handler(name: str) -> Callable[[Any], Callable]:
    """The patch of handler-table entry `name` (5.x): the plugin's optimizer for that name."""

    def wrap(original: Any) -> Callable:
        def galore_optimizer_handler(ctx):
            return _galore_optimizer_cls_and_kwargs(ctx.args, ctx.model, name)

        return mark(galore_optimizer_handler)

    return wrap


def wrap_optimizer_dispatch(original: Any) -> Any:
    """The patch of ``Trainer.get_optimizer_cls_and_kwargs`` where there is no handler table (4.57)."""
    original = getattr(original, "__func__", original)

    @functools.wraps(original)
    def get_optimizer_cls_and_kwargs(args, model=None):
        name = served_name(args.optim)
        if name is None:
            return original(args, model)
        return _galore_optimizer_cls_and_kwargs(args, model, name)

    return staticmethod(mark(get_optimizer_cls_and_kwargs))

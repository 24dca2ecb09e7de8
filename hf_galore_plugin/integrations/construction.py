"""Trainer construction: the layers are replaced before any wrapping, and the callback is attached.

``Trainer.__init__`` with one of the plugin's optimizer names prepares the model (or wraps
``model_init`` to prepare each model it makes) with the config the arguments ask for, before
accelerate, FSDP or DeepSpeed wrap it; it attaches :class:`~.callback.GaLoreCallback` and binds every
GaLoreCallback to its Trainer (whose DeepSpeed engine it needs). ``PreTrainedModel._initialize_weights``
initialises a GaLore layer through the model's own ``_init_weights``, as the ``nn.Linear`` it replaced.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional

from ..config import GaLoreConfig
from ..layers import GaLoreLinear
from ..layers.experts import GaLoreExpertStack, GaLoreExperts
from .chunked_loss import check_head_weight_readers, configure_trainer_loss
from ..state import state_of
from .names import galore_config_for, prepare_model_for_trainer, served_name
from .patching import mark

__all__ = ["check_training_args", "wrap_init", "wrap_initialize_weights"]


def check_training_args(args: Any, name: str, config: Optional[GaLoreConfig] = None) -> None:
    """Configurations that would silently train something else fail here, before the first step."""
    ds_config = getattr(getattr(args, "hf_deepspeed_config", None), "config", None)
    if ds_config is None and isinstance(getattr(args, "deepspeed", None), dict):
        ds_config = args.deepspeed
    if ds_config is None:
        ds_config = getattr(getattr(args, "deepspeed_plugin", None), "deepspeed_config", None)
    if config is not None and config.inner_optimizer != "adamw" and getattr(args, "fsdp", None):
        _check_fsdp1_state_dict_type(args, name)
    if isinstance(ds_config, dict) and "optimizer" in ds_config:
        raise ValueError(
            f"optim={name!r}: the DeepSpeed config has an 'optimizer' block "
            f"({ds_config['optimizer'].get('type', '?')!r}), which would replace the GaLore optimizer "
            "silently. Remove the 'optimizer' block from the DeepSpeed config (keep 'scheduler' if you like)."
        )


def _check_fsdp1_state_dict_type(args: Any, name: str) -> None:
    """FSDP1 checkpoints Muon's and Adafactor's state only as SHARDED_STATE_DICT: accelerate saves and loads a
    FULL_STATE_DICT optimizer with ``rank0_only=True``, whose load moves every state value with ``.cpu()``, and
    these optimizers keep numbers in their state (step counts; Adafactor's per-matrix statistics of FSDP1's views,
    which FSDP1 would cut as slices of the flat parameter if they were tensors). Refused before the first step,
    not at the first resume."""
    if _fsdp_version(args) != 1:
        return
    state_dict_type = _fsdp_setting(args, "state_dict_type", "FULL_STATE_DICT")
    if str(state_dict_type).upper() != "SHARDED_STATE_DICT":
        raise ValueError(
            f"optim={name!r} under FSDP1 checkpoints its optimizer state as SHARDED_STATE_DICT only (got "
            f"state_dict_type={state_dict_type!r}: a FULL_STATE_DICT optimizer checkpoint is loaded with "
            "rank0_only=True, which cannot hold the numbers in its state). Set fsdp_config={'state_dict_type': "
            "'SHARDED_STATE_DICT', ...} (accelerate: fsdp_state_dict_type: SHARDED_STATE_DICT, as "
            "examples/accelerate/fsdp1.yaml), or use FSDP2 (fsdp_version: 2)."
        )


def _fsdp_version(args: Any) -> int:
    """The FSDP version `args` configure (:func:`_fsdp_setting`), 1 (FSDP1, whose refusals are the wider: an
    unknown version is not let through as FSDP2) where none is set."""
    return 2 if str(_fsdp_setting(args, "version", 1)) == "2" else 1


def _fsdp_setting(args: Any, key: str, default: Any) -> Any:
    """An FSDP setting of `args`: what TrainingArguments resolved (``fsdp_plugin_args``, accelerate's names:
    "fsdp_version", "state_dict_type"), else the ``fsdp_config`` entry (TrainingArguments strip its keys'
    ``fsdp_`` prefix: "version"; either spelling is read), else `default`."""
    resolved = getattr(args, "fsdp_plugin_args", None)
    if isinstance(resolved, dict):
        for name in (key, f"fsdp_{key}"):
            if resolved.get(name) is not None:
                return resolved[name]
    fsdp_config = getattr(args, "fsdp_config", None) or {}
    for name in (key, f"fsdp_{key}"):
        if fsdp_config.get(name) is not None:
            return fsdp_config[name]
    return default


def wrap_init(original: Callable) -> Callable:
    """The patch of ``Trainer.__init__`` (module docstring)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:
            return original(self, *args, **kwargs)  # let the Trainer report the bad call
        training_args = bound.arguments.get("args")
        name = served_name(getattr(training_args, "optim", None))
        if name is None:
            _check_foreign_optimizer(bound.arguments, training_args)
            original(*bound.args, **bound.kwargs)
            if getattr(self, "model", None) is not None and state_of(self.model) is not None:
                check_head_weight_readers(self)
                # a GaLore model with the user's own optimizer: without the callback no layer would train
                _attach_callback(self, None)
            _bind_callbacks(self)
            return
        config = galore_config_for(training_args, name)
        check_training_args(training_args, name, config)
        if bound.arguments.get("model") is not None:
            prepare_model_for_trainer(bound.arguments["model"], config, name)
        elif bound.arguments.get("model_init") is not None:
            bound.arguments["model_init"] = _preparing_model_init(bound.arguments["model_init"], config, name)
        original(*bound.args, **bound.kwargs)
        configure_trainer_loss(self, config)
        check_head_weight_readers(self)
        _attach_callback(self, config)
        _bind_callbacks(self)

    return mark(__init__)


def _check_foreign_optimizer(arguments: dict[str, Any], training_args: Any) -> None:
    """A GaLore-prepared model given to a Trainer whose optimizer the Trainer builds from another name
    (``adamw_torch``): that optimizer has no GaLore groups (no eps scaling, no base decay) and nothing
    drives the layers' refreshes. Refused; an optimizer passed in ``optimizers=`` is the user's choice."""
    model = arguments.get("model")
    optimizers = arguments.get("optimizers") or (None, None)
    has_optimizer = optimizers[0] is not None or arguments.get("optimizer_cls_and_kwargs") is not None
    if model is None or has_optimizer or state_of(model) is None:
        return
    optim = getattr(getattr(training_args, "optim", None), "value", getattr(training_args, "optim", None))
    raise ValueError(
        f"the model holds GaLore layers (hf_galore_plugin.prepare_model) but TrainingArguments.optim={optim!r} "
        "builds an optimizer that cannot train them. Use one of the plugin's names, e.g. optim='galore_adamw' "
        "with optim_args matching the model's GaLoreConfig, or pass "
        "optimizers=(hf_galore_plugin.create_optimizer(model, lr=...), None)."
    )


def _bind_callbacks(trainer: Any) -> None:
    # callback imports transformers.trainer_callback, which imports the modules this package patches:
    # imported when a Trainer is built, never while a patch is applied.
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
    from .callback import GaLoreCallback  # lazily: see _bind_callbacks

    handler = trainer.callback_handler
    if any(isinstance(callback, GaLoreCallback) for callback in handler.callbacks):
        return
    # first, so that the values it adds in on_log reach the reporting callbacks after it
    handler.callbacks.insert(0, GaLoreCallback(config))


def wrap_initialize_weights(original: Callable) -> Callable:
    """transformers initialises a model module by module (``initialize_weights`` -> ``_initialize_weights``
    -> the model's ``_init_weights``), which knows ``nn.Linear`` but not a GaLore layer: a model prepared on
    the meta device would keep uninitialised W0s after ``to_empty()`` + ``init_weights()``. A GaLore layer
    is initialised as the ``nn.Linear`` it replaced would be, by the model's own ``_init_weights`` (same
    rule, same random draws), and gets a new layer's GaLore state."""

    @functools.wraps(original)
    def _initialize_weights(self, module, *args, **kwargs):
        if isinstance(module, GaLoreExpertStack):
            return None  # initialised by its GaLoreExperts, whichever transformers visits first
        if isinstance(module, GaLoreExperts):
            # The stock experts module's rule, for both stacks: the draws of the module it stands in for
            if not getattr(module, "_is_hf_initialized", False):
                module.initialize_base(lambda stock: original(self, stock, *args, **kwargs))
                module._is_hf_initialized = True
            return None
        if not isinstance(module, GaLoreLinear):
            return original(self, module, *args, **kwargs)
        if getattr(module, "_is_hf_initialized", False):
            return None
        module.initialize_base(lambda linear: original(self, linear, *args, **kwargs))
        module._is_hf_initialized = True
        return None

    return mark(_initialize_weights)

"""The state of a prepared model, found through one function: :func:`state_of`.

:func:`hf_galore_plugin.prepare_model` records a :class:`GaLoreState` for the model it prepared (its
config and what was targeted or skipped); ``merge_and_unload`` removes it. The package keeps it in a
table of its own, keyed weakly by the model, and writes no attribute onto the user's model, its
parameters, optimizers or Trainers: whether a model is prepared is asked of :func:`state_of`, and
whether a module is a GaLore layer with ``isinstance(module, GaLoreLinear)``.

The table is keyed by the module object. A copy of a prepared model (``copy.deepcopy``, pickling) is not
in it, but it holds the GaLore layers and their config: ``state_of`` records a state for such a copy on
first sight, with the layers' config and no report (what was skipped at preparation is not known then).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

from torch import nn

from .config import GaLoreConfig

__all__ = ["GaLoreState", "state_of", "prepared_state", "record_state", "forget_state"]


class GaLoreState:
    """What the package keeps about one prepared model.

    - ``config``: the :class:`~hf_galore_plugin.GaLoreConfig` it was prepared with;
    - ``report``: what ``prepare_model`` targeted and skipped, and why (:class:`~hf_galore_plugin.inject.TargetReport`;
      None for a copy of a prepared model, see the module docstring);
    - ``model``: the prepared module itself (under a wrapper, the module ``prepare_model`` was given).
    """

    __slots__ = ("config", "report", "_model", "__weakref__")

    def __init__(self, model: nn.Module, config: GaLoreConfig, report: Any) -> None:
        self.config = config
        self.report = report
        self._model = weakref.ref(model)

    @property
    def model(self) -> nn.Module:
        model = self._model()
        if model is None:  # the table drops a state with its model, so a live state has a live model
            raise RuntimeError("the model of this GaLoreState was garbage-collected")
        return model

    def __repr__(self) -> str:
        model = self._model()
        return f"GaLoreState(model={type(model).__name__ if model is not None else None}, config={self.config!r})"


_STATES: "weakref.WeakKeyDictionary[nn.Module, GaLoreState]" = weakref.WeakKeyDictionary()


def record_state(model: nn.Module, config: GaLoreConfig, report: Any) -> GaLoreState:
    """Record `model` as prepared with `config` (``prepare_model``; the engine variants of it)."""
    state = _STATES[model] = GaLoreState(model, config, report)
    return state


def forget_state(model: nn.Module) -> Optional[GaLoreState]:
    """Remove the state of `model` itself (``merge_and_unload``); returns it, or None."""
    return _STATES.pop(model, None)


def state_of(model: Any) -> Optional[GaLoreState]:
    """The :class:`GaLoreState` of a prepared model, or None when it is not prepared.

    `model` may be the prepared module or a wrapper of it: DDP/FSDP1/DeepSpeed (``.module``),
    ``torch.compile`` (``._orig_mod``), peft, accelerate: the wrapper's modules are searched for the
    prepared one."""
    for candidate in (model, getattr(model, "module", None), getattr(model, "_orig_mod", None)):
        if isinstance(candidate, nn.Module):
            state = _STATES.get(candidate)
            if state is not None:
                return state
    if not isinstance(model, nn.Module):
        return None
    layer_config = None
    for module in model.modules():
        state = _STATES.get(module)
        if state is not None:
            return state
        # Only a GaLore layer holds a GaLoreConfig as its `config` (a transformers model's is its own config).
        config = getattr(module, "config", None)
        if layer_config is None and isinstance(config, GaLoreConfig):
            layer_config = config
    if layer_config is None:
        return None
    # A copy of a prepared model: its layers say it is prepared and with what.
    return record_state(model, layer_config, None)


def prepared_state(model: Any, *, what: str = "this") -> GaLoreState:
    """:func:`state_of` for a model that must be prepared: a ValueError naming `what` needs it otherwise."""
    state = state_of(model)
    if state is None:
        raise ValueError(
            f"{what} needs a GaLore-prepared model, got a {type(model).__name__} that is not one: call "
            "hf_galore_plugin.prepare_model(model, config) first"
        )
    return state

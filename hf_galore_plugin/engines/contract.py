"""What a basis refresh needs from the optimizer and from the engine: the one written contract.

A refresh (:meth:`hf_galore_plugin.layers.GaLoreLinear.refresh`) folds the factor B into W0, restarts
B at zero and sets new bases. It talks to one object, the *refresh optimizer*: a plain
``torch.optim.Optimizer`` or an engine adapter standing in for it
(:class:`hf_galore_plugin.engines.deepspeed.DeepSpeedGaLoreOptimizer`). Each method of the two
protocols below is optional (each is looked up on its own: an adapter may offer ``reset_state`` but
not ``transform_state``); the functions of this module are the only place that checks for them,
and they define what happens when one is absent.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Optional, Protocol, runtime_checkable

import torch
from torch import nn

__all__ = [
    "StateOptimizer",
    "EngineAdapter",
    "MomentTransform",
    "gathered_parameters",
    "gathers_parameters",
    "param_changed",
    "reset_state",
    "transform_state",
]

MomentTransform = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@runtime_checkable
class StateOptimizer(Protocol):
    """An optimizer whose per-parameter state a refresh may reset or transform.

    Without these methods the state is ``optimizer.state[param]`` with fp32 ``exp_avg`` /
    ``exp_avg_sq`` (torch's AdamW layout), which :func:`reset_state` and :func:`transform_state` edit.
    """

    def reset_state(self, param: torch.Tensor) -> None:
        """Forget `param`'s state: its next step is a first step."""

    def transform_state(self, param: torch.Tensor, fn: MomentTransform) -> None:
        """Replace `param`'s moments (exp_avg, exp_avg_sq), given as fp32 tensors, by ``fn(exp_avg, exp_avg_sq)``."""


@runtime_checkable
class EngineAdapter(Protocol):
    """An engine that partitions the layer's parameters or keeps its own master copy of them."""

    def gathered_parameters(self, layer: nn.Module) -> ContextManager[Any]:
        """Context in which `layer`'s W0 and factor are whole on every rank (a collective); changes
        made inside are partitioned again on exit."""

    def param_changed(self, param: torch.Tensor) -> None:
        """The layer changed `param` in place in the model: make the engine's own copy follow."""


def gathers_parameters(optimizer: Any) -> bool:
    """Whether `optimizer` gathers partitioned layer parameters itself (an :class:`EngineAdapter`)."""
    return hasattr(optimizer, "gathered_parameters")


def gathered_parameters(optimizer: Any, layer: nn.Module) -> ContextManager[Any]:
    """The engine's gathering context for `layer`, or a no-op when the parameters are whole already."""
    gather = getattr(optimizer, "gathered_parameters", None)
    return gather(layer) if gather is not None else contextlib.nullcontext()


def param_changed(optimizer: Optional[Any], param: torch.Tensor) -> None:
    """Tell an engine with its own master copy (DeepSpeed ZeRO) that `param` changed; else nothing to do."""
    notify = getattr(optimizer, "param_changed", None)
    if notify is not None:
        notify(param)


def reset_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> None:
    """Forget `param`'s optimizer state (:class:`StateOptimizer`, or drop ``optimizer.state[param]``)."""
    # Per method, not isinstance(StateOptimizer): an adapter may offer reset_state alone.
    reset = getattr(optimizer, "reset_state", None)
    if reset is not None:
        reset(param)
    else:
        optimizer.state.pop(param, None)


def transform_state(optimizer: torch.optim.Optimizer, param: torch.Tensor, fn: MomentTransform) -> None:
    """Apply `fn` to `param`'s Adam moments (:class:`StateOptimizer`, or torch AdamW's layout in place).

    A parameter without moments yet (never stepped, or just reset) has nothing to transform.
    """
    transform = getattr(optimizer, "transform_state", None)
    if transform is not None:
        transform(param, fn)
        return
    state = optimizer.state.get(param)
    if not state or "exp_avg" not in state or "exp_avg_sq" not in state:
        return
    exp_avg, exp_avg_sq = fn(state["exp_avg"].float(), state["exp_avg_sq"].float())
    state["exp_avg"].copy_(exp_avg)
    state["exp_avg_sq"].copy_(exp_avg_sq)

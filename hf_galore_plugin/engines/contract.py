"""What a basis refresh needs from the optimizer and from the engine: the one written contract.

A refresh (:meth:`hf_galore_plugin.layers.GaLoreLinear.refresh`) folds the factor B into W0, restarts
B at zero and sets new bases. It talks to one object, the *refresh optimizer*: a plain
``torch.optim.Optimizer`` or an engine adapter standing in for it
(:class:`hf_galore_plugin.engines.deepspeed.DeepSpeedGaLoreOptimizer`). Each method of the two
protocols below is optional (each is looked up on its own: an adapter may offer ``reset_state`` but
not ``transform_state``); the functions of this module are the only place that checks for them,
and they define what happens when one is absent.

The residual mode (``GaLoreConfig.residual``) needs one thing the other way round: the factor's Adam update
of every step, which only the optimizer has. A layer registers itself as the :class:`UpdateObserver` of its
factor (:func:`observe_updates`); an optimizer that reports updates (``hf_galore_plugin.optim.AdamW``) looks
the observer up (:func:`update_observer`) and calls it after each step of that parameter.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, ContextManager, Optional, Protocol, runtime_checkable

import torch
from torch import nn

__all__ = [
    "StateOptimizer",
    "EngineAdapter",
    "MomentTransform",
    "UpdateObserver",
    "gathered_parameters",
    "gathers_parameters",
    "has_update_observers",
    "observe_updates",
    "param_changed",
    "reset_state",
    "transform_state",
    "unwrap_optimizer",
    "update_observer",
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


def unwrap_optimizer(optimizer: Any) -> Any:
    """The innermost torch optimizer under accelerate's / DeepSpeed's wrappers (``.optimizer`` chains).

    accelerate's ``AcceleratedOptimizer`` mirrors ``param_groups`` but has no hook registries of its
    own; hooks, ``after_step`` and the tables keyed by optimizer need the optimizer that really steps.
    """
    while True:
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer or not hasattr(inner, "param_groups"):
            return optimizer
        optimizer = inner


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


class UpdateObserver(Protocol):
    """What a layer in residual mode asks of the optimizer of its factor: each step's Adam update."""

    def check_optimized(self, param: torch.Tensor) -> None:
        """Raise when `param`, as the optimizer holds it, cannot serve the observer (an engine's 1-D slice or
        DTensor shard of the factor): called when the optimizer takes the parameter, so a refusal comes first."""

    def observe_update(self, grad: torch.Tensor, update: torch.Tensor, lr: float) -> None:
        """After a step of the factor: its gradient, its Adam update m_hat / (sqrt(v_hat) + eps) (fp32, without
        the learning rate and the weight decay) and the learning rate the step used. Tensor ops only: no sync."""


# id(param) -> (the parameter, its observer), both weakly: the registry keeps neither a model nor a layer alive,
# and an entry whose parameter was freed (or whose id was reused by another tensor) answers None.
_OBSERVERS: dict[int, tuple["weakref.ref[torch.Tensor]", "weakref.ref[UpdateObserver]"]] = {}


def observe_updates(param: torch.Tensor, observer: UpdateObserver) -> None:
    """Make `observer` the one that optimizers reporting updates call after each step of `param`."""
    key = id(param)

    def forget(_: object) -> None:
        entry = _OBSERVERS.get(key)
        if entry is not None and entry[0]() is None:
            del _OBSERVERS[key]

    _OBSERVERS[key] = (weakref.ref(param, forget), weakref.ref(observer))


def has_update_observers() -> bool:
    """Whether any parameter has an observer (one dict check: an optimizer step without any looks nothing up)."""
    return bool(_OBSERVERS)


def update_observer(param: torch.Tensor) -> Optional[UpdateObserver]:
    """The observer of `param` registered with :func:`observe_updates`, or None."""
    entry = _OBSERVERS.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()

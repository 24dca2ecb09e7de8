"""What a basis refresh needs from the optimizer and from the engine: the one written contract.

A refresh (:meth:`hf_galore_plugin.layers.GaLoreLinear.refresh`) folds the factor B into W0, restarts
B at zero and sets new bases. It talks to one object, the *refresh optimizer*: a plain
``torch.optim.Optimizer`` or an engine adapter standing in for it
(:class:`hf_galore_plugin.engines.deepspeed.DeepSpeedGaLoreOptimizer`). Each method of the two
protocols below is optional (each is looked up on its own: an adapter may offer ``reset_state`` but
not ``change_basis``); the functions of this module are the only place that checks for them,
and they define what happens when one is absent.

The optimizer owns its state: a layer never reads or writes it. After a refresh the layer calls
:func:`change_basis` with the geometry of the change (transport matrices, for an expert stack the experts
whose basis changed) and the policy (:mod:`.basis`); the optimizer decides what that means for its state.

The residual mode (``GaLoreConfig.residual``) needs one thing the other way round: the factor's Adam update
of every step, which only the optimizer has. A layer registers itself as the :class:`UpdateObserver` of its
factor (:func:`observe_updates`); an optimizer that reports updates (``hf_galore_plugin.optim.AdamW``) looks
the observer up (:func:`update_observer`) and calls it after each step of that parameter.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, ContextManager, Optional, Protocol, runtime_checkable

import torch
from torch import nn

from .basis import BasisChange, change_state_basis, state_rules

__all__ = [
    "StateOptimizer",
    "EngineAdapter",
    "UpdateObserver",
    "change_basis",
    "gathered_parameters",
    "gathers_parameters",
    "has_update_observers",
    "observe_updates",
    "param_changed",
    "reset_state",
    "unwrap_optimizer",
    "update_observer",
]


@runtime_checkable
class StateOptimizer(Protocol):
    """An optimizer that says itself what a refresh does to its per-parameter state.

    Without ``reset_state`` a reset drops ``optimizer.state[param]``; without ``change_basis`` the state is
    taken in torch's layout and changed key by key by the optimizer's ``basis_state_rules``
    (:func:`hf_galore_plugin.engines.basis.state_rules`: torch's Adam layout when it declares none).

    Under DeepSpeed ZeRO a reset of some factors of a flat partition zeroes their elements of the state tensors
    of the partition's shape. Two optional class attributes say what that does to an optimizer:
    ``factor_step_count`` (default True: the factors' groups keep a step count, shared by the partition, which
    runs on, and a warning says so; Muon: False) and ``elementwise_state`` (default True; False where the state
    has per-matrix parts, as Adafactor's statistics, which that cannot restart: such resets are refused).
    """

    def reset_state(self, param: torch.Tensor) -> None:
        """Forget `param`'s state: its next step is a first step."""

    def change_basis(
        self,
        param: torch.Tensor,
        *,
        left: Optional[torch.Tensor] = None,
        right: Optional[torch.Tensor] = None,
        policy: str,
        experts: Optional[torch.Tensor] = None,
    ) -> None:
        """`param`'s basis changed by the transport matrices `left` / `right` (given for ``policy='project'``),
        for an expert stack of the experts in the mask `experts` (None: all): keep, reset or project `param`'s
        state as `policy` says (:mod:`hf_galore_plugin.engines.basis`)."""


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


def factor_rescaled(optimizer: Optional[Any], param: torch.Tensor, ratio: float) -> None:
    """The GaLore scale of `param`'s layer changed by `ratio` (rank_allocation='auto' gave it another rank): the
    group that holds the factor (its own: api.galore_param_groups) keeps eps = eps * scale, so its eps follows
    (an (eps1, eps2) pair: eps1, added to squared gradients, by ratio ** 2)."""
    if optimizer is None:
        return
    for group in unwrap_optimizer(optimizer).param_groups:
        if not any(p is param for p in group["params"]):
            continue
        if not group.get("galore") or len(group["params"]) != 1:
            raise ValueError(
                "a GaLore factor changed its scale, but its optimizer group holds other parameters (whose eps would "
                "change with it); build the optimizer with hf_galore_plugin.create_optimizer"
            )
        eps = group["eps"]
        group["eps"] = (eps[0] * ratio**2, *eps[1:]) if isinstance(eps, (tuple, list)) else eps * ratio
        return


def reset_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> None:
    """Forget `param`'s optimizer state (:class:`StateOptimizer`, or drop ``optimizer.state[param]``)."""
    # Per method, not isinstance(StateOptimizer): an adapter may offer reset_state alone.
    reset = getattr(optimizer, "reset_state", None)
    if reset is not None:
        reset(param)
    else:
        optimizer.state.pop(param, None)


def change_basis(
    optimizer: torch.optim.Optimizer,
    param: torch.Tensor,
    *,
    left: Optional[torch.Tensor] = None,
    right: Optional[torch.Tensor] = None,
    policy: str,
    experts: Optional[torch.Tensor] = None,
) -> None:
    """The seam between a refresh and the optimizer: `param`'s basis changed (:mod:`.basis`), the optimizer
    keeps, resets or projects its state as `policy` says.

    The optimizer's own ``change_basis`` when it has one (:class:`StateOptimizer`); else 'keep' changes nothing,
    a reset of the whole state is :func:`reset_state`, and a per-expert reset or a projection changes
    ``optimizer.state[param]`` key by key by the optimizer's state rules (nothing before its first step).
    """
    change = BasisChange(policy=policy, left=left, right=right, experts=experts)  # checks the policy
    method = getattr(optimizer, "change_basis", None)
    if method is not None:
        method(param, left=left, right=right, policy=policy, experts=experts)
    elif change.resets_all:
        reset_state(optimizer, param)
    elif policy != "keep":
        change_state_basis(optimizer.state.get(param), state_rules(optimizer), change, param)


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

"""A change of basis of a GaLore factor, as the optimizer of the factor receives it.

A refresh gives a layer a new left basis P (m x r) or right basis Q (n x r). The factor B was stepped in the
old coordinates, and so was its optimizer state. The layer hands the optimizer only the geometry of the change
and the user's policy, through the one seam :func:`hf_galore_plugin.engines.contract.change_basis`; what that
means for the state is the optimizer's business (``change_basis(param, *, left, right, policy, experts)`` on
the optimizer: :class:`hf_galore_plugin.optim.AdamW`, the DeepSpeed adapter, any new inner optimizer).

- ``left`` / ``right``: the transport matrices T = P_old^T P_new (Q_old^T Q_new), r x r, or E x r x r for an
  expert stack (the identity for an expert whose basis did not change). A matrix X in the old coordinates of
  the factor is T^T X (left) and X T (right) in the new ones. Given with ``policy='project'`` only (a side
  without a matrix did not change).
- ``policy``: ``'keep'`` (the state stays as it is), ``'reset'`` (it restarts from zero) or ``'project'`` (it
  moves into the new coordinates): ``GaLoreConfig.moment_handling``, and ``'reset'`` at a first calibration.
- ``experts``: for an expert stack (factor E x ...), the boolean mask (E) of the experts whose basis changed
  (the others keep theirs); None when all of them did, or the factor is not a stack.

:class:`BasisChange` holds the four and applies them to one state tensor by a *rule*, which says how that
tensor depends on the gradients: :data:`LINEAR` (a linear function of past projected gradients, such as a
momentum: its change of coordinates is exact) or :data:`SQUARED` (an elementwise statistic of squared
gradients, such as Adam's second moment: no exact transport exists; mapping it with the elementwise square of
T keeps it non-negative and is exact for permutations and sign flips). An optimizer that keeps its state in
torch's layout (one tensor of the parameter's shape per key) can declare ``basis_state_rules``, a mapping of
its state keys to rules, instead of implementing ``change_basis``: the contract's default, and the DeepSpeed
adapter for ZeRO's partitions, apply the rules by key. :func:`state_rules` gives torch's Adam / AdamW layout
to an optimizer that declares none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch

from .collectives import from_local, is_dtensor, local_rows, local_shard

__all__ = [
    "ADAM_STATE_RULES",
    "BasisChange",
    "LINEAR",
    "POLICIES",
    "SQUARED",
    "change_state_basis",
    "state_rules",
]

POLICIES = ("keep", "reset", "project")
LINEAR = "linear"
SQUARED = "squared"

# torch.optim.Adam / AdamW's state (and the fp32 state of the package's AdamW, and DeepSpeed's Adam): the first
# moment is a linear function of the gradients, the second an elementwise statistic of their squares.
ADAM_STATE_RULES: Mapping[str, str] = {"exp_avg": LINEAR, "exp_avg_sq": SQUARED}


def state_rules(optimizer: Any) -> Mapping[str, str]:
    """The state keys of `optimizer` that follow a change of basis, each with its rule: the optimizer's
    ``basis_state_rules``, or torch's Adam layout."""
    rules = getattr(optimizer, "basis_state_rules", None)
    return rules if rules is not None else ADAM_STATE_RULES


@dataclasses.dataclass(frozen=True)
class BasisChange:
    """One refresh's change of basis of one factor (module docstring), applied to state tensors by rule."""

    policy: str
    left: Optional[torch.Tensor] = None
    right: Optional[torch.Tensor] = None
    experts: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"a change of basis has the policy 'keep', 'reset' or 'project', got {self.policy!r}")

    def for_state(self, reset_all: Callable[[], None]) -> Optional["BasisChange"]:
        """What an optimizer's ``change_basis`` applies to its state tensors: None where there is nothing
        ('keep'), or where the whole state restarts, which `reset_all` then does (the optimizer's own reset,
        with its step count); else this change."""
        if self.policy == "keep":
            return None
        if self.resets_all:
            reset_all()
            return None
        return self

    @property
    def resets_all(self) -> bool:
        """Whether the whole state restarts (a reset of every expert, or of a factor that is not a stack)."""
        return self.policy == "reset" and self.experts is None

    @property
    def per_expert(self) -> bool:
        """Whether the change is given per expert (along dimension 0 of the factor: an expert stack)."""
        matrices = (t for t in (self.left, self.right) if t is not None)
        return self.experts is not None or any(t.dim() == 3 for t in matrices)

    def apply(self, value: torch.Tensor, rule: str, param: torch.Tensor) -> torch.Tensor:
        """State tensor `value` of `param` (fp32: whole, the local shard of a DTensor `param`, or a DTensor placed
        like it) after the change, by `rule`; a new tensor. ``'keep'`` returns `value`; for ``'reset'`` of
        some experts their rows are zero (a reset of all is the optimizer's own, with its step count)."""
        if self.policy == "keep":
            return value
        if is_dtensor(value):
            # torch's optimizers keep DTensor state for a DTensor parameter: the change applies to the local rows.
            return from_local(self.apply(local_shard(value), rule, param), value)
        rows = slice(None)
        if self.per_expert:
            # Under FSDP2 the state is sharded on the expert dimension like the factor: this rank's experts,
            # whose state is whole (a per-expert change needs no communication, whatever the basis side).
            start, stop = local_rows(param)
            if value.shape[0] != stop - start:
                raise RuntimeError(
                    f"the optimizer state of a GaLore expert factor has shape {tuple(value.shape)}, expected "
                    f"{stop - start} experts first: an engine holds it in another layout, which expert layers do "
                    "not support"
                )
            rows = slice(start, stop)
        if self.policy == "reset":
            assert self.experts is not None, "a reset of all experts is the optimizer's reset of the parameter"
            keep = 1 - self.experts.to(torch.float32).view(-1, *([1] * (value.dim() - 1)))
            return value * keep[rows]
        if rule not in (LINEAR, SQUARED):
            raise ValueError(
                f"a state tensor follows a change of basis by the rule {LINEAR!r} or {SQUARED!r}, got {rule!r}"
            )
        if self.left is not None:
            t = self.left[rows] if self.per_expert else self.left
            value = (t if rule == LINEAR else t.square()).mT @ value
        if self.right is not None:
            t = self.right[rows] if self.per_expert else self.right
            value = value @ (t if rule == LINEAR else t.square())
        return value


def change_state_basis(
    state: Optional[dict[str, Any]], rules: Mapping[str, str], change: BasisChange, param: torch.Tensor
) -> None:
    """`change` applied in place to `state` (``optimizer.state[param]`` in torch's layout), key by key of `rules`.

    A parameter without that state yet (never stepped, or just reset) has nothing to change.
    """
    if not state or any(key not in state for key in rules):
        return
    changed = {key: change.apply(state[key].float(), rule, param) for key, rule in rules.items()}
    for key, value in changed.items():
        state[key].copy_(value)

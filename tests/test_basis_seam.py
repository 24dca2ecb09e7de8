"""The refresh's one seam with the optimizer: a layer hands over a change of basis, the optimizer owns its state.

A fake inner optimizer (heavy-ball momentum, one buffer under its own key) implements ``change_basis`` with a rule
of its own and records every call. It trains a GaLoreLinear and a GaLoreExpertStack through refreshes while
``optimizer.state`` is replaced by a tripwire during ``after_step``: the layers may only call the seam, never read
or write the state, and the state after a refresh is exactly the fake's rule applied to the state before it, with
the transport matrices the layers' bases define (T = P_old^T P_new; the identity for an expert that kept its basis).
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import pytest
import torch
from torch import nn

from hf_galore_plugin import GaLoreConfig, after_step, prepare_model
from hf_galore_plugin.config import PAPER_REFRESH
from hf_galore_plugin.engines import contract
from hf_galore_plugin.engines.basis import LINEAR
from hf_galore_plugin.layers.experts import GaLoreExpertStack

EXPERTS = 4


class _Tripwire:
    """Stands in for ``optimizer.state`` while the layers refresh: any use is recorded and fails."""

    def __init__(self) -> None:
        self.touched: list[str] = []

    def _touch(self, what: str) -> Any:
        self.touched.append(what)
        raise AssertionError(f"a layer used optimizer.state ({what}) instead of the change_basis seam")

    def __getattr__(self, name: str) -> Any:  # .get, .pop, .items, ...: anything not defined here
        return self._touch(name)

    def __getitem__(self, key: Any) -> Any:
        return self._touch("[]")

    def __setitem__(self, key: Any, value: Any) -> None:
        self._touch("[]=")

    def __delitem__(self, key: Any) -> None:
        self._touch("del")

    def __contains__(self, key: Any) -> bool:
        return self._touch("in")

    def __iter__(self):
        return self._touch("iter")

    def __len__(self) -> int:
        return self._touch("len")

    def __bool__(self) -> bool:
        return self._touch("bool")


class Momentum(torch.optim.Optimizer):
    """Heavy-ball momentum with state ``{"velocity": ...}``; its change of basis by its own rule: 'keep' nothing,
    'reset' forgets the parameter (for some experts: sets their velocity rows to zero), 'project' maps the
    velocity like a matrix of the factor's coordinates (T^T v, v T). It reaches its state through ``_own`` only,
    so the test can hide ``state`` during a refresh."""

    def __init__(self, params, lr: float = 1e-2, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})
        self._own = self.state
        self.calls: list[dict[str, Any]] = []

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._own[p]
                if "velocity" not in state:
                    state["velocity"] = torch.zeros_like(p)
                state["velocity"].mul_(group["beta"]).add_(p.grad)
                p.add_(state["velocity"], alpha=-group["lr"])

    def change_basis(
        self,
        param: torch.Tensor,
        *,
        left: Optional[torch.Tensor] = None,
        right: Optional[torch.Tensor] = None,
        policy: str,
        experts: Optional[torch.Tensor] = None,
    ) -> None:
        self.calls.append(
            {
                "param": param,
                "left": None if left is None else left.clone(),
                "right": None if right is None else right.clone(),
                "policy": policy,
                "experts": None if experts is None else experts.clone(),
            }
        )
        state = self._own.get(param)
        if policy == "keep" or not state:
            return
        if policy == "reset":
            if experts is None:
                del self._own[param]
            else:
                state["velocity"][experts] = 0.0
            return
        state["velocity"].copy_(_fake_rule(state["velocity"], left, right))


def _fake_rule(velocity: torch.Tensor, left: Optional[torch.Tensor], right: Optional[torch.Tensor]) -> torch.Tensor:
    if left is not None:
        velocity = left.mT @ velocity
    if right is not None:
        velocity = velocity @ right
    return velocity


@contextlib.contextmanager
def _state_hidden(optimizer: Momentum):
    own = optimizer.state
    wire = _Tripwire()
    optimizer.state = wire  # type: ignore[assignment]
    try:
        yield wire
    finally:
        optimizer.state = own


def _bases(layer: nn.Module) -> dict[str, torch.Tensor]:
    return {
        side: basis.clone() for side in ("left", "right") if (basis := layer.basis(side, torch.float32)) is not None
    }


def _refresh(model: nn.Module, optimizer: Momentum) -> list[dict[str, Any]]:
    """One after_step with the optimizer's state hidden; the seam calls it made."""
    before = len(optimizer.calls)
    with _state_hidden(optimizer) as wire:
        after_step(model, optimizer)
    assert wire.touched == []
    return optimizer.calls[before:]


# ---------------------------------------------------------------------- GaLoreLinear
@pytest.mark.parametrize("proj_type", ["right", "left", "full"])
@pytest.mark.parametrize("policy", ["keep", "reset", "project"])
def test_linear_refresh_changes_a_foreign_state_only_through_the_seam(policy, proj_type):
    torch.manual_seed(0)
    config = GaLoreConfig(
        rank=4, update_proj_gap=2, proj_type=proj_type, moment_handling=policy, scale=0.25, **PAPER_REFRESH
    )
    model = prepare_model(nn.Sequential(nn.Linear(20, 24, bias=True)), config)
    layer = model[0]
    factor = layer.galore_factor
    optimizer = Momentum(model.parameters())
    gen = torch.Generator().manual_seed(1)
    target = torch.randn(24, 20, generator=gen)
    refreshes = 0
    for step in range(7):  # refreshes at 0 (calibration), 2, 4, 6
        x = torch.randn(16, 20, generator=gen)
        torch.nn.functional.mse_loss(model(x), x @ target.T).backward()
        optimizer.step()
        due = layer.refresh_due
        velocity = optimizer.state[factor]["velocity"].clone()
        old = _bases(layer)
        calls = _refresh(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
        if not due:
            assert calls == []
            continue
        refreshes += 1
        [call] = calls
        assert call["param"] is factor and call["experts"] is None
        if step == 0:  # calibration: the state restarts whatever the policy
            assert call["policy"] == "reset" and call["left"] is None and call["right"] is None
            assert factor not in optimizer.state
            continue
        assert call["policy"] == policy
        new = _bases(layer)
        if policy == "project":
            for side in ("left", "right"):
                if side in new:
                    assert torch.equal(call[side], old[side].mT @ new[side])
                else:
                    assert call[side] is None
            expected = _fake_rule(velocity, call["left"], call["right"])
        else:
            assert call["left"] is None and call["right"] is None
            expected = velocity
        if policy == "reset":
            assert factor not in optimizer.state
        else:
            assert set(optimizer.state[factor]) == {"velocity"}
            assert torch.equal(optimizer.state[factor]["velocity"], expected)
            # A projection moved the state (the comparison is not between two untouched copies).
            assert torch.equal(expected, velocity) == (policy == "keep")
    assert refreshes == 4 and int(layer.galore_num_refreshes) == 4


# ---------------------------------------------------------------------- GaLoreExpertStack
class _Holder(nn.Module):
    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.experts = experts

    def forward(self, *args):
        return self.experts(*args)


@pytest.mark.parametrize("proj_type", ["right", "left"])
@pytest.mark.parametrize("policy", ["keep", "reset", "project"])
def test_expert_refresh_changes_a_foreign_state_only_through_the_seam(policy, proj_type):
    config = GaLoreConfig(
        rank=8, expert_rank=4, experts=True, update_proj_gap=2, proj_type=proj_type, moment_handling=policy
    )
    weight = torch.randn(EXPERTS, 48, 40, generator=torch.Generator().manual_seed(0))
    model = _Holder(GaLoreExpertStack(nn.Parameter(weight), config))
    stack = model.experts
    factor = stack.galore_factor
    optimizer = Momentum(model.parameters())
    side = "right" if proj_type == "right" else "left"
    # Refresh steps 0 (calibration), 2 (expert 1 gets no tokens: it keeps its basis) and 4 (every expert).
    routing = [[4, 4, 4, 4], [4, 4, 4, 4], [6, 0, 6, 4], [4, 4, 4, 4], [3, 5, 4, 4]]
    for step, counts in enumerate(routing):
        x = torch.randn(sum(counts), 40, generator=torch.Generator().manual_seed(step))
        model(x, counts).square().sum().backward()
        optimizer.step()
        due = stack.refresh_due
        velocity = optimizer.state[factor]["velocity"].clone()
        old = _bases(stack)
        calls = _refresh(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
        if not due:
            assert calls == []
            continue
        [call] = calls
        assert call["param"] is factor
        if step == 0:
            assert call["policy"] == "reset" and call["experts"] is None and call[side] is None
            assert factor not in optimizer.state
            continue
        assert call["policy"] == policy
        hit = torch.tensor([c > 0 for c in counts])
        if bool(hit.all()):
            assert call["experts"] is None
        else:
            assert torch.equal(call["experts"], hit)
        new = _bases(stack)
        if policy == "project":
            transport = torch.where(hit.view(-1, 1, 1), old[side].mT @ new[side], torch.eye(4).expand(EXPERTS, 4, 4))
            assert torch.equal(call[side], transport)
            assert torch.equal(call[side][1], torch.eye(4)) == (not bool(hit[1]))
            expected = _fake_rule(velocity, call["left"], call["right"])
        else:
            assert call["left"] is None and call["right"] is None
            expected = velocity.clone()
            if policy == "reset":
                expected[hit] = 0.0
        if policy == "reset" and call["experts"] is None:
            assert factor not in optimizer.state
        else:
            assert set(optimizer.state[factor]) == {"velocity"}
            assert torch.equal(optimizer.state[factor]["velocity"], expected)
    assert stack.galore_expert_refreshes.tolist() == [3, 2, 3, 3]


# ---------------------------------------------------------------------- an optimizer that declares rules only
class _RulesOnly(torch.optim.SGD):
    """torch's SGD with momentum (state ``momentum_buffer``), which only declares how its state follows a change
    of basis: the contract's default applies the rule (no change_basis method needed)."""

    basis_state_rules = {"momentum_buffer": LINEAR}


def test_an_optimizer_in_torchs_layout_needs_only_its_state_rules():
    config = GaLoreConfig(rank=4, update_proj_gap=2, proj_type="right", moment_handling="project", **PAPER_REFRESH)
    model = prepare_model(nn.Sequential(nn.Linear(20, 24, bias=False)), config)
    layer = model[0]
    optimizer = _RulesOnly(model.parameters(), lr=1e-2, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):  # refreshes at 0 (calibration: the state is dropped) and 2 (projected)
        x = torch.randn(16, 20, generator=gen)
        model(x).square().mean().backward()
        optimizer.step()
        buffer = optimizer.state[layer.galore_factor]["momentum_buffer"].clone()
        old = _bases(layer)
        after_step(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
        if step == 0:
            assert layer.galore_factor not in optimizer.state
    transport = old["right"].mT @ _bases(layer)["right"]
    assert torch.equal(optimizer.state[layer.galore_factor]["momentum_buffer"], buffer @ transport)
    assert not torch.equal(transport, torch.eye(4))  # the basis moved: the check above is not an identity


def test_the_contract_default_resets_through_an_adapters_own_reset():
    calls = []

    class Adapter:
        def reset_state(self, param):
            calls.append(param)

    param = torch.zeros(2, 2)
    contract.change_basis(Adapter(), param, policy="reset")
    contract.change_basis(Adapter(), param, policy="keep")
    assert calls == [param]

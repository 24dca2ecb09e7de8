"""The engine contract (engines/contract.py) and the capability table (engines/capabilities.py).

The distributed tests run the engines themselves; these check, in one process, that each
refusal comes from the table with one wording, and that the contract's defaults are torch's.
"""

from __future__ import annotations

import ast
import contextlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_galore_plugin.engines import contract
from hf_galore_plugin.engines.capabilities import (
    CAPABILITIES,
    ENGINES,
    UnsupportedByEngine,
    check_moment_handling,
)
from hf_galore_plugin.config import GaLoreConfig
from hf_galore_plugin.engines.deepspeed import DeepSpeedGaLoreOptimizer
from hf_galore_plugin.state import record_state

PACKAGE = Path(__file__).resolve().parent.parent / "hf_galore_plugin"


def test_table_has_a_row_per_engine():
    assert set(CAPABILITIES) == set(ENGINES)
    assert {e for e, caps in CAPABILITIES.items() if caps.master_copy} == {"zero1", "zero2", "zero3"}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("left_basis", [True, False])
def test_project_is_refused_exactly_where_the_table_says(engine, left_basis):
    caps = CAPABILITIES[engine]
    refused = caps.project_moments == "none" or (caps.project_moments == "right" and left_basis)
    for handling in ("keep", "reset"):
        check_moment_handling(engine, moment_handling=handling, left_basis=left_basis, layer="l")
    if not refused:
        check_moment_handling(engine, moment_handling="project", left_basis=left_basis, layer="l")
        return
    with pytest.raises(UnsupportedByEngine) as info:
        check_moment_handling(engine, moment_handling="project", left_basis=left_basis, layer="model.q_proj")
    message = str(info.value)
    # one wording: the layer, the setting, the engine, the reason, the fix
    assert message.startswith("GaLore layer 'model.q_proj': moment_handling='project'")
    assert f"not supported under {caps.label}: {caps.project_reason}." in message
    assert "Use moment_handling='keep' (the default) or 'reset'" in message
    # callers that caught either type before still do
    assert isinstance(info.value, ValueError) and isinstance(info.value, NotImplementedError)


def test_unknown_engine_is_named():
    with pytest.raises(ValueError, match="unknown engine 'zero4'; known: single, ddp"):
        check_moment_handling("zero4", moment_handling="project")


def test_no_module_words_the_project_refusal_itself():
    # Every refusal of moment_handling='project' goes through check_moment_handling: no other module
    # raises with its own text about it.
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "capabilities.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and "moment_handling='project'" in ast.unparse(node):
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not offenders, offenders


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_adapter_refuses_project_with_the_table_wording(stage):
    model = torch.nn.Linear(4, 4)  # recorded as prepared: the adapter reads the config through state_of
    record_state(model, GaLoreConfig(rank=2, moment_handling="project"), report=None)
    engine = SimpleNamespace(zero_optimization_stage=lambda: stage, module=model)
    with pytest.raises(UnsupportedByEngine, match=f"not supported under DeepSpeed ZeRO-{stage}: the moments"):
        DeepSpeedGaLoreOptimizer(engine)


# ---------------------------------------------------------------------- contract defaults
def _adamw_with_state():
    param = torch.nn.Parameter(torch.randn(3, 4))
    optimizer = torch.optim.AdamW([param], lr=0.1)
    param.grad = torch.randn(3, 4)
    optimizer.step()
    return param, optimizer


def test_reset_state_on_a_torch_optimizer_forgets_the_parameter():
    param, optimizer = _adamw_with_state()
    contract.reset_state(optimizer, param)
    assert param not in optimizer.state


def test_change_basis_on_a_torch_optimizer_follows_adams_state_rules():
    # The contract's default for an optimizer without change_basis: torch's Adam layout, each moment by its rule.
    param, optimizer = _adamw_with_state()
    exp_avg, exp_avg_sq = (optimizer.state[param][k].clone() for k in ("exp_avg", "exp_avg_sq"))
    t = torch.randn(4, 4)
    contract.change_basis(optimizer, param, right=t, policy="project")
    torch.testing.assert_close(optimizer.state[param]["exp_avg"], exp_avg @ t)
    torch.testing.assert_close(optimizer.state[param]["exp_avg_sq"], exp_avg_sq @ t.square())
    contract.change_basis(optimizer, param, policy="keep")
    torch.testing.assert_close(optimizer.state[param]["exp_avg"], exp_avg @ t)
    fresh = torch.nn.Parameter(torch.zeros(2, 2))  # no state yet: nothing to change
    contract.change_basis(optimizer, fresh, left=torch.eye(2), policy="project")
    assert fresh not in optimizer.state
    contract.change_basis(optimizer, param, policy="reset")
    assert param not in optimizer.state
    with pytest.raises(ValueError, match="'keep', 'reset' or 'project'"):
        contract.change_basis(optimizer, param, policy="transport")


class _Adapter:
    """An engine adapter with reset_state but without change_basis or an optimizer `state`."""

    def __init__(self):
        self.calls = []

    def reset_state(self, param):
        self.calls.append(("reset", param))

    def gathered_parameters(self, layer):
        self.calls.append(("gather", layer))
        return contextlib.nullcontext()

    def param_changed(self, param):
        self.calls.append(("changed", param))


def test_each_method_of_an_adapter_is_used_on_its_own():
    adapter, param, layer = _Adapter(), torch.zeros(1), torch.nn.Linear(1, 1)
    contract.reset_state(adapter, param)
    with contract.gathered_parameters(adapter, layer):
        pass
    contract.param_changed(adapter, param)
    assert adapter.calls == [("reset", param), ("gather", layer), ("changed", param)]
    assert contract.gathers_parameters(adapter) and isinstance(adapter, contract.EngineAdapter)


def test_a_plain_optimizer_gathers_nothing_and_needs_no_notice():
    _, optimizer = _adamw_with_state()
    assert not contract.gathers_parameters(optimizer)
    with contract.gathered_parameters(optimizer, torch.nn.Linear(1, 1)):
        pass
    contract.param_changed(optimizer, torch.zeros(1))  # no master copy: nothing to tell
    contract.param_changed(None, torch.zeros(1))

"""rank_allocation='auto' with expert stacks (experts=True): a stack's spectrum is its experts' calibration spectra
combined (oracle: the singular values of each expert's gradient in a plain copy of the model), the stacks share
the budget with the linear layers at E x (kept side) values per unit of rank and within their bounds (from
expert_rank), take their rank at their next refresh, resume exactly across it (plain load and the Trainer's),
and a ranks file fixes them from the start."""

from __future__ import annotations

import json
import math

import pytest
import torch

import hf_galore_plugin as hgp
from hf_galore_plugin import api
from hf_galore_plugin.layers.experts import GaLoreExpertStack
from hf_galore_plugin.ranks import allocate_ranks

transformers = pytest.importorskip("transformers", reason="platform: transformers is a dependency of the tests")

from test_experts import EXPERTS, qwen3_moe  # noqa: E402  (after the skip: the module needs transformers)

VOCAB = 128


def _config(**overrides) -> hgp.GaLoreConfig:
    settings = dict(rank=8, expert_rank=4, experts=True, rank_allocation="auto", update_proj_gap=3,
                    refresh_schedule="aligned", seed=3)  # fmt: skip
    return hgp.GaLoreConfig(**{**settings, **overrides})


def _prepared(config=None, seed=0):
    model = hgp.prepare_model(qwen3_moe(seed), config or _config())
    return model, hgp.create_optimizer(model, lr=1e-2)


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(100 + step))


def _train(model, opt, steps, *, start=0):
    losses = []
    for step in range(start, start + steps):
        ids = _batch(step)
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        hgp.after_step(model, opt)
        losses.append(loss.item())
    return losses


def _stacks(model) -> dict[str, GaLoreExpertStack]:
    return {name: layer for name, layer in hgp.galore_layers(model) if isinstance(layer, GaLoreExpertStack)}


def _ranks(model) -> dict[str, int]:
    return {name: layer.right_rank or layer.left_rank for name, layer in hgp.galore_layers(model)}


def test_stack_spectrum_is_its_experts_dense_spectra_combined():
    """Oracle: with a dense ('svd') calibration a stack keeps, at index i, the sum over its experts of each one's
    i-th squared singular value, and the whole energy of its gradient; computed here with svdvals from the expert
    gradients of a plain copy of the model on the same batch."""
    plain = qwen3_moe()
    model, opt = _prepared(_config(basis_method="svd"))
    ids = _batch(0)
    plain(ids, labels=ids).loss.backward()
    _train(model, opt, 1)
    stacks = _stacks(model)
    assert len(stacks) == 4
    for name, stack in stacks.items():
        module, projection = name.rsplit(".", 1)
        grad = getattr(plain.get_submodule(module), projection).grad  # E x m x n
        high = stack.rank_state.high
        expected = torch.zeros(high)
        for expert in range(EXPERTS):
            values = torch.linalg.svdvals(grad[expert]).square()
            expected[: min(high, values.numel())] += values[:high]
        torch.testing.assert_close(stack.galore_spectrum, expected, rtol=1e-4, atol=1e-9)
        torch.testing.assert_close(stack.galore_spectrum_total, grad.square().sum(), rtol=1e-4, atol=1e-9)


def test_stacks_share_the_budget_at_their_cost_and_within_their_bounds():
    model, opt = _prepared()
    layers = hgp.galore_layers(model)
    stacks = _stacks(model)
    # the default budget: the factor values of the uniform ranks (linear layers at rank, stacks at expert_rank)
    uniform = sum(layer.galore_factor.numel() for _, layer in layers)
    assert api.rank_budget(layers) == uniform
    for stack in stacks.values():
        state = stack.rank_state
        kept = stack.out_features if state.side == "right" else stack.in_features
        assert state.cost == EXPERTS * kept, "a unit of a stack's rank costs E x (its kept side) values"
        assert (state.low, state.high) == (1, min(8, state.dim - 1)), "bounds from expert_rank=4: 4 // 4, 2 * 4"
        assert stack.galore_factor.shape[-1 if state.side == "right" else -2] == 4
    _train(model, opt, 1)  # calibration: every layer and stack measures, the driver allocates
    spectra = api._spectra(layers)
    targets = {name: layer.rank_state.target for name, layer in layers}
    assert targets == allocate_ranks(spectra, uniform), "the stacks are allocated with the linear layers"
    assert sum(layer.rank_state.cost * targets[name] for name, layer in layers) <= uniform
    assert all(stack.rank_state.low <= targets[name] <= stack.rank_state.high for name, stack in stacks.items())
    _train(model, opt, 3, start=1)  # step 3 refreshes: every layer and stack takes its rank
    assert _ranks(model) == targets
    assert sum(layer.galore_factor.numel() for _, layer in layers) <= uniform
    rows = {row["layer"]: row for row in hgp.rank_report(model)}
    for name, stack in stacks.items():
        row = rows[name]
        assert row["shape"] == [EXPERTS, stack.out_features, stack.in_features] and row["rank"] == targets[name]
        assert row["factor_values"] == stack.galore_factor.numel() and 0 < row["share"] <= 1


def test_explicit_budget_and_bounds_count_the_stacks():
    uniform = sum(layer.galore_factor.numel() for _, layer in hgp.galore_layers(_prepared()[0]))
    budget = uniform // 2
    model, opt = _prepared(_config(rank_budget=budget, rank_min=2, rank_max=6))
    layers = hgp.galore_layers(model)
    stacks = _stacks(model)
    # the uniform ranks scaled by one factor (1/2): linear layers start at 4, stacks at 2
    assert {_ranks(model)[name] for name in stacks} == {2}
    assert {rank for name, rank in _ranks(model).items() if name not in stacks} == {4}
    assert sum(layer.galore_factor.numel() for _, layer in layers) <= budget
    _train(model, opt, 4)
    assert all((s.rank_state.low, s.rank_state.high) == (2, min(6, s.rank_state.dim - 1)) for s in stacks.values())
    spent = sum(layer.rank_state.cost * layer.rank_state.target for _, layer in layers)
    assert budget - max(layer.rank_state.cost for _, layer in layers) < spent <= budget
    assert all(2 <= rank <= 6 for rank in _ranks(model).values())
    assert sum(layer.galore_factor.numel() for _, layer in layers) <= budget


def test_tiny_moe_trains_through_calibration_allocation_and_resize():
    model, opt = _prepared()
    stacks = _stacks(model)
    losses = _train(model, opt, 3)  # calibration at step 0 (allocation after it), the change of rank at step 3
    targets = {name: stack.rank_state.target for name, stack in stacks.items()}
    changed = [name for name, stack in stacks.items() if targets[name] != 4]
    assert changed, "the experts' spectra move some stack off expert_rank"
    before = {name: stack.effective_weight().clone() for name, stack in stacks.items()}
    ids = _batch(3)
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    stepped = {name: stack.effective_weight().clone() for name, stack in stacks.items()}
    hgp.after_step(model, opt)  # the refresh: fold, new shapes
    base_eps = next(group["eps"] for group in opt.param_groups if not group.get("galore"))
    for name, stack in stacks.items():
        assert stack.rank_state.target == (stack.right_rank or stack.left_rank) == targets[name]
        side = stack.rank_state.side
        assert stack.basis(side).shape == (EXPERTS, stack.rank_state.dim, targets[name])
        torch.testing.assert_close(stack.effective_weight(), stepped[name], rtol=0, atol=1e-6)
        assert not torch.equal(stepped[name], before[name])
        if name in changed:
            assert not opt.state[stack.galore_factor], "a factor of a new shape starts without optimizer state"
            assert torch.count_nonzero(stack.galore_factor) == 0
        (group,) = [g for g in opt.param_groups if any(p is stack.galore_factor for p in g["params"])]
        assert group["eps"] == pytest.approx(base_eps * stack.scale, rel=1e-12)
    losses += _train(model, opt, 4, start=4)
    assert all(math.isfinite(loss) for loss in losses)
    assert all(stack.galore_factor.abs().sum() > 0 for stack in stacks.values())
    assert {name: _ranks(model)[name] for name in stacks} == targets


@pytest.mark.parametrize("stop", [2, 5], ids=["allocated-not-taken", "after-the-change"])
def test_resume_across_the_change_of_rank_is_bit_exact(stop, round_trip):
    model, opt = _prepared()
    reference = _train(model, opt, 9)
    final = {key: value.clone() for key, value in model.state_dict().items()}

    model, opt = _prepared()
    first = _train(model, opt, stop)
    saved = round_trip({"model": model.state_dict(), "optimizer": opt.state_dict()})
    resumed, resumed_opt = _prepared(seed=5)  # a new run: other weights, expert_rank shapes until the load
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["optimizer"])
    assert _ranks(resumed) == _ranks(model)
    rest = _train(resumed, resumed_opt, 9 - stop, start=stop)
    assert first + rest == reference
    assert any(_ranks(resumed)[name] != 4 for name in _stacks(resumed))
    assert resumed.state_dict().keys() == final.keys()
    for key, value in resumed.state_dict().items():
        assert torch.equal(value, final[key]), key


def test_trainer_resume_across_the_change_of_rank_is_bit_exact(tmp_path):
    """The Trainer's resume (galore_state.pt put into the model's load): a stack of another rank reshapes first."""
    from conftest import logged_losses, token_data, training_args

    def run(output_dir, resume=None):
        args = training_args(output_dir, optim="galore_adamw", max_steps=6, save_strategy="steps", save_steps=3,
                             optim_args="rank=8,rank_allocation=auto,update_proj_gap=2,refresh_schedule=aligned,"
                                        "experts=true,expert_rank=4")  # fmt: skip
        trainer = transformers.Trainer(model=qwen3_moe(), args=args, train_dataset=token_data(vocab=VOCAB))
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "full")
    rows = json.loads((tmp_path / "full" / "galore_ranks.json").read_text())
    assert {row["layer"] for row in rows} >= set(_stacks(full.model))
    assert any(_ranks(full.model)[name] != 4 for name in _stacks(full.model))
    # the checkpoint holds the stacks at their new ranks (taken at the refresh of step 2), the prepared model at 4
    saved = torch.load(tmp_path / "full" / "checkpoint-3" / "galore_state.pt", weights_only=False)
    factors = {key: value for key, value in saved["state"].items() if key.endswith("experts.gate_up_proj.galore_factor")
               or key.endswith("experts.down_proj.galore_factor")}  # fmt: skip
    assert len(factors) == 4 and any(factor.shape[-1] != 4 for factor in factors.values())
    resumed = run(tmp_path / "resumed", resume=str(tmp_path / "full" / "checkpoint-3"))
    assert logged_losses(resumed) == logged_losses(full)
    full_state, resumed_state = full.model.state_dict(), resumed.model.state_dict()
    assert full_state.keys() == resumed_state.keys()
    for key in full_state:
        assert torch.equal(full_state[key], resumed_state[key]), key


def test_ranks_file_fixes_the_stacks_from_the_start(tmp_path):
    """rank_allocation=<galore_ranks.json>: the stacks are built at the ranks an 'auto' run chose (one process here:
    the engines' test of the file, tests/test_distributed_trainer.py, runs a dense model)."""
    model, opt = _prepared()
    _train(model, opt, 1)
    path = hgp.save_rank_report(model, str(tmp_path))
    chosen = {name: layer.rank_state.target for name, layer in hgp.galore_layers(model)}
    rows = json.loads(open(path).read())
    assert {row["layer"] for row in rows} == set(chosen) and set(_stacks(model)) < set(chosen)
    fixed, fixed_opt = _prepared(_config(rank_allocation=path))
    assert _ranks(fixed) == chosen
    assert all(layer.rank_state is None for _, layer in hgp.galore_layers(fixed))
    losses = _train(fixed, fixed_opt, 4)
    assert _ranks(fixed) == chosen and all(math.isfinite(loss) for loss in losses)
    # a file without the stacks (written for the linear layers) leaves them at expert_rank; a stack of another
    # model is refused
    linear_only = tmp_path / "linear.json"
    linear_only.write_text(json.dumps({name: rank for name, rank in chosen.items() if name not in _stacks(model)}))
    partial, _ = _prepared(_config(rank_allocation=str(linear_only)))
    assert {_ranks(partial)[name] for name in _stacks(partial)} == {4}
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({**chosen, "model.layers.7.mlp.experts.down_proj": 4}))
    with pytest.raises(ValueError, match=r"not targeted here \['model.layers.7.mlp.experts.down_proj'\]"):
        _prepared(_config(rank_allocation=str(foreign)))


def test_planner_plans_the_stacks_at_expert_rank(tmp_path):
    """The memory planner traces an MoE model under 'auto' (fake tensors: nothing to allocate from) at the starting
    ranks, expert stacks at expert_rank, with the same factors as the uniform plan."""
    from hf_galore_plugin.plan import estimate
    from test_experts import HIDDEN, MOE_INTERMEDIATE, TOP_K

    fields = dict(
        model_type="qwen3_moe", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128,
        moe_intermediate_size=MOE_INTERMEDIATE, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=EXPERTS, num_experts_per_tok=TOP_K, decoder_sparse_step=1, tie_word_embeddings=False,
    )  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(fields))

    def plan(extra: str) -> dict:
        return estimate(config=str(tmp_path / "config.json"), methods=["galore_adamw"], seq_len=32, rank=8,
                        optim_args="experts=true,expert_rank=4" + extra, device="cpu")["methods"]["galore_adamw"]  # fmt: skip

    auto, uniform = plan(",rank_allocation=auto"), plan("")
    assert any("planned at the starting rank 4/8" in note for note in auto["notes"])
    assert auto["parts"]["optimizer_state"] == uniform["parts"]["optimizer_state"]


def test_empty_stack_bounds_are_refused_by_name():
    with pytest.raises(ValueError, match="GaLoreConfig.rank_min=.*expert stacks' bounds"):
        _config(rank_min=9)  # expert_rank 4: at most 2 * 4 = 8
    assert _config(rank_min=9, rank_max=12).rank_bounds(4) == (9, 12)

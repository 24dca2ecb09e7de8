"""scale='auto': each layer's GaLore scale sqrt(projected side / rank), against the formula, against AdamW's
update norm (the rule's reason) and through the optimizer groups and checkpoints."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hf_galore_plugin import (
    GaLoreConfig,
    GaLoreLinear,
    after_step,
    create_optimizer,
    galore_layers,
    prepare_model,
    state_of,
)
from hf_galore_plugin.api import galore_param_groups
from hf_galore_plugin.checkpoint.state import GaLoreCheckpointError, compare_galore_config


def _model(shapes: dict[str, tuple[int, int]], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.ModuleDict({name: nn.Linear(n_in, n_out, bias=False) for name, (n_out, n_in) in shapes.items()})


def _expected(proj_type: str, m: int, n: int, rank: int) -> float:
    # The formula written out per projection type: the projected side of a one-sided basis is the smaller
    # (std) or the larger (reverse_std) side; 'full' projects both; a side the rank covers is no projection.
    sides = {
        "std": [n] if m >= n else [m],
        "reverse_std": [m] if m >= n else [n],
        "left": [m],
        "right": [n],
        "full": [m, n],
    }[proj_type]
    ratio = 1.0
    for side in sides:
        if rank < side:
            ratio *= side / rank
    return math.sqrt(ratio)


SHAPES = {"square": (64, 64), "tall": (96, 32), "wide": (24, 80)}


@pytest.mark.parametrize("proj_type", ["std", "reverse_std", "left", "right", "full"])
def test_each_layer_gets_the_scale_of_its_projected_sides(proj_type):
    # Layers built directly: target selection refuses an explicit target whose smaller side the rank covers,
    # but a layer so built (and a two-sided layer whose rank covers one side) takes the identity there.
    shapes = {**SHAPES, "covered": (64, 8)}
    config = GaLoreConfig(rank=8, proj_type=proj_type)
    scales = {
        name: GaLoreLinear(nn.Linear(n_in, n_out, bias=False), config).scale for name, (n_out, n_in) in shapes.items()
    }
    assert scales == {name: _expected(proj_type, m, n, 8) for name, (m, n) in shapes.items()}
    assert scales["square"] == (64 / 8 if proj_type == "full" else math.sqrt(64 / 8))
    # the rank covers the projected side of 'covered' under std (8 columns): exactly AdamW's update, scale 1
    if proj_type == "std":
        assert scales["covered"] == 1.0


def test_an_explicit_float_is_every_layers_scale():
    model = prepare_model(_model(SHAPES), GaLoreConfig(rank=8, scale=0.25, target_modules=list(SHAPES)))
    assert {layer.scale for _, layer in galore_layers(model)} == {0.25}
    assert GaLoreConfig().scale == "auto"


def test_expert_stacks_take_the_scale_of_one_expert():
    transformers = pytest.importorskip("transformers", reason="platform: transformers is a dependency of the tests")
    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model = prepare_model(transformers.Qwen3MoeForCausalLM(config), GaLoreConfig(rank=8, experts=True, expert_rank=4))
    stacks = {name: layer for name, layer in galore_layers(model) if layer.galore_factor.ndim == 3}
    assert stacks, "the experts were not projected"
    for name, stack in stacks.items():
        m, n = stack.out_features, stack.in_features  # one expert's shape, not the stack's
        assert stack.scale == _expected("std", m, n, 4), name
    # gate_up_proj (32 x 32 per expert here) and down_proj (32 x 16): sqrt(16 / 4) for the 16-wide side
    assert {stack.scale for stack in stacks.values()} == {math.sqrt(32 / 4), math.sqrt(16 / 4)}


@pytest.mark.parametrize("shape", [(64, 64), (96, 32), (24, 80)])
def test_first_update_has_adamws_norm(shape):
    # The rule's reason, as an oracle: Adam's first step is lr * g / (|g| + eps), entries of size ~1, so
    # the full-rank update of an m x n weight has norm lr * sqrt(m n); GaLore's first step on the factor
    # has norm lr * sqrt(m r), and the scale sqrt(n / r) lifts it to AdamW's. With scale 0.25 it is far off.
    m, n = shape
    x = torch.randn(32, n, generator=torch.Generator().manual_seed(1))
    y = torch.randn(32, m, generator=torch.Generator().manual_seed(2))

    def weight_change(config):
        model = prepare_model(_model({"layer": (m, n)}), config)
        layer = model["layer"]
        optimizer = create_optimizer(model, lr=1e-3, eps=1e-12)
        for _ in range(2):  # the calibration step records the basis and moves nothing; the second steps
            before = layer.effective_weight().clone()
            torch.nn.functional.mse_loss(layer(x), y).backward()
            optimizer.step()
            after_step(model, optimizer)
            optimizer.zero_grad()
        return float((layer.effective_weight() - before).norm())

    dense = nn.Linear(n, m, bias=False)
    adamw = torch.optim.AdamW(dense.parameters(), lr=1e-3, eps=1e-12, weight_decay=0.0)
    before = dense.weight.detach().clone()
    torch.nn.functional.mse_loss(dense(x), y).backward()
    adamw.step()
    adamw_norm = float((dense.weight.detach() - before).norm())
    assert adamw_norm == pytest.approx(1e-3 * math.sqrt(m * n), rel=1e-3)

    auto = weight_change(GaLoreConfig(rank=8, target_modules=["layer"]))
    assert auto == pytest.approx(adamw_norm, rel=1e-3)
    fixed = weight_change(GaLoreConfig(rank=8, scale=0.25, target_modules=["layer"]))
    assert fixed == pytest.approx(0.25 * adamw_norm / math.sqrt(min(m, n) / 8), rel=1e-3)


def test_optimizer_groups_split_by_scale_with_eps_times_scale():
    model = prepare_model(_model(SHAPES), GaLoreConfig(rank=8, target_modules=list(SHAPES)))
    groups = galore_param_groups(model, [{"params": list(model.parameters())}], state_of(model).config, eps=1e-8)
    galore_groups = [g for g in groups if g.get("galore")]
    by_layer = dict(galore_layers(model))
    seen = set()
    for group in galore_groups:
        scales = {by_layer[name].scale for name in group["galore_layers"]}
        assert len(scales) == 1
        (scale,) = scales
        assert group["eps"] == 1e-8 * scale
        seen.update(group["galore_layers"])
    assert seen == set(SHAPES)
    assert len(galore_groups) == len({layer.scale for layer in by_layer.values()}) == 3


def test_checkpoint_records_each_layers_resolved_scale_and_a_float_run_resumes_only_with_its_float():
    model = prepare_model(_model(SHAPES), GaLoreConfig(rank=8, target_modules=list(SHAPES)))
    state = model.state_dict()
    for name, layer in galore_layers(model):
        if layer._folded_side is not None:
            assert float(state[f"{name}.galore_folded_scale"]) == float(torch.tensor(layer.scale))
    # A run started with scale=0.25 is not continued under 'auto' (the factor would mean another update):
    # the resume is refused by naming the field and both values.
    saved = GaLoreConfig(rank=8, scale=0.25, target_modules=list(SHAPES)).to_dict()
    with pytest.raises(GaLoreCheckpointError, match=r"scale: saved 0.25, now 'auto'"):
        compare_galore_config(saved, state_of(model).config, where="checkpoint x")


def test_a_state_saved_under_auto_reloads_bit_exactly():
    config = GaLoreConfig(rank=8, target_modules=list(SHAPES), update_proj_gap=2)
    model = prepare_model(_model(SHAPES), config)
    optimizer = create_optimizer(model, lr=1e-2)
    x = torch.randn(16, 96)
    for _ in range(3):
        sum(layer(x[:, : layer.in_features]).square().mean() for _, layer in galore_layers(model)).backward()
        optimizer.step()
        after_step(model, optimizer)
        optimizer.zero_grad()
    saved = model.state_dict()
    twin = prepare_model(_model(SHAPES, seed=5), GaLoreConfig(rank=8, target_modules=list(SHAPES), update_proj_gap=2))
    twin.load_state_dict(saved)
    for (name, layer), (_, copy) in zip(galore_layers(model), galore_layers(twin)):
        assert torch.equal(layer.effective_weight(), copy.effective_weight()), name


@pytest.mark.parametrize("value", ["Auto", "sqrt", ""])
def test_scale_rejects_other_strings(value):
    with pytest.raises(ValueError, match="scale"):
        GaLoreConfig(scale=value)


def test_optim_args_take_auto_and_floats():
    from hf_galore_plugin.integrations.optim_args import parse_optim_args

    assert parse_optim_args("scale=auto") == {"scale": "auto"}
    assert parse_optim_args("scale=0.25") == {"scale": 0.25}


def test_summary_line_names_the_scale_each_layer_got():
    model = prepare_model(_model(SHAPES), GaLoreConfig(rank=8, target_modules=list(SHAPES)))
    summary = state_of(model).report.summary()
    assert summary.endswith("; scale per layer 2.828 (square: 1 layers); 2 (tall: 1 layers); 1.732 (wide: 1 layers)"), (
        summary
    )
    model = prepare_model(_model(SHAPES), GaLoreConfig(rank=8, scale=0.25, target_modules=list(SHAPES)))
    assert state_of(model).report.summary().endswith("; scale 0.25")

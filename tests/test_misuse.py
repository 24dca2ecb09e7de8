"""Misuse that must not pass silently: a missing step driver, meta-device initialisation, config values
that cannot train, stepping after merge_and_unload, tied weights, models GaLore cannot target."""

from __future__ import annotations

import math
import re
import warnings

import logging

import pytest
import torch
from torch import nn

import hf_galore_plugin as hgp

transformers = pytest.importorskip("transformers")
from transformers import LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402
from conftest import build_tiny_llama  # noqa: E402
from conftest import use_torch_twins  # noqa: E402
from conftest import token_data as shared_token_data  # noqa: E402

from hf_galore_plugin.integrations.callback import GaLoreCallback  # noqa: E402


@pytest.fixture(autouse=True)
def _torch_twins(monkeypatch):
    use_torch_twins(monkeypatch)


# A smaller Llama than the shared one: these tests only need a model to misuse.
SMALL_LLAMA = dict(
    hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
    vocab_size=128, max_position_embeddings=32,
)  # fmt: skip


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    return build_tiny_llama(seed=seed, **{**SMALL_LLAMA, **overrides})


def token_data(n: int = 16) -> list[dict[str, torch.Tensor]]:
    return shared_token_data(n, 8, vocab=128)


def args(tmp_path, **overrides) -> TrainingArguments:
    kwargs = dict(
        output_dir=str(tmp_path),
        optim="adamw_torch",
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def effective(model) -> dict[str, torch.Tensor]:
    return {name: layer.effective_weight(torch.float32).clone() for name, layer in hgp.galore_layers(model)}


# ---------------------------------------------------------------------- the step driver
def _plain_loop(model, optimizer, steps: int, *, drive: bool) -> list[str]:
    """`steps` plain training steps (with `after_step` when `drive`); the messages of every warning."""
    batch = torch.randint(0, 128, (2, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            model(input_ids=batch, labels=batch).loss.backward()
            optimizer.step()
            if drive:
                hgp.after_step(model, optimizer)
            optimizer.zero_grad()
    return [str(w.message) for w in caught]


def test_plain_loop_without_after_step_warns_once_naming_the_fix():
    model = hgp.prepare_model(tiny_llama(), hgp.GaLoreConfig(rank=4))
    optimizer = hgp.create_optimizer(model, lr=1e-2)
    messages = [m for m in _plain_loop(model, optimizer, 4, drive=False) if "after_step" in m]
    assert len(messages) == 1 and "GaLoreCallback" in messages[0]


def test_plain_loop_with_after_step_does_not_warn_and_trains():
    model = hgp.prepare_model(tiny_llama(), hgp.GaLoreConfig(rank=4))
    optimizer = hgp.create_optimizer(model, lr=1e-2)
    before = effective(model)
    batch = torch.randint(0, 128, (2, 8))
    layers = [layer for _, layer in hgp.galore_layers(model)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        # Under the staggered default a layer calibrates on the step of its phase (packed at the first
        # forward): train until every layer has its basis, then two steps more, so that each one has moved.
        steps = 0
        while steps < 2 + max(int(layer.galore_phase) for layer in layers) + 1:
            model(input_ids=batch, labels=batch).loss.backward()
            optimizer.step()
            hgp.after_step(model, optimizer)
            optimizer.zero_grad()
            steps += 1
    assert all(layer.calibrated for layer in layers) and steps < 20
    after = effective(model)
    assert all(not torch.equal(before[name], after[name]) for name in before)


@pytest.mark.parametrize(
    ("overrides", "warns"),
    [({}, False), ({"lr_scale": 0.9}, True), ({"lr_recovery_fraction": 0.1}, True), ({"lr_scale": 1.0}, True)],
)
def test_plain_loop_with_a_non_default_lr_scale_warns_once_that_it_is_not_applied(overrides, warns):
    model = hgp.prepare_model(tiny_llama(), hgp.GaLoreConfig(rank=4, **overrides))
    optimizer = hgp.create_optimizer(model, lr=1e-2)
    messages = [m for m in _plain_loop(model, optimizer, 3, drive=True) if "GaLoreCallback in a Trainer run" in m]
    assert len(messages) == (1 if warns else 0)
    if warns:
        assert "lr_scale=" in messages[0] and "param_groups" in messages[0]
    # not applied, as the warning says: every group keeps the rate it was given
    assert {group["lr"] for group in optimizer.param_groups} == {1e-2}


def test_trainer_with_own_optimizer_gets_the_callback_and_trains(tmp_path):
    model = hgp.prepare_model(tiny_llama(), hgp.GaLoreConfig(rank=4, update_proj_gap=2))
    optimizer = hgp.create_optimizer(model, lr=1e-2)
    before = effective(model)
    trainer = Trainer(model=model, args=args(tmp_path), train_dataset=token_data(), optimizers=(optimizer, None))
    assert sum(isinstance(cb, GaLoreCallback) for cb in trainer.callback_handler.callbacks) == 1
    trainer.train()
    after = effective(model)
    assert all(not torch.equal(before[name], after[name]) for name in before)


def test_trainer_building_a_foreign_optimizer_for_a_galore_model_is_refused(tmp_path):
    model = hgp.prepare_model(tiny_llama(), hgp.GaLoreConfig(rank=4))
    with pytest.raises(
        ValueError, match=r"optim='adamw_torch' builds an optimizer that cannot train them.*galore_adamw"
    ):
        Trainer(model=model, args=args(tmp_path), train_dataset=token_data())


# ---------------------------------------------------------------------- meta device
class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _train(model, steps=6) -> list[float]:
    optimizer = hgp.create_optimizer(model, lr=1e-2, weight_decay=0.1)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(3))
    losses = []
    for _ in range(steps):
        loss = (model(x) - x).square().mean()
        loss.backward()
        optimizer.step()
        hgp.after_step(model, optimizer)
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_meta_device_prepare_then_load_trains_like_a_cpu_prepared_model():
    config = hgp.GaLoreConfig(rank=4, update_proj_gap=2)
    torch.manual_seed(0)
    reference = _MLP()
    weights = {k: v.clone() for k, v in reference.state_dict().items()}
    expected = _train(hgp.prepare_model(reference, config))

    with torch.device("meta"):
        model = _MLP()
    hgp.prepare_model(model, config)
    model.to_empty(device="cpu")
    # to_empty leaves whatever the allocator hands out: make that visibly wrong
    for _, layer in hgp.galore_layers(model):
        for buffer in layer.buffers():
            buffer.fill_(7 if not buffer.is_floating_point() else 7.5)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all("galore" in key or "base_multiplier" in key for key in missing)
    got = _train(model)
    assert all(math.isfinite(v) for v in got)
    assert got == expected


def test_reset_parameters_gives_a_new_layer_state():
    config = hgp.GaLoreConfig(rank=4)
    with torch.device("meta"):
        model = _MLP()
    hgp.prepare_model(model, config)
    model.to_empty(device="cpu")
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    torch.manual_seed(0)
    fresh = hgp.prepare_model(_MLP(), config)
    for (_, layer), (_, new) in zip(hgp.galore_layers(model), hgp.galore_layers(fresh)):
        state, expected = layer.state_dict(), new.state_dict()
        for key in expected:
            if key not in ("weight", "bias"):
                torch.testing.assert_close(state[key], expected[key], rtol=0, atol=0, equal_nan=True, msg=key)
        assert float(layer.weight.abs().max()) <= 1 / math.sqrt(layer.in_features)  # nn.Linear's init bound


def _lm_losses(model, steps: int = 4) -> list[float]:
    optimizer = hgp.create_optimizer(model, lr=1e-2)
    batch = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(5))
    losses = []
    for _ in range(steps):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        hgp.after_step(model, optimizer)
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _poison(model) -> None:
    """What to_empty() may leave, made visibly wrong (NaN weights, absurd counters)."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.fill_(float("nan") if tensor.is_floating_point() else 7)


def _meta_init_weights_losses(build, config) -> tuple[list[float], list[float]]:
    """(oracle, got): the meta -> to_empty -> init_weights flow of the model `build()` makes, prepared with
    `config` after it on CPU (the oracle), and prepared on the meta device before it (poisoned after
    to_empty, so what the init does not write shows)."""
    with torch.device("meta"):
        reference = build()
    reference.to_empty(device="cpu")
    torch.manual_seed(3)
    reference.init_weights()
    expected = _lm_losses(hgp.prepare_model(reference, config))

    with torch.device("meta"):
        model = build()
    hgp.prepare_model(model, config)
    model.to_empty(device="cpu")
    _poison(model)
    torch.manual_seed(3)
    model.init_weights()
    got = _lm_losses(model)
    assert all(math.isfinite(v) for v in got), got
    return expected, got


@pytest.mark.parametrize("weight_storage", ["as_loaded", "int8"])
def test_meta_device_transformers_init_weights_trains_like_a_cpu_prepared_model(weight_storage):
    config = hgp.GaLoreConfig(rank=4, update_proj_gap=2, weight_storage=weight_storage)
    expected, got = _meta_init_weights_losses(lambda: LlamaForCausalLM(tiny_llama().config), config)
    assert got == expected


def test_meta_device_reset_parameters_trains_like_a_cpu_prepared_model():
    config = hgp.GaLoreConfig(rank=4, update_proj_gap=2)
    with torch.device("meta"):
        reference = _MLP()
    reference.to_empty(device="cpu")
    torch.manual_seed(3)
    for module in reference.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    expected = _train(hgp.prepare_model(reference, config))

    with torch.device("meta"):
        model = _MLP()
    hgp.prepare_model(model, config)
    model.to_empty(device="cpu")
    _poison(model)
    torch.manual_seed(3)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    assert _train(model) == expected


@pytest.mark.parametrize("weight_storage", ["as_loaded", "int8"])
def test_meta_device_moe_with_experts_init_weights_trains_like_a_cpu_prepared_model(weight_storage):
    """The expert stacks of a Qwen3-MoE prepared on the meta device are initialised by the model's own rule for
    the stock experts module (same draws, same order): training matches a model prepared after its init."""
    config = hgp.GaLoreConfig(rank=8, experts=True, expert_rank=4, update_proj_gap=2, weight_storage=weight_storage)
    shape = _tiny_moe().config
    expected, got = _meta_init_weights_losses(lambda: transformers.Qwen3MoeForCausalLM(shape), config)
    assert got == expected


def test_expert_stack_reset_parameters_initialises_each_expert_as_an_nn_linear():
    """torch's meta-device flow (reset_parameters on every module): each expert of a stack as nn.Linear's
    reset_parameters initialises a weight of its shape, experts in order; the GaLore state is a new layer's."""
    from hf_galore_plugin.layers.experts import GaLoreExpertStack

    config = hgp.GaLoreConfig(rank=8, experts=True, expert_rank=4)
    with torch.device("meta"):
        stack = GaLoreExpertStack(torch.empty(3, 24, 16), config)
    stack.to_empty(device="cpu")
    _poison(stack)
    torch.manual_seed(11)
    stack.reset_parameters()
    torch.manual_seed(11)
    expected = torch.stack([nn.init.kaiming_uniform_(torch.empty(24, 16), a=math.sqrt(5)) for _ in range(3)])
    assert torch.equal(stack.weight, expected)
    assert int(stack.galore_step) == 0 and not stack.calibrated
    assert torch.count_nonzero(stack.galore_factor) == 0


def test_init_weights_leaves_loaded_galore_layers_alone():
    # A model built and initialised on CPU, then prepared: init_weights() again changes none of its weights,
    # as for its plain layers (transformers marks what its init has run on).
    model = hgp.prepare_model(tiny_llama(), hgp.GaLoreConfig(rank=4))
    before = {key: value.clone() for key, value in model.state_dict().items()}
    model.init_weights()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0, equal_nan=True, msg=key)


@pytest.mark.parametrize("weight_storage", ["as_loaded", "int8"])
def test_meta_device_without_init_or_load_is_refused_naming_the_flows_that_work(weight_storage):
    with torch.device("meta"):
        model = _MLP()
    hgp.prepare_model(model, hgp.GaLoreConfig(rank=4, weight_storage=weight_storage))
    model.to_empty(device="cpu")
    message = r"GaLore layer 'up' was prepared on the meta device .* never initialised"
    with pytest.raises(ValueError, match=message) as info:
        hgp.create_optimizer(model, lr=1e-3)
    for flow in ("init_weights()", "reset_parameters()", "load_state_dict"):
        assert flow in str(info.value)
    assert (f"weight_storage={weight_storage!r}" in str(info.value)) == (weight_storage != "as_loaded")


# ---------------------------------------------------------------------- config values
@pytest.mark.parametrize("field", ["scale", "cos_threshold", "lr_scale", "lr_recovery_fraction"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_float_fields_are_refused(field, value):
    with pytest.raises(ValueError, match=rf"GaLoreConfig.{field}=.* is invalid"):
        hgp.GaLoreConfig(**{field: value})


def test_scale_inf_through_optim_args_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"scale=inf is invalid: use a finite number"):
        Trainer(
            model=tiny_llama(),
            args=args(tmp_path, optim="galore_adamw", optim_args="rank=4,scale=inf"),
            train_dataset=token_data(),
        )


@pytest.mark.parametrize(
    "field, value",
    [("update_proj_gap", 2**63), ("max_proj_gap", 2**64), ("rank", 2**31), ("oversampling", 2**70), ("seed", 2**40)],
)
def test_int_fields_beyond_their_range_are_refused_naming_the_field(field, value):
    # Unchecked, these overflowed later in an int64 buffer or a generator seed: "Overflow when unpacking long".
    with pytest.raises(ValueError, match=rf"GaLoreConfig.{field}={value} is invalid: use a value of magnitude below"):
        hgp.GaLoreConfig(**{field: value})


def test_a_scale_too_small_for_eps_is_reported_as_scale():
    model = hgp.prepare_model(_MLP(), hgp.GaLoreConfig(rank=4, scale=1e-320))
    with pytest.raises(ValueError, match=r"GaLoreConfig.scale=1e-320 is too small") as info:
        hgp.create_optimizer(model, lr=1e-3)
    assert "eps=0.0" not in str(info.value)


@pytest.mark.parametrize("field", ["oversampling", "power_iterations", "seed", "max_proj_gap", "state_bits"])
def test_int_fields_refuse_floats(field):
    with pytest.raises(TypeError, match=rf"GaLoreConfig.{field} must be an int"):
        hgp.GaLoreConfig(**{field: 8.5})


# ---------------------------------------------------------------------- after merge_and_unload
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_step_after_merge_and_unload_says_what_happened(weight_decay):
    model = hgp.prepare_model(tiny_llama(), hgp.GaLoreConfig(rank=4))
    optimizer = hgp.create_optimizer(model, lr=1e-3, weight_decay=weight_decay)
    batch = torch.randint(0, 128, (2, 8))
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    hgp.after_step(model, optimizer)
    hgp.merge_and_unload(model)
    model(input_ids=batch, labels=batch).loss.backward()
    with pytest.raises(RuntimeError, match=r"optimizer.step\(\) after merge_and_unload\(model\).*new optimizer"):
        optimizer.step()


# ---------------------------------------------------------------------- tied weights
def test_explicitly_targeting_a_tied_head_is_refused():
    model = tiny_llama(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with pytest.raises(ValueError, match=r"'lm_head', whose weight is tied to 'model.embed_tokens'"):
        hgp.prepare_model(model, hgp.GaLoreConfig(rank=4, target_modules=["lm_head", "q_proj"]))
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_default_targets_skip_tied_linear_layers():
    model = tiny_llama()
    model.model.layers[0].mlp.up_proj.weight = model.model.layers[0].mlp.gate_proj.weight  # tied pair
    hgp.prepare_model(model, hgp.GaLoreConfig(rank=4))
    report = hgp.state_of(model).report
    assert report.skipped["model.layers.0.mlp.up_proj"].startswith("weight tied to")
    assert model.model.layers[0].mlp.up_proj.weight is model.model.layers[0].mlp.gate_proj.weight


# ---------------------------------------------------------------------- messages
def test_gpt2_conv1d_message_names_the_real_reason():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=16))
    with pytest.raises(ValueError, match=r"transformers' Conv1D .*does not target") as info:
        hgp.prepare_model(model, hgp.GaLoreConfig(rank=4))
    assert "rank" not in str(info.value)


def test_model_without_linear_layers_message():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Conv1d(8, 8, 1))
    with pytest.raises(ValueError, match=r"has no nn.Linear module") as info:
        hgp.prepare_model(model, hgp.GaLoreConfig(rank=4))
    assert "rank" not in str(info.value)


def test_lora_only_peft_model_message():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(
        ValueError, match=r"LoRA-only peft model has nothing for GaLore to train.*modules_to_save"
    ) as info:
        hgp.prepare_model(model, hgp.GaLoreConfig(rank=4))
    assert "Lower `rank`" not in str(info.value)


def test_rank_message_stays_for_small_layers():
    with pytest.raises(ValueError, match=r"Lower `rank`"):
        hgp.prepare_model(tiny_llama(), hgp.GaLoreConfig(rank=64))


# ---------------------------------------------------------------------- target and exclude patterns
# The decoder's nn.Linear layers of tiny_llama() (one layer); the output head `lm_head` is left out by default.
DECODER = [f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"] + [
    f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")
]


def _targets_and_skips(config) -> tuple[list[str], dict[str, str]]:
    model = hgp.prepare_model(tiny_llama(), config)
    report = hgp.state_of(model).report
    return report.targeted, report.skipped


# exclude_modules -> the decoder layers it excludes, written out by hand from the documented rule: a list entry
# excludes every module whose name contains it, a string is a regex that must match the whole name.
EXCLUDED = [
    pytest.param(["mlp"], DECODER[4:], id="list-substring-mlp"),
    pytest.param(["mlp.up", "self_attn.q"], [DECODER[0], DECODER[5]], id="list-substrings-inside-names"),
    pytest.param(r".*self_attn\.[qk]_proj", DECODER[:2], id="regex-fullmatch"),
    pytest.param(r"model\.layers\.0\.mlp\.(up|down)_proj", DECODER[5:], id="regex-alternatives"),
]


@pytest.mark.parametrize("exclude, excluded", EXCLUDED)
def test_exclude_modules_follow_the_matching_rules_of_target_modules(exclude, excluded):
    targeted, skipped = _targets_and_skips(hgp.GaLoreConfig(rank=4, exclude_modules=exclude))
    assert targeted == [name for name in DECODER if name not in excluded]
    assert {name for name, reason in skipped.items() if reason == "in exclude_modules"} == set(excluded)
    assert skipped["lm_head"] == "output head"


@pytest.mark.parametrize("exclude", [["proj"], ".*", ["model"]])
def test_exclude_modules_matching_every_layer_leaves_nothing_to_train(exclude):
    with pytest.raises(ValueError, match=r"no nn.Linear layer to train .* 7 in exclude_modules"):
        hgp.prepare_model(tiny_llama(), hgp.GaLoreConfig(rank=4, exclude_modules=exclude))


@pytest.mark.parametrize(
    "exclude, unmatched",
    [
        (["o_porj"], "entry 'o_porj'"),  # a typo
        (["o_proj", "dwon_proj"], "entry 'dwon_proj'"),  # one typo among good entries
        ("o_proj", "exclude_modules='o_proj'"),  # a string is a regex of the whole name: '.*o_proj' matches
        ([r".*_proj"], r"entry '.*_proj'"),  # a list entry is a substring, never a regex
        (r"model\.layers\.7\..*", r"exclude_modules='model\\.layers\\.7"),  # the model has one layer
    ],
)
def test_exclude_modules_matching_nothing_is_refused_as_target_modules_is(exclude, unmatched):
    model = tiny_llama()
    with pytest.raises(ValueError, match=r"matched no") as info:
        hgp.prepare_model(model, hgp.GaLoreConfig(rank=4, exclude_modules=exclude))
    message = str(info.value)
    assert unmatched in message and "re.fullmatch" in message and "substring" in message
    assert "model.layers.0.self_attn.q_proj" in message  # names of the model to match against
    assert hgp.state_of(model) is None and isinstance(model.model.layers[0].self_attn.o_proj, nn.Linear)


def test_exclude_modules_regex_string_through_optim_args(tmp_path):
    # One optim_args item without '+' is a string: a regex, as for target_modules.
    trainer = Trainer(
        model=tiny_llama(),
        args=args(tmp_path, optim="galore_adamw", optim_args=r"rank=4,exclude_modules=.*mlp\..*"),
        train_dataset=token_data(),
    )
    assert hgp.state_of(trainer.model).report.targeted == DECODER[:4]


def test_exclude_modules_naming_the_default_excluded_head_is_accepted():
    # The head is excluded by default; naming it too is no mistake and selects the same layers.
    targeted, skipped = _targets_and_skips(hgp.GaLoreConfig(rank=4, exclude_modules=["lm_head"]))
    assert targeted == DECODER and skipped == {"lm_head": "output head"}


def test_target_modules_message_says_how_a_string_matches():
    with pytest.raises(ValueError, match=r"target_modules='q_proj' matched no trainable") as info:
        hgp.prepare_model(tiny_llama(), hgp.GaLoreConfig(rank=4, target_modules="q_proj"))
    assert "re.fullmatch" in str(info.value) and "'.*q_proj'" in str(info.value)


def test_config_help_states_the_matching_rule_of_both_fields():
    import dataclasses

    helps = {f.name: f.metadata["help"] for f in dataclasses.fields(hgp.GaLoreConfig)}
    for name in ("target_modules", "exclude_modules"):
        assert "re.fullmatch" in helps[name] and "substring" in helps[name], name
        assert "suffix" not in helps[name], name


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("target_modules", ["q_proj", 3], "entries must be strings"),
        ("target_modules", ("q_proj", None), "entries must be strings"),
        ("target_modules", ["q_proj", ""], "an empty entry"),
        ("exclude_modules", [""], "an empty entry"),
        ("exclude_modules", ["o_proj", 2], "entries must be strings"),
        ("exclude_modules", "o_proj(", "not a valid regular expression"),
        ("exclude_modules", 7, "use None"),
    ],
)
def test_pattern_fields_refuse_entries_that_are_not_strings(field, value, fragment):
    with pytest.raises(ValueError, match=rf"GaLoreConfig.{field}=.* is invalid: .*{re.escape(fragment)}"):
        hgp.GaLoreConfig(**{field: value})


# ---------------------------------------------------------------------- ranks a layer cannot take
def _gqa_llama():
    """tiny_llama with one key/value head: k_proj and v_proj are 16 x 32, every other decoder layer 32 wide."""
    return tiny_llama(num_key_value_heads=1)


# k_proj of _gqa_llama() is 16 x 32 (out x in). (proj_type, rank) -> the rank from which the sides proj_type
# keeps are covered whole (projection.resolve_sides: std keeps the smaller side, reverse_std the larger, left
# the output side, right the input side, full both), or None where the rank still projects a side, with the
# factor's shape there.
PROJECTION_LIMITS = [
    ("std", 16, 16, None),
    ("std", 32, 16, None),
    ("left", 16, 16, None),
    ("reverse_std", 32, 32, None),
    ("full", 32, 32, None),
    ("std", 15, None, (15, 32)),
    ("reverse_std", 16, None, (16, 16)),
    ("right", 16, None, (16, 16)),
    ("full", 16, None, (16, 16)),
]


@pytest.mark.parametrize("proj_type, rank, limit, factor", [case for case in PROJECTION_LIMITS if case[2]])
def test_explicit_target_the_rank_does_not_project_is_named_in_a_warning(proj_type, rank, limit, factor, caplog):
    # Trained with the identity basis (exactly AdamW, the whole weight as its factor), as transformers' GaLore
    # trains such targets; the warning names the layer, its weight and the fix.
    model = _gqa_llama()
    config = hgp.GaLoreConfig(rank=rank, proj_type=proj_type, target_modules=["k_proj", "v_proj"])
    with caplog.at_level(logging.WARNING, logger="hf_galore_plugin.inject"):
        hgp.prepare_model(model, config)
    (message,) = [r.getMessage() for r in caplog.records if "GaLore does not project it" in r.getMessage()]
    assert "'model.layers.0.self_attn.k_proj'" in message and "16 x 32" in message  # the layer and its weight
    assert "and 1 more layers" in message  # v_proj
    assert f"rank={rank}" in message and f"rank < {limit}" in message and "target_modules" in message  # the fix
    layer = dict(hgp.galore_layers(model))["model.layers.0.self_attn.k_proj"]
    assert tuple(layer.galore_factor.shape) == (16, 32) and layer.scale == 1.0 and not layer.needs_basis


@pytest.mark.parametrize("proj_type, rank, limit, factor", [case for case in PROJECTION_LIMITS if not case[2]])
def test_explicit_target_the_rank_projects_is_accepted(proj_type, rank, limit, factor):
    config = hgp.GaLoreConfig(rank=rank, proj_type=proj_type, target_modules=["k_proj"])
    model = hgp.prepare_model(_gqa_llama(), config)
    (name, layer), *_ = hgp.galore_layers(model)
    assert name == "model.layers.0.self_attn.k_proj" and tuple(layer.galore_factor.shape) == factor


def test_all_linear_skips_layers_at_most_rank_wide_and_names_them():
    model = hgp.prepare_model(_gqa_llama(), hgp.GaLoreConfig(rank=16, target_modules="all-linear"))
    report = hgp.state_of(model).report
    small = [DECODER[1], DECODER[2]]  # k_proj, v_proj: 16 x 32
    assert report.targeted == [name for name in DECODER if name not in small] + ["lm_head"]
    assert {name: report.skipped[name] for name in small} == dict.fromkeys(small, "smaller side <= rank 16")
    assert all(name in report.matched_skipped for name in small)
    assert "matched by target_modules but not projected: " in report.summary()


# ---------------------------------------------------------------------- expert ranks
def _tiny_moe() -> nn.Module:
    """A Qwen3-MoE of 2 layers, 4 experts of gate_up_proj 64 x 64 and down_proj 64 x 32 each."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(config)


@pytest.mark.parametrize("expert_rank", [32, 64])
def test_expert_rank_at_least_an_experts_smaller_side_is_refused(expert_rank):
    model = _tiny_moe()
    with pytest.raises(ValueError) as info:
        hgp.prepare_model(model, hgp.GaLoreConfig(rank=8, experts=True, expert_rank=expert_rank))
    message = str(info.value)
    assert "'model.layers.0.mlp.experts'" in message and "down_proj" in message and "64 x 32" in message
    assert f"expert_rank={expert_rank}" in message and "expert_rank < 32" in message
    assert hgp.state_of(model) is None


def test_expert_rank_below_every_experts_smaller_side_is_accepted():
    model = hgp.prepare_model(_tiny_moe(), hgp.GaLoreConfig(rank=8, experts=True, expert_rank=31))
    assert hgp.state_of(model).report.experts == [f"model.layers.{i}.mlp.experts" for i in (0, 1)]


def test_exclude_modules_regex_leaves_one_experts_module_out():
    config = hgp.GaLoreConfig(rank=8, experts=True, expert_rank=4, exclude_modules=r"model\.layers\.0\.mlp\.experts")
    report = hgp.state_of(hgp.prepare_model(_tiny_moe(), config)).report
    assert report.experts == ["model.layers.1.mlp.experts"]
    assert report.unprojected_experts == {"model.layers.0.mlp.experts": "in exclude_modules"}


@pytest.mark.parametrize("expert_rank", [4, 64])
def test_expert_rank_without_experts_is_refused(expert_rank):
    with pytest.raises(ValueError, match=rf"GaLoreConfig.expert_rank={expert_rank} is invalid: .*experts=True"):
        hgp.GaLoreConfig(expert_rank=expert_rank)


def test_expert_rank_without_experts_through_optim_args_is_refused(tmp_path):
    model = tiny_llama()
    with pytest.raises(ValueError, match=r"expert_rank=4 is invalid: .*experts=True"):
        Trainer(model=model, args=args(tmp_path, optim="galore_adamw", optim_args="rank=4,expert_rank=4"))
    assert hgp.state_of(model) is None


def test_expert_rank_at_its_default_or_with_experts_is_accepted():
    # The default value cannot be told apart from no value, and changes nothing without experts=True.
    assert hgp.GaLoreConfig(expert_rank=16).experts is False
    assert hgp.GaLoreConfig(experts=True, expert_rank=4).expert_rank == 4

"""transformers' own GaLore tests (tests/trainer, the GaLore section), rewritten here with the plugin imported.

Each test states what transformers' test checks and checks the same with the plugin serving the names; where
the plugin's behaviour differs on purpose, the test checks the plugin's behaviour and docs/guides/trainer.md ("transformers'
GaLore tests") gives the reason. Their model (tiny Llama: vocab 100, hidden 32, 3 layers, 4 heads) and data
(one random 128-token row repeated) are kept; the runs are shorter (``max_steps``), since their tests only
ask that training runs. Oracles: transformers' own target matcher, transformers' learning-rate schedule, and
for the layerwise names the same run under ``galore_adamw``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import hf_galore_plugin as hgp

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402
from transformers.trainer_utils import check_target_module_exists  # noqa: E402

from hf_galore_plugin.inject import _matches  # noqa: E402
from hf_galore_plugin.integrations.optim_args import target_modules_from_optim_target_modules  # noqa: E402
from conftest import use_torch_twins  # noqa: E402

ATTN_MLP = [r".*attn.*", r".*mlp.*"]


@pytest.fixture(autouse=True)
def _torch_twins(monkeypatch):
    use_torch_twins(monkeypatch)


class _Repeat(torch.utils.data.Dataset):
    """One token row, `length` times: the data of transformers' GaLore tests."""

    def __init__(self, row: torch.Tensor, length: int = 64):
        self.row, self.length = row, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.row, "labels": self.row}


def _llama_and_data(seed: int = 0) -> tuple[LlamaForCausalLM, _Repeat]:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=3, num_attention_heads=4))
    return model, _Repeat(torch.randint(0, 100, (128,), generator=torch.Generator().manual_seed(1)))


def _args(tmp_path, **kwargs) -> TrainingArguments:
    base = dict(
        output_dir=str(tmp_path), learning_rate=1e-9, logging_steps=5, max_steps=3, report_to=[], use_cpu=True,
        save_strategy="no", disable_tqdm=True, seed=0, data_seed=0, dataloader_num_workers=0,
    )  # fmt: skip
    base.update(kwargs)
    return TrainingArguments(**base)


def _train(tmp_path, **kwargs) -> Trainer:
    model, data = _llama_and_data()
    trainer = Trainer(model, _args(tmp_path, **kwargs), train_dataset=data)
    trainer.train()
    return trainer


# ---------------------------------------------------------------------- test_galore_matched_modules
NAMES = [
    "model.transformer.h.0.ln_1",
    "model.transformer.h.0.attn.q_proj",
    "model.lm_head",
    "model.transformer.h.0.mlp.up_proj",
]


@pytest.mark.parametrize(
    "patterns",
    [ATTN_MLP, ["q_proj", "up_proj"], r".*.attn.*", "model.transformer.h.0.attn.q_proj", ["attn", "mlp"]],
)
def test_galore_matched_modules(patterns):
    # their test: check_target_module_exists on these names; ours: the plugin's translation selects the same
    ours = target_modules_from_optim_target_modules(patterns)
    assert [_matches(name, ours) for name in NAMES] == [check_target_module_exists(patterns, name) for name in NAMES]


# ---------------------------------------------------------------------- test_galore, test_galore_extra_args
@pytest.mark.parametrize("optim", ["galore_adamw", "galore_adamw_layerwise", "galore_adamw_8bit"])
def test_galore(tmp_path, optim):
    trainer = _train(tmp_path, optim=optim, optim_target_modules=ATTN_MLP)
    assert isinstance(getattr(trainer.optimizer, "optimizer", trainer.optimizer), hgp.AdamW)
    assert trainer.state.global_step == 3
    assert len(hgp.galore_layers(trainer.model)) == 21  # 7 projections in each of 3 decoder layers


def test_galore_extra_args(tmp_path):
    # transformers' own parser removes the spaces of optim_args; the plugin reads the same string
    trainer = _train(
        tmp_path,
        optim="galore_adamw",
        optim_target_modules=ATTN_MLP,
        optim_args="rank=64, update_proj_gap=100, scale=0.10",
    )
    config = hgp.state_of(trainer.model).config
    assert (config.rank, config.update_proj_gap, config.scale) == (64, 100, 0.10)


def test_galore_layerwise_with_scheduler(tmp_path):
    trainer = _train(
        tmp_path, optim="galore_adamw_layerwise", optim_target_modules=ATTN_MLP, lr_scheduler_type="cosine"
    )
    assert isinstance(getattr(trainer.optimizer, "optimizer", trainer.optimizer), hgp.AdamW)


# ---------------------------------------------------------------------- test_galore_adafactor
@pytest.mark.parametrize("optim", ["galore_adafactor", "galore_adafactor_layerwise"])
@pytest.mark.parametrize("targets", [ATTN_MLP, ["q_proj", "k_proj", "v_proj"], "all-linear"])
def test_galore_adafactor(tmp_path, targets, optim):
    # their test: galore_adafactor trains on these targets (and bounds the accelerator's peak memory, which needs
    # one: docs/guides/trainer.md). Served by the plugin: Adafactor on the factors and on every other parameter,
    # lr-driven as transformers passes it (scale_parameter and relative_step off); the layerwise name, which
    # transformers' own code cannot build (it passes its lr to Adafactor's relative step), is the same optimizer.
    # 'all-linear' skips layers whose smaller side is <= rank (the plugin's rule, docs/guides/trainer.md): at the
    # default rank 128 this 32-wide model would keep none, so that case runs at rank 16.
    optim_args = "rank=16" if targets == "all-linear" else None
    trainer = _train(tmp_path, optim=optim, optim_target_modules=targets, learning_rate=1e-3, optim_args=optim_args)
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert isinstance(optimizer, hgp.Adafactor)
    assert trainer.state.global_step == 3
    assert hgp.galore_layers(trainer.model)
    groups = optimizer.param_groups
    assert all(not g["relative_step"] and not g["scale_parameter"] and g["eps"][1] == 1e-3 for g in groups)
    assert any(g.get("galore") for g in groups) and any(not g.get("galore") for g in groups)
    assert all(optimizer.state[p] for g in groups for p in g["params"] if p.grad is not None)


def test_galore_adafactor_optim_args(tmp_path):
    trainer = _train(
        tmp_path, optim="galore_adafactor", optim_target_modules=ATTN_MLP,
        optim_args="rank=8,update_proj_gap=2,scale=0.5,proj_type=left,adafactor_beta1=0.9",
    )  # fmt: skip
    config = hgp.state_of(trainer.model).config
    assert (config.rank, config.update_proj_gap, config.scale, config.proj_type) == (8, 2, 0.5, "left")
    assert config.inner_optimizer == "adafactor" and config.adafactor_beta1 == 0.9
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert all(g["beta1"] == 0.9 for g in optimizer.param_groups)


# ---------------------------------------------------------------------- learning-rate display
def test_galore_lr_display_without_scheduler(tmp_path):
    # Theirs expects [lr, lr]: galore-torch's two groups (non-target, target). Ours has one group more (the
    # decay / no-decay split of every other optimizer name, with the GaLore factors in a group of their own:
    # docs/guides/trainer.md), so get_learning_rates() holds one equal value per group.
    model, data = _llama_and_data()
    trainer = Trainer(model, _args(tmp_path, optim="galore_adamw", optim_target_modules=ATTN_MLP), train_dataset=data)
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    rates = trainer.get_learning_rates()
    assert rates == [1e-9] * len(trainer.optimizer.param_groups) and len(rates) == 3


def test_galore_lr_display_with_scheduler(tmp_path):
    # warmup then cosine: the logged lr rises to the peak at the end of warmup and falls to ~0 (their test);
    # oracle: transformers' own schedule function
    from transformers import get_cosine_schedule_with_warmup

    # batch 1 (theirs: the default 8): the schedule does not depend on the batch, and their model's MLPs
    # (LlamaConfig's default intermediate size, 11008) make each of the 16 steps costly
    lr, warmup = 2e-4, 5
    trainer = _train(
        tmp_path, optim="galore_adamw", optim_target_modules=ATTN_MLP, learning_rate=lr, warmup_steps=warmup,
        lr_scheduler_type="cosine", logging_steps=1, max_steps=16, per_device_train_batch_size=1,
    )  # fmt: skip
    logged = [entry["learning_rate"] for entry in trainer.state.log_history if "learning_rate" in entry]
    reference = get_cosine_schedule_with_warmup(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr), warmup, 16)
    expected = []
    for _ in range(16):
        expected.append(reference.get_last_lr()[0])
        reference.step()
    assert logged == pytest.approx(expected, rel=1e-6, abs=1e-12)
    assert logged[warmup] == lr and math.isclose(logged[-1], 0, abs_tol=5e-6)
    assert all(a < b for a, b in zip(logged[:warmup], logged[1 : warmup + 1]))
    assert all(a > b for a, b in zip(logged[warmup:-1], logged[warmup + 1 :]))


# ---------------------------------------------------------------------- layerwise names, gradient accumulation
@pytest.mark.parametrize("base", ["galore_adamw", "galore_adamw_8bit", "galore_adafactor"])
def test_layerwise_name_with_gradient_accumulation_trains_like_its_base_name(tmp_path, base):
    # transformers' layerwise mode refuses gradient accumulation; served by the plugin it is the base name's
    # optimizer, so the weights after 4 steps of 2 accumulated micro-batches are those of the base name
    runs = {}
    for optim in (base, base + "_layerwise"):
        trainer = _train(
            tmp_path / optim, optim=optim, optim_target_modules=ATTN_MLP, optim_args="rank=8,update_proj_gap=2",
            learning_rate=1e-3, gradient_accumulation_steps=2, per_device_train_batch_size=4, max_steps=4,
        )  # fmt: skip
        expected = hgp.Adafactor if "adafactor" in base else hgp.AdamW
        assert isinstance(getattr(trainer.optimizer, "optimizer", trainer.optimizer), expected)
        runs[optim] = {k: v.detach().clone() for k, v in hgp.merged_state_dict(trainer.model).items()}
    (name_a, a), (name_b, b) = runs.items()
    model, _ = _llama_and_data()
    initial = model.state_dict()
    assert a.keys() == b.keys()
    moved = [key for key in a if not torch.equal(a[key], initial[key])]
    assert len(moved) > 20  # it trained
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=0, msg=f"{key}: {name_b} vs {name_a}")


# ---------------------------------------------------------------------- optim_target_modules selection
def _transformers_selection(model: nn.Module, targets) -> list[str]:
    """The layers transformers' own low-rank set-up (``_setup_low_rank_optimizer``) puts in its target group."""
    from types import SimpleNamespace

    from transformers.trainer_optimizer import _setup_low_rank_optimizer
    from transformers.training_args import ParallelMode

    args = SimpleNamespace(
        optim_target_modules=targets, parallel_mode=ParallelMode.NOT_PARALLEL, gradient_accumulation_steps=1
    )
    _, kwargs = _setup_low_rank_optimizer(args, model, "galore_adamw", {"galore_adamw": object}, {}, {})
    target_ids = {id(p) for p in kwargs["params"][1]["params"]}
    return sorted(name[: -len(".weight")] for name, p in model.named_parameters() if id(p) in target_ids)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize(
    "targets",
    ["all-linear", "all_linear", ATTN_MLP, ["q_proj", "v_proj"], ["attn", "mlp"], r".*mlp\..*",
     "model.layers.1.self_attn.q_proj", ["model.layers.0.mlp.up_proj"]],
)  # fmt: skip
def test_optim_target_modules_select_what_transformers_selects(tmp_path, targets, tied):
    theirs = _transformers_selection(
        LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     tie_word_embeddings=tied)),
        targets,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, tie_word_embeddings=tied
        )
    )
    config = hgp.GaLoreConfig(rank=8, target_modules=target_modules_from_optim_target_modules(targets))
    ours = sorted(name for name, _ in hgp.galore_layers(hgp.prepare_model(model, config)))
    assert ours == theirs
    assert ("lm_head" in ours) == (targets in ("all-linear", "all_linear") and not tied)


def test_summary_names_matched_layers_that_were_not_projected(caplog):
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, tie_word_embeddings=True
        )
    )
    model.model.layers[1].mlp.down_proj.weight.requires_grad_(False)
    with caplog.at_level("INFO", logger="hf_galore_plugin.inject"):
        hgp.prepare_model(model, hgp.GaLoreConfig(rank=8, target_modules="all-linear"))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("GaLore targets"))
    assert "GaLore targets 13 nn.Linear" in line
    assert "matched by target_modules but not projected: " in line
    assert "model.layers.1.mlp.down_proj (frozen)" in line
    assert "lm_head (weight tied to model.embed_tokens)" in line
    # an explicit pattern names only what it matched; the default (None) names nothing
    caplog.clear()
    model = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4))
    model.model.layers[1].mlp.down_proj.weight.requires_grad_(False)
    with caplog.at_level("INFO", logger="hf_galore_plugin.inject"):
        hgp.prepare_model(model, hgp.GaLoreConfig(rank=8, target_modules=["mlp"]))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("GaLore targets"))
    assert line.endswith("matched by target_modules but not projected: model.layers.1.mlp.down_proj (frozen)")
    caplog.clear()
    with caplog.at_level("INFO", logger="hf_galore_plugin.inject"):
        hgp.prepare_model(
            LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)),
            hgp.GaLoreConfig(rank=8),
        )
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("GaLore targets"))
    assert "not projected" not in line and "1 output head" in line

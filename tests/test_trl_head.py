"""TRL's trainers and a GaLore output head.

TRL's SFT, DPO, KTO, GRPO and RLOO trainers (TRL >= 1.15) compute their loss through TRL's fused LM head,
which multiplies the hidden states by ``get_output_embeddings().weight`` and never calls the head. A GaLore
head's ``.weight`` is W0 alone (the layer computes with W0 + scale * B Q^T): no gradient reaches the factor
and the head stays at its initial weights. ``optim_target_modules="all-linear"`` selects the untied head, so
the Trainer refuses that run when it is built, naming the head, TRL and the fix (exclude the head).

Tiny Llama (hidden 64, 2 layers, vocabulary 256) on random token ids, a word-level tokenizer built in
memory (no network); each training runs 3 steps on CPU.
"""

from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch

import hf_galore_plugin as hgp

pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from hf_galore_plugin.integrations import chunked_loss  # noqa: E402
from conftest import activation_checkpointing_field, build_tiny_llama, use_torch_twins  # noqa: E402

# update_proj_gap=3 with every layer on one schedule (aligned): the first basis at step 0, the factors train at
# steps 1 and 2 (a refresh would fold them into W0 at step 3, after the run).
OPTIM_ARGS = "rank=8,update_proj_gap=3,refresh_schedule=aligned"


@pytest.fixture(autouse=True)
def _torch_twins(monkeypatch):
    use_torch_twins(monkeypatch)


def _tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(256)}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    return PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="t0", eos_token="t1", unk_token="t0")


def _dataset():
    # pre-tokenized: SFTTrainer adds the labels and nothing else (ids >= 2: no pad or eos inside a row)
    ids = torch.randint(2, 256, (12, 16), generator=torch.Generator().manual_seed(1))
    return datasets.Dataset.from_dict({"input_ids": ids.tolist()})


def _sft_trainer(tmp_path, optim_args: str = OPTIM_ARGS, **kwargs):
    from trl import SFTConfig, SFTTrainer

    config = SFTConfig(
        output_dir=str(tmp_path), optim="galore_adamw", optim_args=optim_args, optim_target_modules="all-linear",
        max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2, save_strategy="no", report_to=[],
        use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True, logging_steps=1,
        # TRL defaults to activation checkpointing under the name transformers 5.x deprecates (a FutureWarning,
        # an error in this suite); off, under the name the installed transformers reads
        **{activation_checkpointing_field(): False},
    )  # fmt: skip
    model = build_tiny_llama()
    return SFTTrainer(model=model, args=config, train_dataset=_dataset(), processing_class=_tokenizer(), **kwargs)


def _weight(layer: torch.nn.Module) -> torch.Tensor:
    if isinstance(layer, hgp.GaLoreLinear):
        return layer.effective_weight(torch.float32).detach().clone()
    return layer.weight.detach().float().clone()


def _trained(trainer) -> dict[str, bool]:
    """Train `trainer`; whether its output head and its first q_proj moved."""
    model = trainer.model
    layers = {"head": model.lm_head, "q_proj": model.model.layers[0].self_attn.q_proj}
    before = {name: _weight(layer) for name, layer in layers.items()}
    trainer.train()
    return {name: not torch.equal(_weight(layer), before[name]) for name, layer in layers.items()}


def test_sft_trainer_all_linear_galore_head_trains_or_is_refused_at_construction(tmp_path):
    # Whichever way the installed TRL computes the loss, an all-linear run never leaves the head untrained.
    try:
        trainer = _sft_trainer(tmp_path)
    except ValueError as exc:
        message = str(exc)
        assert "SFTTrainer" in message and "fused LM head" in message, message  # the library and its loss
        assert "'lm_head'" in message and "exclude_modules=lm_head" in message, message  # the head, the fix
        return
    assert _trained(trainer) == {"head": True, "q_proj": True}


def test_sft_trainer_fused_head_leaves_a_galore_head_untrained(tmp_path, monkeypatch):
    # The premise of the refusal in the installed TRL: with the check off, the run trains the decoder's GaLore
    # layers and never the GaLore head (its factor gets no gradient). A TRL whose SFT loss calls the head fails
    # here: the refusal would then be a false one.
    if not hasattr(sys.modules[trl.SFTTrainer.__module__], "add_fused_lm_head"):
        pytest.skip(f"TRL {trl.__version__}'s SFTTrainer has no fused LM head")
    monkeypatch.setattr(chunked_loss, "_trl_head_weight_reader", lambda trainer: None)
    trainer = _sft_trainer(tmp_path)
    assert isinstance(trainer.model.lm_head, hgp.GaLoreLinear)
    assert _trained(trainer) == {"head": False, "q_proj": True}
    assert trainer.model.lm_head.galore_factor.grad is None


def test_sft_trainer_with_the_head_excluded_trains_it_as_a_plain_parameter(tmp_path):
    # The fix the refusal names.
    trainer = _sft_trainer(tmp_path, OPTIM_ARGS + ",exclude_modules=lm_head")
    assert not isinstance(trainer.model.lm_head, hgp.GaLoreLinear)
    assert isinstance(trainer.model.model.layers[0].self_attn.q_proj, hgp.GaLoreLinear)
    assert _trained(trainer) == {"head": True, "q_proj": True}


def test_sft_trainer_loss_through_the_model_logits_is_not_refused(tmp_path):
    # SFTTrainer's compute_loss_func (deprecated) computes the loss from the model's own logits, through the head's
    # forward: the GaLore head trains, so that run is not refused.
    def loss(outputs, labels, num_items_in_batch=None):
        logits = outputs.logits[:, :-1].flatten(0, 1)
        return torch.nn.functional.cross_entropy(logits, labels[:, 1:].flatten(), ignore_index=-100)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`compute_loss_func` is deprecated", FutureWarning)
        trainer = _sft_trainer(tmp_path, compute_loss_func=loss)
    assert isinstance(trainer.model.lm_head, hgp.GaLoreLinear)
    assert _trained(trainer) == {"head": True, "q_proj": True}


# ---------------------------------------------------------------------- which TRL losses read the head's weight
def _stand_in_trainer(monkeypatch, module_name: str, marker: str, *, loss_type=None, base=object):
    """A trainer class defined in a stand-in module `module_name` whose namespace holds `marker`."""
    module = types.ModuleType(module_name)
    setattr(module, marker, lambda *args, **kwargs: None)
    monkeypatch.setitem(sys.modules, module_name, module)
    cls = type("SFTTrainer", (base,), {"compute_loss": lambda self, *args, **kwargs: None, "__module__": module_name})
    trainer = object.__new__(cls)
    trainer.args = types.SimpleNamespace(loss_type=loss_type)
    trainer.compute_loss_func = None
    trainer.label_smoother = None
    return cls, trainer


def test_trl_chunked_nll_of_trl_1_6_to_1_14_reads_the_head_weight(monkeypatch):
    # TRL 1.6-1.14: SFTTrainer patches a chunked cross-entropy reading lm_head.weight under loss_type='chunked_nll'
    # (the default from 1.7); loss_type='nll' calls the head.
    _, chunked = _stand_in_trainer(
        monkeypatch, "trl.trainer.sft_old", "_patch_chunked_ce_lm_head", loss_type="chunked_nll"
    )
    assert "loss_type='nll'" in (chunked_loss._trl_head_weight_reader(chunked) or "")
    _, plain = _stand_in_trainer(monkeypatch, "trl.trainer.sft_old", "_patch_chunked_ce_lm_head", loss_type="nll")
    assert chunked_loss._trl_head_weight_reader(plain) is None


def test_trl_loss_is_judged_by_the_first_trl_class_defining_compute_loss(monkeypatch):
    fused, _ = _stand_in_trainer(monkeypatch, "trl.trainer.fused", "add_fused_lm_head")
    # a user's subclass that calls super().compute_loss runs TRL's fused loss
    user = type("MySFT", (fused,), {"compute_loss": lambda self, *a, **k: None, "__module__": "my_training"})
    assert "fused LM head" in (chunked_loss._trl_head_weight_reader(object.__new__(user)) or "")
    # a TRL trainer deriving from it without a loss of its own runs it too (GMPO from GRPO) ...
    inherits = type("GMPOTrainer", (fused,), {"__module__": "trl.experimental.inherited"})
    monkeypatch.setitem(sys.modules, "trl.experimental.inherited", types.ModuleType("trl.experimental.inherited"))
    assert "fused LM head" in (chunked_loss._trl_head_weight_reader(object.__new__(inherits)) or "")
    # ... one with its own loss in a module without the fused head (GKD from SFT) does not
    _, derived = _stand_in_trainer(monkeypatch, "trl.experimental.own_loss", "unrelated", base=fused)
    assert chunked_loss._trl_head_weight_reader(derived) is None
    # not TRL at all
    plain = type("Trainer", (), {"compute_loss": lambda self, *a, **k: None, "__module__": "transformers.trainer"})
    assert chunked_loss._trl_head_weight_reader(object.__new__(plain)) is None

"""The plugin on a peft QLoRA model (docs/guides/lora-qlora.md): GaLore goes to the unquantized
trainable nn.Linear layers only (here the output head in ``modules_to_save``), the LoRA adapters train in the
same optimizer's plain groups, and ``state_offload=cpu`` holds every state tensor, the adapters' included, in
host memory. The 4-bit base is bitsandbytes' NF4 ``Linear4bit``, which bitsandbytes runs on CPU.

Oracles: the same run with resident state (offloaded state is bit-identical by design), and the 4-bit base
weights before training (frozen: unchanged).
"""

from __future__ import annotations

import pytest
import torch

import hf_galore_plugin as hgp

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from conftest import build_tiny_llama, token_data, training_args, use_torch_twins  # noqa: E402


@pytest.fixture(autouse=True)
def _torch_twins(monkeypatch):
    use_torch_twins(monkeypatch)


def _qlora_model(folder):
    pytest.importorskip("bitsandbytes", reason="platform: bitsandbytes is not installed (the QLoRA 4-bit base)")
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    model = LlamaForCausalLM.from_pretrained(folder, quantization_config=quantization, device_map="cpu")
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(0)  # the adapters' initialisation
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    return get_peft_model(model, lora)


def _train(tmp_path, folder, offload: str):
    from transformers import Trainer

    model = _qlora_model(folder)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "q_proj.base_layer" in n}
    args = training_args(
        tmp_path / offload,
        optim_target_modules="all-linear",
        optim_args=f"rank=8,update_proj_gap=2,state_offload={offload}",
        max_steps=3,
    )
    trainer = Trainer(model=model, args=args, train_dataset=token_data(12, vocab=256))
    trainer.train()
    return trainer, base


def test_galore_on_a_qlora_model_with_offloaded_adapter_state(tmp_path):
    folder = tmp_path / "base"
    build_tiny_llama().save_pretrained(folder)
    trainer, base = _train(tmp_path, folder, "cpu")
    model = trainer.model
    import bitsandbytes as bnb

    # what gets GaLore: the unquantized trainable head copy only; the 4-bit layers and the adapters do not
    assert [name for name, _ in hgp.galore_layers(model)] == ["base_model.model.lm_head.modules_to_save.default"]
    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules()) == 2 * 7  # every decoder linear
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert isinstance(optimizer, hgp.AdamW)
    adapters = {id(p) for n, p in model.named_parameters() if "lora_" in n}
    plain = [g for g in optimizer.param_groups if not g.get("galore")]
    assert adapters <= {id(p) for g in plain for p in g["params"]}
    assert all(g["state_offload"] == "cpu" for g in optimizer.param_groups)
    assert all(optimizer.state[p] for g in plain for p in g["params"] if id(p) in adapters)  # they stepped
    after = dict(model.named_parameters())
    for name, weight in base.items():
        assert torch.equal(after[name], weight), name  # the NF4 base stays frozen

    # oracle: resident state trains to the same bits
    resident, _ = _train(tmp_path, folder, "none")
    ours = {k: v for k, v in hgp.merged_state_dict(model).items() if v.is_floating_point()}
    theirs = hgp.merged_state_dict(resident.model)
    moved = 0
    for key, value in ours.items():
        assert torch.equal(value, theirs[key]), key
    for name, p in model.named_parameters():
        if "lora_B" in name:
            moved += int(p.abs().sum() > 0)  # lora_B starts at zero: non-zero means the adapters trained
    assert moved == 4

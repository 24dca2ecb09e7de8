"""Experts of a mixture-of-experts model that GaLore leaves unprojected (the default experts=False) keep full-size
AdamW moments for most of the model's parameters. The core's summary line says so at INFO, which a library
logger without a handler never shows (transformers' Trainer and scripts such as run_clm configure the
transformers logger only): the Trainer also says it as a WARNING, which Python prints by default."""

import pytest

pytest.importorskip("transformers")

_TRAINER = """
import sys

import hf_galore_plugin  # noqa: F401
import transformers
from transformers import Trainer, TrainingArguments

def build():
    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    return transformers.Qwen3MoeForCausalLM(config)

for optim_args in ("rank=8", "rank=8,experts=true,expert_rank=4"):
    sys.stderr.write(f"=== {optim_args}\\n")
    args = TrainingArguments(output_dir=OUT, optim="galore_adamw", optim_args=optim_args, use_cpu=True,
                             report_to=[], save_strategy="no")
    Trainer(model=build(), args=args)
"""


def test_trainer_warns_at_default_verbosity_that_experts_stay_unprojected(tmp_path, python_subprocess):
    result = python_subprocess(f"OUT = {str(tmp_path)!r}\n" + _TRAINER, timeout=300)
    default, projected = result.stderr.split("=== rank=8,experts=true,expert_rank=4\n")
    # the premise: the core's INFO summary is not shown at the default verbosity
    assert "GaLore targets" not in result.stderr
    line = next((line for line in default.splitlines() if "expert modules" in line), None)
    assert line is not None, default[-3000:]
    assert "2 expert modules of Qwen3MoeForCausalLM are not projected by GaLore" in line
    assert "2 experts=False" in line and "optim_args experts=true" in line
    assert "expert modules" not in projected, projected[-3000:]

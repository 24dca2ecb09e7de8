"""Fine-tune a tiny Llama with Trainer and each optimizer preset of the plugin.

    python examples/train_trainer.py [--steps 10] [--output_dir outputs/train_trainer]

The only plugin-specific line is the import; the optimizer is chosen by name in TrainingArguments.
"""

import argparse
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import hf_galore_plugin  # noqa: F401  registers galore_adamw, galore_adamw_8bit, qgalore_adamw_8bit

PRESETS = ("galore_adamw", "galore_adamw_8bit", "qgalore_adamw_8bit")


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=128,
            vocab_size=256,
            max_position_embeddings=64,
        )
    )


def byte_dataset(block_size: int = 32) -> list[dict]:
    data = torch.frombuffer(bytearray(open(__file__, "rb").read()), dtype=torch.uint8).long()
    blocks = data[: len(data) // block_size * block_size].view(-1, block_size)
    return [{"input_ids": block, "labels": block} for block in blocks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--output_dir", default="outputs/train_trainer")
    cli = parser.parse_args()
    for optim in PRESETS:
        args = TrainingArguments(
            output_dir=os.path.join(cli.output_dir, optim),
            optim=optim,
            optim_args="rank=16,update_proj_gap=4",
            max_steps=cli.steps,
            per_device_train_batch_size=4,
            learning_rate=2e-3,
            lr_scheduler_type="cosine",
            warmup_steps=2,
            weight_decay=0.01,
            logging_steps=max(1, cli.steps // 2),
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
        )
        trainer = Trainer(model=tiny_llama(), args=args, train_dataset=byte_dataset())
        result = trainer.train()
        trainer.save_model()
        print(f"{optim}: loss {result.training_loss:.4f}, saved merged model to {args.output_dir}")


if __name__ == "__main__":
    main()

"""A standard HfArgumentParser causal-LM recipe, unaware of the plugin.

Run it through the plugin's runner, exactly as you would run transformers' run_clm.py:

    python -m hf_galore_plugin examples/run_clm_cli.py --output_dir out --optim qgalore_adamw_8bit \
        --optim_args "rank=16,update_proj_gap=50" --max_steps 20 --use_cpu

The model is a Llama built from a config (no download); the data is the bytes of a text file
(--text_file, default: this script), tokenizer-free: token id = byte value.
"""

from dataclasses import dataclass, field

import torch
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


@dataclass
class ModelArguments:
    hidden_size: int = field(default=64, metadata={"help": "hidden size of the Llama built from a config"})
    num_hidden_layers: int = field(default=2, metadata={"help": "number of decoder layers"})
    intermediate_size: int = field(default=128, metadata={"help": "MLP width"})


@dataclass
class DataArguments:
    text_file: str = field(default=__file__, metadata={"help": "text whose bytes are the training tokens"})
    block_size: int = field(default=32, metadata={"help": "sequence length"})


def main() -> None:
    model_args, data_args, training_args = HfArgumentParser(
        (ModelArguments, DataArguments, TrainingArguments)
    ).parse_args_into_dataclasses()
    config = LlamaConfig(
        hidden_size=model_args.hidden_size,
        num_hidden_layers=model_args.num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=model_args.intermediate_size,
        vocab_size=256,
        max_position_embeddings=data_args.block_size,
    )
    model = LlamaForCausalLM(config)
    data = torch.frombuffer(bytearray(open(data_args.text_file, "rb").read()), dtype=torch.uint8).long()
    blocks = data[: len(data) // data_args.block_size * data_args.block_size].view(-1, data_args.block_size)
    train_dataset = [{"input_ids": block, "labels": block} for block in blocks]
    trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset)
    result = trainer.train()
    trainer.save_model()
    print(
        f"optim={training_args.optim.value} final_loss={result.training_loss:.4f} "
        f"layers={type(model.model.layers[0].mlp.down_proj).__name__}"
    )


if __name__ == "__main__":
    main()

"""GaLore in a plain PyTorch loop: a tiny Llama learns bytes of the shipped Shakespeare text.

    python examples/plain_pytorch.py --preset qgalore_adamw_8bit --steps 60

Works the same inside an accelerate loop: call after_step(model, optimizer) after every
optimizer.step() (and accelerator.prepare the model only after prepare_model).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_galore_plugin import GaLoreConfig, after_step, create_optimizer, galore_stats, merge_and_unload, prepare_model

DATA = Path(__file__).resolve().parent.parent / "data"


def byte_batches(text: bytes, *, steps: int, batch: int, seq: int, seed: int):
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
        yield torch.stack([data[s : s + seq] for s in starts.tolist()])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--preset", default="galore_adamw", choices=["galore_adamw", "galore_adamw_8bit", "qgalore_adamw_8bit"]
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--gap", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-2)  # GaLore paper: 0.01 with scale 0.25
    args = parser.parse_args(argv)

    text = (DATA / "shakespeare.txt").read_bytes()
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=128,
        )
    )
    config = GaLoreConfig.preset(args.preset, rank=args.rank, update_proj_gap=args.gap)
    model = prepare_model(model, config)
    optimizer = create_optimizer(model, lr=args.lr, weight_decay=0.0)
    losses = []
    for step, ids in enumerate(byte_batches(text, steps=args.steps, batch=8, seq=64, seed=0)):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        event = after_step(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if event["refreshed"] or step % 20 == 0:
            print(f"step {step:4d}  loss {loss.item():.3f}  refreshed {len(event['refreshed'])} layers")
    stats = galore_stats(model, optimizer)
    print(
        f"optimizer state: {stats['galore/bytes_optimizer_state']:.0f} bytes; refreshes {stats['galore/refreshes']:.0f}"
    )
    model = merge_and_unload(model)
    print(f"first loss {losses[0]:.3f} (ln 256 = {math.log(256):.3f}), last {losses[-1]:.3f}")
    return {"losses": losses, "model": model}


if __name__ == "__main__":
    main()

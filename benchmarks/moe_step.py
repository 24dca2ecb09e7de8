"""Ordinary-step CPU time of a tiny mixture-of-experts model: experts projected by GaLore vs not.

    python benchmarks/moe_step.py                 # tiny Qwen3-MoE (hidden 64, 4 experts, 2 layers), 4 x 64 tokens
    python benchmarks/moe_step.py --experts 8 --hidden 256 --moe-intermediate 128 --rounds 40

Same model, same tokens, same preset; "unprojected" leaves the fused expert weights to the optimizer as
plain 3-D parameters (stock transformers experts module, its default ``grouped_mm`` implementation),
"projected" trains them with GaLore (``experts=True``). Also the stock model with torch AdamW for scale.
Measure: CPU time of the thread running one step (``time.thread_time``, torch on one thread), median over
rounds in which every variant runs one step, the order rotating every round; every step is an ordinary one
(refresh gap beyond the run, calibration step taken before the timed rounds). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def build(args, variant: str):
    import transformers

    import hf_galore_plugin as hg

    config = transformers.Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.moe_intermediate, num_hidden_layers=args.layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=args.hidden // 4, num_experts=args.experts,
        num_experts_per_tok=args.top_k, decoder_sparse_step=1, max_position_embeddings=args.seq_len,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    if variant == "adamw_torch":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3), None
    # expert_rank is an option of projected experts only (GaLoreConfig refuses it without experts=True)
    experts = {"experts": True, "expert_rank": args.expert_rank} if variant == "projected" else {}
    galore = hg.GaLoreConfig.preset(args.preset, rank=args.rank, update_proj_gap=10**6, **experts)
    hg.prepare_model(model, galore)
    optimizer = hg.create_optimizer(model, lr=1e-3)
    return model, optimizer, hg.after_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--moe-intermediate", type=int, default=32)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--expert-rank", type=int, default=8)
    parser.add_argument("--preset", default="galore_adamw")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    variants = ("adamw_torch", "unprojected", "projected")
    runs = {name: build(args, name) for name in variants}
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))

    def step(name: str) -> float:
        model, optimizer, after = runs[name]
        start = time.thread_time()
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        if after is not None:
            after(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
        return time.thread_time() - start

    for name in variants:  # calibration step (first bases) and warm-up, untimed
        step(name)
        step(name)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.rounds):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for name in order:
            times[name].append(step(name))
    median = {name: statistics.median(values) for name, values in times.items()}
    ratios = {name: statistics.median(a / b for a, b in zip(times[name], times["unprojected"])) for name in variants}
    print(
        f"tiny Qwen3-MoE: hidden {args.hidden}, {args.experts} experts (top {args.top_k}, moe_intermediate "
        f"{args.moe_intermediate}), {args.layers} layers, {args.batch} x {args.seq_len} tokens, preset {args.preset}, "
        f"rank {args.rank}, expert_rank {args.expert_rank}, {args.threads} thread(s), {args.rounds} rounds"
    )
    print()
    print("| variant | CPU ms / step (median) | ratio to unprojected (median of per-round ratios) |")
    print("|---|---:|---:|")
    for name in variants:
        print(f"| {name} | {1000 * median[name]:.2f} | {ratios[name]:.3f} |")


if __name__ == "__main__":
    main()

"""Step time and peak bytes of the chunked loss against the model's own loss, on CPU.

    python benchmarks/chunked_loss.py                    # small Llama, seq 2048, 32k vocabulary
    python benchmarks/chunked_loss.py --vocab 128256 --repeats 3

One process, one torch thread; a training step (forward with labels, backward; no optimizer) of the same
model with the model's own loss (transformers' ForCausalLMLoss on the full logits) and with the chunked
loss at each chunk size, interleaved round by round so load on the machine hits every variant alike. Time:
`time.thread_time` (CPU seconds of this thread: robust to other processes on a shared machine), median over
the rounds. Peak: live tensor bytes of one step above the model's parameters (the planner's tracker).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from hf_galore_plugin.loss import default_chunk_tokens, disable_chunked_loss, enable_chunked_loss  # noqa: E402
from hf_galore_plugin.plan.tracker import LiveBytes  # noqa: E402


def build(vocab: int, hidden: int, layers: int, seq: int):
    from _models import build_llama

    shape = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.6875), num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=seq,
    )  # fmt: skip
    return build_llama(shape, seed=0).train()


def step(model, ids) -> float:
    start = time.thread_time()
    model(input_ids=ids, labels=ids).loss.backward()
    seconds = time.thread_time() - start
    model.zero_grad(set_to_none=True)
    return seconds


def set_variant(model, chunk) -> None:
    if chunk is None:
        disable_chunked_loss(model)
    else:
        enable_chunked_loss(model, chunk_tokens=chunk)


def peak_bytes(model, ids) -> int:
    with LiveBytes() as tracker:
        for p in model.parameters():
            tracker.track(p)
        start = tracker.total
        model(input_ids=ids, labels=ids).loss.backward()
        peak = tracker.peak - start
    model.zero_grad(set_to_none=True)
    return peak


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--chunks", default="default,256", help="chunk sizes in tokens ('default': the package's)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model = build(args.vocab, args.hidden, args.layers, args.seq_len)
    ids = torch.randint(0, args.vocab, (args.batch_size, args.seq_len), generator=torch.Generator().manual_seed(0))
    chunks = [default_chunk_tokens(args.vocab) if c == "default" else int(c) for c in args.chunks.split(",")]
    variants = [None, *chunks]
    names = {None: "model's own loss (full logits)", **{c: f"chunked, {c} tokens per chunk" for c in chunks}}
    for chunk in variants:  # warm-up: first-call allocations and library set-up
        set_variant(model, chunk)
        step(model, ids)
    times: dict = {chunk: [] for chunk in variants}
    for _ in range(args.repeats):
        for chunk in variants:
            set_variant(model, chunk)
            times[chunk].append(step(model, ids))
    peaks = {}
    for chunk in variants:
        set_variant(model, chunk)
        peaks[chunk] = peak_bytes(model, ids)
    params = sum(p.numel() for p in model.parameters())
    print(f"Llama {params / 1e6:.1f}M parameters (hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}), "
          f"batch {args.batch_size} x seq {args.seq_len}, fp32, 1 thread, median of {args.repeats} interleaved "
          "rounds")  # fmt: skip
    print()
    print("| loss | step CPU s | vs own loss | peak MiB above parameters |")
    print("|---|---:|---:|---:|")
    base = statistics.median(times[None])
    for chunk in variants:
        median = statistics.median(times[chunk])
        print(f"| {names[chunk]} | {median:.3f} | {median / base:.3f}x | {peaks[chunk] / 2**20:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU measurements for benchmarks/gpu.sh: fused 8-bit AdamW kernel throughput, and step time plus
peak torch.cuda.max_memory_allocated of a ~1B Llama for AdamW, bitsandbytes AdamW8bit and our presets.

    python benchmarks/gpu_step.py kernel --out DIR           # adamw8bit kernel vs torch fused AdamW (and bnb)
    python benchmarks/gpu_step.py step --method NAME --out DIR   # one method, in its own process
    python benchmarks/gpu_step.py table --out DIR            # collect step_*.json into step.md, with the
                                                             # memory planner's peaks for the same settings
    python benchmarks/gpu_step.py step --method adamw --tiny --device cpu --out DIR   # smoke test of the code path

Step model: Llama (_models.SHAPES["1.1b"]: hidden 2048, intermediate 5504, 22 layers, 32 heads, 4 KV heads, vocab 32000:
TinyLlama-1.1B's shape), bf16 weights, batch 4 x 512 tokens, activation checkpointing off. A step is
forward + backward + optimizer.step() (+ after_step for ours) + zero_grad(set_to_none). Steps 0-2 are
warm-up (step 0 is our calibration step, which also computes the first bases); the median of the
next 5 is reported. Refresh steps are not in the timed window (gap 200, as in the GaLore paper).
Peak memory: torch.cuda.max_memory_allocated over the whole run, weights included. Step-driver syncs:
device-to-host synchronizations inside after_step of one more normal step (CUDA's sync debug mode);
the layers read their schedule counters from host copies, so this should be 0 at any depth.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
import warnings

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _common  # noqa: E402  (keeps transformers' own optimizer names untouched)
import torch  # noqa: E402

from _models import SHAPES, build_llama, llama_config  # noqa: E402

STEP_METHODS = ("adamw", "adamw_fused", "bnb_adamw8bit", "torchao_adamw8bit", "galore_torch", *_common.EVERY_PRESET)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _median_seconds(fn, device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---------------------------------------------------------------------- kernel throughput
def kernel(args: argparse.Namespace) -> None:
    """One AdamW step over n values: ours (8-bit blockwise, Triton), torch fused AdamW (fp32 state),
    bitsandbytes AdamW8bit. Bytes moved = what the step must read and write at least."""
    from hf_galore_plugin.optim.adamw8bit import AdamW8bitHyper, adamw8bit_step

    device = torch.device(args.device)
    n = args.numel
    block = 256
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        param = torch.randn(n, device=device, dtype=dtype)
        grad = torch.randn(n, device=device, dtype=dtype)
        blocks = (n + block - 1) // block
        codes = [torch.zeros(n, device=device, dtype=t) for t in (torch.int8, torch.uint8)]
        scales = [torch.zeros(blocks, device=device, dtype=torch.float32) for _ in range(2)]
        step = [0]

        def ours() -> None:
            step[0] += 1
            hyper = AdamW8bitHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, block_size=block)
            adamw8bit_step(param, grad, (codes[0], scales[0], codes[1], scales[1]), step=step[0], hyper=hyper)

        size = param.element_size()
        moved = n * (2 * size + size + 2 * 2) + 4 * blocks * 2 * 2  # param r/w, grad r, 2 moments r/w, scales
        seconds = _median_seconds(ours, device, 3, args.repeats)
        rows.append((f"ours adamw8bit (Triton), {str(dtype)[6:]} params", n, seconds, moved))

        p = torch.nn.Parameter(param.clone())
        p.grad = grad.clone()
        fused = device.type == "cuda"
        torch_opt = torch.optim.AdamW([p], lr=1e-3, fused=fused)
        seconds = _median_seconds(torch_opt.step, device, 3, args.repeats)
        state = p.element_size()
        rows.append((f"torch AdamW ({'fused' if fused else 'foreach'}), {str(dtype)[6:]} state", n, seconds,
                     n * (3 * size + 4 * state)))  # fmt: skip
        del torch_opt, p
        try:
            import bitsandbytes as bnb

            q = torch.nn.Parameter(param.clone())
            q.grad = grad.clone()
            bnb_opt = bnb.optim.AdamW8bit([q], lr=1e-3)
            seconds = _median_seconds(bnb_opt.step, device, 3, args.repeats)
            rows.append((f"bitsandbytes AdamW8bit, {str(dtype)[6:]} params", n, seconds, moved))
            del bnb_opt, q
        except Exception as exc:  # not importable, or no kernel for this device
            rows.append(
                (f"bitsandbytes AdamW8bit, {str(dtype)[6:]} params: not run ({type(exc).__name__})", n, None, moved)
            )
        del param, grad, codes, scales
    # The floor of a memory-bound step: a device-to-device copy of the same size, counted as bytes read
    # plus bytes written (the same definition as the rows' "bytes that must move").
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    copy_bw = 2 * src.nbytes / _median_seconds(lambda: dst.copy_(src), device, 3, args.repeats)
    del src, dst
    lines = [f"Device copy bandwidth (read + write, {n:,} fp32 values): {copy_bw / 1e9:.0f} GB/s.", "",
             "| optimizer step | values | ms | GB/s (bytes that must move) | of copy bandwidth |",
             "|---|---|---|---|---|"]  # fmt: skip
    for name, count, seconds, moved in rows:
        if seconds is None:
            lines.append(f"| {name} | {count:,} | n/a | n/a | n/a |")
        else:
            bw = moved / seconds
            lines.append(f"| {name} | {count:,} | {seconds * 1e3:.3f} | {bw / 1e9:.0f} | {bw / copy_bw:.0%} |")
    text = "\n".join(lines) + "\n"
    (args.out / "kernel.md").write_text(text)
    print(text)


# ---------------------------------------------------------------------- 1B step
def _step_syncs(model, optimizer, after_step, ids) -> tuple[int, int]:
    """Device-to-host synchronizations of one normal step, as counted by CUDA's sync debug mode (one warning
    per synchronizing call): (in the whole step, in the step driver `after_step` alone)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            before_driver = len(caught)
            after_step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    optimizer.zero_grad(set_to_none=True)
    syncs = ["synchroniz" in str(w.message).lower() for w in caught]
    return sum(syncs), sum(syncs[before_driver:])


def step(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    shape = SHAPES["tiny-h64" if args.tiny else "1.1b"]
    batch, seq = (2, 32) if args.tiny else (args.batch, args.seq)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model = build_llama(shape, seed=0, init_device=device, dtype=torch.bfloat16, max_position_embeddings=seq)
    params = sum(p.numel() for p in model.parameters())
    rank = 16 if args.tiny else 512  # GaLore paper: 512 for 1B
    setup = _common.MethodSetup(
        targets_regex=r"model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)",
        extra_trainable=r"embed_tokens|lm_head|norm", galore_rank=rank, galore_gap=200, galore_scale=0.25,
        lora_rank=8, lora_matched_rank=8,
    )  # fmt: skip
    model, optimizer, after_step = _common.setup_method(args.method, model, setup, lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)

    def one_step() -> None:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        after_step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):  # warm-up; step 0 is the calibration step, which also computes the first bases
        one_step()
    run_peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = _median_seconds(one_step, device, 0, 2 if args.tiny else 5)
    normal_peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    step_syncs, driver_syncs = _step_syncs(model, optimizer, after_step, ids) if device.type == "cuda" else (None, None)
    result = {
        "method": args.method,
        "parameters": params,
        "batch": batch,
        "seq": seq,
        "seconds_per_step": seconds,
        "tokens_per_second": batch * seq / seconds,
        "peak_allocated_bytes": max(run_peak, normal_peak) if device.type == "cuda" else None,
        "warmup_peak_allocated_bytes": run_peak,  # steps 0-2: the calibration/first-refresh step
        "normal_step_peak_allocated_bytes": normal_peak,  # the timed steps only (no refresh)
        "step_device_syncs": step_syncs,  # in one whole normal step (CUDA sync debug mode)
        "step_driver_device_syncs": driver_syncs,  # of which in after_step
        "settings": {"shape": shape, "rank": rank, "dtype": "bf16", "gradient_checkpointing": False},
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
    }
    (args.out / f"step_{args.method}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


# Planner names of the step methods (hf_galore_plugin.plan).
PLAN_METHODS = {"adamw": "adamw_torch", "adamw_fused": "adamw_torch", "bnb_adamw8bit": "adamw_8bit",
                "galore_torch": "galore_torch", **{m: m for m in _common.EVERY_PRESET}}  # fmt: skip


def planned_peaks(shape: dict, rank: int, batch: int, seq: int) -> dict[str, tuple[int, int]]:
    """(normal-step, refresh-step) peak bytes of every step method, from the memory planner (CPU only):
    the same shape, dtype, batch, rank and GaLore targets as `step`."""
    import hf_galore_plugin.plan as plan

    config = llama_config(shape, max_position_embeddings=seq)
    original = plan.load_config
    plan.load_config = lambda model, config_path: config
    try:
        result = plan.estimate(
            model="1.1B Llama (gpu_step)", methods=list(dict.fromkeys(PLAN_METHODS.values())), seq_len=seq, batch_size=batch,
            gradient_checkpointing=False, dtype="bf16", rank=rank,
            optim_args={"target_modules": r"model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"},
        )  # fmt: skip
    finally:
        plan.load_config = original
    return {step: (result["methods"][name]["peak_bytes"], result["methods"][name]["refresh_peak_bytes"])
            for step, name in PLAN_METHODS.items()}  # fmt: skip


def table(args: argparse.Namespace) -> None:
    results = {m: json.loads((args.out / f"step_{m}.json").read_text()) for m in STEP_METHODS
               if (args.out / f"step_{m}.json").exists()}  # fmt: skip
    # Ratios against the strongest baseline run: torch's fused AdamW when it ran.
    base_name = "adamw_fused" if "adamw_fused" in results else "adamw"
    reference = results.get(base_name)
    plans = {}
    if results and not args.no_plan:
        first = next(iter(results.values()))
        plans = planned_peaks(first["settings"]["shape"], first["settings"]["rank"], first["batch"], first["seq"])
    lines = [f"| method | params | batch x seq | s/step | tokens/s | tokens/s vs {base_name} | peak GiB, whole run "
             "| peak GiB, normal steps | planner peak GiB (normal / refresh step) | syncs per normal step (after_step) |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for method in STEP_METHODS:
        r = results.get(method)
        planned = plans.get(method)
        planned = "n/a" if planned is None else f"{planned[0] / 2**30:.2f} / {planned[1] / 2**30:.2f}"
        if r is None:
            lines.append(f"| {method} | not run (see gpu.log) | | | | | | | {planned} | |")
            continue
        versus = f"{reference['seconds_per_step'] / r['seconds_per_step']:.2f}x" if reference else "n/a"
        peak = "n/a" if r["peak_allocated_bytes"] is None else f"{r['peak_allocated_bytes'] / 2**30:.2f}"
        normal = r.get("normal_step_peak_allocated_bytes")
        peak += " | " + ("n/a" if normal is None else f"{normal / 2**30:.2f}")
        lines.append(f"| {method} | {r['parameters'] / 1e9:.2f}B | {r['batch']} x {r['seq']} | {r['seconds_per_step']:.3f} "
                     f"| {r['tokens_per_second']:.0f} | {versus} | {peak} | {planned} "
                     f"| {_syncs(r)} |")  # fmt: skip
    text = "\n".join(lines) + "\n"
    (args.out / "step.md").write_text(text)
    print(text)


def _syncs(result: dict) -> str:
    whole, driver = result.get("step_device_syncs"), result.get("step_driver_device_syncs")
    return "n/a" if whole is None else f"{whole} ({driver})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["kernel", "step", "table"])
    parser.add_argument("--method", choices=STEP_METHODS, default="adamw")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--numel", type=int, default=64 * 2**20, help="values per kernel step (default 64M)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama (smoke test of the code path)")
    parser.add_argument("--no-plan", action="store_true", help="table: leave out the memory planner's column")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    {"kernel": kernel, "step": step, "table": table}[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

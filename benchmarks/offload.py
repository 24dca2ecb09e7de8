"""Step time and device-resident optimizer state with and without state_offload='cpu'.

    python benchmarks/offload.py                          # CPU: 32k x 256 embedding + head, fp32 state
    python benchmarks/offload.py --state-bits 8 --error-feedback
    python benchmarks/offload.py --device cuda --hidden 2048   # TinyLlama-1.1B's embedding and head

The parameters are what offloading is for: an untied embedding and output head (vocab x hidden
each), the large tensors GaLore does not project. A step is `optimizer.step()` on fixed random
gradients; 2 warm-up steps, then the median of `--steps`, the two settings' steps interleaved. "device state" is the optimizer state
held on the parameters' device between steps (resident: all of it; offloaded: none, the step
counters are host scalars either way), and "staging" the device bytes the offloaded step streams
through (two slots, alive inside the step only). On the CPU "device" and host are the same memory:
the offloaded step's extra copies are pure cost there, and the ratio says how much.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

from hf_galore_plugin.optim import AdamW  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def setup(args: argparse.Namespace, offload: str):
    """(step function, optimizer, parameters) of one setting, on fresh copies of the same tensors."""
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)
    shapes = [(args.vocab, args.hidden), (args.vocab, args.hidden)]
    params = [torch.nn.Parameter(torch.randn(*s, generator=generator).to(device, args.dtype)) for s in shapes]
    grads = [torch.randn(*s, generator=generator).to(device, args.dtype) for s in shapes]
    optimizer = AdamW(
        params, lr=1e-4, weight_decay=0.01, state_bits=args.state_bits, error_feedback=args.error_feedback,
        state_offload=offload, state_offload_chunk_mb=args.chunk_mb,
    )  # fmt: skip

    def step() -> None:
        for p, g in zip(params, grads):
            p.grad = g
        optimizer.step()

    return step, optimizer, params


def measure(args: argparse.Namespace) -> list[dict]:
    """Both settings, their timed steps interleaved (none, cpu, none, ...) so that load from other
    processes on a shared machine falls on both alike."""
    device = torch.device(args.device)
    runs = {offload: setup(args, offload) for offload in ("none", "cpu")}
    for step, _, _ in runs.values():
        for _ in range(2):
            step()
    times: dict[str, list[float]] = {offload: [] for offload in runs}
    for _ in range(args.steps):
        for offload, (step, _, _) in runs.items():
            _sync(device)
            start = time.perf_counter()
            step()
            _sync(device)
            times[offload].append(time.perf_counter() - start)
    rows = []
    for offload, (_, optimizer, params) in runs.items():
        steps_bytes = 4 * len(optimizer.state)  # 0-d fp32 step counters, host scalars in both settings
        host = optimizer.host_state_nbytes()
        rows.append({
            "offload": offload,
            "step_ms": 1000 * statistics.median(times[offload]),
            "device_state_bytes": optimizer.state_nbytes() - steps_bytes - host,
            "host_state_bytes": host,
            "staging_bytes": optimizer.staging_nbytes(),
            "params": sum(p.numel() for p in params),
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--state-bits", type=int, default=32, choices=(32, 8))
    parser.add_argument("--error-feedback", action="store_true")
    parser.add_argument("--chunk-mb", type=float, default=16.0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", type=pathlib.Path, help="also write the rows to this file")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here; use --device cpu")
    args.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    rows = measure(args)
    state = f"{args.state_bits}-bit" + (" + error feedback" if args.error_feedback else "")
    print(f"{args.device}: embedding + head {args.vocab} x {args.hidden} ({rows[0]['params'] / 1e6:.1f}M values), "
          f"{str(args.dtype).removeprefix('torch.')} params, {state} state, chunk {args.chunk_mb} MiB, "
          f"median of {args.steps} steps, torch threads {torch.get_num_threads()}")  # fmt: skip
    print("| state_offload | step ms | device state MiB | host state MiB | staging MiB |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['offload']} | {row['step_ms']:.1f} | {row['device_state_bytes'] / 2**20:.1f} "
              f"| {row['host_state_bytes'] / 2**20:.1f} | {row['staging_bytes'] / 2**20:.1f} |")  # fmt: skip
    print(f"step time ratio offload/resident: {rows[1]['step_ms'] / rows[0]['step_ms']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a checkpoint manifest costs: checksum throughput per algorithm, and writing / verifying the
manifest of a checkpoint-shaped folder.

    python benchmarks/checkpoint_manifest.py [--size-mb 2048] [--dir DIR] [--quick]

1. Single-core throughput of the standard library's checksums (crc32, adler32, sha256, sha1, md5,
   blake2b) over a 256 MB buffer in memory, fed in the manifest's 16 MiB chunks.
2. A folder like a checkpoint: ``model.safetensors`` (half of --size-mb, in 64 MB tensors) and a
   torch.save zip file (the other half, 64 MB tensors), written and flushed first, then
   ``write_manifest`` and ``verify_manifest`` timed with the files in the page cache (as right after a
   save) and MB/s = file bytes / seconds. The 7B estimate divides a Llama-2-7B GaLore checkpoint's bytes
   (bf16 merged weights 13.5 GB, galore_state.pt with the bf16 W0 13.5 GB, optimizer.pt with fp32 Adam
   moments of embeddings and head 2.1 GB) by the measured rate.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
import zlib

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hf_galore_plugin.checkpoint.manifest import _THREADS, verify_manifest, write_manifest  # noqa: E402

CHUNK = 16 << 20
LLAMA2_7B_CHECKPOINT_BYTES = 13.5e9 + 13.5e9 + 2.1e9


def checksum_rates(nbytes: int) -> dict[str, float]:
    """MB/s of each checksum over `nbytes` of random data, one core."""
    data = memoryview(os.urandom(nbytes))

    def crc32() -> None:
        crc = 0
        for start in range(0, nbytes, CHUNK):
            crc = zlib.crc32(data[start : start + CHUNK], crc)

    def adler32() -> None:
        value = 1
        for start in range(0, nbytes, CHUNK):
            value = zlib.adler32(data[start : start + CHUNK], value)

    def hashlib_digest(name: str):
        def run() -> None:
            digest = hashlib.new(name)
            for start in range(0, nbytes, CHUNK):
                digest.update(data[start : start + CHUNK])

        return run

    runs = {"crc32": crc32, "adler32": adler32}
    runs.update({name: hashlib_digest(name) for name in ("sha256", "sha1", "md5", "blake2b")})
    rates = {}
    for name, run in runs.items():
        best = min(_timed(run) for _ in range(3))
        rates[name] = nbytes / best / 1e6
    return rates


def _timed(run) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def build_checkpoint(folder: str, size_mb: int) -> int:
    """model.safetensors and state.pt of `size_mb` MB together (64 MB fp32 tensors), flushed to disk."""
    from safetensors.torch import save_file

    tensor_values = 16 << 20  # 64 MB of fp32
    count = max(1, size_mb // 2 // 64)
    generator = torch.Generator().manual_seed(0)
    tensors = {f"layer{i}.weight": torch.randn(tensor_values, generator=generator) for i in range(count)}
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "state.pt"), "wb") as handle:
        torch.save({"state": tensors}, handle)
    total = 0
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
        total += os.path.getsize(path)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=2048, help="checkpoint size to build (MB)")
    parser.add_argument("--dir", default=None, help="where to build it (default: a temporary folder)")
    parser.add_argument("--quick", action="store_true", help="64 MB buffer and a 256 MB checkpoint")
    args = parser.parse_args()
    size_mb = 256 if args.quick else args.size_mb
    rates = checksum_rates((64 if args.quick else 256) << 20)
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        total = build_checkpoint(folder, size_mb)
        write = write_manifest(folder, global_step=1)
        verify = verify_manifest(folder)
    write_rate = total / write["seconds"] / 1e6
    verify_rate = total / verify["seconds"] / 1e6
    result = {
        "threads": _THREADS,
        "cpu_count": os.cpu_count(),
        "checksum_mb_per_s_one_core": {name: round(rate) for name, rate in rates.items()},
        "checkpoint_mb": round(total / 1e6),
        "write_manifest_s": round(write["seconds"], 3),
        "write_manifest_mb_per_s": round(write_rate),
        "verify_manifest_s": round(verify["seconds"], 3),
        "verify_manifest_mb_per_s": round(verify_rate),
        "llama2_7b_checkpoint_gb": LLAMA2_7B_CHECKPOINT_BYTES / 1e9,
        "llama2_7b_write_s_estimate": round(LLAMA2_7B_CHECKPOINT_BYTES / 1e6 / write_rate, 1),
        "llama2_7b_verify_s_estimate": round(LLAMA2_7B_CHECKPOINT_BYTES / 1e6 / verify_rate, 1),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

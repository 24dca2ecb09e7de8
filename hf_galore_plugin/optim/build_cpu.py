"""Build the C++ CPU form of the 8-bit AdamW step for this machine, ahead of training.

    python -m hf_galore_plugin.optim.build_cpu [--verbose]

Needs a C++ compiler and ninja; takes one to three minutes; cached per machine (see
`hf_galore_plugin.optim.adamw8bit_cpu`). Without it the CPU step runs as torch operations: same results,
20-80x slower.
"""

from __future__ import annotations

import os
import sys

from hf_galore_plugin.optim import adamw8bit_cpu


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print((__doc__ or "").strip())
        return 0
    unknown = [a for a in argv if a not in ("-v", "--verbose")]
    if unknown:
        print(f"unknown arguments {unknown}; usage: python -m hf_galore_plugin.optim.build_cpu [--verbose]")
        return 2
    print(f"building {adamw8bit_cpu.extension_name()} under {os.path.dirname(adamw8bit_cpu.build_directory())}")
    adamw8bit_cpu.build(verbose=bool(argv))
    print(f"built: {adamw8bit_cpu.library_path()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

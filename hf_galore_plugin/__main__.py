"""Run an unmodified training script with the plugin registered.

    python -m hf_galore_plugin path/to/train.py ARGS...
    python -m hf_galore_plugin -m package.module ARGS...
    accelerate launch -m hf_galore_plugin train.py ARGS...
    torchrun --nproc_per_node=2 -m hf_galore_plugin train.py ARGS...
    deepspeed --module hf_galore_plugin train.py ARGS...

The plugin is imported (which registers its optimizer names with transformers, now or when the
script imports it), then the target runs as ``__main__`` with ``sys.argv`` set to what it would
see if started directly (``[script, ARGS...]``, or ``[module file, ARGS...]`` with ``-m``).
"""

from __future__ import annotations

import os
import runpy
import sys

import hf_galore_plugin  # noqa: F401  (registration happens at import)

USAGE = "usage: python -m hf_galore_plugin (SCRIPT.py | -m MODULE) [ARGS...]"


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + __doc__.strip())
        raise SystemExit(0 if argv else 2)
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit(USAGE)
        module, args = argv[1], argv[2:]
        # runpy sets sys.argv[0] to the module's file once it is found, as `python -m` does
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script, args = argv[0], argv[1:]
    sys.argv = [script, *args]
    # `python script.py` puts the script's folder first on sys.path (sibling imports work)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])

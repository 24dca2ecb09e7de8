"""How every two-rank script of the test suite ends: collectives finished, process group destroyed, and
the process left without interpreter finalization.

A gloo worker thread can still own a finished work object (e.g. FSDP2's coalesced all-gather) whose tensors
reference Python objects. If it releases that object while the interpreter is finalizing, acquiring the GIL
ends the thread with pthread_exit inside a C++ destructor and the rank aborts with "terminate called without
an active exception" after a passing run (core dump: `AsyncAllgatherCoalescedWork` destroyed in
`ProcessGroupGloo::runLoop` under `Py_FinalizeEx`; pytorch/pytorch#179291 describes the same race). Leaving
through `os._exit` after the results are written and flushed skips finalization, so the race cannot happen.
"""

from __future__ import annotations

import gc
import os
import sys

import torch.distributed as dist


def shut_down() -> None:
    """Barrier, destroy the process group, flush, and exit 0 without interpreter finalization."""
    if dist.is_initialized():
        dist.barrier()  # every rank has finished its collectives and written its results
        gc.collect()  # engine objects (DDP reducers, FSDP states) go while the interpreter is whole
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

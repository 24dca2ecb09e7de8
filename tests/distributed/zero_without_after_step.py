"""sharded_galore.py's DeepSpeed run (ENGINE=zero1 | zero2 | zero3) with a loop that never calls after_step: the
GaLore layers never get a basis and do not train, which the optimizer's step-driver check must report on every
rank (tests/test_distributed_step_driver.py)."""

import sys

import _deepspeed_loop
import sharded_galore
from _teardown import shut_down


def _no_after_step(model, optimizer=None, **kwargs):
    return {"refreshed": [], "similarity": None}


if __name__ == "__main__":
    _deepspeed_loop.after_step = _no_after_step  # the loop's own name: the step it leaves out
    sharded_galore.main(sys.argv[1])
    shut_down()

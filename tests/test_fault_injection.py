"""SIGKILL a GaLore Trainer run at 12 instants (between steps, inside every file write of a checkpoint,
before and inside rotation, with save_total_limit=1), then ``train(resume_from_checkpoint=True)``
from whatever the output_dir holds. Every resume must end with final tensors bit-identical to an
uninterrupted run, or be refused before any step with a message naming the complete checkpoint to
use (or saying that none exists). The table in README "Checkpoints and failures" is this test's.

The kill points and the worker are in tests/_fault_worker.py (one interpreter, forked runs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fault_worker.py")


@pytest.mark.slow
def test_sigkill_anywhere_resumes_exactly_or_is_refused(tmp_path):
    repo = os.path.dirname(os.path.dirname(WORKER))
    env = {
        **os.environ,
        "HF_GALORE_DISABLE_TRITON": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, WORKER, str(tmp_path)], capture_output=True, text=True, timeout=600, env=env
    )
    assert result.returncode == 0, result.stderr[-4000:]
    with open(tmp_path / "rows.json") as handle:
        rows = json.load(handle)["rows"]
    assert len(rows) >= 10
    table = "\n".join(f"{r['point']}: held {r['held']} -> {r['outcome']} {r.get('message', '')[:160]}" for r in rows)
    for row in rows:
        assert row["killed"], f"the kill at {row['point']!r} did not happen\n{table}"
        complete = [entry for entry in row["held"] if not entry.endswith("(incomplete)")]
        if row["outcome"] == "refused":
            if complete:
                assert any(entry in row["message"] for entry in complete), table
            else:
                assert "no complete GaLore checkpoint" in row["message"], table
        else:
            assert row["outcome"] == "exact", table
            newest = max(int(entry.split("-")[1]) for entry in complete)
            assert row["resumed_steps"] == list(range(newest + 1, 7)), table  # resumed from the newest complete
    # the crash points inside a save all fell back to the previous complete checkpoint and resumed
    assert sum(row["outcome"] == "exact" for row in rows) >= 10, table

"""Join's memory estimate against the resident memory of real shard processes, at 1 and 64 workers.

Runs ``benchmarks/join_memory.py`` (cold ``shardps-server`` processes, raw
gRPC clients that join, push one round and pull it at once; the shard's
``VmHWM`` read from ``/proc``). 256 workers are left to the benchmark itself
(docs/performance.md, "Join's memory estimate"): they take 2.5 GB and half a
minute.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_estimate_is_within_20_percent_of_the_measured_peak(tmp_path) -> None:
    out = tmp_path / "join_memory.json"
    run = subprocess.run([sys.executable, "benchmarks/join_memory.py", "--workers", "1", "64", "--json", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    runs = json.loads(out.read_text())["runs"]
    assert [r["workers"] for r in runs] == [1, 64]
    for r in runs:
        assert math.isclose(r["estimate_bytes"], r["peak_bytes"], rel_tol=0.2), r
        assert r["peak_bytes"] > r["baseline_bytes"]  # the round was measured, not an idle process
    # 63 more members cost about what the estimate gives each: their staged gradients and streams
    grown = runs[1]["peak_bytes"] - runs[0]["peak_bytes"]
    assert math.isclose(grown, runs[1]["estimate_bytes"] - runs[0]["estimate_bytes"], rel_tol=0.2), runs

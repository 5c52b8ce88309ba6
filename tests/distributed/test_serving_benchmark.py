"""benchmarks/serving.py runs end to end (small): training alone and with ``shardps serve`` subscribed and queried.

No timing is asserted (latency and slowdown are the benchmark's report). What is tested: both runs trained,
the replica answered every Lookup and Score query sent (none failed), and the latencies were measured.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DATA = Path(os.environ.get("SHARDPS_MOVIELENS_DIR", REPO.parent / "shared" / "data" / "ml-100k"))


@pytest.mark.slow
def test_serving_benchmark_answers_every_query_while_training(tmp_path: Path) -> None:
    assert (DATA / "u.data").is_file(), f"MovieLens-100K is not at {DATA}: set SHARDPS_MOVIELENS_DIR"
    out = tmp_path / "serving.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "serving.py"), "--seconds", "4", "--repeats", "1",
                           "--qps", "40", "--data-dir", str(DATA), "--json", str(out)],
                          capture_output=True, text=True, timeout=400, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert sorted(r["kind"] for r in result["runs"]) == ["alone", "served"]
    assert all(r["steps"] > 0 for r in result["runs"])
    served = next(r for r in result["runs"] if r["kind"] == "served")
    for kind in ("lookup", "score"):
        q = served["queries"][kind]
        assert q["failed"] == 0 and q["answered"] > 10, q
        assert math.isfinite(q["p50_ms"]) and 0 < q["p50_ms"] <= q["p99_ms"], q
    assert result["failed"] == 0

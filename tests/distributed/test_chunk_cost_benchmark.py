"""benchmarks/chunk_cost.py runs end to end and its JSON holds every run's figures.

One repeat of a few steps. No speed is asserted (speed is reported, never tested): only that every run is
there with positive figures, that the medians are the runs' own, and that the cost per extra key is the
medians' difference over the five extra keys.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
def test_chunk_cost_benchmark_reports_every_run(tmp_path: Path) -> None:
    out = tmp_path / "chunk_cost.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "chunk_cost.py"), "--steps", "10", "--warmup", "2",
         "--repeats", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=160, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert set(r["runs"]) == {"torch (6 keys)", "1 key", "2 keys", "6 keys"}
    for name, runs in r["runs"].items():
        assert len(runs) == 1 and runs[0] == r["median"][name]
        assert runs[0]["step_ms"] > 0 and runs[0]["worker_cpu_ms"] > 0, name
    assert r["ms_per_extra_key"] == pytest.approx((r["median"]["6 keys"]["step_ms"] - r["median"]["1 key"]["step_ms"]) / 5)

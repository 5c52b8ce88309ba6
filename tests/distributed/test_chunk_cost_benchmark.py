"""benchmarks/chunk_cost.py runs end to end and its JSON holds every run's figures.

One repeat of a few steps. No speed is asserted (speed is reported, never tested): only that every run is
there with positive figures, that the medians are the runs' own, and that the cost per extra key is the
medians' difference over the five extra keys.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.procs import run_benchmark


@pytest.mark.timeout(180)
def test_chunk_cost_benchmark_reports_every_run(tmp_path: Path) -> None:
    out = tmp_path / "chunk_cost.json"
    r, _ = run_benchmark("chunk_cost", "--steps", "10", "--warmup", "2", "--repeats", "1", out=out, timeout=160)
    assert set(r["runs"]) == {"torch (6 keys)", "1 key", "2 keys", "6 keys"}
    for name, runs in r["runs"].items():
        assert len(runs) == 1 and runs[0] == r["median"][name]
        assert runs[0]["step_ms"] > 0 and runs[0]["worker_cpu_ms"] > 0, name
    median = r["median"]
    assert r["ms_per_extra_key"] == pytest.approx((median["6 keys"]["step_ms"] - median["1 key"]["step_ms"]) / 5)

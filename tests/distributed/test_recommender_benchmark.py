"""benchmarks/recommender.py runs end to end (``--quick``): the swapped-module DeepFM against one process.

No timing is asserted (speed is the benchmark's report, and the losses of lazy and dense Adam differ
slightly); what is tested: every row (grid cell) ran every system without a failure, each with a
positive samples/s and finite losses, the prefetching loader's prefetches were used (every step but
the first), and the goal has a computed verdict. The data is MovieLens-100K, read in place from
``shared/data/ml-100k`` beside this checkout or ``$SHARDPS_MOVIELENS_DIR`` (as the DeepFM tests).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from tests.support.procs import run_benchmark

REPO = Path(__file__).resolve().parents[2]
DATA = Path(os.environ.get("SHARDPS_MOVIELENS_DIR") or REPO.parent / "shared" / "data" / "ml-100k")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_recommender_benchmark_runs_every_row(tmp_path: Path) -> None:
    out = tmp_path / "recommender.json"
    result, _ = run_benchmark("recommender", "--quick", "--data-dir", str(DATA), out=out, timeout=180)
    assert {(r["workers"], r["shards"]) for r in result["rows"]} == {(1, 1), (2, 2)}
    steps = result["steps"] + result["warmup"]
    for row in result["rows"]:
        assert row["failed_runs"] == 0, row
        for system in ("one_process", "prefetch", "no_prefetch"):
            assert row[f"{system}_samples_per_s"] > 0, (row["cell"], system)
            assert math.isfinite(row[f"{system}_loss"]) and math.isfinite(row[f"{system}_last_loss"]), (row, system)
        assert row["ratio_prefetch"] > 0 and row["ratio_no_prefetch"] > 0
        for pair in row["pairs"]:
            assert pair["prefetch"]["prefetches"] == {"used": steps - 1, "dropped": 0, "pulled_again": 0}, pair
            assert pair["no_prefetch"]["prefetches"]["used"] == 0
    assert isinstance(result["goal"]["met"], bool) and result["goal"]["value"] > 0

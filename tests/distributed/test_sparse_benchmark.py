"""benchmarks/sparse.py runs end to end (``--quick``): the wire carries only the rows a step touches.

No timing is asserted (speed is the benchmark's report); what is tested: every configuration ran,
its bytes on the wire per step are within 10% of (unique rows x row bytes + ids), the shards' memory
per row is reported from their Prometheus endpoints, and every target has a computed verdict.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.procs import run_benchmark


@pytest.mark.slow
def test_sparse_benchmark_moves_only_the_touched_rows(tmp_path: Path) -> None:
    out = tmp_path / "sparse.json"
    result, _ = run_benchmark("sparse", "--quick", out=out, timeout=600)
    assert set(result["grid"]) == {"1x1", "2x2"}
    for name, run in result["grid"].items():
        assert "error" not in run, (name, run)
        assert run["samples_per_s"] > 0 and run["unique_rows_per_step"] > 0
        assert 1.0 <= run["wire_ratio"] <= 1.1, (name, run["wire_ratio"])
        assert run["shard_rows"] > 0 and run["shard_bytes_per_row"] >= result["row_bytes"]
    assert result["oracle"]["samples_per_s"] > 0 and result["dense_tables"]["samples_per_s"] > 0
    assert {"wire_bytes", "shard_memory", "vs_oracle", "vs_dense_tables"} <= set(result["targets"])
    assert all(isinstance(t["met"], bool) for t in result["targets"].values())

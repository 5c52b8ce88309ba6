"""benchmarks/wire.py runs end to end and its JSON holds every rate, ceiling and ratio.

One repeat, 1 and 2 channels. No rate is asserted (speed is reported, never
tested): only that every figure is there, positive, and that the ratios are
the rates' quotients.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_wire_benchmark_reports_every_ceiling(tmp_path: Path) -> None:
    out = tmp_path / "wire.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "wire.py"), "--repeats", "1", "--channels", "1,2",
         "--json", str(out)],
        capture_output=True, text=True, timeout=220, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    for key in ("shardps_gbps", "shardps_bf16_wire_gbps", "shardps_push_then_pull_gbps", "grpc_ceiling_gbps",
                "tcp_ceiling_gbps",
                "grpc_multi_channel_ceiling_gbps", "grpc_push_pull_ceiling_gbps"):
        assert r[key] > 0, key
    assert set(r["grpc_channels_gbps"]) == set(r["grpc_push_pull_channels_gbps"]) == {"1", "2"}
    assert r["grpc_multi_channel_ceiling_gbps"] == max(r["grpc_channels_gbps"].values())
    assert r["grpc_push_pull_ceiling_gbps"] == max(r["grpc_push_pull_channels_gbps"].values())
    assert r["ratio_to_grpc_push_pull"] == pytest.approx(r["shardps_gbps"] / r["grpc_push_pull_ceiling_gbps"])
    assert r["goal"]["ratio"] == pytest.approx(r["shardps_gbps"] / r["grpc_multi_channel_ceiling_gbps"])
    assert r["goal"]["met"] == (r["goal"]["ratio"] >= r["goal"]["min_ratio_to_grpc_multi_channel"])
    assert r["ratio_push_then_pull_to_grpc_multi_channel"] == pytest.approx(
        r["shardps_push_then_pull_gbps"] / r["grpc_multi_channel_ceiling_gbps"])
    assert "push+pull" in proc.stdout

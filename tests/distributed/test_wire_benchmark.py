"""benchmarks/wire.py runs end to end and its JSON holds every rate, ceiling and ratio.

One repeat, 1 and 2 channels. No rate is asserted (speed is reported, never
tested): only that every figure is there, positive, and that the ratios are
the rates' quotients.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.procs import run_benchmark


@pytest.mark.timeout(240)
def test_wire_benchmark_reports_every_ceiling(tmp_path: Path) -> None:
    out = tmp_path / "wire.json"
    r, stdout = run_benchmark("wire", "--repeats", "1", "--channels", "1,2", out=out, timeout=220)
    for key in ("shardps_gbps", "shardps_bf16_wire_gbps", "shardps_push_then_pull_gbps",
                "shardps_stream_processes_gbps", "grpc_ceiling_gbps",
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
    assert "push+pull" in stdout
    # every call is charged with its CPU time: this process's (getrusage) and each server process's (/proc)
    accounts = r["cpu_seconds_per_round"]
    assert set(accounts) == {"tcp", "grpc", "grpc_2", "echo_1", "echo_2", "shardps", "shardps_plain", "shardps_procs"}
    for name, servers in (("shardps", 2), ("shardps_plain", 2), ("shardps_procs", 4), ("grpc", 1), ("echo_2", 2),
                          ("tcp", 1)):
        a = accounts[name]
        assert len(a["servers"]) == servers, name
        assert a["client"] > 0 and min(a["servers"]) >= 0 and a["wall"] > 0, (name, a)
        assert a["total"] == pytest.approx(a["client"] + sum(a["servers"])), name
        assert a["cores_busy"] == pytest.approx(a["total"] / a["wall"]), name
    # shardps' worker encodes, sends, receives and copies back 2 x 64 MiB: far more than nothing
    assert accounts["shardps"]["client"] > 0.005
    # with stream processes the worker's two helpers run the gRPC streams: they too move 2 x 64 MiB
    procs = accounts["shardps_procs"]
    assert procs["stream_processes"] == pytest.approx(sum(procs["servers"][2:])) and procs["stream_processes"] > 0.005
    goal = r["goal"]
    assert goal["round_seconds_at_goal"] == pytest.approx(
        2 * r["model_bytes"] / (goal["min_ratio_to_grpc_multi_channel"] * r["grpc_multi_channel_ceiling_gbps"] * 1e9))
    assert goal["cpu_seconds_per_round_at_goal_all_cores"] == pytest.approx(goal["round_seconds_at_goal"] * r["cores"])
    assert "CPU per round" in stdout

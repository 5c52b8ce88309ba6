"""Exhaustion and denial of service: every size is bounded, malformed bytes are refused cleanly, ports are exclusive."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch
from torch import nn

from shardps.proto import shardps_pb2 as pb
from shardps.common.codec import encode_chunk, encode_round
from shardps.server.membership.admission import member_bytes, memory_estimate
from shardps.worker.session.client import ShardClient, ShardRpcError
from tests.support.raw import SERVING, RawWorker, health_status, plan_and_spec, raw_call, raw_stream, snapshot


def rss_bytes(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def join_request(keys, *, num_shards=1, chunk_bytes=256, groups=1) -> bytes:
    spec = pb.OptimizerSpec(class_name="SGD", group_hyperparams_json=['{"lr": 0.1}'] * groups)
    plan = pb.PlanSpec(keys=keys, num_shards=num_shards, chunk_bytes=chunk_bytes)
    return pb.JoinRequest(worker_id="bomb", session="s" * 32, plan=plan, plan_fingerprint="f",
                          optimizer=spec).SerializeToString()


def test_join_requests_that_ask_for_too_much_are_refused_at_once(start_cluster) -> None:
    """Item 11: sizes are checked before any plan is built; the shard stays responsive and stops on SIGTERM."""
    cluster = start_cluster(1)
    address = cluster.addresses[0]
    bombs = {
        "num_shards 2^26": (join_request([pb.KeySpec(key="w", shape=[4])], num_shards=1 << 26),
                            grpc.StatusCode.FAILED_PRECONDITION, "plan has 67108864 shard(s)"),
        "num_shards 2^32-1": (join_request([pb.KeySpec(key="w", shape=[4])], num_shards=(1 << 32) - 1),
                              grpc.StatusCode.FAILED_PRECONDITION, "pass the addresses of all 1 shards"),
        "2^40 elements in 16-byte chunks": (join_request([pb.KeySpec(key="w", shape=[1 << 40])], chunk_bytes=16),
                                            grpc.StatusCode.INVALID_ARGUMENT, "more than 262144 chunks"),
        "group 3e7": (join_request([pb.KeySpec(key="w", shape=[4], group=30_000_000)]),
                      grpc.StatusCode.INVALID_ARGUMENT, "param group 30000000 but the optimizer has 1"),
        "10^5 groups": (join_request([pb.KeySpec(key="w", shape=[4])], groups=100_000),
                        grpc.StatusCode.INVALID_ARGUMENT, "at most 4096"),
        "200k keys": (join_request([pb.KeySpec(key=f"k{i}", shape=[1]) for i in range(200_000)]),
                      grpc.StatusCode.INVALID_ARGUMENT, "this shard accepts 1 to 131072"),
        "64 dimensions": (join_request([pb.KeySpec(key="w", shape=[1] * 64)]),
                          grpc.StatusCode.INVALID_ARGUMENT, "64 dimensions"),
        "a 2 KiB key": (join_request([pb.KeySpec(key="k" * 2048, shape=[1])]),
                        grpc.StatusCode.INVALID_ARGUMENT, "1 to 1024 characters"),
    }
    for name, (request, code, message) in bombs.items():
        started = time.monotonic()
        got, details = raw_call(address, "Join", request)
        assert (got, message in details) == (code, True), (name, got, details)
        assert time.monotonic() - started < 1.0, name
        assert health_status(address) == SERVING
    client = ShardClient(address, index=0)
    assert client.stats().plan_fingerprint == ""  # nothing was fixed
    client.close()
    proc = cluster.processes[0]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0


def test_members_are_capped_and_memory_is_bounded(start_cluster) -> None:
    """Item 12: --max-workers caps members; the memory bound is checked at Join; Joins allocate nothing."""
    cluster = start_cluster(1, extra_args=("--max-workers", "300", "--memory-budget-bytes", str(4 << 30)))
    torch.manual_seed(0)
    m = nn.Linear(1000, 1000)  # 1,001,000 elements: 4 MB per staged gradient
    plan, spec = plan_and_spec(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), chunk_bytes=1 << 20)
    client = ShardClient(cluster.addresses[0], index=0, rpc_timeout=30.0)
    try:
        workers = [RawWorker(client, f"w{i:03d}", plan, spec) for i in range(300)]
        workers[0].join()
        workers[0].init(0, dict(m.named_parameters()))
        before = rss_bytes(cluster.processes[0].pid)
        for w in workers[1:]:
            w.join()
        # 300 members of a 4 MB shard: staging is made when a member pushes, not when it joins
        assert rss_bytes(cluster.processes[0].pid) - before < 100 << 20
        # Join's estimate (the process, then about 9 MB a member of a 4 MB shard) fits 400 members in 4 GiB,
        # but --max-workers is 300
        with pytest.raises(ShardRpcError, match="--max-workers limit") as err:
            RawWorker(client, "one-more", plan, spec).join()
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert len(snapshot(client)["members"]) == 300
    finally:
        client.close()

    # Join's estimate counts the shard process itself: a shard that may hold nothing says how much it is
    m = nn.Linear(2000, 2000)  # 4,002,000 elements: 16 MB of parameters, about 33 MB a member
    plan, spec = plan_and_spec(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), chunk_bytes=1 << 20)
    probe = start_cluster(1, extra_args=("--memory-budget-bytes", "1"))
    client = ShardClient(probe.addresses[0], index=0, rpc_timeout=30.0)
    try:
        with pytest.raises(ShardRpcError, match="memory budget is 1 bytes") as err:
            RawWorker(client, "a", plan, spec).join()
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        baseline = int(re.search(r"\((\d+) bytes of process before any job", err.value.details).group(1))
    finally:
        client.close()
    # two members fit, a third does not (half a member of margin each way for another process's baseline)
    budget = memory_estimate(baseline, 4_002_000, 1, 2, 1 << 20) + member_bytes(4_002_000, 1 << 20) // 2
    small = start_cluster(1, extra_args=("--memory-budget-bytes", str(budget)))
    client = ShardClient(small.addresses[0], index=0, rpc_timeout=30.0)
    try:
        RawWorker(client, "a", plan, spec).join()
        RawWorker(client, "b", plan, spec).join()
        with pytest.raises(ShardRpcError, match=f"memory budget is {budget} bytes") as err:
            RawWorker(client, "c", plan, spec).join()
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert client.stats().members == ["a", "b"]
    finally:
        client.close()


def test_staging_of_members_that_leave_mid_push_is_freed(start_cluster) -> None:
    """Item 12: a member that leaves while its push streams gets its push ended and its staging freed."""
    cluster = start_cluster(1, extra_args=("--max-workers", "1"))
    torch.manual_seed(0)
    m = nn.Linear(1000, 1000)  # 4 MB staged per push
    plan, spec = plan_and_spec(m, torch.optim.SGD(m.parameters(), lr=0.1), chunk_bytes=1 << 20)
    client = ShardClient(cluster.addresses[0], index=0, rpc_timeout=30.0)
    try:
        first = RawWorker(client, "w", plan, spec)
        first.join()
        first.init(0, dict(m.named_parameters()))
        first.leave()
        pid = cluster.processes[0].pid
        before = None
        for cycle in range(20):
            w = RawWorker(client, "w", plan, spec)
            w.join()
            release = threading.Event()
            frames = list(w.frames(w.header(0), w.chunks(0, 0.5)))

            def stalled():
                yield from frames[:-1]
                release.wait(30)  # this push never finishes by itself

            outcome = {}
            t = threading.Thread(target=lambda: outcome.update(r=_call(client.push, stalled())))
            t.start()
            time.sleep(0.2)
            w.leave()
            t.join(10)
            release.set()
            assert isinstance(outcome["r"], ShardRpcError) and "left during its push" in outcome["r"].details
            if cycle == 2:
                before = rss_bytes(pid)
        assert rss_bytes(pid) - before < 20 << 20  # 17 more cycles of 4 MB staging each would be 68 MB
        assert snapshot(client)["version"] == 0 and snapshot(client)["members"] == []
    finally:
        client.close()


def _call(fn, *args):
    try:
        return fn(*args)
    except ShardRpcError as exc:
        return exc


def test_pulls_from_non_members_are_refused_at_once(start_cluster) -> None:
    """Item 10: 100 pulls on a future version without Join cannot park on the shard."""
    cluster = start_cluster(1)
    request = pb.PullRequest(min_version=1000, plan_fingerprint="f", worker_id="x", session="s").SerializeToString()
    started = time.monotonic()
    for _ in range(100):
        code, details = raw_call(cluster.addresses[0], "Pull", request, stream=True)
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "call Join first" in details
    assert time.monotonic() - started < 20
    client = ShardClient(cluster.addresses[0], index=0)
    assert client.stats().waiting == 0
    client.close()


def test_a_port_in_use_is_an_error(start_cluster) -> None:
    """Item 15: SO_REUSEPORT is off: a second shard on the same port exits instead of sharing it."""
    cluster = start_cluster(1)
    port = cluster.addresses[0].rsplit(":", 1)[1]
    proc = subprocess.run(
        [sys.executable, "-m", "shardps.cli.server", "--shard-index", "0", "--num-shards", "1", "--port", port],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 1
    assert f"could not bind 127.0.0.1:{port}" in proc.stderr
    assert health_status(cluster.addresses[0]) == SERVING


def test_malformed_requests_get_invalid_argument_and_no_traceback(start_cluster) -> None:
    """Item 17: garbage bodies and broken frames are INVALID_ARGUMENT, never UNKNOWN/INTERNAL, and log no traceback."""
    cluster = start_cluster(1)
    address = cluster.addresses[0]
    torch.manual_seed(0)
    m = nn.Linear(20, 10)
    plan, spec = plan_and_spec(m, torch.optim.SGD(m.parameters(), lr=0.1))
    client = ShardClient(address, index=0)
    w = RawWorker(client, "w", plan, spec)
    w.join()
    w.init(0, dict(m.named_parameters()))
    before = snapshot(client)
    garbage = b"\xff\xfe\x00garbage"
    for method in ("Join", "Stats", "Leave"):
        assert raw_call(address, method, garbage)[0] == grpc.StatusCode.INVALID_ARGUMENT, method
    assert raw_call(address, "Pull", garbage, stream=True)[0] == grpc.StatusCode.INVALID_ARGUMENT
    header = encode_round(w.header(0))
    good = encode_chunk("weight", 0, torch.ones(64), 0)
    for name, frames in {
        "garbage first frame": [garbage],
        "truncated chunk header": [header, b"\x0a\x05\x0a\x03ab"],
        "invalid UTF-8 key": [header, b"\x0a\x04\x0a\x02\xff\xfe"],
        "truncated payload": [header, good[:-5]],
        "chunk before header": [good],
        "empty stream": [],
    }.items():
        # Init takes the header-level cases only: past its header this shard (initialised) refuses it
        for method in ("Push", "PushPull") + (("Init",) if len(frames) < 2 else ()):
            code, details = raw_stream(address, method, frames)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, method, code, details)
    assert snapshot(client) == before
    client.close()
    log = cluster.log_path(0).read_text()
    assert "Traceback" not in log and "internal error" not in log

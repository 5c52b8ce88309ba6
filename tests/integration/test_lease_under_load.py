"""Leases hold while a worker's link is saturated by its own pushes (issue 44, item 6).

One worker host and one shard host in network namespaces (``benchmarks/cluster_net.py``), two shards on the
shard host, started with ``--lease-seconds 2``. The worker (``tests.support.lease_load_proc``) joins,
initialises and trains a step at 1000 Mbit/s; then its link is cut to 4 Mbit/s in both directions (``tc``
token buckets) and it trains steps whose rounds each take several leases to cross that link (a 3 MB model,
streamed rounds: its pushes fill the link for seconds, and the new version streams back at once).

Before, a heartbeat queued on the push's own connection, behind the megabytes the push had already
written, and the shard renewed a lease at the start of a call only: the worker was dropped two seconds
into its first slow round. Now every chunk that arrives renews the lease, and heartbeats travel a
connection of their own. Skipped only where network namespaces cannot be made (no CAP_NET_ADMIN), with
the reason; every namespace and process is removed at the end, failed or not, and every wait is bounded.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from shardps.common.security import ChannelSecurity
from shardps.worker.config import WireOptions
from shardps.worker.optimizer import DistributedOptimizer
from shardps.worker.session.client import ShardClient
from tests.support.pki import TOKEN, make_pki
from tests.support.procs import benchmark_module, shard_stats, wait_until
from tests.support.raw import RawWorker, plan_and_spec

LEASE = 2.0
FAST_BIT = 1000e6
SLOW_BIT = 4e6
PARAMS = 768 * 1024  # 3 MB in fp32: about 6 s each way at 4 Mbit/s, 3 leases
CHUNK_BYTES = 256 << 10  # at 4 Mbit/s a chunk of each shard's stream arrives every second or so
STEPS = 2
SHARDS = 2
PORT = 50071
MODULE = "tests.support.lease_load_proc"


def lease_run(old_renewal: bool) -> tuple[dict, str]:
    """Run the worker's steps on the slowed link; ``(its done event, the shards' logs)``."""
    net = benchmark_module("cluster_net")
    cluster = benchmark_module("cluster")
    if (reason := net.probe()) is not None:
        pytest.skip(f"network namespaces cannot be made here: {reason}")
    network = net.Network(["w0", "s0"], {"w0": FAST_BIT, "s0": FAST_BIT})
    hosts = []
    flag = ["--old-renewal"] if old_renewal else []
    with tempfile.TemporaryDirectory(prefix="shardps-lease-load-") as logs:
        try:
            network.create()
            address = network.address["s0"]
            for i in range(SHARDS):
                hosts.append(cluster.Host(f"shard{i}", network.exec_args("s0") + [
                    sys.executable, "-m", MODULE, "shard", *flag, "--shard-index", str(i), "--num-shards", str(SHARDS),
                    "--host", address, "--port", str(PORT + i), "--lease-seconds", str(LEASE), "--min-workers", "1",
                    "--threads", "1"], logs, None))
            for host in hosts:
                host.expect("listening", time.monotonic() + 60)
            servers = ",".join(f"{address}:{PORT + i}" for i in range(SHARDS))
            worker = cluster.Host("worker", network.exec_args("w0") + [
                sys.executable, "-m", MODULE, "worker", *flag, "--servers", servers, "--params", str(PARAMS),
                "--chunk-bytes", str(CHUNK_BYTES), "--steps", str(STEPS)], logs, None)
            hosts.append(worker)
            worker.expect("ready", time.monotonic() + 60)
            network.set_rate("w0", SLOW_BIT)
            worker.send("go")
            done = worker.expect("done", time.monotonic() + 60)
            shard_logs = "\n".join(h.log.read_text() for h in hosts[:SHARDS])
        finally:
            for host in hosts:
                host.stop(grace=2.0)
            network.destroy()
    return done, shard_logs


def test_a_worker_whose_link_its_pushes_saturate_keeps_its_lease() -> None:
    """Each slow round takes several leases and the worker is never dropped: the rounds complete, no shard
    counts a lease expiry, and the membership never changes (one join, on each shard and as the worker saw
    it). A heartbeat sent where heartbeats went before, on the pushes' connection, took longer than the lease."""
    done, logs = lease_run(old_renewal=False)
    assert done["error"] is None, (done, logs[-3000:])
    assert done["steps"] == STEPS and all(s > 1.5 * LEASE for s in done["step_seconds"]), done
    assert [s["lease_expiries"] for s in done["stats"]] == [0] * SHARDS, (done, logs[-3000:])
    assert [s["membership_epoch"] for s in done["stats"]] == [1] * SHARDS, done
    assert [s["members"] for s in done["stats"]] == [["w0"]] * SHARDS, done
    assert [s["version"] for s in done["stats"]] == [1 + STEPS] * SHARDS, done
    assert done["membership_changes"] == [["w0"]] and done["epoch"] == 1, done
    assert done["heartbeats_sent"] > 0, done
    assert done["bulk_heartbeat_s"] is not None and done["bulk_heartbeat_s"] > LEASE, done
    assert "dropped" not in logs, logs[-3000:]


def test_before_the_change_that_worker_was_dropped() -> None:
    """The control: the same run with the renewal as it was (the shard renews at a call's start only, the
    heartbeats share the pushes' connection) loses the worker at lease expiry during its first slow round."""
    done, logs = lease_run(old_renewal=True)
    assert done["error"] is not None, done  # (ABORTED: its push ended when the shard dropped it)
    assert sum(s["lease_expiries"] for s in done["stats"]) >= 1, done
    assert "its lease expired" in logs, logs[-3000:]


def connections(ports: list[int]) -> dict[int, int]:
    """``{port: this process's established TCP connections to it}`` (``/proc/net/tcp*``, what ``ss -tnp`` reads)."""
    mine = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[8:-1])
    count = dict.fromkeys(ports, 0)
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            port, state, inode = int(fields[2].rsplit(":", 1)[1], 16), fields[3], fields[9]
            if state == "01" and port in count and inode in mine:  # 01: ESTABLISHED
                count[port] += 1
    return count


@pytest.mark.parametrize("tls", [False, True], ids=["token", "tls-and-token"])
def test_heartbeats_have_a_connection_of_their_own_with_the_same_security(start_cluster, tmp_path, tls: bool) -> None:
    """Each shard gets two connections from a worker, its calls' and its heartbeats' (over plaintext gRPC would
    otherwise share one between channels of the same target and options); both carry the worker's token (and
    TLS): with ``--lease-seconds 2`` and no call but heartbeats for three leases the worker stays a member and
    steps on. Closing the optimizer closes both."""
    pki = make_pki(tmp_path)
    tls_args = ("--tls-cert", pki.path("server.pem"), "--tls-key", pki.path("server.key")) if tls else ()
    cluster = start_cluster(2, extra_args=(*tls_args, "--auth-token-file", pki.path("token"),
                                           "--lease-seconds", str(LEASE)))
    ports = [int(a.rsplit(":", 1)[1]) for a in cluster.addresses]
    security = pki.security(token=TOKEN) if tls else ChannelSecurity(token=TOKEN)
    torch.manual_seed(0)
    model = nn.Linear(16, 4)

    def step(dist) -> None:
        dist.zero_grad()
        nn.functional.mse_loss(model(torch.ones(8, 16)), torch.zeros(8, 4)).backward()
        dist.step()

    with DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                              servers=cluster.addresses, worker_id="w0",
                              wire=WireOptions(chunk_bytes=256, connect_timeout=10.0, security=security)) as dist:
        step(dist)
        time.sleep(3 * LEASE)  # only heartbeats reach the shards meanwhile
        assert connections(ports) == {p: 2 for p in ports}
        step(dist)
        assert dist.version == 2 and dist.membership_epoch == 1
    wait_until(lambda: connections(ports) == {p: 0 for p in ports}, 10, "both connections to close")
    for i, address in enumerate(cluster.addresses):
        client = ShardClient(address, index=i, security=security, connect_timeout=10.0)
        try:
            stats = client.stats()
        finally:
            client.close()
        assert (stats.lease_expiries, stats.membership_epoch, list(stats.members)) == (0, 2, [])  # joined, left


def slowly(frames, gap: float):
    """``frames``, each sent ``gap`` seconds after the one before: a push crossing a slow link."""
    for frame in frames:
        time.sleep(gap)
        yield frame


def test_every_frame_of_an_init_and_of_a_push_renews_the_lease(start_cluster) -> None:
    """A worker that sends no heartbeat keeps its lease (1 s) through an Init and an unstreamed push that each take
    over three leases to arrive, a chunk every 0.3 s: every chunk renews it, not only the call's start."""
    cluster = start_cluster(1, extra_args=("--lease-seconds", "1"))
    torch.manual_seed(0)
    model = nn.Linear(16, 48)
    plan, spec = plan_and_spec(model, torch.optim.SGD(model.parameters(), lr=0.1), chunk_bytes=256)
    client = ShardClient(cluster.addresses[0], index=0)
    try:
        w = RawWorker(client, "w0", plan, spec)
        w.join()
        chunks = w.chunks(0, params=dict(model.named_parameters()))
        assert len(chunks) >= 12  # 3.6 s at least, each way
        began = time.monotonic()
        client.init(slowly(w.frames(w.header(), chunks, version=0), 0.3))
        client.push(slowly(w.frames(w.header(0), w.chunks(0, 0.5), trailer=w.trailer()), 0.3))
        assert time.monotonic() - began > 6.0
    finally:
        client.close()
    [stats] = shard_stats(cluster.addresses)
    assert (stats.lease_expiries, list(stats.members), stats.membership_epoch, stats.version) == (0, ["w0"], 1, 1)

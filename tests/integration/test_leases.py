"""Leases: a worker that crashes or hangs is dropped when its lease runs out, and the others go on.

Real worker processes (``tests.support.worker_proc``) against real shards started
with ``--lease-seconds 2``, stopped with real signals. A round may wait for
a dead worker at most the lease (plus the shard's check period, a quarter
lease) before it goes on without it; the tests allow lease + 5 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import torch
from torch import nn

from tests.support.procs import shard_stats, wait_until
from tests.support.procs import start_worker as start_process

LEASE = 2.0


def start_worker(servers: str, worker_id: str, index: int, workers: int, steps: int,
                 sleep: float = 0.05) -> subprocess.Popen:
    return start_process(servers, worker_id, "--index", str(index), "--workers", str(workers), "--steps", str(steps),
                         "--sleep", str(sleep))


def stats(cluster) -> list:
    return shard_stats(cluster.addresses)


def finish(procs: list[subprocess.Popen], timeout: float = 120) -> list[tuple[int, str, str]]:
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
        out.append((p.returncode, stdout, stderr))
    return out


def kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.wait()


def progress_after(cluster, signal_to, proc: subprocess.Popen) -> float:
    """Send ``signal_to`` to ``proc`` once training runs; seconds until the shards applied 2 more rounds."""
    wait_until(lambda: min(s.version for s in stats(cluster)) >= 5, 90, "training to start")
    os.kill(proc.pid, signal_to)
    t0, v0 = time.monotonic(), max(s.version for s in stats(cluster))
    wait_until(lambda: min(s.version for s in stats(cluster)) >= v0 + 2, LEASE + 5, "rounds without the worker")
    return time.monotonic() - t0


def test_killed_worker_is_dropped_at_lease_expiry(start_cluster) -> None:
    # min_workers=3: with 2, the third worker could join shard 0 before a round and shard 1 after it, leaving the
    # shards one round apart (allowed for a mid-job join, see the README) for a reason unrelated to leases
    cluster = start_cluster(2, min_workers=3, extra_args=("--lease-seconds", str(LEASE)))
    procs = [start_worker(cluster.servers, f"w{i}", i, 3, steps=120) for i in range(3)]
    try:
        waited = progress_after(cluster, signal.SIGKILL, procs[2])
        results = finish(procs[:2])
    finally:
        kill_all(procs)
    for code, stdout, stderr in results:
        assert code == 0, stderr[-2000:]
        assert "done version=" in stdout
    final = stats(cluster)
    assert [s.lease_expiries for s in final] == [1, 1]
    assert [list(s.members) for s in final] == [[], []]  # the survivors left, the dead one expired
    assert final[0].version == final[1].version
    assert waited <= LEASE + 5


def test_stopped_worker_is_dropped_and_told_when_it_wakes(start_cluster) -> None:
    # min_workers=2: every worker joins before the first round (see the test above)
    cluster = start_cluster(2, min_workers=2, extra_args=("--lease-seconds", str(LEASE)))
    procs = [start_worker(cluster.servers, f"w{i}", i, 2, steps=150) for i in range(2)]
    try:
        progress_after(cluster, signal.SIGSTOP, procs[1])
        os.kill(procs[1].pid, signal.SIGCONT)
        (code0, _, err0), (code1, out1, err1) = finish(procs)
    finally:
        kill_all(procs)
    assert code0 == 0, err0[-2000:]
    assert code1 != 0 and "done version" not in out1, "a worker dropped from the job must not finish as if it counted"
    assert "lease expired" in err1 or "dropped worker w1" in err1, err1[-2000:]
    final = stats(cluster)
    assert final[0].version == final[1].version and final[0].lease_expiries == 1


def test_restarted_worker_rejoins_as_the_same_member(start_cluster) -> None:
    """A crashed worker restarted with the same id joins once the old process's lease expires."""
    cluster = start_cluster(1, min_workers=1, extra_args=("--lease-seconds", str(LEASE)))
    first = start_worker(cluster.servers, "w0", 0, 1, steps=400)
    try:
        wait_until(lambda: stats(cluster)[0].version >= 3, 90, "training to start")
        first.kill()
        first.wait()
        version = stats(cluster)[0].version
        started = time.monotonic()
        again = start_worker(cluster.servers, "w0", 0, 1, steps=3, sleep=0)
        (code, stdout, stderr), = finish([again])
    finally:
        kill_all([first])
    assert code == 0, stderr[-2000:]
    joined = int(stdout.split("joined version=")[1].split()[0])
    assert joined >= version, "the restarted worker pulls the current version"
    assert f"done version={joined + 3}" in stdout
    assert time.monotonic() - started < 60
    assert stats(cluster)[0].lease_expiries == 1


def test_worker_joining_mid_training_takes_part_from_the_next_round(start_cluster) -> None:
    cluster = start_cluster(2, min_workers=3, extra_args=("--lease-seconds", str(LEASE)))
    procs = [start_worker(cluster.servers, f"w{i}", i, 4, steps=100) for i in range(3)]
    try:
        wait_until(lambda: min(s.version for s in stats(cluster)) >= 5, 90, "training to start")
        assert {s.last_round_contributors for s in stats(cluster)} == {3}
        late = start_worker(cluster.servers, "w3", 3, 4, steps=10, sleep=0.05)
        procs.append(late)
        wait_until(lambda: all(s.last_round_contributors == 4 and "w3" in s.members for s in stats(cluster)), 60,
                   "a round averaged over 4 workers")
        results = finish(procs)
    finally:
        kill_all(procs)
    for code, _, stderr in results:
        assert code == 0, stderr[-2000:]
    joined = int(results[3][1].split("joined version=")[1].split()[0])
    assert joined >= 5, "the late worker's first pull returns the current version"
    assert f"done version={joined + 10}" in results[3][1]


def test_members_expiring_together_leave_the_shard_working(start_cluster) -> None:
    """Two members whose leases run out in the same check (a whole node lost): the first one had not pushed
    the open round, the second had. Both go before the round may close, so the round never averages a push
    whose member is gone; the next worker trains on, and the shard's counters add up."""
    from shardps.worker.session.client import ShardClient
    from tests.support.raw import RawWorker, plan_and_spec

    cluster = start_cluster(1, extra_args=("--lease-seconds", "2"))
    m = nn.Linear(4, 2)
    plan, spec = plan_and_spec(m, torch.optim.SGD(m.parameters(), lr=0.1))
    client = ShardClient(cluster.addresses[0], index=0)
    try:
        a, b, c = (RawWorker(client, w, plan, spec) for w in ("wa", "wb", "wc"))
        a.join()
        a.init(0, dict(m.named_parameters()))
        a.push(0, fill=1.0)  # round 0, a alone (past the first round's --min-workers gate)
        a.pull(min_version=1)
        b.join()
        b.push(0, fill=1.0, round_=1)  # a (the lower id) has not pushed round 1: the round waits for it
        # a's lease is renewed after b's push, so a can never expire alone first (which would let the round
        # close with b's push under load); they expire in the same check, or b first (its push dropped)
        client.heartbeat(a.worker_id, a.session, timeout=5.0)
        wait_until(lambda: list(client.stats().members) == [], 10, "both leases to expire")
        c.join()  # a fresh worker: the round is its alone
        c.push(0, fill=2.0, round_=1)
        c.pull(min_version=2)
        s = client.stats()
        assert (s.version, s.last_round_contributors, s.lease_expiries) == (2, 1, 2)
        assert s.pushes_accepted == s.contributions_applied + s.pushes_dropped + len(s.pushed) == 3
        c.leave()
    finally:
        client.close()
    assert "dropping expired members failed" not in cluster.log_tail(0, 200)  # the lease watcher never failed

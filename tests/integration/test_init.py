"""Initialisation is all-or-nothing across shards, and bounded in time.

Real shard processes are killed and restarted (SIGKILL, state lost); real
worker processes (``tests.support.worker_proc``) join them.
"""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from shardps.proto import shardps_pb2 as pb
from shardps.worker.session.client import ShardClient, ShardRpcError
from tests.support.procs import run_worker, shard_stats
from tests.support.raw import RawWorker, plan_and_spec
from tests.support.worker_proc import model


def test_a_shard_that_lost_its_state_is_never_reinitialised(start_cluster) -> None:
    """Item 7: a restarted empty shard beside trained ones makes joining fail loudly, on both sides."""
    cluster = start_cluster(2)
    assert run_worker(cluster.servers, "w0", "--steps", "3").returncode == 0
    trained = shard_stats(cluster.addresses)[0]
    assert trained.version == 3

    cluster.restart(1)  # shard 1 comes back empty
    proc = run_worker(cluster.servers, "w1", "--steps", "1")
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "shard 1 holds no state but shard 0 of job" in proc.stderr
    assert "lost its partition" in proc.stderr and "FAILED_PRECONDITION" in proc.stderr
    s0, s1 = shard_stats(cluster.addresses)
    assert s0.version == 3 and list(s0.members) == [] and s0.job_id == trained.job_id  # untouched, w1 left
    assert s1.plan_fingerprint == "" and not s1.initialised and list(s1.members) == []  # nothing was accepted

    # A raw client cannot initialise it either: without shard 0's view, or with shard 0's (true) view.
    m = model()
    plan, spec = plan_and_spec(m, torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.05), num_shards=2)
    client = ShardClient(cluster.addresses[1], index=1)
    try:
        with pytest.raises(ShardRpcError, match="join shard 0 first") as err:
            RawWorker(client, "raw", plan, spec).join()
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        view = pb.JobView(job_id=trained.job_id, initialiser="w0", initialised=True, version=3)
        with pytest.raises(ShardRpcError, match="lost its partition"):
            RawWorker(client, "raw", plan, spec).join(job=view)
    finally:
        client.close()

    # A forged view (claiming shard 0 is fresh) can initialise the empty shard: views come from clients, which
    # are trusted until authentication exists. Then the versions give it away: shards 3 rounds apart.
    client = ShardClient(cluster.addresses[1], index=1)
    try:
        forger = RawWorker(client, "w0", plan, spec)  # even the real initialiser's id
        forged = pb.JobView(job_id=trained.job_id, initialiser="w0", initialised=False, version=0)
        assert forger.join(job=forged).initialise
        forger.init(1, dict(m.named_parameters()))
        forger.leave()
    finally:
        client.close()
    proc = run_worker(cluster.servers, "w1", "--steps", "1")
    assert proc.returncode == 3 and "shard 1 is at version 0 but shard 0 at 3" in proc.stderr

    # Restarting every shard is a new job: it trains from scratch.
    cluster.restart(1)
    cluster.restart(0)
    assert run_worker(cluster.servers, "w2", "--steps", "2").returncode == 0
    job = shard_stats(cluster.addresses)[0].job_id
    assert job != trained.job_id and shard_stats(cluster.addresses)[1].job_id == job

    # Shard 0 restarting beside a trained shard 1: shard 1 refuses the new job shard 0 starts.
    cluster.restart(0)
    proc = run_worker(cluster.servers, "w3", "--steps", "1")
    assert proc.returncode == 3 and f"shard 1 serves job '{job}' but shard 0 serves job" in proc.stderr
    s0 = shard_stats(cluster.addresses)[0]
    assert s0.plan_fingerprint == "" and list(s0.members) == []  # the half-made job was forgotten when w3 left
    assert shard_stats(cluster.addresses)[1].version == 2


def test_an_initialiser_that_never_sends_init_is_replaced(start_cluster) -> None:
    """Item 9: after --init-timeout the next worker initialises; waiting pulls are told to join again."""
    # long enough for the worker process to start (importing torch) and join while the ghost holds the role
    cluster = start_cluster(2, extra_args=("--init-timeout", "8"))
    m = model()
    plan, spec = plan_and_spec(m, torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.05), num_shards=2)
    clients = [ShardClient(a, index=i) for i, a in enumerate(cluster.addresses)]
    try:
        ghost = [RawWorker(c, "ghost", plan, spec) for c in clients]
        ghost[1].session = ghost[0].session
        first = ghost[0].join()
        assert first.initialise and ghost[1].join(job=first.job).initialise
        started = time.monotonic()
        proc = run_worker(cluster.servers, "w1", "--steps", "0")  # joins, initialises after the timeout, leaves
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert time.monotonic() - started < 45
        assert "joined version=0" in proc.stdout
        assert "did not complete Init within 8s" in proc.stderr and "joining again" in proc.stderr
        for i, c in enumerate(clients):
            s = c.stats()
            assert s.initialised and list(s.members) == ["ghost"], s
            with pytest.raises(ShardRpcError, match="may not initialise") as err:
                ghost[i].init(i, dict(m.named_parameters()))  # the ghost's late Init changes nothing
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert ghost[0].join().job.initialiser == "w1"
    finally:
        for c in clients:
            c.close()


def test_an_init_that_streams_longer_than_the_timeout_still_completes(start_cluster) -> None:
    """The init timeout bounds a worker that does not start sending, not a slow Init stream (review finding)."""
    cluster = start_cluster(1, extra_args=("--init-timeout", "1"))
    m = model()
    plan, spec = plan_and_spec(m, torch.optim.SGD(m.parameters(), lr=0.1))
    client = ShardClient(cluster.addresses[0], index=0, rpc_timeout=30.0)
    try:
        w = RawWorker(client, "slow", plan, spec)
        assert w.join().initialise
        frames = list(w.frames(w.header(), w.chunks(0, params=dict(m.named_parameters())), version=0))

        def slow():
            for frame in frames:
                time.sleep(2.5 / len(frames))  # 2.5 s in all, well past the 1 s timeout
                yield frame

        client.init(slow())
        assert client.stats().initialised and w.join().job.initialiser == "slow"
    finally:
        client.close()

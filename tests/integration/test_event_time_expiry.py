"""Expiry by event time (``ttl_seconds``): rows unseen for T seconds of the records' own clock are evicted.

Real shard processes. The steps tell the shards their events' time (``set_event_time``), as a stream job
does from its records; the rows a step pushed keep its time, and after each round the rows older than
``ttl_seconds`` on the table's clock (the latest time pushed) are evicted and read as their initial value
again, whatever the wall clock did meanwhile. A restarted shard keeps the rows' times through its
checkpoint. A table with ``ttl_seconds`` refuses a push without an event time, and a churning stream of ids
holds a plateau of rows instead of growing without bound.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardps.common.rows import TableSpec
from shardps.worker import DistributedOptimizer, ShardedEmbedding
from tests.support.forked import ForkedCluster, cluster_fixture
from tests.support.procs import run_module

TTL = 50.0


def job(servers: str, worker_id: str = "w0", ttl: float = TTL):
    model = nn.ModuleDict({"emb": ShardedEmbedding(None, 4, name="emb", ttl_seconds=ttl)})
    x = nn.Parameter(torch.zeros(1))  # the job's dense part
    dist = DistributedOptimizer(torch.optim.SGD([x], lr=0.1), [("x", x)], servers=servers, model=model,
                                worker_id=worker_id, sparse_optimizer=torch.optim.SGD([model["emb"].handle], lr=0.5))
    return model, dist


def step(model, dist, ids: list[int], event_time: float | None) -> None:
    dist.zero_grad()
    model["emb"](torch.tensor(ids)).sum().backward()
    if event_time is not None:
        dist.set_event_time(event_time)
    dist.step()


def held(dist) -> list[int]:
    dist.synchronize()
    return sorted(dist.tables.export("emb").ids.tolist())


shards = cluster_fixture(2)


def test_rows_unseen_for_ttl_seconds_of_event_time_are_evicted(shards):
    shards.reset()
    model, dist = job(shards.servers)
    try:
        step(model, dist, [1, 2, 3], 1_000.0)
        step(model, dist, [3, 4], 1_030.0)   # 1 and 2 are 30 s old: kept
        assert held(dist) == [1, 2, 3, 4]
        step(model, dist, [5], 1_060.0)      # 1 and 2 are 60 s old, past 50: evicted; 3 and 4 are 30 s old
        assert held(dist) == [3, 4, 5]
        step(model, dist, [5], 1_085.0)      # 3 and 4 are 55 s old: evicted
        assert held(dist) == [5]
        initial = model["emb"].spec().initial_rows(torch.tensor([1]))
        with torch.no_grad():
            assert torch.equal(model["emb"](torch.tensor([1])), initial)  # an evicted id reads its initial row
        step(model, dist, [9], 1_100.0)
        step(model, dist, [9], 1_060.0)      # a late event: 9 keeps its latest time, 1,100
        step(model, dist, [10], 1_140.0)     # 9 is 40 s old (it would be 80 had its time gone back)
        assert held(dist) == [9, 10]
        dist.zero_grad()
        model["emb"](torch.tensor([6])).sum().backward()
        with pytest.raises(Exception, match="expires rows by event time"):  # a step that did not say its time
            dist.step()
            dist.synchronize()
    finally:
        dist.close()


def test_a_churning_stream_holds_a_plateau_of_rows(shards):
    """Each second of event time brings 20 new ids and 5 returning ones: without expiry the rows grow by 20 a
    step; with a 10 s ttl they settle (measured: 235 rows from the 14th step on, the last 11 seconds' new ids
    and the returning ones they keep fresh) and stay within 10% of the plateau."""
    shards.reset()
    model, dist = job(shards.servers, ttl=10.0)
    counts = []
    try:
        for t in range(60):
            ids = list(range(20 * t, 20 * t + 20)) + [20 * max(0, t - 3) + k for k in range(5)]
            step(model, dist, sorted(set(ids)), 5_000.0 + t)
            counts.append(len(held(dist)))
    finally:
        dist.close()
    plateau = counts[30:]
    assert counts[-1] < 60 * 20 / 4, counts  # far below the 1,200 ids the stream brought
    assert max(plateau) <= 1.1 * min(plateau), plateau


def test_a_restarted_shard_keeps_its_rows_event_times(tmp_path):
    with ForkedCluster(1, extra_args=("--checkpoint-dir", str(tmp_path), "--lease-seconds", "120")) as cluster:
        model, dist = job(cluster.servers)
        try:
            step(model, dist, [1, 2], 2_000.0)
            step(model, dist, [3], 2_040.0)
            assert held(dist) == [1, 2, 3]
        finally:
            dist.close()
        proc = run_module("shardps.cli.main", "checkpoint", "--servers", cluster.servers, "--timeout", "60",
                          timeout=90)
        assert proc.returncode == 0, (proc.stdout, proc.stderr)
        cluster.restart(0, same_port=True)
        model, dist = job(cluster.servers, worker_id="w1")
        try:
            assert held(dist) == [1, 2, 3]
            step(model, dist, [4], 2_060.0)  # 1 and 2 were seen at 2,000 (before the restart): 60 s old now
            assert held(dist) == [3, 4]
        finally:
            dist.close()


def test_a_push_in_parts_keeps_its_event_time(shards):
    """A step whose rows pass half the message limit goes in several parts: each carries the time."""
    shards.reset()
    model = nn.ModuleDict({"emb": ShardedEmbedding(None, 512, name="emb", ttl_seconds=TTL)})
    x = nn.Parameter(torch.zeros(1))
    from shardps.worker import WireOptions
    dist = DistributedOptimizer(torch.optim.SGD([x], lr=0.1), [("x", x)], servers=shards.servers, model=model,
                                worker_id="w0", sparse_optimizer=torch.optim.SGD([model["emb"].handle], lr=0.5),
                                wire=WireOptions(max_message_bytes=1 << 20, chunk_bytes=1 << 18))
    try:
        step(model, dist, list(range(600)), 3_000.0)  # 600 rows x 2 KiB: about 5 parts of 256 KiB for 2 shards
        step(model, dist, [1_000], 3_060.0)
        assert held(dist) == [1_000]  # the 600 rows kept time 3,000 and expired at 3,060
    finally:
        dist.close()


def test_ttl_seconds_is_part_of_the_spec():
    spec = ShardedEmbedding(None, 4, name="t", ttl_seconds=86_400).spec()
    assert spec.ttl_seconds == 86_400.0 and TableSpec.from_proto(spec.to_proto()) == spec
    with pytest.raises(ValueError, match="ttl_seconds must be finite and >= 0"):
        ShardedEmbedding(None, 4, name="t", ttl_seconds=-1).spec()

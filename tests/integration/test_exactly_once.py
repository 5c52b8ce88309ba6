"""Exactly-once training from a stream: stream offsets held by the shards and saved in their checkpoints.

Real shard processes (checkpointing every few rounds), a real Redis broker, real SIGKILLs. The model makes
the count of trainings exact: a loss linear in the parameters (``-row[0]`` per occurrence of an id, ``-x``
per event) under SGD with lr 1, so whatever the other parameters are when an event is trained, its update
is the same: row ``id`` ends at the number of times ``id`` was trained, ``x`` at the number of events
trained. An event trained twice on a shard leaves a row or ``x`` too high; one skipped leaves it too low.

The stream runs while shards are SIGKILLed and restarted from their checkpoints (which hold fewer events
than the trainer trained), then the trainer itself stops mid-stream and both shards restart, and a new
trainer resumes the same job: every row and ``x`` must equal the stream's counts exactly.
"""

from __future__ import annotations

import collections
import threading

import grpc
import pytest
import torch
from torch import nn

from shardps.common.stream_offsets import span
from shardps.worker import DistributedOptimizer, ShardedEmbedding
from shardps.proto import shardps_pb2 as pb
from shardps.worker.session.client import ShardClient, ShardRpcError
from shardps.worker.stream.exactly_once import ExactlyOnce, held_offsets, redis_id, redis_offset
from shardps.worker.stream.local_redis import LocalRedis
from shardps.worker.stream.redis_source import RedisStreamReader, publish
from shardps.worker.stream.replay import FileReplay
from tests.support.forked import ForkedCluster

EVENTS = 1_500
IDS = 40
BATCH = 25


def job(servers: str, worker_id: str):
    model = nn.ModuleDict({"emb": ShardedEmbedding(None, 2, name="emb", init="zeros")})
    x = nn.Parameter(torch.zeros(1))  # the job's dense part: counts the events trained
    dist = DistributedOptimizer(torch.optim.SGD([x], lr=1.0), [("x", x)], servers=servers, model=model,
                                worker_id=worker_id, sparse_optimizer=torch.optim.SGD([model["emb"].handle], lr=1.0))
    return model, x, dist


def train(model, x, dist, batch) -> None:
    ids = torch.tensor([int(e.fields["id"]) for e in batch])
    dist.zero_grad()
    (-(model["emb"](ids)[:, 0].sum()) - x.sum() * len(batch)).backward()
    dist.step()


def stats(shards, shard: int, call: str = "stats"):
    client = ShardClient(shards.addresses[shard], index=shard)
    try:
        return getattr(client, call)()
    finally:
        client.close()


@pytest.fixture()
def broker(tmp_path):
    with LocalRedis(tmp_path / "redis") as server:
        yield server


def test_a_stream_through_shard_kills_and_a_trainer_restart_trains_every_event_exactly_once(tmp_path, broker):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, IDS, (EVENTS,), generator=g).tolist()
    entry_ids = publish(broker.url, "events", [{"id": i, "time": 1_000 + k} for k, i in enumerate(ids)], end=True)
    last = redis_offset(entry_ids[-2])  # the last event (the final entry ends the stream)
    args = ("--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every-rounds", "7")
    with ForkedCluster(2, extra_args=args) as shards:
        model, x, dist = job(shards.servers, "trainer-1")
        stream = ExactlyOnce(dist, RedisStreamReader(broker.url, "events"), BATCH, max_wait=0.05)
        try:
            for n, batch in enumerate(stream.batches()):
                train(model, x, dist, batch)
                if n in (12, 30):  # between two checkpoints: the restarted shard holds fewer events
                    shards.restart(1 if n == 12 else 0, same_port=True)
                if n == 40:
                    break  # the trainer stops mid-stream (what it trained is on the shards)
            first = stream
        finally:
            dist.close()
        assert first.replays >= 2 and first.replayed > 0  # both restarts were replayed to the shard behind
        for shard in (0, 1):  # the whole job restarts: every shard from its newest checkpoint
            shards.restart(shard, same_port=True)
        restored = [stats(shards, s).stream_positions[0] for s in (0, 1)]
        assert all(p.partition == "events" for p in restored)
        model, x, dist = job(shards.servers, "trainer-2")
        try:
            stream = ExactlyOnce(dist, RedisStreamReader(broker.url, "events"), BATCH, max_wait=0.05)
            for batch in stream.batches():
                train(model, x, dist, batch)
            assert stream.replays == 0  # nothing restarted meanwhile: the checks found every shard where it was
            assert held_offsets(dist, "events") == [last, last]
            rows = dist.tables.export("emb")
            dist.synchronize()
            counted = collections.Counter(ids)
            want = torch.tensor([float(counted[i]) for i in rows.ids.tolist()])
            assert sorted(rows.ids.tolist()) == sorted(counted)
            assert torch.equal(rows.weights[:, 0], want), "a row was trained more or fewer times than its id came"
            assert float(x.detach()) == EVENTS, "the dense part was trained more or fewer times than there were events"
        finally:
            dist.close()
        held = sum(stats(shards, s).stream_positions[0].rows == last for s in (0, 1))
        assert held == 2


def test_a_batch_the_shards_hold_is_skipped_and_a_gap_is_not_applied(tmp_path):
    """The shards' rules, step by step with explicit spans: a due batch applies, a held one is skipped
    (nothing moves), one leaving a gap is skipped and the held offset stays; malformed spans sent as they are
    (a 300-byte partition name, a last offset not after the one before) are refused and stage nothing; a
    second span before the first was sent is refused on the worker; checkpoints keep the offsets."""
    with ForkedCluster(1, extra_args=("--checkpoint-dir", str(tmp_path / "ckpt"))) as shards:
        model, x, dist = job(shards.servers, "w0")
        try:
            def step(after, last, ids):
                dist.set_stream_span("p", after, last)
                train(model, x, dist, [_Event(i) for i in ids])
                dist.synchronize()

            step(None, 1, [3, 3])  # due: the partition's first batch
            assert float(x.detach()) == 2.0
            x_before = float(x.detach())
            step(None, 1, [3])  # held: the shard holds offset 1 already
            assert float(x.detach()) == x_before
            step(5, 8, [4])  # a gap: the shard holds 1, not 5
            assert float(x.detach()) == x_before and held_offsets(dist, "p") == [1]
            step(1, 4, [4, 4, 4])  # due
            rows = dist.tables.export("emb")
            assert float(x.detach()) == 5.0 and rows.weights[rows.ids.tolist().index(4), 0] == 3.0
            assert rows.weights[rows.ids.tolist().index(3), 0] == 2.0
            assert held_offsets(dist, "p") == [4]
            client = dist.clients[0]  # hostile spans sent as they are (the worker's own checks bypassed)
            for bad, match in ((pb.StreamSpan(partition="q" * 300, last=9), "partition name"),
                               (pb.StreamSpan(partition="p", after=7, last=7), "must come after")):
                with pytest.raises(ShardRpcError, match=match) as refused:
                    client.push_rows(pb.PushRowsRequest(worker_id=dist.worker_id, session=dist.tables.session,
                                                        push=10 ** 6, span=bad))
                assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert held_offsets(dist, "p") == [4]  # nothing staged, nothing moved
            step(4, 5, [4])  # and training goes on
            assert held_offsets(dist, "p") == [5]
            dist.set_stream_span("p", 5, 6)
            with pytest.raises(RuntimeError, match="was not sent yet"):  # two batches for one step: refused
                dist.set_stream_span("p", 6, 7)
        finally:
            dist.close()
        position = stats(shards, 0).stream_positions[0]
        assert (position.partition, position.dense, position.rows) == ("p", 5, 5)
        stats(shards, 0, "checkpoint")
        shards.restart(0, same_port=True)  # SIGKILL: the offsets come back with the state they produced
        position = stats(shards, 0).stream_positions
        assert [(p.partition, p.dense, p.rows) for p in position] == [("p", 5, 5)]


def test_a_shard_joined_again_by_the_rows_thread_while_a_round_is_in_flight_is_pulled_by_the_training_thread(tmp_path):
    """The race a stream trainer met at a shard restart: the thread sending table rows finds the restarted shard
    and joins it again while the step's dense round, numbered for the killed process, is in flight to it. That
    round's refusal must still read as the restart: the training thread pulls the restored version and training
    goes on (it raised "pushed round 5 but the shard is collecting round 3" when the rows thread pulled and took
    the shard's new incarnation for the one the round was sent to)."""
    with ForkedCluster(2, extra_args=("--checkpoint-dir", str(tmp_path / "ckpt"))) as shards:
        model, x, dist = job(shards.servers, "w0")
        try:
            for _ in range(3):
                train(model, x, dist, [_Event(i) for i in range(8)])
            dist.synchronize()
            stats(shards, 1, "checkpoint")  # shard 1 at version 3
            for _ in range(2):
                train(model, x, dist, [_Event(i) for i in range(8)])
            dist.synchronize()
            assert dist.versions == [5, 5]
            dist.zero_grad()
            loss = -(model["emb"](torch.arange(8))[:, 0].sum()) - x.sum() * 8  # rows pulled from the old process
            shards.restart(1, same_port=True)  # SIGKILL; back at version 3
            loss.backward()  # round 5 opened on both shards
            dist._rejoin_shard(1)  # what the rows thread does when its push finds the shard forgot this worker
            dist.step()
            dist.synchronize()  # the round failed on shard 1: joined again and pulled here, on this thread
            assert dist.versions == [6, 3]
            train(model, x, dist, [_Event(i) for i in range(8)])  # and training goes on from there
            dist.synchronize()
            assert dist.versions == [7, 4]
        finally:
            dist.close()


class _Event:
    def __init__(self, i: int) -> None:
        self.fields = {"id": str(i)}


def test_spans_and_offsets_are_checked():
    assert redis_id(redis_offset("1700000000123-7")) == "1700000000123-7"
    assert redis_offset("1-0") < redis_offset("1-1") < redis_offset("2-0")
    for bad in ("x", "1-2-3", f"1-{2 ** 20}"):
        with pytest.raises(ValueError):
            redis_offset(bad)
    with pytest.raises(ValueError, match="partition"):
        span("", None, 1)
    with pytest.raises(ValueError, match="partition"):
        span("p" * 257, None, 1)
    with pytest.raises(ValueError, match="must come after"):
        span("p", 5, 5)
    with pytest.raises(ValueError, match=r"\[0, 2\*\*64\)"):
        span("p", None, -1)
    assert not span("p", None, 3).HasField("after") and span("p", 2, 3).after == 2


def test_a_file_replay_seeks(tmp_path):
    path = tmp_path / "events.tsv"
    path.write_text("".join(f"{k}\t{100 + k}\n" for k in range(10)))
    replay = FileReplay(path, ["id", "time"], "time")
    assert replay.partition == "events.tsv"
    assert [replay.position(e) for e in replay.read(4, 0)] == [0, 1, 2, 3]
    replay.seek(6)
    assert [e.fields["id"] for e in replay.read(10, 0)] == ["7", "8", "9"] and replay.read(1, 0) == []
    replay.seek(None)
    assert [replay.position(e) for e in replay.read(2, 0)] == [0, 1]


def test_a_stream_trimmed_past_the_resume_point_is_refused(broker):
    import redis

    entry_ids = publish(broker.url, "trimmed", [{"id": k, "time": k} for k in range(10)])
    client = redis.Redis.from_url(broker.url)
    try:
        client.xtrim("trimmed", maxlen=3, approximate=False)
    finally:
        client.close()
    reader = RedisStreamReader(broker.url, "trimmed")
    try:
        reader.seek(redis_offset(entry_ids[7]))  # the entries after it are still there
        assert [e.fields["id"] for e in reader.read(5, 0.1)] == ["8", "9"]
        with pytest.raises(RuntimeError, match="trimmed"):
            reader.seek(redis_offset(entry_ids[2]))  # 3 to 6 are gone: resuming would skip them
    finally:
        reader.close()


def test_two_members_pushing_one_partition_in_a_round_are_refused_and_nothing_moves():
    """Two sync trainers of one job that both train partition ``p`` in the same round: the shard refuses the
    round (each trainer must read its own partition) and applies nothing of it, dense or rows."""
    with ForkedCluster(1, min_workers=2) as shards:
        jobs = [None, None]

        def start(k: int) -> None:
            jobs[k] = job(shards.servers, f"w{k}")

        threads = [threading.Thread(target=start, args=(k,)) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert all(j is not None for j in jobs)
        errors = [None, None]

        def push(k: int) -> None:
            model, x, dist = jobs[k]
            try:
                dist.set_stream_span("p", None, 5)
                train(model, x, dist, [_Event(1), _Event(2)])
                dist.synchronize()
            except Exception as exc:  # noqa: BLE001 - checked below
                errors[k] = exc

        try:
            threads = [threading.Thread(target=push, args=(k,)) for k in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert not any(t.is_alive() for t in threads)
            assert all(e is not None and "two members pushed batches of one stream partition" in str(e)
                       for e in errors), errors
            reply = stats(shards, 0)
            assert list(reply.stream_positions) == []  # nothing held: the round was not applied
            assert reply.version == 0
        finally:
            for _, _, dist in jobs:
                dist.close()

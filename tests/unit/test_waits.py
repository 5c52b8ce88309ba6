"""The sentence a waiting worker logs (``shardps.worker.session.waits.explain``), from real ``StatsReply`` messages."""

from __future__ import annotations

import time

from shardps.proto import shardps_pb2 as pb
from shardps.worker.session.waits import explain, tell

NOW = time.time()


def test_a_member_that_has_not_pushed_is_named_with_its_lease_bound() -> None:
    stats = pb.StatsReply(shard_index=0, version=7, members=["w0", "w1"], pushed=["w0"], min_workers=1)
    text = explain(7, stats, "sync", 0, 10.0, NOW)
    by = time.strftime("%H:%M:%S", time.localtime(NOW + 10.0))
    assert "round 7 waits for worker(s) w1" in text and "lease of 10 s runs out by " + by in text
    assert "w0" not in text.split("(")[0]


def test_too_few_members_name_min_workers() -> None:
    stats = pb.StatsReply(version=0, members=["w0"], min_workers=3)
    assert "waits for 2 more worker(s) to join" in explain(0, stats, "sync", 0, 10.0, NOW)


def test_ssp_names_the_bound_and_async_names_the_shard() -> None:
    stats = pb.StatsReply(shard_index=1, version=30, members=["w0", "w1"], min_workers=1)
    assert "slowest worker" in explain(12, stats, "ssp", 2, 10.0, NOW) and "2 clocks" in explain(12, stats, "ssp", 2,
                                                                                                  10.0, NOW)
    assert "waits for shard 1 to apply it" in explain(12, stats, "async", 0, 10.0, NOW)


def test_a_round_already_applied_is_not_blamed_on_a_member() -> None:
    stats = pb.StatsReply(shard_index=0, version=8, members=["w0", "w1"], pushed=[], min_workers=1)
    assert "waits for shard 0 to apply it" in explain(7, stats, "sync", 0, 10.0, NOW)


def test_the_shard_still_collecting_the_round_is_asked_not_the_first_one() -> None:
    # w1 died after its push reached shard 0 only: shard 0 applied round 7, shard 1 still waits for w1
    applied = pb.StatsReply(shard_index=0, version=8, members=["w0", "w1"], pushed=[], min_workers=1)
    waiting = pb.StatsReply(shard_index=1, version=7, members=["w0", "w1"], pushed=["w0"], min_workers=1)
    assert "round 7 waits for worker(s) w1" in tell(7, [applied, waiting], "sync", 0, 10.0, NOW)
    assert "round 7 waits for worker(s) w1" in tell(7, [waiting, None], "sync", 0, 10.0, NOW)


def test_silent_shards_are_named_when_every_answering_shard_applied_the_round() -> None:
    applied = pb.StatsReply(shard_index=0, version=8, members=["w0", "w1"], pushed=[], min_workers=1)
    assert "waits for shard(s) 1, 2, which do not answer" in tell(7, [applied, None, None], "sync", 0, 10.0, NOW)
    assert "waits for shard(s) 0, which do not answer" in tell(7, [None], "sync", 0, 10.0, NOW)

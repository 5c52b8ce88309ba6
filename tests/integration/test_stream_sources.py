"""Stream sources: a replayed file and a real Redis stream (``redis-server``) with a consumer group.

- A file replay hands records out in event-time order, refuses a time that goes back (naming the line)
  unless asked to sort, and resumes after a committed offset with exactly the records after it.
- Mini-batches hold ``batch_size`` events, the last partial, none lost or repeated.
- Redis: a consumer that dies after committing part of what it read is restarted under the same name:
  it gets the uncommitted events again, then the new ones: every event trained, none skipped.
- A broker that goes away mid-stream is retried (reported in WARNING lines and ``reconnects``) and the
  stream goes on when it is back; one that stays away raises ``BrokerUnavailable`` after the retry budget.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest

from shardps.worker.stream.events import minibatches
from shardps.worker.stream.local_redis import LocalRedis
from shardps.worker.stream.redis_source import BrokerUnavailable, RedisStreamSource, publish
from shardps.worker.stream.replay import FileReplay

MOVIELENS = Path(os.environ.get("SHARDPS_MOVIELENS_DIR") or
                 Path(__file__).resolve().parents[2].parent / "shared" / "data" / "ml-100k")
COLUMNS = ["user", "item", "rating", "time"]


def write(path: Path, times: list[int]) -> Path:
    path.write_text("".join(f"{k}\t{100 + k}\t{1 + k % 5}\t{t}\n" for k, t in enumerate(times)))
    return path


def test_a_file_replay_keeps_event_time_order_and_resumes_after_a_commit(tmp_path):
    unordered = write(tmp_path / "u.data", [5, 3, 9, 9, 1, 7])
    with pytest.raises(ValueError, match=r"u.data:2: time 3.0 is before the previous record's 5.0"):
        FileReplay(unordered, COLUMNS, "time").read(10, 0)
    replay = FileReplay(unordered, COLUMNS, "time", sort=True)
    events = replay.read(10, 0)
    assert [e.time for e in events] == [1, 3, 5, 7, 9, 9] and replay.ended
    assert [e.fields["user"] for e in events] == ["4", "1", "0", "5", "2", "3"]  # ties keep the file's order
    assert [e.offset for e in events] == [str(k) for k in range(6)]
    resumed = FileReplay(unordered, COLUMNS, "time", sort=True, start_after="2")
    assert [e.fields["user"] for e in resumed.read(10, 0)] == ["5", "2", "3"]


def test_minibatches_hold_every_event_once(tmp_path):
    replay = FileReplay(write(tmp_path / "d", list(range(23))), COLUMNS, "time")
    batches = list(minibatches(replay, 5, max_wait=0.5))
    assert [len(b) for b in batches] == [5, 5, 5, 5, 3]
    assert [e.offset for b in batches for e in b] == [str(k) for k in range(23)]
    with pytest.raises(ValueError, match="batch_size"):
        next(minibatches(replay, 0))


def test_movielens_ratings_replay_in_time_order():
    replay = FileReplay(MOVIELENS / "u.data", COLUMNS, "time", sort=True)
    events = replay.read(200_000, 0)
    assert len(events) == 100_000 and replay.ended
    assert all(a.time <= b.time for a, b in zip(events, events[1:]))


@pytest.fixture
def redis(tmp_path):
    with LocalRedis(tmp_path / "redis") as server:
        yield server


def records(first: int, n: int) -> list[dict]:
    return [{"time": 1000 + k, "user": k % 7, "item": k} for k in range(first, first + n)]


def test_a_restarted_consumer_gets_what_it_did_not_commit_then_the_rest(redis):
    publish(redis.url, "events", records(0, 30), end=True)
    first = RedisStreamSource(redis.url, "events", "trainers", "c0")
    got = first.read(20, 1.0)
    assert [int(e.fields["item"]) for e in got] == list(range(20)) and [e.time for e in got][:2] == [1000, 1001]
    first.commit(got[9].offset)  # events 0-9 trained and saved; the consumer dies before committing 10-19
    assert first.pending() == 10
    first.close()
    again = RedisStreamSource(redis.url, "events", "trainers", "c0")
    seen = [int(e.fields["item"]) for batch in minibatches(again, 7, max_wait=0.2) for e in batch]
    assert seen == list(range(10, 30)) and again.ended  # 10-19 again, then the new ones, none skipped
    again.close()


def test_a_broker_that_goes_away_is_retried_reported_and_followed_again(redis, caplog):
    publish(redis.url, "events", records(0, 10))
    source = RedisStreamSource(redis.url, "events", "trainers", "c0", retry_seconds=30)
    assert len(source.read(10, 1.0)) == 10
    redis.stop()
    back = threading.Timer(2.0, redis.start)
    back.start()
    try:
        with caplog.at_level(logging.WARNING, logger="shardps.worker.stream.redis_source"):
            started = time.monotonic()
            got = []
            while time.monotonic() - started < 20 and not got:
                got = source.read(10, 0.2)  # blocks in retries until the broker is back, then nothing new yet
                if not got and redis.proc is not None:
                    publish(redis.url, "events", records(10, 5), end=True)
                    got = source.read(10, 1.0)
    finally:
        back.join()
    assert [int(e.fields["item"]) for e in got] == list(range(10, 15))
    assert source.reconnects >= 1 and any("unreachable" in r.getMessage() for r in caplog.records)
    source.close()


def test_a_broker_that_stays_away_raises_after_the_retry_budget(redis):
    source = RedisStreamSource(redis.url, "events", "trainers", "c0", retry_seconds=1.5)
    redis.stop()
    started = time.monotonic()
    with pytest.raises(BrokerUnavailable, match="could not be reached for 1.5 s"):
        source.read(10, 0.2)
    assert 1.0 <= time.monotonic() - started < 15
    source.close()

"""The online job's producer process (``shardps.apps.movielens_online.Producer``) with a real Redis: a producer
that dies mid-stream ends the stream (the trainer's read stops instead of waiting for events that will not
come) and is reported; one that cannot reach the broker refuses to start and leaves no process behind."""

from __future__ import annotations

import os
import signal
import time

import pytest

from shardps.apps.movielens_online import Producer
from shardps.worker.stream.events import Event
from shardps.worker.stream.local_redis import LocalRedis
from shardps.worker.stream.redis_source import RedisStreamReader

EVENTS = [Event(offset=str(k), time=float(k), fields={"user": "1", "item": "2", "rating": "3"}) for k in range(20_000)]


def test_a_producer_killed_mid_stream_ends_the_stream_and_join_says_so(tmp_path):
    with LocalRedis(tmp_path / "redis") as broker, Producer(broker.url, "ratings", EVENTS, rate=2000) as producer:
        source = RedisStreamReader(broker.url, "ratings")
        producer.start()
        read: list = []
        deadline = time.monotonic() + 60
        while len(read) < 500 and time.monotonic() < deadline:
            read += source.read(1000, 0.2)
        os.kill(producer.process.pid, signal.SIGKILL)
        while not source.ended and time.monotonic() < deadline:
            read += source.read(1000, 0.2)
        assert source.ended, "the stream was not ended after the producer died"
        assert 500 <= len(read) < len(EVENTS)
        with pytest.raises(RuntimeError, match="exited with code -9 before publishing every event"):
            producer.join(10)
        source.close()


def test_a_producer_that_cannot_reach_the_broker_refuses_to_start():
    producer = Producer("redis://127.0.0.1:1/0", "ratings", EVENTS[:10], rate=100)
    with pytest.raises(RuntimeError, match="the producer failed: ConnectionError"):
        with producer:
            pass
    assert not producer.process.is_alive()

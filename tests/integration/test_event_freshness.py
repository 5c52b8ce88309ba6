"""The replica's per-event freshness histogram (``EventFreshness``, ``shardps serve --freshness-redis``) against a
real Redis: each event a state newly covers is observed once, at the state's swap time minus its entry's time;
the first state's events, the end marker and events past the cap are not; a broker down is counted, never
raised into the replica. The end-to-end check (a real replica beside a real stream job, bucket for bucket
against the probe) is in ``test_serving_freshness.py``."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from shardps.worker.serving.event_freshness import BUCKETS, EventFreshness
from shardps.worker.serving.freshness import entry_seconds
from shardps.worker.stream.exactly_once import redis_offset
from shardps.worker.stream.local_redis import LocalRedis
from shardps.worker.stream.redis_source import publish


def _value(registry, name, **labels):
    v = registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def _buckets(registry, partition):
    return [_value(registry, "shardps_serving_event_freshness_seconds_bucket", partition=partition,
                   le=str(b) if b != float("inf") else "+Inf") for b in BUCKETS]


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    with LocalRedis(tmp_path_factory.mktemp("redis")) as r:
        yield r


def test_each_newly_visible_event_is_observed_once_at_its_states_swap(broker):
    ids = [redis_offset(i) for i in publish(broker.url, "s1", [{"k": n} for n in range(50)], end=True)]
    events, end = ids[:-1], ids[-1]
    registry = CollectorRegistry()
    fresh = EventFreshness(broker.url, registry, page=7)  # several pages a state; the end marker ends a full one
    try:
        made = time.time() + 3.0
        assert fresh.measure(made - 2, {"s1": events[9]}) == 0  # the first state: held before it watched
        assert fresh.measure(made, {"s1": events[29]}) == 20  # events 10..29
        assert fresh.measure(made + 1, {"s1": events[20]}) == 0  # an offset behind the highest: nothing again
        assert fresh.measure(made + 2, {"s1": end}) == 20  # 30..49, the end marker left out
        assert fresh.observed == 40
        got = sorted([made - entry_seconds(o) for o in events[10:30]] + [made + 2 - entry_seconds(o)
                                                                           for o in events[30:]])
        assert _value(registry, "shardps_serving_event_freshness_seconds_count", partition="s1") == 40
        assert _value(registry, "shardps_serving_event_freshness_seconds_sum", partition="s1") == pytest.approx(sum(got))
        want = [sum(s <= b for s in got) for b in BUCKETS]
        assert _buckets(registry, "s1") == want
        # a partition that is no stream on the broker reads nothing
        assert fresh.measure(made, {"not-a-stream": 1}) == 0 and fresh.measure(made, {"not-a-stream": 5}) == 0
    finally:
        fresh.close()


def test_a_state_past_the_cap_is_truncated_and_counted(broker):
    ids = [redis_offset(i) for i in publish(broker.url, "s2", [{"k": n} for n in range(30)], end=True)]
    registry = CollectorRegistry()
    fresh = EventFreshness(broker.url, registry, max_events=10, page=4)
    truncated = lambda: _value(registry, "shardps_serving_event_freshness_truncated_total", partition="s2")  # noqa
    try:
        fresh.measure(time.time(), {"s2": ids[0]})
        assert fresh.measure(time.time(), {"s2": ids[-2]}) == 10 and truncated() == 1  # 29 newly visible
        assert fresh.measure(time.time(), {"s2": ids[-2]}) == 0  # taken as seen: not measured again
        # exactly the cap, then only the end marker left: nothing truncated
        assert fresh.measure(time.time(), {"s2": ids[-1]}) == 0 and truncated() == 1
    finally:
        fresh.close()
    ids = [redis_offset(i) for i in publish(broker.url, "s2b", [{"k": n} for n in range(11)], end=True)]
    registry = CollectorRegistry()
    fresh = EventFreshness(broker.url, registry, max_events=10, page=4)
    try:
        fresh.measure(time.time(), {"s2b": ids[0]})
        assert fresh.measure(time.time(), {"s2b": ids[-1]}) == 10  # 10 events and the marker: the cap exactly
        assert _value(registry, "shardps_serving_event_freshness_truncated_total", partition="s2b") == 0
    finally:
        fresh.close()


def test_a_partition_the_broker_cannot_give_leaves_the_others_measured(broker):
    """A key that is not a stream fails its own measure only; every offset is taken as seen, so the other
    partitions' events are observed at their state's time, and none later at another's."""
    import redis

    redis.Redis.from_url(broker.url).set("plain", "not a stream")
    ids = [redis_offset(i) for i in publish(broker.url, "s4", [{"k": n} for n in range(6)])]
    registry = CollectorRegistry()
    fresh = EventFreshness(broker.url, registry)
    try:
        fresh.measure(time.time(), {"plain": 1, "s4": ids[0]})
        made = time.time()
        assert fresh.measure(made, {"plain": 5, "s4": ids[2]}) == 2
        assert _value(registry, "shardps_serving_event_freshness_failures_total", partition="plain") == 1
        assert fresh.measure(made + 5, {"plain": 5, "s4": ids[-1]}) == 3
        got = _value(registry, "shardps_serving_event_freshness_seconds_sum", partition="s4")
        assert got == pytest.approx(sum(made - entry_seconds(o) for o in ids[1:3]) +
                                    sum(made + 5 - entry_seconds(o) for o in ids[3:]))
    finally:
        fresh.close()


def test_a_state_dropped_from_a_full_queue_is_never_measured_at_a_later_states_time(broker, monkeypatch):
    import shardps.worker.serving.event_freshness as ef

    ids = [redis_offset(i) for i in publish(broker.url, "s5", [{"k": n} for n in range(4)])]
    monkeypatch.setattr(ef, "QUEUED", 2)
    registry = CollectorRegistry()
    fresh = EventFreshness(broker.url, registry, thread=False)
    try:
        for k, offset in enumerate(ids):
            fresh.note(SimpleNamespace(made_at=1000.0 + k, positions={"s5": offset}))
        # 4 states into a queue of 2: those of ids[0] (the baseline) and ids[1] are dropped
        assert _value(registry, "shardps_serving_event_freshness_failures_total", partition="s5") == 2
        made, positions = fresh.take()
        assert (made, positions) == (1002.0, {"s5": ids[2]})
        assert fresh.measure(made, positions) == 1  # ids[2] alone: ids[1] is not counted at state 2's time
        assert fresh.measure(*fresh.take()) == 1
        assert _value(registry, "shardps_serving_event_freshness_seconds_sum", partition="s5") == pytest.approx(
            1002.0 - entry_seconds(ids[2]) + 1003.0 - entry_seconds(ids[3]))
    finally:
        fresh.close()
    assert fresh.take() is None


def test_the_replica_thread_measures_queued_states_and_a_broker_down_is_counted(tmp_path):
    with LocalRedis(tmp_path / "redis") as r:
        ids = [redis_offset(i) for i in publish(r.url, "s3", [{"k": n} for n in range(5)])]
        registry = CollectorRegistry()
        fresh = EventFreshness(r.url, registry)
        fresh.note(SimpleNamespace(made_at=time.time(), positions={"s3": ids[0]}))
        fresh.note(SimpleNamespace(made_at=time.time(), positions={"s3": ids[-1]}))
        deadline = time.monotonic() + 10
        while fresh.observed < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fresh.observed == 4
    # the broker is gone: the next state is counted as not measured, the thread lives on
    fresh.note(SimpleNamespace(made_at=time.time(), positions={"s3": ids[-1] + 10}))
    deadline = time.monotonic() + 30
    while fresh.failed < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fresh.failed == 1
    assert _value(registry, "shardps_serving_event_freshness_failures_total", partition="s3") == 1
    assert fresh._thread.is_alive()
    fresh.close()
    assert not fresh._thread.is_alive()


def test_a_url_that_is_not_redis_is_refused():
    with pytest.raises(ValueError):
        EventFreshness("http://example.invalid/", CollectorRegistry())

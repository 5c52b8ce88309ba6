"""Per-event freshness in Prometheus: ``shardps_serving_event_freshness_seconds``, from an event's time to the
moment it became visible in this replica.

A replica swaps in states that hold, per stream partition, every event up to an offset
(``ReplicaState.positions``: what the training shards had trained when the pages were read). With
``shardps serve --freshness-redis URL`` the partitions are Redis streams on that broker (a
``RedisStreamReader``'s partition is its stream's key, an offset its entry id as ``ms << 20 | seq``). For each
state swapped in, the entries its offsets newly cover (``XRANGE`` from the highest offset visible before, exclusive,
to the new one) are read in a thread of their own, off the query path, and each is observed once: the state's
swap time minus the entry's broker time (its id's milliseconds, ``freshness.entry_seconds``). That is the
measure ``FreshnessProbe`` takes from outside and the serving benchmark reports, now per event in Prometheus
(Ekko, Sima et al., OSDI 2022, measures model-update latency the same way: from an update's creation to its
visibility at the inference servers). The moment is this host's clock and the entry time the broker's: both
hosts keep NTP time.

What is not measured, and said so: the events the replica's first state already holds (they were trained
before it watched; a replica restarted starts again there); entries past ``max_events`` newly visible in one
state (``shardps_serving_event_freshness_truncated_total`` counts those states); the events of a state whose
entries the broker could not give (``..._failures_total``, a WARNING logged). The stream's end marker
(``redis_source.END_FIELD``) is not an event. A partition that is not a stream on the broker reads no entries
(nothing observed). Events stay unmeasured while no state makes them visible: a replica that stops refreshing
observes nothing, which ``shardps_serving_state_age_seconds`` and ``shardps_serving_stream_offset`` show.
"""

from __future__ import annotations

import logging
import queue
import threading

from prometheus_client import CollectorRegistry, Counter, Histogram

from shardps.worker.serving.freshness import entry_seconds
from shardps.worker.stream.exactly_once import redis_id, redis_offset
from shardps.worker.stream.redis_source import END_FIELD

__all__ = ["BUCKETS", "EventFreshness"]

log = logging.getLogger(__name__)

END = END_FIELD.encode()  # entry fields come as bytes

#: Upper bounds (seconds) of the freshness histograms, Prometheus' and the serving benchmark's.
BUCKETS = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0, float("inf"))


class EventFreshness:
    """Observes every event a replica's states make visible (module docstring) into Prometheus metrics of
    ``registry``; :meth:`note` is what the replica calls for each state swapped in (``Replica.watchers``).

    Args:
        url: the broker, ``redis://host:port/db`` (or ``rediss://``, ``unix://``), as redis-py takes it.
        registry: where the metrics go (the replica's ``ServingMetrics.registry``).
        max_events: entries read and observed for one state at most (the rest: truncated, counted).
        page: entries per ``XRANGE`` call.

    Attributes:
        observed: events observed so far (the histogram's count, all partitions). failed: states not measured
            because the broker could not be read.

    Raises:
        ImportError: redis-py is not installed (``pip install -e ".[stream]"``).
        ValueError: ``url`` is not a Redis URL, or ``max_events`` / ``page`` < 1.
    """

    def __init__(self, url: str, registry: CollectorRegistry, *, max_events: int = 200_000,
                 page: int = 10_000) -> None:
        from shardps.worker.stream.redis_source import _redis

        if max_events < 1 or page < 1:
            raise ValueError(f"max_events and page must be >= 1, got {max_events}, {page}")
        self.max_events, self.page = max_events, page
        self._client = _redis().Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5)  # ValueError
        self.histogram = Histogram(
            "shardps_serving_event_freshness_seconds", "Seconds from each stream event's broker time to the swap of "
            "the first state of this replica that holds it, by partition.", ("partition",), buckets=BUCKETS,
            registry=registry)
        self.truncated = Counter(
            "shardps_serving_event_freshness_truncated", "States that made more events visible than were measured "
            "(the rest not observed).", ("partition",), registry=registry)
        self.failures = Counter(
            "shardps_serving_event_freshness_failures", "States whose newly visible events the broker could not "
            "give (not observed).", registry=registry)
        self.observed = self.failed = 0
        self._high: dict[str, int] = {}  # per partition, the highest offset visible so far
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="shardps-event-freshness", daemon=True)
        self._thread.start()

    def note(self, state) -> None:
        """Queue ``state`` (a ``ReplicaState`` just swapped in: its ``made_at`` and ``positions``) for measuring;
        returns at once."""
        self._queue.put((state.made_at, dict(state.positions)))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self.measure(*item)
            except Exception as exc:  # noqa: BLE001 - the broker down: counted, said, and the replica serves on
                self.failures.inc()
                self.failed += 1
                if self.failed % 100 == 1:
                    log.warning("freshness: could not read the events a state made visible from the broker (%s); "
                                "they are not measured (%d states so far)", exc, self.failed)

    def measure(self, made_at: float, positions: dict[str, int]) -> int:
        """Observe the events ``positions`` (``{partition: offset}``) newly cover, visible at ``made_at``
        (seconds since the epoch); returns how many were observed.

        Raises:
            redis.RedisError: the broker could not be read (the offsets are taken as seen: not measured again).
        """
        done = 0
        for partition, offset in positions.items():
            high = self._high.get(partition)
            if high is not None and offset <= high:
                continue
            self._high[partition] = offset
            if high is None:  # the first state: what it holds was trained before this replica watched
                continue
            done += self._observe(partition, high, offset, made_at)
        self.observed += done
        return done

    def _observe(self, partition: str, after: int, upto: int, made_at: float) -> int:
        histogram, start, left, done = self.histogram.labels(partition), "(" + redis_id(after), self.max_events, 0
        while left > 0:
            count = min(self.page, left)
            entries = self._client.xrange(partition, min=start, max=redis_id(upto), count=count)
            for entry_id, fields in entries:
                if END not in fields:  # the end marker is not an event
                    histogram.observe(made_at - entry_seconds(redis_offset(entry_id.decode())))
                    done += 1
            left -= len(entries)
            if len(entries) < count:
                return done
            start = "(" + entries[-1][0].decode()
        if self._client.xrange(partition, min=start, max=redis_id(upto), count=1):
            self.truncated.labels(partition).inc()
        return done

    def close(self, timeout: float = 10.0) -> None:
        """Stop after the states queued so far are measured (at most ``timeout`` seconds) and close the
        connection."""
        self._queue.put(None)
        self._thread.join(timeout)
        self._client.close()

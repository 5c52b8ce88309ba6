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

import torch
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from shardps.worker.stream.exactly_once import redis_id
from shardps.worker.stream.redis_source import END_FIELD

__all__ = ["BUCKETS", "EventFreshness"]

log = logging.getLogger(__name__)

#: Upper bounds (seconds) of the freshness histograms, Prometheus' and the serving benchmark's.
BUCKETS = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0, float("inf"))

# The ids of up to ARGV[3] entries of stream KEYS[1] in [ARGV[1], ARGV[2]], the end marker's (an entry with the
# field ARGV[4]) prefixed "!": run by the broker, so the replica parses short strings, not every entry's fields.
_IDS = """
local out = {}
for i, e in ipairs(redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[2], 'COUNT', tonumber(ARGV[3]))) do
  local id, f = e[1], e[2]
  for j = 1, #f, 2 do
    if f[j] == ARGV[4] then id = '!' .. id end
  end
  out[i] = id
end
return out
"""


class _Histogram:
    """``shardps_serving_event_freshness_seconds{partition}``: a Prometheus histogram whose observations come a
    batch at a time (:meth:`add`: one ``torch.bucketize`` for a state's events, not one ``observe`` each)."""

    def __init__(self) -> None:
        self._bounds = torch.tensor(BUCKETS[:-1], dtype=torch.float64)
        self._counts: dict[str, list[int]] = {}  # per partition, observations per bucket (not cumulative)
        self._sums: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, partition: str, seconds: torch.Tensor) -> None:
        """Observe each of ``seconds`` (float64 ``[n]``) under ``partition``."""
        # right=False: bucket k holds BUCKETS[k-1] < s <= BUCKETS[k], Prometheus' "le"
        counts = torch.bincount(torch.bucketize(seconds, self._bounds), minlength=len(BUCKETS)).tolist()
        total = float(seconds.sum())
        with self._lock:
            mine = self._counts.setdefault(partition, [0] * len(BUCKETS))
            for k, c in enumerate(counts):
                mine[k] += c
            self._sums[partition] = self._sums.get(partition, 0.0) + total

    def describe(self):
        return [HistogramMetricFamily("shardps_serving_event_freshness_seconds", "", labels=["partition"])]

    def collect(self):
        family = HistogramMetricFamily(
            "shardps_serving_event_freshness_seconds", "Seconds from each stream event's broker time to the swap of "
            "the first state of this replica that holds it, by partition.", labels=["partition"])
        with self._lock:
            items = [(p, list(c), self._sums[p]) for p, c in self._counts.items()]
        for partition, counts, total in items:
            cumulative, running = [], 0
            for bound, c in zip(BUCKETS, counts):
                running += c
                cumulative.append((floatToGoString(bound), running))
            family.add_metric([partition], cumulative, total)
        yield family


class EventFreshness:
    """Observes every event a replica's states make visible (module docstring) into Prometheus metrics of
    ``registry``; :meth:`note` is what the replica calls for each state swapped in (``Replica.watchers``).

    Args:
        url: the broker, ``redis://host:port/db`` (or ``rediss://``, ``unix://``), as redis-py takes it.
        registry: where the metrics go (the replica's ``ServingMetrics.registry``).
        max_events: entries read and observed for one state at most (the rest: truncated, counted).
        page: entries per read (``XRANGE`` run by the broker, answering their ids alone).

    Attributes:
        observed: events observed so far (the histogram's count, all partitions). failed: states not measured
            because the broker could not be read.

    Raises:
        ImportError: redis-py is not installed (``pip install -e ".[stream]"``).
        ValueError: ``url`` is not a Redis URL, or ``max_events`` / ``page`` < 1.
    """

    def __init__(self, url: str, registry: CollectorRegistry, *, max_events: int = 200_000,
                 page: int = 2_000) -> None:
        from shardps.worker.stream.redis_source import _redis

        if max_events < 1 or page < 1:
            raise ValueError(f"max_events and page must be >= 1, got {max_events}, {page}")
        self.max_events, self.page = max_events, page
        self._client = _redis().Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5)  # ValueError
        self._ids = self._client.register_script(_IDS)
        self.histogram = _Histogram()
        registry.register(self.histogram)
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
        start, left, done = "(" + redis_id(after), self.max_events, 0
        while left > 0:
            count = min(self.page, left)
            ids = self._ids(keys=[partition], args=[start, redis_id(upto), count, END_FIELD])
            ms = [int(i.split(b"-", 1)[0]) for i in ids if not i.startswith(b"!")]  # not the end marker
            if ms:  # an entry's time: the milliseconds of its id (freshness.entry_seconds)
                self.histogram.add(partition, made_at - torch.tensor(ms, dtype=torch.float64) / 1000.0)
            done += len(ms)
            left -= len(ids)
            if len(ids) < count:
                return done
            start = "(" + ids[-1].lstrip(b"!").decode()
        if self._ids(keys=[partition], args=[start, redis_id(upto), 1, END_FIELD]):
            self.truncated.labels(partition).inc()
        return done

    def close(self, timeout: float = 10.0) -> None:
        """Stop after the states queued so far are measured (at most ``timeout`` seconds) and close the
        connection."""
        self._queue.put(None)
        self._thread.join(timeout)
        self._client.close()

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
before it watched; a replica restarted starts again there); events past ``max_events`` newly visible in one
state (``shardps_serving_event_freshness_truncated_total{partition}`` counts those states); the events of a
partition the broker could not give for a state (down, or a key that is not a stream:
``..._failures_total{partition}``, a WARNING logged), and those up to the next state measured when states come
faster than they are measured (past :data:`QUEUED` waiting, the oldest's; counted there too). The stream's end marker
(``redis_source.END_FIELD``) is not an event; a key that does not exist holds none. Events stay unmeasured while
no state makes them visible: a replica that stops refreshing observes nothing, which
``shardps_serving_state_age_seconds`` and ``shardps_serving_stream_offset`` show. The broker runs the reads as a
Lua script (``EVALSHA``): an ACL user of the replica needs it besides ``XRANGE``.
"""

from __future__ import annotations

import collections
import logging
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

# The ids of up to ARGV[3] entries of stream KEYS[1] from ARGV[1] to ARGV[2], that of ARGV[1] itself left out when
# ARGV[5] is "1" (an exclusive start that Redis before 6.2 cannot say), the end marker's (an entry with the field
# ARGV[4]) prefixed "!": run by the broker, so the replica parses short strings, not every entry's fields.
_IDS = """
local start, count, skip = ARGV[1], tonumber(ARGV[3]), ARGV[5] == '1'
local out = {}
for i, e in ipairs(redis.call('XRANGE', KEYS[1], start, ARGV[2], 'COUNT', count + (skip and 1 or 0))) do
  if #out < count and not (skip and i == 1 and e[1] == start) then
    local id, f = e[1], e[2]
    for j = 1, #f, 2 do
      if f[j] == ARGV[4] then id = '!' .. id end
    end
    out[#out + 1] = id
  end
end
return out
"""
#: States waiting to be measured at most; past it a state is not measured (nor are the events it covers).
QUEUED = 256


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
        thread: measure the states :meth:`note` queues in a thread of this object's (False: the caller takes
            them, :meth:`take`).

    Attributes:
        observed: events observed so far (the histogram's count, all partitions). failed: partitions of states
            not measured because the broker could not give their events.

    Raises:
        ImportError: redis-py is not installed (``pip install -e ".[stream]"``).
        ValueError: ``url`` is not a Redis URL, or ``max_events`` / ``page`` < 1.
    """

    def __init__(self, url: str, registry: CollectorRegistry, *, max_events: int = 200_000,
                 page: int = 2_000, thread: bool = True) -> None:
        from shardps.worker.stream.redis_source import redis_client

        if max_events < 1 or page < 1:
            raise ValueError(f"max_events and page must be >= 1, got {max_events}, {page}")
        self.max_events, self.page = max_events, page
        self._client = redis_client(url, socket_timeout=10, socket_connect_timeout=5)  # ValueError
        self._ids = self._client.register_script(_IDS)
        self.histogram = _Histogram()
        registry.register(self.histogram)
        self.truncated = Counter(
            "shardps_serving_event_freshness_truncated", "States that made more events visible than were measured "
            "(the rest not observed).", ("partition",), registry=registry)
        self.failures = Counter(
            "shardps_serving_event_freshness_failures", "States whose newly visible events of a partition were not "
            "measured: the broker could not give them (down, or the key is not a stream), or states came faster "
            "than they were measured.", ("partition",), registry=registry)
        self.observed = self.failed = 0
        self._high: dict[str, int] = {}  # per partition, the highest offset visible so far
        self._states: collections.deque = collections.deque()  # (made_at, positions) to measure, oldest first
        self._dropped: dict[str, int] = {}  # the offsets of states dropped before the oldest queued one
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shardps-event-freshness", daemon=True)
        if thread:
            self._thread.start()

    def note(self, state) -> None:
        """Queue ``state`` (a ``ReplicaState`` just swapped in: its ``made_at`` and ``positions``) for measuring;
        returns at once. With :data:`QUEUED` states waiting, the oldest is dropped: the events it made visible
        are not measured (counted as failures of its partitions), never measured at a later state's time."""
        with self._cond:
            if len(self._states) >= QUEUED:
                _, oldest = self._states.popleft()
                for partition, offset in oldest.items():
                    self._dropped[partition] = max(offset, self._dropped.get(partition, offset))
                    self.failures.labels(partition).inc()
            self._states.append((state.made_at, dict(state.positions)))
            self._cond.notify()

    def take(self) -> tuple[float, dict[str, int]] | None:
        """The oldest state queued (``(made_at, positions)``; waits for one), the offsets of the states dropped
        before it taken as seen; None once :meth:`close` was called. The measuring thread's; with ``thread=False``
        the caller's, who then calls :meth:`measure` on it."""
        with self._cond:
            self._cond.wait_for(lambda: self._states or self._stop.is_set())
            if self._stop.is_set():
                return None
            item = self._states.popleft()
            dropped, self._dropped = self._dropped, {}
        for partition, offset in dropped.items():  # what they made visible is not measured later
            self._high[partition] = max(offset, self._high.get(partition, offset))
        return item

    def _run(self) -> None:
        while (item := self.take()) is not None:
            self.measure(*item)

    def measure(self, made_at: float, positions: dict[str, int]) -> int:
        """Observe the events ``positions`` (``{partition: offset}``) newly cover, visible at ``made_at``
        (seconds since the epoch); returns how many were observed. Every partition's offset is taken as seen
        first, so a partition the broker cannot give (counted in ``failures``, a WARNING logged) leaves the
        others' measures as they are, and its events are not measured later at another state's time."""
        ranges = []
        for partition, offset in positions.items():
            high = self._high.get(partition)
            if high is not None and offset <= high:
                continue
            self._high[partition] = offset
            if high is not None:  # a first state holds what was trained before it watched
                ranges.append((partition, high, offset))
        done = 0
        for partition, after, upto in ranges:
            try:
                done += self._observe(partition, after, upto, made_at)
            except Exception as exc:  # noqa: BLE001 - the broker down: counted, said, and the replica serves on
                self.failures.labels(partition).inc()
                self.failed += 1
                if self.failed % 100 == 1:
                    log.warning("freshness: could not read the events a state made visible of %r from the broker "
                                "(%s); they are not measured (%d so far)", partition, exc, self.failed)
        return done

    def _observe(self, partition: str, after: int, upto: int, made_at: float) -> int:
        start, last, left, done = redis_id(after), redis_id(upto), self.max_events, 0
        while not self._stop.is_set():
            count = min(self.page, left)
            ids = self._ids(keys=[partition], args=[start, last, count, END_FIELD, "1"])
            ms = [int(i.split(b"-", 1)[0]) for i in ids if not i.startswith(b"!")]  # not the end marker
            if ms:  # an entry's time: the milliseconds of its id, as freshness.entry_seconds reads them
                self.histogram.add(partition, made_at - torch.tensor(ms, dtype=torch.float64) / 1000.0)
            done += len(ms)
            self.observed += len(ms)
            left -= len(ms)
            if len(ids) < count:
                return done
            start = ids[-1].lstrip(b"!").decode()
            if left <= 0:
                rest = self._ids(keys=[partition], args=[start, last, 1, END_FIELD, "1"])
                if rest and not rest[0].startswith(b"!"):  # events left (the end marker is not one)
                    self.truncated.labels(partition).inc()
                return done
        return done

    def close(self, timeout: float = 2.0) -> None:
        """Stop measuring (a state being measured stops after its current page; those queued are dropped) and,
        once the thread has ended (at most ``timeout`` seconds), close the connection."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self._client.close()

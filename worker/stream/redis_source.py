"""``RedisStreamSource``: events from a Redis stream through a consumer group; ``publish`` writes them.

Redis Streams (``XADD``/``XREADGROUP``/``XACK``) with a consumer group give
what a trainer needs of a broker (as Kafka's consumer groups do): entries
are delivered to one consumer of the group in order, and an entry stays
*pending* for that consumer until it is acknowledged. The source
acknowledges on :meth:`RedisStreamSource.commit` (once the events are
trained and saved), so a consumer restarted under the same name first gets
its pending entries again, then new ones: the events after the last
commit are trained again, none is skipped.

A broker that goes away is retried, with a WARNING log line per attempt
and the count in :attr:`RedisStreamSource.reconnects`, for
``retry_seconds``; then :class:`BrokerUnavailable` is raised. The stream is
never given up in silence. The client is redis-py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping

from shardps.worker.stream.events import Event
from shardps.worker.stream.exactly_once import redis_id, redis_offset

__all__ = ["END_FIELD", "BrokerUnavailable", "RedisStreamReader", "RedisStreamSource", "publish", "redis_client"]

log = logging.getLogger(__name__)

#: An entry holding this field ends the stream (``publish(..., end=True)`` writes one).
END_FIELD = "__end__"


class BrokerUnavailable(RuntimeError):
    """The broker could not be reached for longer than the source's retry budget (the message names it)."""


def _redis():
    try:
        import redis
    except ImportError as exc:
        raise ImportError('Redis streams need redis-py: pip install -e ".[stream]"') from exc
    return redis


def redis_client(url: str, **kwargs):
    """A redis-py client of ``url`` (``redis.Redis.from_url(url, **kwargs)``; it connects when first used).

    Raises:
        ImportError: redis-py is not installed (the message says how to install it).
        ValueError: ``url`` is not a Redis URL (``redis://``, ``rediss://``, ``unix://``).
    """
    return _redis().Redis.from_url(url, **kwargs)


class RedisStreamSource:
    """Events of Redis stream ``stream`` read as consumer ``consumer`` of group ``group``.

    Args:
        url: the broker, ``redis://host:port/db``. stream, group, consumer: names (the group is made, with
            the stream, at the stream's start if it does not exist).
        time_field: the entry field holding the event time, seconds.
        retry_seconds: how long a broker that cannot be reached is retried before :class:`BrokerUnavailable`.

    Raises:
        BrokerUnavailable: the broker cannot be reached now, for ``retry_seconds``.
    """

    def __init__(self, url: str, stream: str, group: str, consumer: str, *, time_field: str = "time",
                 retry_seconds: float = 30.0) -> None:
        self.url, self.stream, self.group, self.consumer = url, stream, group, consumer
        self.time_field, self.retry_seconds = time_field, retry_seconds
        self.reconnects = 0
        self._client = _redis().Redis.from_url(url, decode_responses=True, socket_timeout=10,
                                               socket_connect_timeout=5)
        self._backlog: str | None = "0"  # first the entries delivered before and not acknowledged (a restart),
        #                                    after this id; None: new ones
        self._delivered: list[str] = []  # entry ids handed out and not acknowledged, in order
        self._ended = False
        self._retrying(self._create_group)

    @property
    def ended(self) -> bool:
        return self._ended

    def _create_group(self) -> None:
        try:
            self._client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except _redis().ResponseError as exc:
            if "BUSYGROUP" not in str(exc):  # the group exists: join it
                raise

    def _retrying(self, fn):
        redis = _redis()
        deadline = time.monotonic() + self.retry_seconds
        attempt = 0
        while True:
            try:
                return fn()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                attempt += 1
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BrokerUnavailable(
                        f"the Redis broker {self.url} (stream {self.stream!r}) could not be reached for "
                        f"{self.retry_seconds:g} s ({attempt} attempts, last: {exc}): start it again, then "
                        "restart the job: it resumes from its last checkpoint") from exc
                self.reconnects += 1
                log.warning("Redis broker %s unreachable (%s): retrying, attempt %d, %.0f s left", self.url, exc,
                            attempt, left)
                time.sleep(min(1.0, left))

    def read(self, max_events: int, timeout: float) -> list[Event]:
        """Up to ``max_events`` next entries (the consumer's pending ones first), waiting at most ``timeout``
        seconds. Raises BrokerUnavailable; ValueError: an entry without a numeric ``time_field``."""
        if self._ended or max_events < 1:
            return []
        start = self._backlog or ">"
        block = None if self._backlog else max(1, int(timeout * 1000))
        reply = self._retrying(lambda: self._client.xreadgroup(self.group, self.consumer, {self.stream: start},
                                                               count=max_events, block=block))
        entries = reply[0][1] if reply else []
        if self._backlog and not entries:
            self._backlog = None  # the pending entries are handed out: new ones from now on
            return self.read(max_events, timeout)
        if self._backlog:
            self._backlog = entries[-1][0]  # the next backlog read starts after these
        out = []
        for entry_id, fields in entries:
            self._delivered.append(entry_id)
            if END_FIELD in fields:
                self._ended = True
                break
            out.append(self._event(entry_id, fields))
        return out

    def _event(self, entry_id: str, fields: dict) -> Event:
        try:
            t = float(fields.pop(self.time_field))
        except (KeyError, ValueError):
            raise ValueError(f"stream {self.stream!r} entry {entry_id}: no numeric {self.time_field!r} "
                             "field (the event time)") from None
        return Event(entry_id, t, fields)

    def commit(self, offset: str) -> None:
        """Acknowledge every entry handed out up to and including ``offset``. Raises BrokerUnavailable."""
        if offset not in self._delivered:
            raise ValueError(f"offset {offset!r} was not handed out by this source (or is acknowledged already)")
        upto = self._delivered.index(offset) + 1
        ids, self._delivered = self._delivered[:upto], self._delivered[upto:]
        if ids:
            self._retrying(lambda: self._client.xack(self.stream, self.group, *ids))

    def pending(self) -> int:
        """Entries delivered to the group and not acknowledged yet (``XPENDING``)."""
        return int(self._retrying(lambda: self._client.xpending(self.stream, self.group))["pending"])

    def close(self) -> None:
        self._client.close()


class RedisStreamReader(RedisStreamSource):
    """Events of Redis stream ``stream`` read by position (``XREAD``, no consumer group): the source of
    exactly-once training (``shardps.worker.stream.exactly_once``), where the shards hold the offsets trained
    and the trainer seeks to them, as a Kafka consumer that stores its offsets with its state does. One reader
    reads a stream; ``commit`` is not needed (the shards' checkpoints hold the position).

    Args:
        url, stream, time_field, retry_seconds: as :class:`RedisStreamSource`.

    Raises:
        BrokerUnavailable: the broker cannot be reached now, for ``retry_seconds``.
    """

    def __init__(self, url: str, stream: str, *, time_field: str = "time", retry_seconds: float = 30.0) -> None:
        self.url, self.stream, self.partition = url, stream, stream
        self.time_field, self.retry_seconds = time_field, retry_seconds
        self.reconnects = 0
        self._client = _redis().Redis.from_url(url, decode_responses=True, socket_timeout=10,
                                               socket_connect_timeout=5)
        self._after = "0-0"  # the id of the last entry read
        self._ended = False
        self._retrying(self._client.ping)

    def position(self, event: Event) -> int:
        """``event``'s offset: its entry id as ``ms << 20 | seq`` (``exactly_once.redis_offset``)."""
        return redis_offset(event.offset)

    def seek(self, after: int | None) -> None:
        """Read next the entries after offset ``after`` (None: from the stream's first).

        Raises:
            RuntimeError: the stream was trimmed past ``after`` (its first entry is later). BrokerUnavailable.
        """
        if after is not None:  # the stream still holds what follows ``after`` (not trimmed past it: XTRIM, MAXLEN)
            first = self._retrying(lambda: self._client.xrange(self.stream, count=1))
            if first and redis_offset(first[0][0]) > after:
                raise RuntimeError(f"stream {self.stream!r} no longer holds the entries after {redis_id(after)} (its "
                                   f"first entry is {first[0][0]}: trimmed): the events between would be skipped; "
                                   "keep the stream longer than the shards' checkpoints lag behind")
        self._after, self._ended = "0-0" if after is None else redis_id(after), False

    def read(self, max_events: int, timeout: float) -> list[Event]:
        """Up to ``max_events`` entries after the last one read, waiting at most ``timeout`` seconds for the
        first. Raises BrokerUnavailable; ValueError: an entry without a numeric ``time_field``."""
        if self._ended or max_events < 1:
            return []
        reply = self._retrying(lambda: self._client.xread({self.stream: self._after}, count=max_events,
                                                          block=max(1, int(timeout * 1000))))
        entries = reply[0][1] if reply else []
        out = []
        for entry_id, fields in entries:
            self._after = entry_id
            if END_FIELD in fields:
                self._ended = True
                break
            out.append(self._event(entry_id, fields))
        return out

    def commit(self, offset: str) -> None:
        """Nothing to tell the broker: the shards' checkpoints hold what was trained."""

    def pending(self) -> int:
        return 0


def publish(url: str, stream: str, records: Iterable[Mapping[str, object]], *, end: bool = False,
            batch: int = 1000, client=None) -> list[str]:
    """``XADD`` each of ``records`` (field names to values, written as text) to ``stream``, in order, ``batch``
    at a time in one pipeline; ``end``: then an entry that ends the stream. Returns the entry ids.

    ``client``: a redis-py client made with ``decode_responses=True`` to use (and leave open) instead of
    connecting to ``url`` for this call alone, for a producer that publishes often."""
    if client is not None:
        return _publish(client, stream, records, end, batch)
    client = _redis().Redis.from_url(url, decode_responses=True)
    try:
        return _publish(client, stream, records, end, batch)
    finally:
        client.close()


def _publish(client, stream: str, records: Iterable[Mapping[str, object]], end: bool, batch: int) -> list[str]:
    ids: list[str] = []
    pipe = client.pipeline(transaction=False)
    pending = 0
    for record in records:
        pipe.xadd(stream, {k: str(v) for k, v in record.items()})
        pending += 1
        if pending == batch:
            ids.extend(pipe.execute())
            pending = 0
    if end:
        pipe.xadd(stream, {END_FIELD: "1"})
    ids.extend(pipe.execute())
    return ids

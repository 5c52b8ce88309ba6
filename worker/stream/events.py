"""Events, the source interface every event stream implements, and mini-batches of events.

An event is one record of the stream (a click, a rating): its ``offset``
(the source's position of it: a line number, a Redis stream entry id), its
**event time** (seconds, from the record: when it happened, not when it
was read) and its fields. A source hands events out in stream order and is
told, with :meth:`EventSource.commit`, up to which offset they are trained
and saved; a source restarted from a committed offset hands out the
events after it again (at-least-once delivery, as Kafka's committed
consumer offsets and Redis's consumer-group acknowledgements give it;
Monolith trains online from Kafka this way). A Kafka consumer is a small
adapter of the same shape: ``read`` polls, ``offset`` is
``f"{partition}:{offset}"``, ``commit`` commits the offsets, ``ended`` is
False.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["Event", "EventSource", "minibatches"]


@dataclass(frozen=True)
class Event:
    """One record of a stream.

    Attributes:
        offset: the source's position of the event (``str``; compare positions only through the source).
        time: the event time, seconds (float, from the record: the event clock of expiry and of latency).
        fields: the record's other fields, names to strings as the source holds them.
    """

    offset: str
    time: float
    fields: dict[str, str] = field(default_factory=dict)


class EventSource(Protocol):
    """What a stream of events offers a trainer (``FileReplay``, ``RedisStreamSource``, a Kafka adapter)."""

    def read(self, max_events: int, timeout: float) -> list[Event]:
        """Up to ``max_events`` next events, in stream order, waiting at most ``timeout`` seconds for the first;
        ``[]`` when none came (the stream may still go on: see :attr:`ended`).

        Raises:
            BrokerUnavailable: the broker could not be reached for longer than the source's retry budget.
        """

    def commit(self, offset: str) -> None:
        """Every event up to and including ``offset`` is trained and saved: a restarted source starts after it."""

    @property
    def ended(self) -> bool:
        """The stream said it has no more events (a file's end, a producer's end marker)."""

    def close(self) -> None:
        """Release the source's connections and files."""


def minibatches(source: EventSource, batch_size: int, max_wait: float = 0.5,
                poll: float = 0.1) -> Iterator[list[Event]]:
    """Mini-batches of ``source``'s events, in stream order: ``batch_size`` events, or fewer when ``max_wait``
    seconds passed since the batch's first event arrived (a quiet stream still trains what came, within
    ``max_wait`` of its arrival), until the source has :attr:`~EventSource.ended` and handed out everything.

    Args:
        batch_size: events per batch at most (>= 1). max_wait: seconds (> 0). poll: the longest single wait
            for events, seconds (> 0): how soon an ended stream is noticed.

    Raises:
        ValueError: ``batch_size`` < 1, ``max_wait`` or ``poll`` not > 0.
        BrokerUnavailable: as :meth:`EventSource.read`.
    """
    if batch_size < 1 or not max_wait > 0 or not poll > 0:
        raise ValueError(f"batch_size must be >= 1 and max_wait, poll > 0, got {batch_size}, {max_wait}, {poll}")
    batch: list[Event] = []
    first = 0.0
    while True:
        wait = poll if not batch else max(0.0, min(poll, first + max_wait - time.monotonic()))
        got = source.read(batch_size - len(batch), wait)
        if got and not batch:
            first = time.monotonic()
        batch.extend(got)
        if batch and (len(batch) >= batch_size or time.monotonic() - first >= max_wait or
                      (not got and source.ended)):
            yield batch
            batch = []
        elif not got and source.ended:
            return

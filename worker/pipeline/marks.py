"""What a step tells the shards about its events: their event time and the stream batch they are.

A mixin of ``DistributedOptimizer`` (its ``_tables``, ``_round`` and ``RoundSteps._span``): a stream trainer
calls these before each step's ``backward()``.
"""

from __future__ import annotations

import math

from shardps.common import stream_offsets


class StreamMarks:
    """``set_event_time`` and ``set_stream_span`` of a ``DistributedOptimizer``."""

    def set_event_time(self, seconds: float) -> None:
        """The event time of this step's batch (seconds; the latest of its events), sent with the step's push of
        table rows: tables with ``ttl_seconds`` need it at every step (their rows expire by event time).

        Raises:
            ValueError: not finite, or < 0. RuntimeError: no sparse tables.
        """
        if self._tables is None:
            raise RuntimeError("set_event_time: this DistributedOptimizer has no sparse tables")
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"event time must be finite and >= 0 seconds, got {seconds}")
        self._tables.event_time = float(seconds)

    def set_stream_span(self, partition: str, after: int | None, last: int) -> None:
        """The stream batch this step trains, for exactly-once training from a stream: events of ``partition``
        after offset ``after`` (None: from the partition's start) up to offset ``last``, both unsigned 64-bit
        integers increasing along the partition. Sent with the step's dense round and its push of rows; each
        shard applies them only if the batch directly follows what it holds, and skips a batch it holds
        (``shardps.worker.stream.exactly_once``, docs/online.md).

        Raises:
            ValueError: a malformed span (``shardps.common.stream_offsets.span``); called after ``backward()``
                began streaming the step's round (a round with a span is pushed whole, not streamed).
            RuntimeError: the span set before was not sent yet: each batch needs its own ``step()`` (a loader
                that reads a batch ahead, or a batch skipped without a step, would give a step another's span).
        """
        pending = self._span if self._span is not None else (self._tables.span if self._tables is not None else None)
        if pending is not None:
            raise RuntimeError(f"set_stream_span: the span of the previous batch (partition {pending.partition!r}, "
                               f"to offset {pending.last}) was not sent yet: call step() once for every batch, and "
                               "set the span of a batch only when its step comes (no read-ahead)")
        if self._round is not None and self._round.options is not None:
            raise ValueError("set_stream_span: this step's round is already streamed (backward() pushed its first "
                             "gradient): call set_stream_span before backward()")
        self._span = stream_offsets.span(partition, after, last)
        if self._tables is not None:
            self._tables.span = self._span

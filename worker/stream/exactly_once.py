"""Exactly-once training from a stream: every event trained once on every shard, across restarts.

Each step tells the shards which batch of the stream it trains (``DistributedOptimizer.set_stream_span``:
the partition, the offset of the event before the batch, the offset of its last event). A shard applies a
batch only if it directly follows what it holds of the partition, skips a batch it holds already, and saves
the offsets it holds in its checkpoints (``shardps.server.stream_positions``). :class:`ExactlyOnce` is the
trainer's half:

- **start**: it asks every shard what it holds (``Stats.stream_positions``) and seeks the source to the
  lowest offset held (the partition's start when a shard holds none): a restarted job resumes where the
  shards' state is, whatever checkpoints they restored;
- **batches** are cut at every offset a shard holds, so each batch is either held by a shard or due on it,
  never half of each;
- **a shard that restarted** from an older checkpoint than the others skips the batches that do not follow
  what it holds (counted in ``shardps_shard_stream_batches_owed_total``); after the worker joins it again
  (and every ``check_every`` batches, and at the stream's end) the trainer asks the shards again and, when one
  is behind, replays the events after its offset from the source: the shards that hold them skip them, the one
  that lost them trains them.

So the events between a shard's checkpoint and its crash are read again from the broker and trained once more
**on that shard only**: no event is trained twice on a shard, none is skipped. The replayed events' gradients
are computed with the model as it is at the replay (the other shards' parameters moved on meanwhile), as any
per-partition recovery of a parameter server does. This is Kafka's and Flink's way of storing the consumer's
offsets with the state they produced, per shard.

The source must be able to seek (:class:`SeekableSource`): :class:`~shardps.worker.stream.replay.FileReplay`
and :class:`~shardps.worker.stream.redis_source.RedisStreamReader`; a Kafka adapter would map a
topic-partition's offsets directly (``KafkaConsumer.seek``). One trainer reads a partition; in a sync job of
several trainers, each reads its own partitions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Protocol

from shardps.worker.stream.events import Event

__all__ = ["ExactlyOnce", "SeekableSource", "held_offsets", "held_positions", "redis_id", "redis_offset"]

log = logging.getLogger(__name__)

#: Bits of a Redis entry id's sequence number in its offset (``ms << 20 | seq``).
REDIS_SEQ_BITS = 20


def redis_offset(entry_id: str) -> int:
    """The offset of Redis stream entry ``entry_id`` (``"<ms>-<seq>"``): ``ms << 20 | seq``.

    Raises:
        ValueError: not an entry id, or a sequence number of 2**20 or more (ids written by hand; Redis's own
            ids number the entries of one millisecond from 0).
    """
    try:
        ms, seq = (int(part) for part in entry_id.split("-"))
    except ValueError:
        raise ValueError(f"{entry_id!r} is not a Redis stream entry id (<milliseconds>-<sequence>)") from None
    if not (0 <= seq < 2 ** REDIS_SEQ_BITS and 0 <= ms < 2 ** (64 - REDIS_SEQ_BITS)):
        raise ValueError(f"Redis entry id {entry_id!r}: exactly-once training takes sequence numbers below "
                         f"2**{REDIS_SEQ_BITS} and times below 2**{64 - REDIS_SEQ_BITS} ms (let Redis make the ids)")
    return ms << REDIS_SEQ_BITS | seq


def redis_id(offset: int) -> str:
    """The Redis entry id of ``offset`` (:func:`redis_offset`'s inverse)."""
    return f"{offset >> REDIS_SEQ_BITS}-{offset & (2 ** REDIS_SEQ_BITS - 1)}"


class SeekableSource(Protocol):
    """A source whose reading can be moved (``EventSource`` plus the three below)."""

    partition: str  # the partition's name, the same across restarts (a file's, a stream key)

    def position(self, event: Event) -> int:
        """``event``'s offset as an int in [0, 2**64), increasing along the partition."""

    def seek(self, after: int | None) -> None:
        """Read next the events after offset ``after`` (None: from the partition's start)."""

    def read(self, max_events: int, timeout: float) -> list[Event]: ...

    @property
    def ended(self) -> bool: ...


def held_offsets(dist, partition: str) -> list[int | None]:
    """What each shard holds of ``partition``, once the steps so far are applied: per shard the lower of its
    dense part's and its rows' offsets (None: it holds nothing of the partition).

    Raises:
        ShardRpcError: a shard could not be asked.
    """
    return [None if None in kinds else min(kinds) for kinds in held_positions(dist, partition)]


def held_positions(dist, partition: str) -> list[list[int | None]]:
    """Per shard, the offsets of ``partition`` its dense part and (with tables) its rows hold (None: nothing),
    once the steps so far are applied.

    Raises:
        ShardRpcError: a shard could not be asked.
    """
    dist.synchronize()
    rows = dist.tables is not None
    if rows and dist.tables.tables:  # the rows of the last step applied, not only taken (step() hands them off)
        dist.tables.settle(next(iter(dist.tables.tables)))
    out: list[list[int | None]] = []
    for client in dist.clients:
        found = [p for p in client.stats().stream_positions if p.partition == partition]
        if not found:
            out.append([None] * (2 if rows else 1))
            continue
        p = found[0]
        out.append([p.dense if p.HasField("dense") else None] + ([p.rows if p.HasField("rows") else None] if rows
                                                                  else []))
    return out


def _lowest(held: list[int | None]) -> int | None:
    return None if None in held else min(held)


class ExactlyOnce:
    """Mini-batches of ``source`` for ``dist`` to train, each event exactly once on every shard (module docstring).

    Use: ``for batch in ExactlyOnce(dist, source, 256).batches(): <forward, backward, dist.step()>`` - each
    batch must be trained by exactly one ``step()`` before the next is asked for (the span is set for it).

    Args:
        dist: the job's ``DistributedOptimizer`` (unstreamed rounds).
        source: a :class:`SeekableSource`.
        batch_size: events per batch at most; max_wait: seconds a partial batch waits for more events.
        check_every: batches between two checks of what the shards hold (a check also follows every rejoin
            of a shard, and the stream's end).

    Attributes:
        replays: times the source was moved back because a shard held less than the trainer had trained.
        replayed: events read again for those replays.

    Raises:
        ValueError: a bad setting. RuntimeError (from :meth:`batches`): a shard holds events after the
            trainer's position (another trainer reads the partition).
    """

    def __init__(self, dist, source: SeekableSource, batch_size: int, *, max_wait: float = 0.5,
                 check_every: int = 50) -> None:
        if batch_size < 1 or check_every < 1 or not max_wait >= 0:
            raise ValueError(f"batch_size and check_every must be >= 1 and max_wait >= 0, got {batch_size}, "
                             f"{check_every}, {max_wait}")
        self.dist, self.source, self.batch_size = dist, source, batch_size
        self.max_wait, self.check_every = max_wait, check_every
        self.after: int | None = None  # the offset of the last event handed out (None: none)
        self.replays = self.replayed = 0
        self._cuts: set[int] = set()
        self._pending: list[Event] = []
        self._rejoins = self._rejoin_count()
        self._trained_to: int | None = None  # the furthest offset ever handed out (replays end there)
        self._stuck, self._last_low = 0, None  # replays in a row from one offset

    def _rejoin_count(self) -> int:
        recovery = self.dist.recovery
        return recovery.rejoins if recovery is not None else 0

    def _seek(self, positions: list[list[int | None]]) -> None:
        offsets = [h for kinds in positions for h in kinds]
        start = _lowest(offsets)
        self.source.seek(start)
        self._pending = []
        self.after = start
        # a batch ends at every offset a shard's dense part or rows hold: held by each, or due on it, never both
        self._cuts = {h for h in offsets if h is not None and (start is None or h > start)}

    def _check(self) -> bool:
        """Ask the shards what they hold; seek back to the lowest when one is behind. True: it moved back.

        Raises:
            RuntimeError: a shard is ahead of the trainer, or stayed behind through three replays in a row.
        """
        positions = held_positions(self.dist, self.source.partition)
        held = [None if None in kinds else min(kinds) for kinds in positions]
        low = _lowest(held)
        if low == self.after:
            self._stuck = 0
            return False
        if self.after is not None and low is not None and low > self.after:
            raise RuntimeError(f"shards hold partition {self.source.partition!r} up to offset {low}, past this "
                               f"trainer's {self.after}: another trainer reads it; give each trainer its own partition")
        behind = [i for i, h in enumerate(held) if h == low]
        log.warning("shard(s) %s hold partition %r only up to offset %s (restored from a checkpoint): replaying "
                    "its events from there; the shards that hold them skip them", behind, self.source.partition,
                    "none (its start)" if low is None else low)
        self._stuck = self._stuck + 1 if low == self._last_low else 1
        self._last_low = low
        if self._stuck > 3:
            raise RuntimeError(f"shard(s) {behind} stayed at offset {low} of partition {self.source.partition!r} "
                               "through 3 replays: they skip every batch (see their logs: a batch that leaves a gap, "
                               "or one step given two batches); nothing more is trained")
        self.replays += 1
        self._seek(positions)
        return True

    def _read(self) -> list[Event]:
        """The next batch: up to ``batch_size`` events, ended early at a cut or after ``max_wait``."""
        batch: list[Event] = []
        deadline = None
        while len(batch) < self.batch_size:
            if not self._pending:
                left = self.max_wait if deadline is None else deadline - time.monotonic()
                if batch and left <= 0:
                    break
                self._pending = self.source.read(self.batch_size - len(batch), max(left, 0.0))
                if not self._pending:
                    if batch or self.source.ended:
                        break
                    continue
                if deadline is None:
                    deadline = time.monotonic() + self.max_wait
            event = self._pending.pop(0)
            batch.append(event)
            offset = self.source.position(event)
            if self._trained_to is not None and offset <= self._trained_to:
                self.replayed += 1
            if offset in self._cuts:
                self._cuts.discard(offset)
                break
        return batch

    def batches(self) -> Iterator[list[Event]]:
        """Batches in stream order, each set as the next step's span, until the source has ended and every shard
        holds every event (module docstring).

        Raises:
            ShardRpcError: a shard could not be asked what it holds. RuntimeError: see the class.
        """
        self._seek(held_positions(self.dist, self.source.partition))
        since_check = 0
        while True:
            batch = self._read()
            if not batch:
                if self.source.ended and not self._check():
                    return
                continue
            last = self.source.position(batch[-1])
            self.dist.set_stream_span(self.source.partition, self.after, last)
            yield batch
            self.after = last
            self._trained_to = last if self._trained_to is None else max(self._trained_to, last)
            since_check += 1
            rejoins = self._rejoin_count()
            if rejoins != self._rejoins or since_check >= self.check_every:
                self._rejoins, since_check = rejoins, 0
                self._check()

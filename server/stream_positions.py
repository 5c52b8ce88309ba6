"""What a shard holds of each event stream partition: exactly-once training from a stream.

A trainer that reads a stream tells every push which batch of events it trains (``StreamSpan``: the
partition, the offset of the event just before the batch, and the offset of its last event). A shard keeps,
per partition, the offset of the last event its dense part trained and of the last one its rows trained, and
judges each push against it:

- **due**: the batch directly follows what it holds (``after`` equal to the held offset, or both absent): it
  is applied and the held offset moves to ``last``;
- **held**: it holds the batch already (``last`` <= held): the round is skipped (the version or the sparse
  round advances, nothing changes), so an event replayed after a restart is never trained twice;
- **gap**: the batch neither follows nor is held (the shard restored an older checkpoint than the trainer
  knew, or the trainer skipped events): the round is skipped too, logged at WARNING and counted, and the
  events stay owed to this shard: the trainer sees the held offsets in Stats and replays from the lowest.

The held offsets are saved in the shard's checkpoints and restored with them, so a shard's state and the
events it trained always agree, whichever checkpoint it restarts from. This is the per-partition form of
Kafka's committed offsets stored with the consumer's state (the "transactional" sink of Flink and Kafka
Streams): offsets and the state they produced are saved together, atomically.
"""

from __future__ import annotations

import logging

from shardps.common.stream_offsets import MAX_PARTITION_BYTES
from shardps.proto import shardps_pb2 as pb
from shardps.server.errors import InvalidArgument

log = logging.getLogger(__name__)

#: Partitions one shard keeps (Stats and checkpoints stay bounded).
MAX_PARTITIONS = 1024
DUE, HELD, GAP = "due", "held", "gap"


def check_span(span: pb.StreamSpan, what: str) -> None:
    """Refuse a malformed span (before anything of the push is kept).

    Raises:
        InvalidArgument: an empty or too long partition name, or ``last`` not after ``after``.
    """
    name = span.partition.encode()
    if not name or len(name) > MAX_PARTITION_BYTES:
        raise InvalidArgument(f"{what}: a stream span needs a partition name of 1 to {MAX_PARTITION_BYTES} bytes, "
                              f"got {len(name)}")
    if span.HasField("after") and not span.last > span.after:
        raise InvalidArgument(f"{what}: a stream span's last offset ({span.last}) must come after its 'after' "
                              f"offset ({span.after})")


class StreamPositions:
    """The held offsets of one shard: ``dense`` and ``rows``, each ``{partition: offset}``."""

    def __init__(self) -> None:
        self.dense: dict[str, int] = {}
        self.rows: dict[str, int] = {}
        self.skipped = {HELD: 0, GAP: 0}  # rounds skipped, by reason

    @staticmethod
    def judge(held: dict[str, int], span: pb.StreamSpan | None) -> str:
        """``DUE``, ``HELD`` or ``GAP`` for a push of ``span`` against ``held`` (no span: ``DUE``)."""
        if span is None:
            return DUE
        have = held.get(span.partition)
        after = span.after if span.HasField("after") else None
        if after == have:
            return DUE
        return HELD if have is not None and span.last <= have else GAP

    def verdict(self, kind: str, spans: list[pb.StreamSpan | None], what: str, shard: int) -> bool:
        """Whether the round of ``spans`` (one per push it merges) is applied (True) or skipped (False).

        Raises:
            InvalidArgument: the pushes disagree (some due, some not): a round cannot apply part of its
                members' batches; every member must replay from the offsets the shards hold (Stats).
        """
        held = self.dense if kind == "dense" else self.rows
        named = [s.partition for s in spans if s is not None]
        if len(set(named)) < len(named):
            raise InvalidArgument(f"{what}: two members pushed batches of one stream partition: give each trainer its "
                                  "own partition")
        verdicts = [self.judge(held, s) for s in spans]
        if all(v == DUE for v in verdicts):
            if len(held) + len({s.partition for s in spans if s is not None} - held.keys()) > MAX_PARTITIONS:
                raise InvalidArgument(f"{what}: a shard keeps at most {MAX_PARTITIONS} stream partitions")
            return True
        if any(v == DUE for v in verdicts):
            raise InvalidArgument(
                f"{what}: its members' stream batches are due on shard {shard} for some and held or owed for "
                "others: every member must replay from the offsets the shards hold (Stats.stream_positions)")
        for s, v in zip(spans, verdicts):
            self.skipped[v] += 1
            if v == GAP:
                log.warning("shard %d: %s skipped: its batch of partition %r (after offset %s, to %d) does not "
                            "follow the offset this shard's %s hold (%s): the trainer must replay from there", shard,
                            what, s.partition, s.after if s.HasField("after") else "none", s.last, kind,
                            held.get(s.partition, "none"))
        return False

    def advance(self, kind: str, spans: list[pb.StreamSpan | None]) -> None:
        """A round of ``spans`` was applied: the held offsets move to each span's ``last``."""
        held = self.dense if kind == "dense" else self.rows
        for s in spans:
            if s is not None:
                held[s.partition] = s.last

    def state(self) -> dict:
        """The held offsets, for a checkpoint's manifest."""
        return {"dense": dict(self.dense), "rows": dict(self.rows)}

    def load(self, state: dict) -> None:
        """Restore :meth:`state`'s output (a checkpoint's; ``{}``: nothing held)."""
        self.dense = {str(k): int(v) for k, v in state.get("dense", {}).items()}
        self.rows = {str(k): int(v) for k, v in state.get("rows", {}).items()}

    def reset(self) -> None:
        self.dense, self.rows = {}, {}

    def positions(self) -> list[pb.StreamPosition]:
        """Every partition held, for Stats."""
        out = []
        for name in sorted(self.dense.keys() | self.rows.keys()):
            p = pb.StreamPosition(partition=name)
            if name in self.dense:
                p.dense = self.dense[name]
            if name in self.rows:
                p.rows = self.rows[name]
            out.append(p)
        return out


def span_of(message) -> pb.StreamSpan | None:
    """A trailer's or PushRowsRequest's span, or None when it has none."""
    return message.span if message.HasField("span") else None

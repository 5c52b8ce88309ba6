"""Touched-row deltas of a table: what a serving replica needs to catch up from a sparse round on.

A row's slot keeps the sparse round it was last pushed in (``RowSlab.touched``), so the rows a replica has
not seen since round ``R`` are the rows with ``touched >= R``: no per-subscriber state on the shard, and a
replica that restarts or reconnects simply asks from where it was (Monolith's parameter sync ships the ids
each step touched; here the slabs already record them). What such a delta cannot show by itself is a row
that is gone: the table keeps an :class:`EvictionLog` of the ids it evicted, per round, bounded; a delta
from before what the log remembers says so (``evictions_forgotten``), and the replica reads the whole table.
"""

from __future__ import annotations

import torch

from shardps.proto import shardps_pb2 as pb

__all__ = ["EvictionLog", "MAX_LOGGED_EVICTIONS", "delta_items"]

#: Evicted ids a table remembers (8 bytes each); older evictions are forgotten, oldest round first.
MAX_LOGGED_EVICTIONS = 1 << 20


class EvictionLog:
    """The ids a table evicted, by sparse round, at most :data:`MAX_LOGGED_EVICTIONS` of them.

    Attributes:
        forgotten_before: deltas from a round below this cannot list their evictions (the shard restarted from
            a checkpoint at that round, or older entries were dropped to stay bounded).
    """

    def __init__(self, forgotten_before: int = 0) -> None:
        self.entries: list[tuple[int, torch.Tensor]] = []
        self.held = 0
        self.forgotten_before = forgotten_before

    def note(self, round_: int, ids: torch.Tensor) -> None:
        """``ids`` (int64) were evicted after round ``round_``."""
        if not ids.numel():
            return
        self.entries.append((round_, ids.clone()))
        self.held += ids.numel()
        while self.held > MAX_LOGGED_EVICTIONS:
            old_round, old = self.entries.pop(0)
            self.held -= old.numel()
            self.forgotten_before = max(self.forgotten_before, old_round + 1)

    def since(self, round_: int) -> torch.Tensor | None:
        """int64 ids evicted in rounds ``>= round_`` (an id may repeat), or None when those are forgotten."""
        if round_ < self.forgotten_before:
            return None
        parts = [ids for r, ids in self.entries if r >= round_]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def delta_items(ids: torch.Tensor, slots: torch.Tensor, touched: torch.Tensor, since: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, slots)`` of the rows last pushed in rounds ``>= since`` (``since`` 0: all), in id order."""
    if since > 0:
        keep = touched[slots] >= since
        ids, slots = ids[keep], slots[keep]
    order = torch.argsort(ids)
    return ids[order], slots[order]


def shard_fields(store) -> bytes:
    """``ExportRowsReply``'s ``incarnation`` and ``positions`` (the offsets the rows hold, read now: before the
    page's rows are, so the page holds at least those events), encoded, to append to a page's bytes."""
    held = [p for p in store.rounds.positions.positions() if p.HasField("rows")]
    return pb.ExportRowsReply(incarnation=store.incarnation,
                              positions=[pb.StreamPosition(partition=p.partition, rows=p.rows) for p in held]
                              ).SerializeToString()

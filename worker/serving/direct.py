"""Direct-indexed rows of a served table: a lookup that is one ``index_select``, for tables whose ids are dense.

A replica state keeps each table as sorted ids and their rows (``TableExport``), and a lookup there is a binary
search per id (``torch.searchsorted``) plus the initial rows of the ids it does not hold, computed per query:
on 2 cores under training about 0.4 ms for 2,000 ids of a MovieLens table, most of a ``Lookup``'s CPU. Ids
drawn from a vocabulary (users, items, categories) are usually dense in a range ``[lo, hi)``; for those, a
state also keeps :class:`DirectRows`: every row of the range, the ids it does not hold at the rows they read as
(their initial rows), made once per state. A lookup whose ids all fall in the range is then one gather, the
way an array-backed embedding table is read; any other lookup takes ``TableExport.lookup``, so answers are the
same either way, bit for bit (the direct rows are made by ``TableExport.lookup`` itself).

Memory and time are bounded: a range is direct only when it is at most :data:`SPAN_FACTOR` times the rows held
plus :data:`SPAN_SLACK`, and at most :data:`MAX_ELEMENTS` elements (``span * dim``; 64 MiB of float32), its
room to grow included (a range near those bounds gets less room, and is made again more often). A new
state whose ids stay inside the previous range copies the previous rows and rewrites only the ids its delta
changed (pushed or evicted); ids outside it make the range again from the table, with an eighth of room on
each side for the next new ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardps.worker.embedding.export import TableExport

__all__ = ["MAX_ELEMENTS", "SPAN_FACTOR", "SPAN_SLACK", "DirectRows", "direct_rows"]

#: Most elements (``span * dim``) direct rows may hold.
MAX_ELEMENTS = 1 << 24
#: A range is direct when ``span <= SPAN_FACTOR * rows held + SPAN_SLACK``.
SPAN_FACTOR = 4
SPAN_SLACK = 1 << 16
LIMIT = 1 << 62


@dataclass(frozen=True)
class DirectRows:
    """Every row of ids ``lo .. lo + rows.shape[0] - 1`` of one table in one state.

    Attributes:
        lo: the first id; rows: ``[span, dim]`` (the table's lookup dtype): row ``i`` is what
            ``TableExport.lookup`` answers for id ``lo + i``.
    """

    lo: int
    rows: torch.Tensor

    def lookup(self, flat: torch.Tensor) -> torch.Tensor | None:
        """Rows ``[n, dim]`` of int64 ``flat`` ``[n]`` when every id is in the range; None otherwise (ask the
        table; ids of another dtype too: ``flat - lo`` in int32 could wrap into the range)."""
        if not flat.numel() or flat.dtype != torch.int64:
            return None
        local = flat - self.lo
        low, high = torch.aminmax(local)
        if int(low) < 0 or int(high) >= self.rows.shape[0]:
            return None
        return self.rows.index_select(0, local)


def direct_rows(table: TableExport, previous: DirectRows | None = None,
                changed: torch.Tensor | None = None) -> DirectRows | None:
    """The direct rows of ``table`` (None when its ids are not dense enough, or it holds none).

    Args:
        table: the state's table (sorted int64 ``ids``).
        previous: the previous state's direct rows of the same table, and ``changed``: the int64 ids whose rows
            may differ between that state and this one (the delta's pushed and evicted ids). Given both, and
            when this table's ids stay inside the previous range, the previous rows are copied and only
            ``changed`` is looked up again; otherwise the whole range is.
    """
    n = table.ids.numel()
    if not n:
        return None
    lo, hi = int(table.ids[0]), int(table.ids[-1]) + 1
    span, dim = hi - lo, table.spec.embedding_dim
    allowed = min(SPAN_FACTOR * n + SPAN_SLACK, MAX_ELEMENTS // dim)  # rows the range may hold, margin included
    if span > allowed or lo < -LIMIT or hi > LIMIT:
        return None  # (ids within +-2**62: ``id - lo`` of an int64 id never wraps into the range)
    if previous is not None and changed is not None and previous.lo <= lo and \
            hi <= previous.lo + previous.rows.shape[0] and previous.rows.shape[0] <= allowed:
        rows = previous.rows.clone()
        end = previous.lo + rows.shape[0]
        changed = changed[(changed >= previous.lo) & (changed < end)]
        if changed.numel():
            rows[changed - previous.lo] = table.lookup(changed).to(rows.dtype)
        return DirectRows(previous.lo, rows)
    # room to grow on both sides (an id not held reads as its initial row, wherever it lies), so a table that
    # gains new ids next to its range is updated in place rather than made again at every refresh
    margin = min(span // 8 + 16, (allowed - span) // 2)
    lo, hi = max(lo - margin, -LIMIT), min(hi + margin, LIMIT)
    return DirectRows(lo, table.lookup(torch.arange(lo, hi, dtype=torch.int64)))

"""Exporting a sparse table for serving: every shard's rows merged, as ``(ids, weights)`` or a bounded ``weight``.

Serving a hashed table (no shardps needed): keep ``ids`` (sorted int64
``[n]``) and ``weights`` (float32 ``[n, dim]``); an id's row is
``weights[i]`` where ``ids[i] == id`` (``torch.searchsorted``), and an id
not in ``ids`` (never trained, not admitted, or evicted) reads as
``shardps.common.rows.initial_rows(name, id, dim, seed, init_scale)``,
as in training: :meth:`TableExport.lookup` does exactly this.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardps.common.rows import TableSpec, ids_from, initial_rows, rows_from
from shardps.common.transport import DEFAULT_MAX_MESSAGE_BYTES

__all__ = ["TableDelta", "TableExport", "export_table", "table_delta"]


@dataclass
class TableExport:
    """One table's trained rows from every shard.

    Attributes:
        spec: the table's spec; ids: sorted int64 ``[n]``; weights: float32 ``[n, dim]``;
        state: optimizer state per row, ``{name: float32 [n, width]}``; round: the lowest shard's sparse round;
        steps: each shard's optimizer step count of the table.
    """

    spec: TableSpec
    ids: torch.Tensor
    weights: torch.Tensor
    state: dict[str, torch.Tensor]
    round: int
    steps: list[int]

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of int64 ``ids`` (any shape; other integer dtypes are widened to int64 first, as the workers
        widen int32 ids before they send them) as training reads them: ``[*ids.shape, dim]`` float32."""
        s = self.spec
        flat = ids.reshape(-1).to(torch.int64)
        if not self.ids.numel():
            return s.initial_rows(flat).view(*ids.shape, s.embedding_dim)
        pos = torch.searchsorted(self.ids, flat).clamp(max=self.ids.numel() - 1)
        hit = self.ids[pos] == flat
        out = self.weights.index_select(0, pos)  # the rows held; the others' initial rows (computed for them only)
        miss = ~hit
        if bool(miss.any()):
            out[miss] = s.initial_rows(flat[miss]).to(out.dtype)
        return out.view(*ids.shape, s.embedding_dim)

    def weight(self) -> torch.Tensor:
        """A bounded table as the ``weight`` ``[num_embeddings, dim]`` a plain ``nn.Embedding``/``nn.EmbeddingBag``
        loads (the padding row zero).

        Raises:
            ValueError: the table is hashed (it has no id range: use ``ids``/``weights`` and :meth:`lookup`).
        """
        if not self.spec.num_embeddings:
            raise ValueError(f"table {self.spec.name!r} is hashed (no num_embeddings): export it as (ids, weights) "
                             "and look rows up with TableExport.lookup")
        return self.lookup(torch.arange(self.spec.num_embeddings))


def _pages(client, name: str, max_message_bytes: int, since: int = 0, state: bool = True) -> list:
    """Every page of ``name``'s rows on one shard (``since`` > 0: of the rows pushed in rounds ``>= since``), each
    reply under half the message limit."""
    pages = [client.export_rows(name, state=state, max_rows=1, since_round=since)]  # the spec, so the row size
    per_page = max(1, (max_message_bytes // 2) // (8 + TableSpec.from_proto(pages[0].spec).row_bytes()))
    offset = len(pages[0].ids) // 8
    while offset < pages[-1].total_rows:
        pages.append(client.export_rows(name, state=state, offset=offset, max_rows=per_page, since_round=since))
        if not pages[-1].ids:  # rows were evicted meanwhile
            break
        offset += len(pages[-1].ids) // 8
    return pages


def export_table(clients, name: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> TableExport:
    """Read table ``name`` from every shard (``clients``: ``ShardClient`` per shard), a page of at most half
    ``max_message_bytes`` per call, and merge the rows. Read between steps: a page is a consistent read, the
    pages of a table being trained meanwhile are not.

    Raises:
        ShardRpcError: a shard does not hold the table (FAILED_PRECONDITION) or did not answer.
    """
    shards = [_pages(c, name, max_message_bytes) for c in clients]
    replies = [page for pages in shards for page in pages]
    spec = TableSpec.from_proto(replies[0].spec)
    ids, weights, state = [], [], {}
    for r in replies:
        part = ids_from(r.ids)
        ids.append(part)
        weights.append(rows_from(r.weights, part.numel(), spec.embedding_dim, spec.row_dtype))  # float32
        for k, data in r.state.items():
            state.setdefault(k, []).append(rows_from(data, part.numel(), r.state_width[k]))
    all_ids = torch.cat(ids)
    order = torch.argsort(all_ids)
    return TableExport(spec=spec, ids=all_ids[order], weights=torch.cat(weights)[order],
                       state={k: torch.cat(v)[order] for k, v in state.items()},
                       round=min(r.round for r in replies), steps=[pages[0].step for pages in shards])


def _delta_pages(client, name: str, max_message_bytes: int, since: int) -> list:
    """A delta's pages from one shard: one page when the delta fits a message (one consistent read), else a page
    at a time (:func:`_pages`)."""
    import grpc

    from shardps.worker.session.client import ShardRpcError

    try:
        return [client.export_rows(name, state=False, since_round=since)]
    except ShardRpcError as exc:
        if exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
    return _pages(client, name, max_message_bytes, since, state=False)


def _whole(pages: list) -> bool:
    """Whether a shard's delta pages are one consistent read: all read in one round (no round applied between
    them) and together every row the shard counts (a page sized before a round and read after it holds fewer
    rows than ``total_rows``)."""
    return len({p.round for p in pages}) == 1 and sum(len(p.ids) // 8 for p in pages) == pages[-1].total_rows


@dataclass
class TableDelta:
    """What changed in one table on every shard since a sparse round per shard (``table_delta``).

    Attributes:
        spec: the table's spec; ids: sorted int64 ``[n]``, the rows pushed since; weights: float32 ``[n, dim]``;
        evicted: sorted unique int64 ids evicted since (an id evicted and pushed again is in both);
        rounds: each shard's sparse round when read: the ``since`` of the next delta;
        incarnations: each shard's process incarnation when read (a restarted shard numbers its rounds again
            from its checkpoint's): the ``incarnations`` of the next delta;
        forgotten: a shard cannot tell what it evicted that far back, went back to an older state, or is
            another process than the last delta read (it restarted from a checkpoint): apply nothing, read the
            whole table again (``since`` 0);
        wire_bytes: the serialized bytes of every ``ExportRows`` reply read for it (pages read again included);
        positions: per shard, ``{stream partition: offset}`` its rows held before its first page was read (the
            delta holds at least the events up to there; exactly-once stream training).
    """

    spec: TableSpec
    ids: torch.Tensor
    weights: torch.Tensor
    evicted: torch.Tensor
    rounds: list[int]
    forgotten: bool
    incarnations: list[str]
    wire_bytes: int = 0
    positions: list[dict[str, int]] = field(default_factory=list)

    def payload_bytes(self) -> int:
        """The least bytes this delta needs: 8 per distinct id and evicted id, plus the row bytes of each distinct
        row's weights (4 bytes an element, 2 for float16 tables)."""
        row = self.spec.row_dtype.itemsize * self.spec.embedding_dim
        return int(torch.unique(self.ids).numel()) * (8 + row) + 8 * int(self.evicted.numel())

    def apply(self, table: TableExport) -> TableExport:
        """``table`` (weights only) with this delta applied: the evicted ids dropped, then the rows taken.

        Raises:
            ValueError: the delta is ``forgotten`` (read the whole table instead).
        """
        if self.forgotten:
            raise ValueError(f"the delta of table {self.spec.name!r} cannot be applied: a shard forgot its "
                             "evictions or went back to an older state; read the whole table (since 0)")
        keep = ~torch.isin(table.ids, torch.cat([self.evicted, self.ids]))
        ids = torch.cat([table.ids[keep], self.ids])
        order = torch.argsort(ids)
        weights = torch.cat([table.weights[keep], self.weights])[order]
        return TableExport(spec=self.spec, ids=ids[order], weights=weights, state={}, round=min(self.rounds),
                           steps=table.steps)


def table_delta(clients, name: str, since: list[int], max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                incarnations: list[str] | None = None) -> TableDelta:
    """The rows of table ``name`` pushed on each shard since sparse round ``since[i]`` (0: every row: a
    snapshot), and the ids evicted since, read a page at a time (``ExportRows(since_round=)``): what a serving
    replica applies to stay fresh, touched rows only (Monolith's parameter sync). ``incarnations``: the previous
    delta's (a shard that restarted since reuses round numbers: the delta is then ``forgotten``). Every page
    names its shard's process incarnation, so a restart between two deltas, or while one shard's pages are read,
    makes the delta ``forgotten``; no other call is made.

    Raises:
        ShardRpcError: a shard does not hold the table or did not answer.
    """
    ids, weights, evicted, rounds, spec, wire, now, positions = [], [], [], [], None, 0, [], []
    forgotten = False
    for client, start in zip(clients, since):
        for _ in range(3):  # a read across a round mixes two states of the shard, or misses rows: read it again
            pages = _delta_pages(client, name, max_message_bytes, start)
            wire += sum(p.ByteSize() for p in pages)
            whole = _whole(pages)
            if whole:
                break
        spec = spec or TableSpec.from_proto(pages[0].spec)
        # a read that stayed partial: its rows are applied (each is the shard's, newer than the replica's), and
        # the next delta reads again from ``start``, so no row pushed since is missed; what it holds is unknown
        rounds.append(pages[0].round if whole else start)
        forgotten |= pages[0].evictions_forgotten or pages[0].round < start  # forgot, or went back
        forgotten |= len({p.incarnation for p in pages}) > 1  # the shard restarted while its pages were read
        now.append(pages[0].incarnation)
        positions.append({q.partition: q.rows for q in pages[0].positions if q.HasField("rows")} if whole else {})
        evicted.append(ids_from(pages[0].evicted))
        for r in pages:
            part = ids_from(r.ids)
            ids.append(part)
            weights.append(rows_from(r.weights, part.numel(), spec.embedding_dim, spec.row_dtype))
    forgotten |= incarnations is not None and list(incarnations) != now
    all_ids = torch.cat(ids)
    order = torch.argsort(all_ids, stable=True)
    all_ids, all_weights = all_ids[order], torch.cat(weights)[order]
    if all_ids.numel() > 1:  # a partial read may hold an id twice (rows moved between its pages): keep the later
        last = torch.ones_like(all_ids, dtype=torch.bool)
        last[:-1] = all_ids[1:] != all_ids[:-1]
        all_ids, all_weights = all_ids[last], all_weights[last]
    return TableDelta(spec=spec, ids=all_ids, weights=all_weights,
                      evicted=torch.unique(torch.cat(evicted)), rounds=rounds, forgotten=forgotten,
                      incarnations=now, wire_bytes=wire, positions=positions)

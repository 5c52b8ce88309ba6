"""Where an export's sparse tables come from, a page at a time: the live shards or the shards' checkpoints.

A :class:`TableSource` knows every exported table's spec and, per shard, how
many trained rows it holds, and gives each shard's rows as a stream of pages
in id order: :class:`LiveTables` reads them with ``ExportRows`` (a page of at
most half the message limit per call), :class:`CheckpointTables` from each
shard's checkpoint (``rows/<table>/ids`` and ``rows/<table>/weights``, which
a shard writes sorted by id) with ``os.pread``. :meth:`TableSource.pages`
merges the shards' streams into one stream in id order (a k-way merge of
whole pages: every id up to the smallest last id of the pages in hand goes
out at once), checking every page as it comes: int64 ids, strictly
increasing within a shard, each held by the shard that sent it
(``shard_of``), inside ``[0, num_embeddings)`` for a bounded table, float32
rows of the table's width, and as many rows in all as the shard declared.
Memory: one page per shard in hand, plus the merged page going out.

Rows that change during a live export (a round applied between two pages)
are refused, never mixed: every page of every table must come from the same
sparse round of its shard, and :meth:`LiveTables.finish` checks that no
dense round was applied since the dense parameters were read.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence

import grpc
import torch

from shardps.proto import shardps_pb2 as pb
from shardps.common.checkpoint_stream import OpenCheckpoint
from shardps.common.rows import TableSpec, ids_from, shard_of
from shardps.common.transport import DEFAULT_MAX_MESSAGE_BYTES

__all__ = ["CheckpointTables", "LiveTables", "Page", "TableSource", "listed_tables", "page_rows"]

#: One page of a table's rows: ids int64 ``[k]`` (ascending), rows float32 ``[k, dim]``.
Page = tuple[torch.Tensor, torch.Tensor]
#: Bytes of pages held at once across all shards, at most (a page is never under :data:`MIN_PAGE_BYTES`).
READ_BUDGET_BYTES = 8 << 20
#: The smallest page asked for (bytes), however many shards.
MIN_PAGE_BYTES = 256 << 10
#: The largest page read from a checkpoint (bytes).
CHECKPOINT_PAGE_BYTES = 4 << 20


def page_rows(spec: TableSpec, num_shards: int, page_bytes: int) -> int:
    """Rows per page of ``spec``'s table (8 bytes of id and ``4 dim`` of row each): at most ``page_bytes``
    (a reply's budget) and at most :data:`READ_BUDGET_BYTES` over all ``num_shards`` pages in hand; >= 1."""
    budget = min(page_bytes, max(MIN_PAGE_BYTES, READ_BUDGET_BYTES // max(1, num_shards)))
    return max(1, budget // (8 + 4 * spec.embedding_dim))


def listed_tables(stats: pb.StatsReply) -> list[str] | None:
    """The names of the tables a shard's Stats lists, sorted; None when its protocol lists none (a StatsReply
    without a ``tables`` field: then the tables to export must be named)."""
    if "tables" not in stats.DESCRIPTOR.fields_by_name:
        return None
    return sorted(t if isinstance(t, str) else t.name for t in getattr(stats, "tables"))


class TableError(RuntimeError):
    """A table's rows cannot be exported as they are (the message names the table, the shard and why)."""


class TableSource:
    """Every exported table's spec and each shard's stream of its rows (base of the two sources).

    Attributes:
        specs: ``{name: TableSpec}`` of the exported tables, in export order.
        counts: ``{name: [trained rows of shard 0, ...]}``.
        rounds: each shard's sparse round (rounds applied) the rows are at.
    """

    def __init__(self, num_shards: int) -> None:
        self.num_shards = num_shards
        self.specs: dict[str, TableSpec] = {}
        self.counts: dict[str, list[int]] = {}
        self.rounds: list[int] = []

    def where(self, shard: int) -> str:
        """Shard ``shard``, for messages."""
        return f"shard {shard}"

    def rows(self, name: str) -> int:
        """Trained rows of table ``name`` on every shard together."""
        return sum(self.counts[name])

    def streams(self, name: str) -> list[Iterator[Page]]:
        """One stream per shard of table ``name``'s pages in id order (read as they are consumed)."""
        raise NotImplementedError

    def pages(self, name: str) -> Iterator[Page]:
        """Table ``name``'s trained rows from every shard in ascending id order, a page at a time.

        Yields:
            ``(ids int64 [k], rows float32 [k, dim])``, ids strictly ascending across pages.

        Raises:
            TableError: a shard's page is malformed, out of order, holds an id of another shard or outside a
                bounded table, or a shard sent more or fewer rows than it declared.
        """
        spec = self.specs[name]
        cursors = [_Cursor(self, spec, s, stream, self.counts[name][s]) for s, stream in enumerate(self.streams(name))]
        for c in cursors:
            c.refill()
        while active := [c for c in cursors if c.ids is not None]:
            limit = min(int(c.ids[-1]) for c in active)
            parts = []
            for c in active:
                upto = int(torch.searchsorted(c.ids, limit, right=True))
                if upto > c.pos:
                    parts.append((c.ids[c.pos: upto], c.rows[c.pos: upto]))
                    c.pos = upto
            yield parts.pop() if len(parts) == 1 else _interleave(parts, spec.embedding_dim)
            for c in active:
                c.refill()

    def finish(self) -> None:
        """Check that what was read is still one state (live: no dense round applied meanwhile)."""

    def close(self) -> None:
        """Release the source (live: close the shards' channels; checkpoints: the files)."""


def _interleave(parts: list[Page], dim: int) -> Page:
    """One page of several shards' ``(ids, rows)`` parts (each ascending, ids disjoint) in ascending id order:
    the ids sorted, each part's rows copied straight to their places in one output buffer (``parts`` emptied)."""
    ids, order = torch.sort(torch.cat([p[0] for p in parts]))
    places = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel()))
    rows, start = torch.empty(ids.numel(), dim), 0
    for part_ids, part_rows in parts:
        rows.index_copy_(0, places[start: start + part_ids.numel()], part_rows)
        start += part_ids.numel()
    parts.clear()
    return ids, rows


class _Cursor:
    """One shard's stream of pages in a merge, each page checked as it comes."""

    def __init__(self, source: TableSource, spec: TableSpec, shard: int, stream: Iterator[Page], declared: int):
        self.source, self.spec, self.shard, self.stream, self.declared = source, spec, shard, stream, declared
        self.ids: torch.Tensor | None = torch.empty(0, dtype=torch.int64)
        self.rows = torch.empty(0, spec.embedding_dim)
        self.pos, self.got, self.last = 0, 0, None

    def fail(self, why: str) -> TableError:
        return TableError(f"table {self.spec.name!r}: {self.source.where(self.shard)} {why}")

    def refill(self) -> None:
        while self.ids is not None and self.pos >= self.ids.numel():
            page = next(self.stream, None)
            if page is None:
                if self.got != self.declared:
                    raise self.fail(f"sent {self.got} rows, declared {self.declared}")
                self.ids = None
                return
            ids, rows = page
            self.check(ids, rows)
            self.got += ids.numel()
            if self.got > self.declared:
                raise self.fail(f"sent more rows than the {self.declared} it declared")
            self.ids, self.rows, self.pos = ids, rows, 0
            if ids.numel():
                self.last = int(ids[-1])

    def check(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        spec, n = self.spec, ids.numel()
        if ids.dtype != torch.int64 or ids.dim() != 1 or rows.dtype != torch.float32 or \
                tuple(rows.shape) != (n, spec.embedding_dim):
            raise self.fail(f"sent ids {ids.dtype} {tuple(ids.shape)} with rows {rows.dtype} {tuple(rows.shape)}, "
                            f"not int64 [n] with float32 [n, {spec.embedding_dim}]")
        if not n:
            return
        if bool((ids[1:] <= ids[:-1]).any()) or (self.last is not None and int(ids[0]) <= self.last):
            raise self.fail("sent ids out of order or repeated (each shard's rows come in ascending id order)")
        if spec.num_embeddings and (int(ids[0]) < 0 or int(ids[-1]) >= spec.num_embeddings):
            raise self.fail(f"holds an id outside [0, {spec.num_embeddings})")
        if self.source.num_shards > 1 and bool((shard_of(spec.name, ids, self.source.num_shards) != self.shard).any()):
            raise self.fail("holds an id that another shard holds (shard_of): rows of another shard or table")


class LiveTables(TableSource):
    """The tables of live shards, read with ``ExportRows`` page by page (the clients stay open until :meth:`close`).

    Opening asks every shard for one row of each table: its spec, its trained rows and the shard's sparse
    round. A page then holds at most half ``max_message_bytes`` (a shard that answers RESOURCE_EXHAUSTED,
    its own limit being lower, is asked again for half as many rows).

    Args:
        clients: a ``ShardClient`` per shard, in shard order (owned from now on: :meth:`close` closes them).
        names: the tables to export (each must be declared on every shard).
        versions: each shard's dense version when its parameters were read (:meth:`finish` checks it again).
        max_message_bytes: the gRPC message limit the shards and these clients share.
        before_call: run on a client before each call (the CLI bounds its deadline there).
        allow_mixed_versions: take shards at different sparse rounds instead of refusing.

    Raises:
        ShardRpcError: a shard does not hold a table (FAILED_PRECONDITION) or did not answer.
        TableError: a shard answered outside the protocol (a bad spec, another table's), or the shards hold
            a table with different specs or are at different sparse rounds.
    """

    def __init__(self, clients: list, names: Sequence[str], *, versions: list[int] | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, before_call: Callable | None = None,
                 allow_mixed_versions: bool = False) -> None:
        super().__init__(len(clients))
        self.clients, self.versions, self.before_call = clients, versions, before_call
        self.page_bytes = max(1, max_message_bytes // 2)
        self._first: dict[str, bytes] = {}
        rounds: list[set[int]] = [set() for _ in clients]
        for name in names:
            specs, counts = [], []
            for s, client in enumerate(clients):
                reply = self._call(client, name, 0, 1)
                try:
                    spec = TableSpec.from_proto(reply.spec)
                except ValueError as exc:
                    raise TableError(f"table {name!r}: {self.where(s)} answered outside the protocol: {exc}") from None
                if spec.name != name:
                    raise TableError(f"table {name!r}: {self.where(s)} answered with table {spec.name!r}")
                if specs and spec != specs[0]:
                    raise TableError(f"table {name!r}: shards 0 and {s} hold it with different specs: "
                                     f"{'; '.join(specs[0].differences(spec))}")
                specs.append(spec)
                counts.append(int(reply.total_rows))
                rounds[s].add(int(reply.round))
                self._first[name] = reply.spec.SerializeToString(deterministic=True)
            self.specs[name], self.counts[name] = specs[0], counts
        if any(len(r) > 1 for r in rounds):
            raise TableError(f"the shards applied sparse rounds while the tables were opened ({rounds}): export "
                             "between steps, with the workers idle")
        self.rounds = [min(r) if r else 0 for r in rounds]
        if len(set(self.rounds)) > 1 and not allow_mixed_versions:
            raise TableError(f"the shards' tables are at sparse rounds {self.rounds}: exporting them together would "
                             "mix rounds (export between steps, or pass --allow-mixed-versions / allow_mixed_versions)")

    def where(self, shard: int) -> str:
        return f"shard {shard} ({self.clients[shard].address})"

    def _call(self, client, name: str, offset: int, max_rows: int) -> pb.ExportRowsReply:
        if self.before_call is not None:
            self.before_call(client)
        return client.export_rows(name, offset=offset, max_rows=max_rows)

    def streams(self, name: str) -> list[Iterator[Page]]:
        return [self._stream(s, name) for s in range(self.num_shards)]

    def _stream(self, s: int, name: str) -> Iterator[Page]:
        spec, total, client = self.specs[name], self.counts[name][s], self.clients[s]
        per_page, offset = page_rows(spec, self.num_shards, self.page_bytes), 0
        while offset < total:
            try:
                reply = self._call(client, name, offset, per_page)
            except Exception as exc:
                if getattr(exc, "code", None) != grpc.StatusCode.RESOURCE_EXHAUSTED or per_page == 1:
                    raise
                per_page //= 2  # the shard's message limit is below ours: smaller pages
                continue
            if reply.spec.SerializeToString(deterministic=True) != self._first[name] or \
                    reply.round != self.rounds[s] or reply.total_rows != total:
                raise TableError(
                    f"table {name!r}: {self.where(s)} changed during the export (sparse round {self.rounds[s]} -> "
                    f"{reply.round}, rows {total} -> {reply.total_rows}): export between steps, with the workers "
                    "idle, and try again")
            n, size = divmod(len(reply.ids), 8)
            if size or not 0 < n <= per_page or len(reply.weights) != spec.row_dtype.itemsize * n * spec.embedding_dim:
                raise TableError(f"table {name!r}: {self.where(s)} answered outside the protocol: a page of "
                                 f"{len(reply.ids)} id bytes and {len(reply.weights)} row bytes for rows "
                                 f"[{offset}, {offset + per_page}) of {total}")
            ids = ids_from(reply.ids)
            weights = reply.weights  # one copy out of the message; the tensor reads it in place (never written)
            del reply
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "The given buffer is not writable")
                rows = torch.frombuffer(weights, dtype=spec.row_dtype).view(n, spec.embedding_dim)
            if rows.dtype != torch.float32:
                rows = rows.float()  # a float16 table's rows, widened exactly: pages are float32
            del weights
            offset += n
            yield ids, rows

    def finish(self) -> None:
        """Raises TableError: a shard applied a dense round since its parameters were read."""
        if self.versions is None:
            return
        for s, client in enumerate(self.clients):
            if self.before_call is not None:
                self.before_call(client)
            now = client.stats().version
            if now != self.versions[s]:
                raise TableError(f"{self.where(s)} went from version {self.versions[s]} to {now} during the export: "
                                 "export between steps, with the workers idle, and try again")

    def close(self) -> None:
        for client in self.clients:
            client.close()


class CheckpointTables(TableSource):
    """The tables of the shards' checkpoints (the files stay open until :meth:`close`).

    Each checkpoint's manifest holds, under ``sparse``, the sparse round and every table's spec (hex
    ``TableSpec`` protobuf); its tensor file holds ``rows/<table>/ids`` (int64 ``[n]``, ascending) and
    ``rows/<table>/weights`` (float32 ``[n, dim]``), read a page at a time.

    Args:
        checkpoints: one open checkpoint per shard, in shard order (owned from now on).
        names: the tables to export (None: every table of the checkpoints).
        allow_mixed_versions: take checkpoints at different sparse rounds.

    Raises:
        TableError: the shards' checkpoints hold different tables or specs, a table is not in them, or its
            tensors are missing or of the wrong dtype or shape (the checkpoint is damaged: its file named).
    """

    def __init__(self, checkpoints: list[OpenCheckpoint], names: Sequence[str] | None = None, *,
                 allow_mixed_versions: bool = False) -> None:
        super().__init__(len(checkpoints))
        self.checkpoints = checkpoints
        held: list[dict[str, TableSpec]] = []
        for s, ck in enumerate(checkpoints):
            tables = (ck.sparse or {}).get("tables") or {}
            specs = {}
            for name, entry in tables.items():
                try:
                    specs[name] = TableSpec.from_proto(pb.TableSpec.FromString(bytes.fromhex(entry["spec"])))
                except Exception as exc:  # bad hex, protobuf or field: the manifest is damaged
                    raise TableError(f"{ck.path}: table {name!r} has a malformed spec ({type(exc).__name__}: "
                                     f"{exc})") from None
                if specs[name].name != name:
                    raise TableError(f"{ck.path}: table {name!r} holds the spec of table {specs[name].name!r}")
            held.append(specs)
        for s, specs in enumerate(held[1:], 1):
            if set(specs) != set(held[0]):
                raise TableError(f"the checkpoints of shards 0 and {s} hold different tables: "
                                 f"{sorted(set(specs) ^ set(held[0]))} in only one of them")
        for name in (sorted(held[0]) if names is None else names):
            if name not in held[0]:
                raise TableError(f"table {name!r} is not in the checkpoints (they hold {sorted(held[0])})")
            for s, specs in enumerate(held[1:], 1):
                if specs[name] != held[0][name]:
                    raise TableError(f"table {name!r}: the checkpoints of shards 0 and {s} hold different specs: "
                                     f"{'; '.join(held[0][name].differences(specs[name]))}")
            self.specs[name] = held[0][name]
            self.counts[name] = [self._entries(s, name) for s in range(len(checkpoints))]
        self.rounds = [int((ck.sparse or {}).get("round", 0)) for ck in checkpoints]
        if self.specs and len(set(self.rounds)) > 1 and not allow_mixed_versions:
            raise TableError(f"the checkpoints' tables are at sparse rounds {self.rounds}: pass version=V "
                             "(--version V) for one version of every shard, or allow_mixed_versions")

    def where(self, shard: int) -> str:
        return f"shard {shard}'s checkpoint {self.checkpoints[shard].file}"

    def _entries(self, s: int, name: str) -> int:
        """Rows of ``name`` in shard ``s``'s checkpoint, its two tensors checked."""
        ck, dim = self.checkpoints[s], self.specs[name].embedding_dim
        want = "F16" if self.specs[name].dtype == "float16" else "F32"
        ids, weights = ck.entries.get(f"rows/{name}/ids"), ck.entries.get(f"rows/{name}/weights")
        if ids is None or weights is None:
            raise TableError(f"{ck.file}: table {name!r} is in its manifest but its rows/{name}/ids or "
                             f"rows/{name}/weights tensor is missing: the checkpoint is damaged")
        if ids.dtype != "I64" or len(ids.shape) != 1 or weights.dtype != want or \
                weights.shape != (ids.shape[0], dim):
            raise TableError(f"{ck.file}: table {name!r}: rows/{name}/ids is {ids.dtype} {list(ids.shape)} and "
                             f"rows/{name}/weights {weights.dtype} {list(weights.shape)}, not I64 [n] and {want} "
                             f"[n, {dim}]: the checkpoint is damaged")
        return ids.shape[0]

    def streams(self, name: str) -> list[Iterator[Page]]:
        return [self._stream(s, name) for s in range(self.num_shards)]

    def _stream(self, s: int, name: str) -> Iterator[Page]:
        ck, total = self.checkpoints[s], self.counts[name][s]
        per_page = page_rows(self.specs[name], self.num_shards, CHECKPOINT_PAGE_BYTES)
        for start in range(0, total, per_page):
            count = min(per_page, total - start)
            yield ck.rows(f"rows/{name}/ids", start, count), \
                ck.rows(f"rows/{name}/weights", start, count).float()  # a float16 table's widened exactly

    def close(self) -> None:
        for ck in self.checkpoints:
            ck.close()

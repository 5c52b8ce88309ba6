"""The sparse tables of one shard: declaring them, sync rounds of row gradients, pulls, export, checkpoints.

Sparse rounds are the shard's own, beside the dense ones, and follow the
same rule as sync dense rounds: a round is applied once every member of
the job has pushed its rows for it (the first round also waits for
``--min-workers`` members; a member must declare the tables before it
pushes), each
unique id's gradient being the sum of the members' gradients divided by
the number of members that pushed (the average over workers, as for
dense parameters). A member pushes once per step, on every shard, even
with no rows there, so every shard's round has every member. Pushes are
numbered by the worker; a retry with the number already taken is
acknowledged and not counted again. A member that leaves, or whose lease
runs out, stops being waited for; a member that joins is waited for from
its first push on (after its Declare). A pull with ``after_push`` waits
until the caller's last push is applied, so a worker's next forward reads
the rows its last step updated. A round is refused (a memory limit, members
pushing a table with different learning rates, an optimizer step that raises
or whose result would not be finite) before anything of it is written: rows,
optimizer state, step counts, admission counts, slots and the index stay
exactly as they were (``rounds``, ``fused.prepare_round``), and the next pull
or push of each of its members fails with the reason (once).

With **async rows** (the members declare ``rows_mode="async"``: hybrid
training, dense rounds sync) a round is one push, the oldest staged,
applied as soon as it is staged without waiting for the other members,
its gradient whole (Persia's hybrid training; Lian et al. 2021).

Every method runs on the shard's event loop; reads and updates of rows run
on the store's compute thread, one at a time (``store.run``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import torch

from shardps.proto import shardps_pb2 as pb
from shardps.common.rows import TableSpec, state_widths
from shardps.server.checks import shown
from shardps.server.compute import AHEAD, IDLE, SPARSE
from shardps.server.errors import (
    DeadlineExceeded, FailedPrecondition, InvalidArgument, ResourceExhausted, ShardError,
)
from shardps.server.membership.admission import resident_bytes
from shardps.server.sparse import deltas, fused, replies, rounds
from shardps.server.sparse.index import IdIndex
from shardps.server.sparse.requests import PushParts, checked_ids, staged_rows
from shardps.server.sparse.slab import RowSlab
from shardps.server.sparse.table import COUNTERS, RowTable
from shardps.server.stream_positions import span_of

log = logging.getLogger(__name__)

#: Tables one job may declare (metric labels stay bounded).
MAX_TABLES = 64


@dataclass(eq=False)
class _Push:
    number: int
    tables: dict[str, tuple[torch.Tensor, torch.Tensor, float]]  # table -> (ids, grads, lr)
    worker: str = ""
    event_time: float = 0.0  # the push's events' time, seconds (0: none)
    span: pb.StreamSpan | None = None  # the stream batch it trains (stream_positions.py)


class SparseTables:
    """Sparse tables of one shard (see the module docstring).

    Args:
        store: the shard's store (public names: config, members, notifier, run, check_open).
    """

    def __init__(self, store) -> None:
        self.store = store
        self.index = IdIndex()  # every table's ids, under the table's tag (its position in self.tables)
        self.tables: dict[str, RowTable] = {}
        self.slabs: dict[tuple, RowSlab] = {}  # row storage per row shape, shared by the tables of that shape
        self.round = 0  # sparse rounds applied
        self.members: dict[str, int] = {}  # table member -> its last push number taken (-1: none yet)
        self.rows_mode: str | None = None  # "sync" or "async" rounds, fixed by the members' declares
        self.staged: dict[str, _Push] = {}
        self.parts = PushParts()  # pushes that come in several messages, until their last part
        self.failed: dict[str, ShardError] = {}
        self.applying = False
        self.rounds_seconds = 0.0
        # the slots and rows each (worker, table) pull found since the last update (compute thread only): a
        # round whose push carries exactly those ids takes them instead of looking the ids up again
        self._pulled: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._applied = 0  # rounds whose update completed (compute thread)
        self._made: tuple | None = None  # (_applied after it, ids, tags, slots, evicted) of the last round
        self._flushing = False  # an index flush is queued (see _flush)
        self._grew: dict = {}  # {RowSlab: rows the last round added to it} (compute thread)
        self.replies = replies.ReplyBudget(store.config)  # memory the pull and export replies in flight hold
        self._round_base: int | None = None  # round - _applied, seen between rounds (see _round_now)

    def _new_table(self, spec: TableSpec, max_bytes: int) -> RowTable:
        widths = state_widths(spec.optimizer, spec.embedding_dim)
        key = (spec.embedding_dim, tuple(widths.items()), spec.row_dtype, spec.ttl_seconds > 0)
        slab = self.slabs.setdefault(key, RowSlab(spec.embedding_dim, widths, spec.row_dtype, spec.ttl_seconds > 0))
        return RowTable(spec, max_bytes, self.index, len(self.tables), slab)

    # ------------------------------------------------------------ declare
    def declare(self, request: pb.DeclareTablesRequest) -> pb.DeclareTablesReply:
        """Create the tables not held yet and make the caller a table member; all or nothing.

        Raises:
            FailedPrecondition: not a member of the job; a table held with another spec (the message
                names each differing field).
            InvalidArgument: a malformed spec, a name declared twice, too many tables.
        """
        self.store.check_open()
        self.store.members.get(request.worker_id, request.session)
        mode = request.rows_mode or "sync"
        if mode not in ("sync", "async"):
            raise InvalidArgument(f"rows_mode must be 'sync' or 'async', got {shown(mode)}")
        if self.rows_mode is not None and mode != self.rows_mode and self.members.keys() - {request.worker_id}:
            raise FailedPrecondition(f"the job's tables run {self.rows_mode} sparse rounds and this worker declared "
                                     f"{mode} ones: every worker must use the same ConsistencyOptions(tables=)")
        specs: dict[str, TableSpec] = {}
        for m in request.tables:
            try:
                spec = TableSpec.from_proto(m)
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from None
            if spec.name in specs:
                raise InvalidArgument(f"table {spec.name!r} is declared twice")
            held = self.tables.get(spec.name)
            if held is not None and held.spec != spec:
                raise FailedPrecondition(
                    f"table {spec.name!r} is held by this shard with another spec ("
                    f"{'; '.join(held.spec.differences(spec))}; held vs declared): every worker must declare the "
                    "same tables (name, embedding_dim, num_embeddings, optimizer and its settings, seed)")
            specs[spec.name] = spec
        if len(set(self.tables) | set(specs)) > MAX_TABLES:
            raise InvalidArgument(f"a job holds at most {MAX_TABLES} sparse tables")
        default = self.store.config.table_max_bytes
        for name, spec in specs.items():
            if name not in self.tables:
                self.tables[name] = self._new_table(spec, spec.max_bytes or default)
                log.info("shard %d: sparse table %s (dim %d, %s) declared", self.store.config.shard_index,
                         shown(name), spec.embedding_dim, spec.optimizer)
        self.members.setdefault(request.worker_id, -1)
        self.rows_mode = mode
        return pb.DeclareTablesReply(round=self.round)

    def _member(self, worker_id: str, session: str) -> None:
        self.store.members.get(worker_id, session)
        if worker_id not in self.members:
            raise FailedPrecondition(f"worker {shown(worker_id)} has not declared this shard's sparse tables "
                                     "(DeclareTables) since it joined: declare them again")

    def _table(self, name: str) -> RowTable:
        table = self.tables.get(name)
        if table is None:
            raise FailedPrecondition(f"sparse table {shown(name)} is not declared on this shard")
        return table

    # ------------------------------------------------------------ push
    async def push(self, request: pb.PushRowsRequest, timeout: float | None = None) -> pb.PushRowsReply:
        """Stage one member's rows for the round being collected; apply it once every member pushed.

        A push that comes while the member's previous one is still staged waits until that round is applied.
        A push in several messages (``parts``) is held part by part and staged with its last part
        (``requests.PushParts``).

        Raises:
            FailedPrecondition: not a table member.
            DeadlineExceeded: the previous push's round was not applied in time.
            ShardError: the round of the member's previous push was refused (its reason, once).
            InvalidArgument: an unknown table, ids of another shard or out of range, repeated ids, a
                gradient of the wrong size or not finite, a bad learning rate, parts that do not add up.
                Nothing is staged.
        """
        self.store.check_open()
        self._member(request.worker_id, request.session)
        last = self.members[request.worker_id]
        if request.push == last:
            return pb.PushRowsReply(round=self.round)  # a retry of a push already taken
        request = self.parts.add(request)  # a push in several messages: staged once its last part is in
        if request is None:
            return pb.PushRowsReply(round=self.round)
        if request.worker_id in self.staged:  # its last push's round is still collected or applied: wait
            w = request.worker_id
            limit = self.store.config.max_wait_seconds if timeout is None else min(
                timeout, self.store.config.max_wait_seconds)
            if not await self.store.notifier.wait_for(
                    lambda: w not in self.staged or w not in self.members or self.store.closing, limit):
                raise DeadlineExceeded(f"the previous push of worker {shown(w)} was not applied within "
                                       f"{limit:.0f}s: sparse round {self.round} waits for "
                                       f"{', '.join(shown(m) for m in self.waiting_for()[:8])}")
            self.store.check_open()
            self._member(request.worker_id, request.session)
            if request.push == self.members[w]:
                return pb.PushRowsReply(round=self.round)
        if request.worker_id in self.failed:  # its last round was refused: say so before taking another push
            raise self.failed.pop(request.worker_id)
        named = [self._table(part.table) for part in request.tables]
        if len({t.spec.name for t in named}) != len(named):
            raise InvalidArgument("a table appears twice in one push: send each table's rows once")
        checked = checked_ids([(t, part.ids) for t, part in zip(named, request.tables)], "the push", self.store.config)
        tables = staged_rows(request, named, checked)
        self.members[request.worker_id] = request.push
        self.staged[request.worker_id] = _Push(request.push, tables, request.worker_id, request.event_time,
                                               span_of(request))
        self.maybe_apply()
        return pb.PushRowsReply(round=self.round)

    def drop(self, worker_id: str) -> None:
        """``worker_id`` is no longer a member: its staged push is dropped and rounds stop waiting for it."""
        self.members.pop(worker_id, None)
        self.staged.pop(worker_id, None)
        self.failed.pop(worker_id, None)
        self.parts.drop(worker_id)
        self.maybe_apply()

    def waiting_for(self) -> list[str]:
        """The job's members whose push the round being collected still needs (declared or not yet)."""
        return [w for w in self.store.members.ids() if w not in self.staged]

    def maybe_apply(self) -> None:
        """Start applying the round once every member of the job pushed (the first round also waits for
        ``min_workers`` members, as dense rounds do); with async rows, once any member pushed."""
        if self.applying or not self.staged or (self.rows_mode != "async" and self.waiting_for()):
            return
        if self.round == 0 and len(self.store.members) < self.store.config.min_workers:
            return
        self.applying = True
        asyncio.get_running_loop().create_task(self._apply())

    async def _apply(self) -> None:
        # async rows: the oldest staged push alone, its gradient whole (the average of one push)
        workers = [next(iter(self.staged))] if self.rows_mode == "async" else sorted(self.staged)
        pushes = [self.staged[w] for w in workers]
        number, spans, positions = self.round, [p.span for p in pushes], self.store.rounds.positions
        due = False
        try:  # a stream batch these rows hold already, or that leaves a gap, is skipped (stream_positions.py)
            due = positions.verdict("rows", spans, f"sparse round {number}", self.store.config.shard_index)
            if due:
                await self.store.run(self._update, pushes, number, priority=SPARSE)
        except ShardError as exc:  # nothing of the round was applied (limits, lrs, a step that failed or overflowed)
            log.warning("shard %d: sparse round %d refused: %s", self.store.config.shard_index, number, exc)
            for w in workers:
                self.failed[w] = type(exc)(f"sparse round {number} was refused: {exc}")
        except Exception as exc:  # any other fault of the shard (a bug): said to every member, never dropped
            log.exception("shard %d: applying sparse round %d failed", self.store.config.shard_index, number)
            for w in workers:
                self.failed[w] = ShardError(f"sparse round {number} failed on shard {self.store.config.shard_index} "
                                            f"({type(exc).__name__}: {exc}); see its log")
        else:
            if due:
                positions.advance("rows", spans)
            self.round += 1
        finally:
            for w, p in zip(workers, pushes):
                if self.staged.get(w) is p:
                    del self.staged[w]
            self.applying = False
            self.store.notifier.notify_all()
            self.maybe_apply()

    def find(self, parts: list[tuple[RowTable, torch.Tensor]]) -> list[torch.Tensor]:
        """The slots of several tables' ids in one index lookup: ``parts`` ``[(table, int64 ids [n])]``, out
        int64 ``[n]`` per part (-1: not a row)."""
        if not parts:
            return []
        ids = torch.cat([i for _, i in parts])
        tags = torch.cat([torch.full((i.numel(),), t.tag, dtype=torch.int64) for t, i in parts])
        return list(self.index.find(ids, tags).split([i.numel() for _, i in parts]))

    def _update(self, pushes: list[_Push], number: int) -> None:
        """Average and apply one round (compute thread), all or nothing: the members' lrs must agree, every
        table's room and the shard's memory budget for the new rows are checked, and the update is computed
        and proved finite (``fused.prepare_round``) before anything changes.

        Raises:
            ShardError: the round is refused, nothing changed (``rounds``, ``fused.prepare_round``).
        """
        started = time.perf_counter()
        merged = rounds.merged_round(self.tables, pushes)
        try:
            found, initial = self._slots_of(merged, pushes)
        finally:
            self._pulled = {}  # a round may change slots: what the pulls found is stale after it
        new = fused.new_counts(found)
        for (table, *_), count in zip(merged, new):
            table.check_room(count)
        growth = sum(count * table.row_cost() for (table, *_), count in zip(merged, new))
        budget = self.store.config.memory_budget_bytes
        if growth and resident_bytes() + growth > budget:
            raise ResourceExhausted(
                f"the round's new rows need about {growth} bytes more and the shard holds {resident_bytes()} bytes "
                f"of its memory budget of {budget} bytes (--memory-budget-bytes): add shards, or set capacity/"
                "ttl_rounds on the tables so rows are evicted")
        ids, slots, tags = fused.commit_round(fused.prepare_round(merged, found, initial), number,
                                              max(p.event_time for p in pushes))
        self._grew = {}
        for (table, *_), count in zip(merged, new):
            self._grew[table.slab] = self._grew.get(table.slab, 0) + count
        self.index.insert_later(ids, slots, tags)  # a prefetch waiting for this round finds them in _made
        made = (ids, tags, slots)
        evicting = [t for t in self.tables.values() if t.evicts()]
        held = sum(t.rows for t in evicting)
        if evicting:  # every round, pushed or not; one pass over the index for all of them
            ids, slots, tags = self.index.items()
            for table in evicting:
                mine = tags == table.tag
                table.evict(number, (ids[mine], slots[mine]))
        self._applied += 1
        self._made = (self._applied, *made, sum(t.rows for t in evicting) < held)
        self.rounds_seconds += time.perf_counter() - started

    # ------------------------------------------------------------ pull
    async def pull(self, request: pb.PullRowsRequest, timeout: float | None, sent=None) -> bytes:
        """The rows of ``request.ids`` (one table) or of each of ``request.tables`` (several, looked up at once);
        with ``after_push``, once the caller's last push is applied: the ``PullRowsReply``'s bytes, sized first,
        held against the memory budget until ``sent`` calls back (``replies.Held.until``), written once.

        Raises:
            FailedPrecondition: not a table member; an unknown table.
            InvalidArgument: malformed ids, ids of another shard or out of range, a table named twice, both
                forms in one request.
            ResourceExhausted: the reply would pass --max-message-bytes or --memory-budget-bytes (nothing read).
            ShardError: the round of the caller's last push was refused (its reason).
            DeadlineExceeded: the round did not complete within the call's deadline.
        """
        self.store.check_open()
        self._member(request.worker_id, request.session)
        if request.tables and (request.table or request.ids):
            raise InvalidArgument("a pull names its table in table and ids, or several in tables, not both")
        wanted = [(p.table, p.ids) for p in request.tables] if request.tables else [(request.table, request.ids)]
        if len({name for name, _ in wanted}) != len(wanted):
            raise InvalidArgument("a pull names a table twice: send each table's unique ids once")
        named = [self._table(name) for name, _ in wanted]
        reply = replies.PullReply(named, [len(data) // 8 for _, data in wanted], bool(request.tables),
                                  self.store.config)  # refused here if too big: before the ids are even parsed
        parts = list(zip(named, checked_ids([(t, data) for t, (_, data) in zip(named, wanted)], "the pull",
                                             self.store.config)))
        if request.after_push_number and request.after_push:
            raise InvalidArgument("a pull waits for after_push or for after_push_number, not both")
        return await self.replies.serve(reply, "pull fewer ids at once", sent,
                                        lambda: self._pull(request, timeout, parts, reply))

    async def _pull(self, request: pb.PullRowsRequest, timeout: float | None, parts: list, reply) -> bytes:
        """:meth:`pull` once its reply is sized and held: wait as asked, read the rows into the reply."""
        w, number, early = request.worker_id, request.after_push_number, None
        if number and not (self.members[w] >= number and w not in self.staged):
            early = await self.store.run(self._look_ahead, parts, reply, priority=AHEAD)  # before push `number`
        if request.after_push or number:

            def ready() -> bool:
                if number:
                    return (self.members.get(w, -1) >= number and w not in self.staged) or w not in self.members \
                        or w in self.failed or self.store.closing
                return w not in self.staged or w not in self.members or self.store.closing

            limit = self.store.config.max_wait_seconds if timeout is None else min(timeout,
                                                                                   self.store.config.max_wait_seconds)
            if not await self.store.notifier.wait_for(ready, limit):
                waiting = sorted(self.waiting_for())
                raise DeadlineExceeded(f"sparse round {self.round} did not complete within {limit:.0f}s: it waits "
                                       f"for the pushes of {', '.join(shown(m) for m in waiting[:8])}")
            self.store.check_open()
            self._member(request.worker_id, request.session)
            if w in self.failed:
                raise self.failed.pop(w)
        self._note_round()
        await self.store.run(self._read, parts, request.worker_id, early, reply, priority=SPARSE)
        if number or request.after_push:  # the round's new keys enter the index now, not in the next lookup
            self._start_flush()
        return reply.take()

    def _note_round(self) -> None:
        """Between rounds (none applied or being counted), note ``round - _applied`` for :meth:`_round_now`."""
        if not self.applying:
            self._round_base = self.round - self._applied

    def _round_now(self) -> int:
        """The rounds applied as the compute thread sees them (before the loop counts them): a reply's round."""
        return self.round if self._round_base is None else self._round_base + self._applied

    def settled(self) -> bool:
        """No round being applied and no index flush queued or due: until the next round starts, the compute
        thread only reads the rows and the index, so the event loop may read them too (a checkpoint). Starts
        the flush when one is due."""
        self._start_flush()
        return not self.applying and not self._flushing

    def _start_flush(self) -> None:
        if self.index.pending and not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        """Insert the last round's new keys into the index while the workers compute their forward (queued
        after the reads the round woke, so it delays none of them; the next lookup would do it otherwise),
        and grow each row store that the next round's new rows (twice the last round's) would overflow."""

        def idle() -> None:
            self.index.flush()
            for slab, n in self._grew.items():
                slab.reserve(2 * n)

        index = self.index
        try:
            await self.store.run(idle, priority=IDLE)
        finally:
            if self.index is index:  # a reset meanwhile: its own flag (and any flush of its index) stands
                self._flushing = False
            self.store.notifier.notify_all()

    def _look_ahead(self, parts: list[tuple[RowTable, torch.Tensor]], reply: replies.PullReply | None = None) -> tuple:
        """A prefetch read before the round it waits for (into ``reply``'s bytes): ``(slots, rows, rounds applied so
        far, the round each row was last pushed)``; ids that are not rows read as their initial values already."""
        found, out = self.find(parts), None if reply is None else reply.out()
        return found, fused.read_rows(*zip(*parts), found, out), self._applied, fused.touched_of(parts, found)

    def _after_round(self, parts: list[tuple[RowTable, torch.Tensor]], early: tuple) -> list[torch.Tensor]:
        """The slots of a prefetch's ids now, from its read ``early`` before the round it waited for: as they
        were if no round ran since; if exactly one round ran and evicted nothing, those found keep their slots
        (a slot is freed only by eviction) and those not found are looked for among the round's new rows;
        otherwise looked up again."""
        found, _, applied, _ = early
        if applied == self._applied:
            return found
        if self._made is not None and self._made[0] == applied + 1 == self._applied and not self._made[4]:
            return fused.found_in(found, parts, *self._made[1:4], self.index)
        return self.find(parts)

    def _read(self, parts: list[tuple[RowTable, torch.Tensor]], worker: str, early: tuple | None = None,
              reply: replies.PullReply | None = None) -> list[torch.Tensor]:
        """A pull's rows (compute thread), kept for the round that pushes them: new tensors, or read into ``reply``
        (then views of its bytes, ``reply.take()``); ``early``: a prefetch's look-ahead, into ``reply`` too."""
        tables, ids = [t for t, _ in parts], [i for _, i in parts]
        for table in tables:  # the caller's last rows of these tables go before the new ones are made
            self._pulled.pop((worker, table.spec.name), None)
        out = None if reply is None else reply.out()
        if early is None:
            found = self.find(parts)
            rows = fused.read_rows(tables, ids, found, out)
        else:  # a prefetch: the rows of ids that are rows now are read again, the others kept
            found = self._after_round(parts, early)
            rows = early[1] if early[2] == self._applied else \
                fused.reread_rows(tables, ids, early[0], found, early[1], early[3])
            if out is not None and rows is not early[1]:
                rows = [into.copy_(now) for into, now in zip(out, rows)]
        if reply is not None:
            rows = reply.finish(self._round_now())
        for table, i, slots, r in zip(tables, ids, found, rows):
            self._pulled[worker, table.spec.name] = (i, slots, r)
        return rows

    def _slots_of(self, merged: list[tuple], pushes: list[_Push]) -> tuple[list[torch.Tensor], list]:
        """The slot of each id of each merged table of a round (compute thread), and the rows a pull read for
        exactly those ids (None where none did): from the pulls since the last round where every push of the
        table carries exactly the ids its worker pulled (no round ran since, so no slot changed), otherwise
        one index lookup for the rest."""
        known: dict[int, torch.Tensor] = {}
        initial: list[torch.Tensor | None] = [None] * len(merged)
        for k, (table, unique, *_) in enumerate(merged):
            name = table.spec.name
            mine = [p for p in pushes if name in p.tables]
            pulled = [self._pulled.get((p.worker, name)) for p in mine]
            if not all(got is not None and torch.equal(got[0], p.tables[name][0]) for got, p in zip(pulled, mine)):
                continue
            if len(mine) == 1:
                known[k], initial[k] = pulled[0][1], pulled[0][2]  # the round's ids are that push's, in its order
            else:
                ids = torch.cat([got[0] for got in pulled])
                slots = torch.empty(unique.numel(), dtype=torch.int64)
                slots[torch.searchsorted(unique, ids)] = torch.cat([got[1] for got in pulled])
                known[k] = slots
        rest = [k for k in range(len(merged)) if k not in known]
        for k, slots in zip(rest, self.find([(merged[k][0], merged[k][1]) for k in rest])):
            known[k] = slots
        return [known[k] for k in range(len(merged))], initial

    async def _settled(self) -> None:
        """Wait (up to ``max_wait_seconds``) while a round is applied: reads between rounds see whole rounds."""
        await self.store.notifier.wait_for(lambda: not self.applying or self.store.closing,
                                           self.store.config.max_wait_seconds)

    # ------------------------------------------------------------ export, checkpoints, metrics
    async def export(self, request: pb.ExportRowsRequest, sent=None) -> bytes:
        """The rows of ``request.table`` on this shard in id order (a page: ``offset``, ``max_rows``), with their
        optimizer state if asked: the ``ExportRowsReply``'s bytes, sized, held and written as :meth:`pull`'s.

        Raises:
            FailedPrecondition: an unknown table.
            ResourceExhausted: the page would pass --max-message-bytes (the message names the max_rows that
                fits) or --memory-budget-bytes; nothing read.
        """
        table = self._table(request.table)
        await self._settled()
        extra = deltas.shard_fields(self.store)  # read before the rows; sized on the compute thread (the index)
        reply = await self.store.run(replies.ExportReply.page, table, request.offset, request.max_rows,
                                     request.state, self.store.config, request.since_round, extra, priority=SPARSE)
        self._note_round()
        return await self.replies.serve(reply, "ask for fewer rows a page (max_rows)", sent,
                                        lambda: self.store.run(reply.read, self._round_now, priority=SPARSE))

    def snapshot(self) -> tuple[list[tuple[str, str, tuple[int, ...]]], dict, object]:
        """The tables as they are now (event loop, once :meth:`settled`): ``(layout, entry, write)``: each tensor's
        ``(rows/<table>/<name>, safetensors dtype, shape)``, the manifest's ``{"round", "tables"}``, and
        ``write(put, block_bytes)``, which hands each tensor to ``put(name, tensor)``, the rows a block at a time
        (``RowTable.write_snapshot``); run it on the compute thread, queued before any round can be."""
        tables = list(self.tables.items())
        layout = [(f"rows/{name}/{k}", dtype, shape) for name, t in tables for k, dtype, shape in t.snapshot_layout()]
        entry = {"round": self.round, "tables": {name: {"spec": t.spec.to_proto().SerializeToString().hex(),
                                                        **t.snapshot_numbers()} for name, t in tables}}

        def write(put, block_bytes: int) -> None:
            for name, table in tables:
                table.write_snapshot(lambda k, data, prefix=f"rows/{name}/": put(prefix + k, data), block_bytes)

        return layout, entry, write

    def restore(self, tensors: dict[str, torch.Tensor], entry: dict) -> None:
        """Load a checkpoint's tables (at shard start): its ``rows/<table>/<name>`` tensors, :meth:`snapshot`'s entry.

        Raises:
            ValueError: a table's spec or tensors are malformed.
        """
        self.round = int(entry.get("round", 0))
        for name, numbers in entry.get("tables", {}).items():
            spec = TableSpec.from_proto(pb.TableSpec.FromString(bytes.fromhex(numbers["spec"])))
            table = self._new_table(spec, spec.max_bytes or self.store.config.table_max_bytes)
            prefix = f"rows/{name}/"
            table.restore({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}, numbers)
            table.evictions.forgotten_before = self.round  # what it evicted before its checkpoint is not known
            self.tables[name] = table

    def metric_values(self) -> dict[str, dict[str, float]]:
        """Per table: rows, bytes, bytes per row and the counters of ``table.COUNTERS``."""
        out = {}
        for name, t in self.tables.items():
            out[name] = {"rows": t.rows, "bytes": t.nbytes(), **t.counts}
        return out

    def reset(self) -> None:
        """The job is dropped: so are its tables."""
        self.__init__(self.store)


__all__ = ["SparseTables", "MAX_TABLES", "COUNTERS"]

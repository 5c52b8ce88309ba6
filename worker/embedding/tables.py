"""The worker's side of sparse tables: declaring them, pulling rows, pushing one step's row gradients.

``DistributedOptimizer(..., sparse_optimizer=opt)`` builds one
:class:`SparseTables` over the sharded modules whose ``handle`` is in
``opt``. ``opt``'s class is the tables' optimizer (``torch.optim.SGD``,
``torch.optim.Adagrad``, ``torch.optim.SparseAdam`` or
:class:`RowWiseAdagrad`); each param group's ``lr`` is read at every
``step()`` and sent with the push, its other hyperparameters are fixed
when the tables are declared (changing one raises at ``step()``). The
shards run the update (``shardps.server.sparse``); ``opt.step()`` itself
is never called.

Every ``step()`` pushes to every shard, with an entry for each table that
had a lookup under autograd in the step (rows summed over the step's
lookups), so each shard's sparse round has every worker and each table's
optimizer step count matches torch's. What the optimizer declares is
``shardps.worker.embedding.specs``.
"""

from __future__ import annotations

import logging

import grpc
import torch

from shardps.proto import shardps_pb2 as pb
from shardps.common.codec import finite
from shardps.common.rows import check_lr, ids_bytes, rows_bytes, rows_from, shard_of
from shardps.worker.embedding.export import TableExport, export_table
from shardps.worker.embedding.modules import unique_ids
from shardps.worker.embedding.specs import group_spec, table_specs
from shardps.worker.session.client import ShardClient, ShardRpcError

log = logging.getLogger(__name__)

__all__ = ["Prefetch", "SparseTables"]


def _by_shard(name: str, ids: torch.Tensor, num_shards: int) -> list[torch.Tensor]:
    """Positions in ``ids`` (int64 ``[n]``) of the ids each shard holds (``shard_of``), in order: int64 per shard."""
    if num_shards == 1:
        return [torch.arange(ids.numel())]
    where = shard_of(name, ids, num_shards)
    return [(where == s).nonzero().reshape(-1) for s in range(num_shards)]


#: The most parts one push to one shard may come in (the shards' ``MAX_PUSH_PARTS``).
MAX_PUSH_PARTS = 2048


def push_parts(worker_id: str, session: str, number: int, entries: list[tuple], max_message_bytes: int,
               event_time: float = 0.0, span: pb.StreamSpan | None = None) -> list[pb.PushRowsRequest]:
    """Push ``number`` of ``entries`` (``[(table, ids int64 [n], gradients float32 [n, dim], lr)]``, ids
    increasing) to one shard: one request, or where its rows pass half of ``max_message_bytes``, parts of at
    most that much (``parts``/``part``; a table's rows split between parts in id order), as pulls are split.

    Raises:
        ValueError: one row of a table would not fit half the message limit, or more than
            :data:`MAX_PUSH_PARTS` parts would be needed.
    """
    budget = max_message_bytes // 2
    parts = [pb.PushRowsRequest(worker_id=worker_id, session=session, push=number, event_time=event_time,
                                span=span)]
    room = budget
    for name, ids, grads, lr in entries:
        per_row, head = 8 + 4 * grads.shape[1], len(name.encode()) + 64
        if per_row + head > budget:
            raise ValueError(f"one row of table {name!r} takes {per_row} bytes, over half the message limit of "
                             f"{max_message_bytes} bytes: raise WireOptions(max_message_bytes=) and the shards' "
                             "--max-message-bytes; nothing was pushed")
        start, n = 0, ids.numel()
        while True:
            fit = (room - head) // per_row
            if fit <= 0 and start < n:
                parts.append(pb.PushRowsRequest(worker_id=worker_id, session=session, push=number,
                                                event_time=event_time, span=span))
                room = budget
                continue
            end = min(n, start + max(fit, 0))
            parts[-1].tables.add(table=name, ids=ids_bytes(ids[start:end]), grads=rows_bytes(grads[start:end]), lr=lr)
            room -= (end - start) * per_row + head
            start = end
            if start >= n:
                break
    if len(parts) > MAX_PUSH_PARTS:
        raise ValueError(f"this step's rows for one shard need {len(parts)} messages, over {MAX_PUSH_PARTS}: use "
                         "smaller batches or more shards; nothing was pushed")
    if len(parts) > 1:
        for k, part in enumerate(parts):
            part.part, part.parts = k, len(parts)
    return parts


#: Codes of a failed prefetch after which the rows are pulled again (the pull rejoins or retries).
_PULL_AGAIN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.FAILED_PRECONDITION,
               grpc.StatusCode.DEADLINE_EXCEEDED)


class Prefetch:
    """A :meth:`SparseTables.prefetch` in flight: ``parts`` as asked, ``number`` the push it waits for,
    ``calls`` ``[(shard, pieces, grpc future)]``."""

    def __init__(self, parts: list[tuple[str, torch.Tensor]], number: int, calls: list) -> None:
        self.parts, self.number, self.calls = parts, number, calls

    def cancel(self) -> None:
        """End the calls still in flight (the shards stop waiting for them)."""
        for _, _, call in self.calls:
            call.cancel()

    def drop(self, tables: "SparseTables") -> None:
        """Cancel it unused, counted in ``tables.prefetches["dropped"]``."""
        self.cancel()
        tables.prefetches["dropped"] += 1


class SparseTables:
    """One worker's sparse tables over ``clients`` (see the module docstring).

    Args:
        clients: one connection per shard, in shard order (the DistributedOptimizer's).
        worker_id, session: this worker's membership (it has joined every shard).
        optimizer: the sparse optimizer; model: names tables without one (may be None).
        rejoin: joins shard ``i`` again (the DistributedOptimizer's recovery) when it forgot this worker.
        max_message_bytes: the gRPC message limit: pulls are split to stay under half of it.

    Raises:
        ValueError: see :func:`table_specs`.
        ShardRpcError: a shard refused the declaration (another spec under the same name, say).
    """

    def __init__(self, clients: list[ShardClient], worker_id: str, session: str, optimizer: torch.optim.Optimizer,
                 model: torch.nn.Module | None, rejoin, max_message_bytes: int, rows_mode: str = "sync") -> None:
        self._clients, self.worker_id, self.session, self._rejoin = clients, worker_id, session, rejoin
        self.rows_mode = rows_mode  # the job's sparse rounds: sync or async (ConsistencyOptions.tables)
        self.event_time = 0.0  # the time of the step's events, seconds, sent with its push (0: none)
        self.span: pb.StreamSpan | None = None  # the stream batch of the step's events, sent with its push
        self._max_message_bytes = max_message_bytes
        self._optimizer = optimizer
        self.tables = table_specs(optimizer, model)
        self._pool = ShardClient.call_pool(len(clients), "shardps-rows")  # daemon threads: never hold the exit
        self._push = 0  # pushes prepared (numbered)
        self._sent = 0  # the last push every shard took
        self._sending: tuple[list, list] | None = None  # the push in flight: (its requests, one future per shard)
        self._sizes: list[int] = []  # bytes of each request of the last prepare()
        self.pushed_bytes = self.pulled_bytes = 0
        #: prefetches whose rows a forward used, that were dropped unused, that could not answer (pulled again)
        self.prefetches = {"used": 0, "dropped": 0, "pulled_again": 0}
        #: prefetches of the tables' own lookups (:meth:`prefetch_tables`): [Prefetch, rows or None], in order
        self._ahead: list[list] = []
        self._declare(range(len(clients)))
        for module, _, _ in self.tables.values():
            module.attach(self)

    def _declare(self, shards) -> None:
        request = pb.DeclareTablesRequest(worker_id=self.worker_id, session=self.session, rows_mode=self.rows_mode,
                                          tables=[spec.to_proto() for _, spec, _ in self.tables.values()])
        shards = list(shards)
        if len(shards) == 1:  # on the caller's thread: it may be a thread of the pool itself (a pull's _call)
            self._clients[shards[0]].declare_tables(request)
        else:
            list(self._pool.map(lambda s: self._clients[s].declare_tables(request), shards))

    def _call(self, shard: int, fn):
        """``fn(client)``; joins and declares again once if the shard forgot this worker (it restarted)."""
        try:
            return fn(self._clients[shard])
        except ShardRpcError as exc:
            if not self._recover(shard, exc):
                raise
            return fn(self._clients[shard])

    def _recover(self, shard: int, exc: ShardRpcError) -> bool:
        """Join ``shard`` and declare the tables again where ``exc`` says it forgot this worker (it restarted, or
        dropped it): True; False for any other error."""
        if exc.code.name != "FAILED_PRECONDITION" or not ("declare" in exc.details or "not a member" in exc.details):
            return False
        if "not a member" in exc.details:
            self._rejoin(shard)
        self._declare([shard])
        return True

    def pull(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows of unique int64 ``ids`` ``[n]`` of table ``name``: float32 ``[n, dim]`` (CPU); see :meth:`pull_many`."""
        return self.pull_many([(name, ids)])[0]

    def pull_many(self, parts: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Rows of several tables, ``parts`` ``[(table name, unique int64 ids [n])]``: float32 ``[n, dim]`` per
        part (CPU), once this worker's last push is applied. One ``PullRows`` call per shard holding some of
        the ids, for every table at once (more where a reply would pass half the message limit), the shards
        called in parallel.

        Raises:
            ShardRpcError: a shard refused (its message says why) or the round of the last push was refused.
            ValueError: a shard's reply does not have the rows asked for.
        """
        self.wait_sent()
        plan = self._plan(parts)

        def one(s: int) -> list[tuple[int, torch.Tensor, bytes]]:
            got = []
            for pieces in plan[s]:
                request = self._request(parts, pieces, after_push=True)
                got.extend(self._parts(s, pieces, self._call(s, lambda c: c.pull_rows(request))))
            return got

        return self._assemble(parts, self._pool.map(one, [s for s in range(len(plan)) if plan[s]]))

    def prefetch(self, parts: list[tuple[str, torch.Tensor]]) -> "Prefetch":
        """Start pulling ``parts`` (as :meth:`pull_many`) for the forward after this worker's next push: the
        shards look the ids up now, while this step computes, and answer once that push is applied (with
        the rows as they are then, so the result equals :meth:`pull_many` called after ``step()``; TorchRec's
        prefetching train pipeline overlaps its input lookups the same way). :meth:`collect` reads it."""
        plan = self._plan(parts)
        number = self._push + 1
        calls = [(s, pieces, self._clients[s].pull_rows_future(self._request(parts, pieces, after_push_number=number)))
                 for s in range(len(plan)) for pieces in plan[s]]
        return Prefetch(parts, number, calls)

    def collect(self, prefetch: "Prefetch") -> list[torch.Tensor] | None:
        """The rows of a :meth:`prefetch`, or None where they cannot be had from it (its push was not taken by
        every shard, or a shard could not answer it: restarting, unreachable, or this worker must declare again); the
        caller then pulls them (:meth:`pull_many`).

        Raises:
            ShardRpcError: a shard refused the pull (the round of the last push was refused: its reason).
            ValueError: a shard's reply does not have the rows asked for.
        """
        self.wait_sent()
        if self._sent < prefetch.number:  # its push was not sent or not taken (step() raised): the shards would wait
            prefetch.cancel()
            self.prefetches["pulled_again"] += 1
            return None
        got = []
        for s, pieces, call in prefetch.calls:
            try:
                got.append(self._parts(s, pieces, call.result()))
            except grpc.RpcError as exc:
                prefetch.cancel()
                if exc.code() in _PULL_AGAIN:
                    self.prefetches["pulled_again"] += 1
                    return None
                raise self._clients[s].error("pull_rows", exc) from None
        self.prefetches["used"] += 1
        return self._assemble(prefetch.parts, got)

    def _plan(self, parts: list[tuple[str, torch.Tensor]]) -> list[list[list[tuple[int, torch.Tensor]]]]:
        """Per shard, its calls, each a list of ``(part, positions of the part's ids)``: a call's reply stays
        under half the message limit."""
        num_shards = len(self._clients)
        budget = self._max_message_bytes // 2
        plan: list[list[list[tuple[int, torch.Tensor]]]] = [[] for _ in range(num_shards)]
        sizes = [0] * num_shards
        for k, (name, ids) in enumerate(parts):
            if not ids.numel():
                continue
            spec = self.tables[name][1]
            row = spec.row_dtype.itemsize * spec.embedding_dim + 8
            for s, mine in enumerate(_by_shard(name, ids, num_shards)):
                for piece in mine.split(max(1, budget // row)):  # replies within the limit
                    if not piece.numel():
                        continue
                    if not plan[s] or sizes[s] + piece.numel() * row > budget:
                        plan[s].append([])
                        sizes[s] = 0
                    plan[s][-1].append((k, piece))
                    sizes[s] += piece.numel() * row
        return plan

    def _request(self, parts, pieces, **wait) -> pb.PullRowsRequest:
        return pb.PullRowsRequest(worker_id=self.worker_id, session=self.session, **wait, tables=[
            pb.TableIds(table=parts[k][0], ids=ids_bytes(ids if piece.numel() == ids.numel() else ids[piece]))
            for k, piece in pieces for ids in (parts[k][1],)])

    @staticmethod
    def _parts(s: int, pieces, reply: pb.PullRowsReply) -> list[tuple[int, torch.Tensor, bytes]]:
        if len(reply.parts) != len(pieces):
            raise ValueError(f"shard {s} answered {len(reply.parts)} tables for a pull of {len(pieces)}")
        return [(k, piece, data) for (k, piece), data in zip(pieces, reply.parts)]

    def _assemble(self, parts, got) -> list[torch.Tensor]:
        specs = [self.tables[name][1] for name, _ in parts]
        outs = [torch.empty(ids.numel(), spec.embedding_dim) for (_, ids), spec in zip(parts, specs)]
        for answers in got:
            for k, piece, data in answers:
                rows = rows_from(data, piece.numel(), specs[k].embedding_dim, specs[k].row_dtype)  # float32
                if piece.numel() == outs[k].shape[0]:  # the whole part in one piece (one shard): no copy
                    outs[k] = rows
                else:
                    outs[k].index_copy_(0, piece, rows)
                self.pulled_bytes += len(data)
        return outs

    def zero_grad(self) -> None:
        """Forget the step's lookups (their gradients are not pushed)."""
        for module, _, _ in self.tables.values():
            module.pending.clear()

    def push(self) -> None:
        """Push this step's row gradients to every shard (all of them, rows or not) and forget the lookups:
        :meth:`send` of :meth:`prepare`.

        Raises: see :meth:`prepare` and :meth:`send`.
        """
        self.send(self.prepare())

    def prepare(self) -> list[list[pb.PushRowsRequest]]:
        """This step's push, for each shard its requests (one, or several parts where the rows pass half the
        message limit: ``PushRowsRequest.parts``), checked (nothing is sent); forgets the step's lookups.

        Raises:
            ValueError: a table's learning rate is not finite, >= 0 and at most float32's largest value
                (``shardps.common.rows.check_lr``), another hyperparameter changed or left torch's range, a
                gradient is not finite, or one row (or the push's parts) would not fit the message limit.
                Nothing was pushed.
        """
        num_shards = len(self._clients)
        entries: list[list[tuple]] = [[] for _ in range(num_shards)]
        steps = []
        for name, (module, spec, group) in self.tables.items():
            lookups = [(ids, leaf.grad) for ids, leaf in module.pending if leaf.grad is not None]
            module.pending.clear()
            if not lookups:
                continue  # as torch: a table without a gradient this step is not stepped
            lr = check_lr(name, group["lr"])  # finite, >= 0, within float32's range: as the shards check it
            if group_spec(self._optimizer, group)[1] != spec.hyperparams:
                raise ValueError(f"a hyperparameter of table {name!r} changed after it was declared; only lr may "
                                 "change during training")
            if len(lookups) == 1:  # one lookup: its ids are unique already, one gradient row each
                unique, summed = lookups[0][0], lookups[0][1].detach().to("cpu", torch.float32)
            else:
                ids = torch.cat([i for i, _ in lookups])
                grads = torch.cat([g.detach().to("cpu", torch.float32) for _, g in lookups])
                unique, inverse = unique_ids(ids, module.num_embeddings or 0)  # a bitmap where that is faster
                summed = torch.zeros(unique.numel(), spec.embedding_dim).index_add_(0, inverse, grads)
            steps.append((name, unique, summed, lr))
        # one finiteness check for every table (the sum of finite values can overflow: then each is checked)
        if steps and not finite(torch.stack([g.sum() for _, _, g, _ in steps])):
            for name, _, summed, _ in steps:
                if not finite(summed):
                    raise ValueError(f"the gradient of table {name!r} is not finite (Inf or NaN); nothing was "
                                     "pushed: lower the learning rate or the loss scale")
        for name, unique, summed, lr in steps:
            for s, idx in enumerate(_by_shard(name, unique, num_shards)):
                if idx.numel() == unique.numel():  # every id on this shard (one shard): no copies
                    entries[s].append((name, unique, summed, lr))
                else:
                    entries[s].append((name, unique.index_select(0, idx), summed.index_select(0, idx), lr))
        requests = [push_parts(self.worker_id, self.session, self._push + 1, mine, self._max_message_bytes,
                               self.event_time, self.span) for mine in entries]
        self.event_time, self.span = 0.0, None  # each step says its own (set_event_time, set_stream_span)
        self._push += 1
        self._drop_ahead(before=self._push)
        self._sizes = [sum(r.ByteSize() for r in parts) for parts in requests]
        return requests

    def send(self, requests: list[list[pb.PushRowsRequest]]) -> None:
        """Start sending the requests of the last :meth:`prepare`, every shard at once, and return: the rows
        travel and the shards stage them while this worker reads its next batch. The next call that depends on
        this push (:meth:`wait_sent`: the next forward's prefetched rows or pull, the next push, an export,
        ``synchronize()``, ``close()``) waits until every shard took it, and raises what a shard answered.

        Raises:
            ShardRpcError: the previous push was refused or could not be delivered (see :meth:`wait_sent`);
                these requests were not sent.
        """
        self.wait_sent()
        self.pushed_bytes += sum(self._sizes)  # measured by prepare()

        def one(s: int) -> None:  # a shard's parts one after the other: it stages the push with the last
            for part in requests[s]:
                self._clients[s].push_rows(part)  # (a shard that forgot this worker: wait_sent joins it again)

        self._sending = (requests, [self._pool.submit(one, s) for s in range(len(requests))])

    def wait_sent(self) -> None:
        """Wait until every shard took this worker's last push (:meth:`send`); a no-op when none is in flight.

        Raises:
            ShardRpcError: a shard refused the push (the round of this worker's previous push was refused: its
                reason) or could not be reached within the retry budget. Raised once.
        """
        sending, self._sending = self._sending, None
        if sending is None:
            return
        requests, calls = sending
        for s, call in enumerate(calls):
            exc = call.exception()
            if exc is None:
                continue
            # a shard that forgot this worker is joined again here, on the training thread (never beside a
            # forward), and one that lost some of the push's parts gets the whole push again
            lost = isinstance(exc, ShardRpcError) and (exc.code.name == "ABORTED" and "send the whole push" in
                                                       exc.details or self._recover(s, exc))
            if not lost:
                raise exc
            for part in requests[s]:
                self._clients[s].push_rows(part)
        self._sent = requests[0][0].push

    def export(self, name: str) -> "TableExport":
        """Every row of table ``name`` on every shard (``shardps.worker.embedding.export``), read once this
        worker's last push is applied on every shard (what its next forward would read).

        Raises:
            ShardRpcError: a shard refused or could not be reached; the round of the last push was refused.
        """
        self.settle(name)
        return export_table(self._clients, name, self._max_message_bytes)

    def settle(self, name: str) -> None:
        """Wait until this worker's last push is applied on every shard (a pull of no ids of table ``name``).

        Raises:
            ShardRpcError: as :meth:`pull_many`.
        """
        self.wait_sent()
        empty = pb.PullRowsRequest(worker_id=self.worker_id, session=self.session, after_push=True,
                                   tables=[pb.TableIds(table=name, ids=b"")])
        list(self._pool.map(lambda s: self._call(s, lambda c: c.pull_rows(empty)), range(len(self._clients))))

    # ------------------------------------------------------------ prefetches of single modules' lookups
    def prefetch_tables(self, wanted: dict[str, torch.Tensor]) -> None:
        """Start pulling the rows of ``wanted`` (``{table name: unique sorted int64 ids}``) for the forward after
        this worker's next push (:meth:`prefetch`); that forward's lookups of these tables whose ids are all
        among them read their rows from it (:meth:`prefetched`) instead of pulling one table at a time. Used
        by ``shardps.worker.embedding.prefetch.prefetching``.

        Raises:
            KeyError: a name that is not a table of this optimizer.
        """
        unknown = [n for n in wanted if n not in self.tables]
        if unknown:
            raise KeyError(f"no sharded table named {unknown[0]!r} (tables: {', '.join(self.tables)})")
        parts = [(name, ids) for name, ids in wanted.items() if ids.numel()]
        if parts:
            self._ahead.append([self.prefetch(parts), None, set()])  # [prefetch, its rows, parts given whole]

    def prefetched(self, name: str, unique: torch.Tensor) -> torch.Tensor | None:
        """Rows of table ``name`` for unique sorted int64 ``unique`` ``[m]`` from the prefetch made for the
        forward after this worker's last push, when it holds every one of these ids: float32 ``[m, dim]``, the
        values :meth:`pull` would return now; else None (pull them)."""
        for entry in self._ahead:
            prefetch = entry[0]
            if prefetch.number != self._push or name not in {n for n, _ in prefetch.parts}:
                continue
            if entry[1] is None:
                entry[1] = self.collect(prefetch) or []  # [] : it could not be answered (pull instead)
            for k, ((part, ids), rows) in enumerate(zip(prefetch.parts, entry[1])):
                if part != name or not ids.numel():
                    continue
                if ids is unique and k not in entry[2]:  # the very ids prefetched (Prefetching's known lookups)
                    entry[2].add(k)
                    return rows.detach()  # the first lookup of them takes these rows whole, a leaf of its own
                at = torch.searchsorted(ids, unique).clamp_(max=ids.numel() - 1)
                if unique.numel() and not bool((ids.index_select(0, at) == unique).all()):
                    return None
                return rows.index_select(0, at)  # a tensor of its own: each lookup has its own leaf
        return None

    def _drop_ahead(self, before: int) -> None:
        """Forget the prefetches for forwards before push ``before`` (cancelled if still in flight)."""
        keep = []
        for entry in self._ahead:
            if entry[0].number >= before:
                keep.append(entry)
            elif entry[1] is None:
                entry[0].drop(self)
        self._ahead = keep

    def close(self) -> None:
        """Wait for the push in flight (a failure is logged: nothing is left to raise it to), detach the
        modules, stop the call threads."""
        try:
            self.wait_sent()
        except Exception as exc:  # noqa: BLE001 - closing goes on; the failure is reported
            log.error("the last push of this worker's table rows failed while closing: %s", exc)
        for module, _, _ in self.tables.values():
            module.attach(None)
        self._pool.shutdown(wait=False, cancel_futures=True)  # calls in flight end when the channels close

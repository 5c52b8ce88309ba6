"""Checks of the sparse calls' contents: the ids of a pull or a push, and a push's gradients.

Each check covers every table of a request in a few tensor operations (a
DLRM step names 26 tables), and names the table at fault when one fails;
nothing is staged or read before all of them pass.
"""

from __future__ import annotations

import bisect
import itertools
import math

import torch

from shardps.proto import shardps_pb2 as pb
from shardps.common.codec import finite
from shardps.common.rows import FLOAT32_MAX, check_ids, ids_from, lr_problem, shard_of_salted
from shardps.server.checks import shown
from shardps.server.errors import Aborted, InvalidArgument
from shardps.server.stream_positions import check_span

__all__ = ["PushParts", "checked_ids", "staged_rows", "increasing"]

#: The most parts one push may come in (``PushRowsRequest.parts``): at the default 64 MiB message limit, 128 GiB
#: of one step's rows for one shard.
MAX_PUSH_PARTS = 2048
#: Event times a push may carry: seconds below 2**53 (exact in float64 and in the rows' int64 times).
MAX_EVENT_TIME = float(2 ** 53)


def checked_ids(parts: list[tuple], what: str, config) -> list[torch.Tensor]:
    """The int64 ids of each ``(table, bytes)`` part (a ``RowTable``), checked: the bounds of bounded tables,
    and that this shard (``config``: its ``ShardConfig``) holds every id, one placement pass for all parts.

    Raises:
        InvalidArgument: malformed ids, an id out of a bounded table's range, ids of another shard (the
            message names the table and ``what``, e.g. "the push").
    """
    out = []
    for table, data in parts:
        try:
            ids = ids_from(data)
            if table.spec.num_embeddings:
                check_ids(ids, f"table {table.spec.name!r}", table.spec.num_embeddings)
        except ValueError as exc:
            raise InvalidArgument(f"{what} of table {shown(table.spec.name)}: {exc}") from None
        out.append(ids)
    sizes = [i.numel() for i in out]
    if config.num_shards > 1 and sum(sizes):
        salts = torch.cat([torch.full((n,), t.place_salt, dtype=torch.int64) for (t, _), n in zip(parts, sizes)])
        wrong = (shard_of_salted(torch.cat(out), salts, config.num_shards) != config.shard_index).nonzero()
        if wrong.numel():
            k = bisect.bisect_right(list(itertools.accumulate(sizes)), int(wrong[0]))
            raise InvalidArgument(f"{what} of table {shown(parts[k][0].spec.name)} names ids that shard "
                                  f"{config.shard_index} does not hold (placement: shardps.common.rows.shard_of)")
    return out


def staged_rows(request: pb.PushRowsRequest, tables: list, ids: list[torch.Tensor]
                ) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """A push's ``{table: (ids int64 [n], gradients float32 [n, dim], lr)}``, checked: ``tables[k]`` (a
    ``RowTable``) and ``ids[k]`` (from :func:`checked_ids`) are those of ``request.tables[k]``.

    The gradients of every table are read into one tensor, and one sum tells they are all finite (the
    exact test only when it is not).

    Raises:
        InvalidArgument: a learning rate not finite, >= 0 and within float32's range, a gradient of the
            wrong size, the padding id pushed, a repeated id, a gradient not finite (the message names the table).
    """
    if not (0 <= request.event_time < MAX_EVENT_TIME):
        raise InvalidArgument(f"event_time must be seconds in [0, 2**53), got {request.event_time}")
    if request.HasField("span"):
        check_span(request.span, "the push")
    for part, table, i in zip(request.tables, tables, ids):
        if table.spec.ttl_seconds and not request.event_time > 0:
            raise InvalidArgument(f"table {shown(part.table)} expires rows by event time (ttl_seconds): its pushes "
                                  "must carry their events' time (DistributedOptimizer.set_event_time)")
        problem = lr_problem(part.lr)
        if problem is not None:
            raise InvalidArgument(f"learning rate of table {shown(part.table)}: {problem}; it must be finite, "
                                  f">= 0 and at most {FLOAT32_MAX:.4g}; nothing was staged")
        n, dim = i.numel(), table.spec.embedding_dim
        if len(part.grads) != 4 * n * dim:
            raise InvalidArgument(f"gradient of table {shown(part.table)}: expected {n} rows of {dim} float32 "
                                  f"values ({4 * n * dim} bytes), got {len(part.grads)} bytes")
        if table.spec.padding_idx >= 0 and bool((i == table.spec.padding_idx).any()):
            raise InvalidArgument(f"the push of table {shown(part.table)} carries padding_idx "
                                  f"{table.spec.padding_idx}, which is never trained")
    data = bytearray().join(part.grads for part in request.tables)
    flat = torch.frombuffer(data, dtype=torch.float32) if data else torch.empty(0)
    grads = list(flat.split([i.numel() * t.spec.embedding_dim for i, t in zip(ids, tables)]))
    if not increasing(ids):  # ids in increasing order (as workers send them) are unique
        for part, i in zip(request.tables, ids):
            if i.numel() > 1 and torch.unique(i).numel() != i.numel():
                raise InvalidArgument(f"the push of table {shown(part.table)} repeats an id: send each unique "
                                      "id once with its summed gradient")
    if not finite(flat):
        bad = next(part.table for part, g in zip(request.tables, grads) if not finite(g))
        raise InvalidArgument(f"gradient of table {shown(bad)} is not finite (Inf or NaN); nothing was staged")
    return {part.table: (i, g.view(i.numel(), t.spec.embedding_dim), part.lr)
            for part, t, i, g in zip(request.tables, tables, ids, grads)}


def increasing(ids: list[torch.Tensor]) -> bool:
    """Whether each of ``ids`` (int64 ``[n_k]``) is strictly increasing: one comparison over all of them."""
    flat = torch.cat(ids) if len(ids) != 1 else ids[0]
    if flat.numel() < 2:
        return True
    up = flat[1:] > flat[:-1]
    ends = torch.tensor([i.numel() for i in ids]).cumsum(0)[:-1] - 1  # last id of each part but the last
    ends = ends[(ends >= 0) & (ends < up.numel())]
    up[ends] = True  # a part's first id is not compared with the part before it
    return bool(up.all())


class PushParts:
    """The parts of each member's push that came in several requests (``PushRowsRequest.parts`` > 1), held until
    every part is in; then one request with every table's rows, as a push of one message would carry them.

    Each member holds the parts of one push at most: a part of a push with another number drops those held (the
    worker gave that push up: its call failed), and a member that leaves drops its parts (:meth:`drop`). At most
    ``parts`` requests of at most ``--max-message-bytes`` each are held per member.
    """

    def __init__(self) -> None:
        self._held: dict[str, tuple[int, int, dict[int, pb.PushRowsRequest]]] = {}

    def add(self, request: pb.PushRowsRequest) -> pb.PushRowsRequest | None:
        """Hold one part; the whole push once its last part is in, else None. A request of one part is the push.

        Raises:
            InvalidArgument: ``part`` not below ``parts``, more than :data:`MAX_PUSH_PARTS` parts, or a part
                of a push held with another number of parts. Nothing is held for this push then.
            Aborted: the last part came while earlier ones are missing (the worker sends the whole push again).
        """
        if request.parts <= 1 and request.part == 0:
            return request
        w, number = request.worker_id, request.push
        if not request.part < request.parts <= MAX_PUSH_PARTS:
            self._held.pop(w, None)
            raise InvalidArgument(f"push {number} names part {request.part} of {request.parts}: a part is below "
                                  f"parts, and a push comes in at most {MAX_PUSH_PARTS} parts; nothing was staged")
        held = self._held.get(w)
        if held is None or held[0] != number:
            held = self._held[w] = (number, request.parts, {})
        elif held[1] != request.parts:
            self._held.pop(w, None)
            raise InvalidArgument(f"push {number} came in {held[1]} parts and now in {request.parts}: send every "
                                  "part of a push with the same parts; nothing was staged")
        held[2][request.part] = request  # a retried part replaces itself
        if len(held[2]) < held[1]:
            if request.part == request.parts - 1:  # parts come in order: the earlier ones were lost (dropped)
                missing = sorted(set(range(held[1])) - set(held[2]))
                self._held.pop(w, None)
                raise Aborted(f"push {number} came without its parts {missing[:8]} (dropped with a lapsed "
                              "membership, or the shard restarted): send the whole push again; nothing was staged")
            return None
        del self._held[w]
        return _joined([held[2][k] for k in range(held[1])])

    def drop(self, worker_id: str) -> None:
        """Forget the parts held for ``worker_id``."""
        self._held.pop(worker_id, None)


def _joined(parts: list[pb.PushRowsRequest]) -> pb.PushRowsRequest:
    """One request with the rows of ``parts`` in order: a table's ids and gradients concatenated across parts.

    Raises:
        InvalidArgument: a table's parts carry different learning rates.
    """
    tables: dict[str, list[pb.TableRows]] = {}
    for part in parts:
        for rows in part.tables:
            tables.setdefault(rows.table, []).append(rows)
    whole = pb.PushRowsRequest(worker_id=parts[0].worker_id, session=parts[0].session, push=parts[0].push,
                               event_time=parts[0].event_time)
    if parts[0].HasField("span"):
        whole.span.CopyFrom(parts[0].span)
    for name, pieces in tables.items():
        if len({p.lr for p in pieces}) > 1:
            raise InvalidArgument(f"push {whole.push} carries table {shown(name)} with different learning rates in "
                                  "its parts; nothing was staged")
        whole.tables.add(table=name, lr=pieces[0].lr, ids=b"".join(p.ids for p in pieces),
                         grads=b"".join(p.grads for p in pieces))
    return whole

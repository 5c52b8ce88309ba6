"""Reads and rounds over several tables at once: one gather, one update and one scatter per slab.

A pull or a round names rows of many tables (a DLRM names 26); the
tables of one shape share a :class:`~shardps.server.sparse.slab.RowSlab`,
so their rows are concatenated and handled as one batch, which is what
makes a round's cost a function of its rows, not of its tables (FBGEMM's
table-batched embeddings do the same on GPUs). Per table there remain
only Python bookkeeping (counters, optimizer step counts) and, for tables
with admission (``min_count > 1``), the sighting counts.

Each function runs on the shard's compute thread. The results are bit for
bit those of handling each table alone: initial rows are the same pure
function (``shardps.common.rows.initial_rows_salted``), and the optimizers
are elementwise, applied per group of tables with equal optimizer,
hyperparameters, learning rate and step count.

A round is all or nothing (``shardps.server.sparse.rounds``): :func:`prepare_round`
computes the new rows and state into temporaries and checks them finite
without changing anything of the shard; only then :func:`commit_round`
writes rows, state, step counts, admission counts and new slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shardps.common.rows import initial_rows_by, initial_rows_salted, salt
from shardps.server.sparse import optimizers, rounds

__all__ = ["new_counts", "read_rows", "reread_rows", "touched_of", "prepare_round", "commit_round", "apply_round",
           "found_in",
           "PreparedRound"]


def _by_slab(tables: list) -> list[tuple[object, list[int]]]:
    """Positions of ``tables`` grouped by their slab, in first-seen order."""
    groups: dict[int, tuple[object, list[int]]] = {}
    for k, table in enumerate(tables):
        groups.setdefault(id(table.slab), (table.slab, []))[1].append(k)
    return list(groups.values())


def _counts(mask: torch.Tensor, sizes: list[int]) -> list[int]:
    """True entries of bool ``mask`` in each consecutive piece of ``sizes``."""
    if len(sizes) == 1:
        return [int(mask.sum())]
    ends = torch.tensor(sizes).cumsum(0)
    total = torch.cat([torch.zeros(1, dtype=torch.int64), mask.to(torch.int64).cumsum(0)])
    return (total[ends] - total[ends - torch.tensor(sizes)]).tolist()


def _per_row(values: list, counts: list[int], dtype: torch.dtype):
    """``values[k]`` repeated ``counts[k]`` times as a tensor ``[sum(counts)]``, or the value itself when all
    are equal."""
    if all(v == values[0] for v in values):
        return values[0]
    return torch.tensor(values, dtype=dtype).repeat_interleave(torch.tensor(counts))


def new_counts(slots: list[torch.Tensor]) -> list[int]:
    """Ids that are not rows yet (slot < 0) in each of ``slots`` (int64 ``[n]`` each), one pass."""
    if not slots:
        return []
    return _counts(torch.cat(slots) < 0, [s.numel() for s in slots])


def _initial(tables: list, ids: torch.Tensor, counts: list[int], dim: int) -> torch.Tensor:
    """Initial rows of ``ids`` (int64 ``[n]``, ``counts[k]`` of them from ``tables[k]``): float32 ``[n, dim]``."""
    if any(t.spec.init for t in tables):  # an initialiser other than the default: table by table
        return torch.cat([initial_rows_by(part, salt(t.spec.name, t.spec.seed), dim, t.spec.init, t.spec.init_args)
                          if t.spec.init else initial_rows_salted(part, salt(t.spec.name, t.spec.seed), dim,
                                                                  float(t.spec.init_scale))
                          for t, part in zip(tables, ids.split(counts))]) if ids.numel() else torch.empty(0, dim)
    salts = _per_row([salt(t.spec.name, t.spec.seed) for t in tables], counts, torch.int64)
    scales = _per_row([float(t.spec.init_scale) for t in tables], counts, torch.float32)
    return initial_rows_salted(ids, salts, dim, scales)


#: Initial values computed at once by :func:`read_rows`: their hash works on int64 temporaries of the block,
#: at most about 48 bytes of scratch a value (24 MiB a block), whatever the read's size.
INIT_BLOCK_VALUES = 1 << 19


def _initial_into(rows: torch.Tensor, where: torch.Tensor, tables: list, ids: torch.Tensor, counts: list[int],
                  dim: int) -> None:
    """``rows[where] =`` the initial rows of ``ids[where]`` (``counts[k]`` of them from ``tables[k]``, in order),
    :data:`INIT_BLOCK_VALUES` values at a time."""
    block = max(1, INIT_BLOCK_VALUES // max(1, dim))
    if where.numel() <= block:
        rows.index_copy_(0, where, _initial(tables, ids.index_select(0, where), counts, dim).to(rows.dtype))
        return
    owner = torch.repeat_interleave(torch.arange(len(tables)), torch.tensor(counts))
    for begin in range(0, where.numel(), block):
        part = where[begin: begin + block]
        per_table = torch.bincount(owner[begin: begin + block], minlength=len(tables)).tolist()
        rows.index_copy_(0, part, _initial(tables, ids.index_select(0, part), per_table, dim).to(rows.dtype))


def read_rows(tables: list, ids: list[torch.Tensor], slots: list[torch.Tensor],
              out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Rows of ``ids[k]`` (int64 ``[n_k]``) of ``tables[k]`` at ``slots[k]`` (the index's answer, -1: not a
    row, which reads as its initial value, rounded to the table's dtype; the padding id as zeros): ``[n_k, dim]``
    per table of the table's dtype (float32, or float16: ``TableSpec.dtype``).

    ``out``: ``[n_k, dim]`` of the table's dtype per table to read into (views of a reply's bytes, ``replies``), returned
    filled; None: new tensors. A table alone in its slab is gathered straight into its ``out``; tables that
    share a slab are gathered together (one operation) and copied. Initial values are computed
    :data:`INIT_BLOCK_VALUES` at a time, so the scratch of a read stays bounded whatever its size.
    """
    result: list[torch.Tensor | None] = [None] * len(tables)
    for slab, group in _by_slab(tables):
        sizes = [ids[k].numel() for k in group]
        flat_ids, flat_slots = torch.cat([ids[k] for k in group]), torch.cat([slots[k] for k in group])
        at = flat_slots.clamp(min=0)
        direct = out is not None and len(group) == 1
        rows = torch.index_select(slab.weights, 0, at, out=out[group[0]]) if direct else \
            slab.weights.index_select(0, at)
        missing = flat_slots < 0
        counts = _counts(missing, sizes)
        if sum(counts):
            _initial_into(rows, missing.nonzero().reshape(-1), [tables[k] for k in group], flat_ids, counts, slab.dim)
        for k, piece in zip(group, [rows] if direct else rows.split(sizes)):
            if out is not None and not direct:
                piece = out[k].copy_(piece)
            result[k] = piece
            table = tables[k]
            table.counts["rows_pulled"] += ids[k].numel()
            if table.spec.padding_idx >= 0:
                piece[ids[k] == table.spec.padding_idx] = 0.0
    return result


def touched_of(parts: list[tuple], slots: list[torch.Tensor]) -> list[torch.Tensor]:
    """The round each row at ``slots[k]`` (of ``parts[k] = (table, ids)``'s slab; -1: not a row) was last pushed
    in: int32 ``[n_k]`` per part, -2 where not a row. A round writes a row's round with its values, so a row whose
    slot and round are as they were holds the values it held (what :func:`reread_rows` skips)."""
    out: list[torch.Tensor | None] = [None] * len(parts)
    for slab, group in _by_slab([t for t, _ in parts]):
        flat = torch.cat([slots[k] for k in group])
        rounds = torch.where(flat >= 0, slab.touched.index_select(0, flat.clamp(min=0)), -2)
        for k, piece in zip(group, rounds.split([slots[k].numel() for k in group])):
            out[k] = piece
    return out


def reread_rows(tables: list, ids: list[torch.Tensor], before: list[torch.Tensor], slots: list[torch.Tensor],
                rows: list[torch.Tensor], rounds: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """``rows`` (``[n_k, dim]`` of the table's dtype per table), read when ``ids[k]`` were at slots ``before[k]``, as they read
    now that they are at ``slots[k]``: rows are read again from the slabs, ids that were not rows and still are
    not keep their initial values, and ids no longer rows (evicted since) read as initial values again. With
    ``rounds`` (:func:`touched_of` the slots ``before``, taken with the read), only the rows that moved or that
    a round wrote since are read again (a prefetch's next batch shares a fifth of its ids with the round's).
    New tensors, same shapes."""
    out: list[torch.Tensor | None] = [None] * len(tables)
    for slab, group in _by_slab(tables):
        sizes = [slots[k].numel() for k in group]
        flat_rows = torch.cat([rows[k] for k in group])
        flat_slots = torch.cat([slots[k] for k in group])
        changed = flat_slots >= 0
        if rounds is not None:
            now = slab.touched.index_select(0, flat_slots.clamp(min=0))
            changed &= (flat_slots != torch.cat([before[k] for k in group])) | \
                (now != torch.cat([rounds[k] for k in group]))
        present = changed.nonzero().reshape(-1)
        flat_rows.index_copy_(0, present, slab.weights.index_select(0, flat_slots.index_select(0, present)))
        lost = ((flat_slots < 0) & (torch.cat([before[k] for k in group]) >= 0))
        counts = _counts(lost, sizes)
        if sum(counts):
            where = lost.nonzero().reshape(-1)
            flat_ids = torch.cat([ids[k] for k in group]).index_select(0, where)
            flat_rows.index_copy_(0, where, _initial([tables[k] for k in group], flat_ids, counts,
                                                     slab.dim).to(flat_rows.dtype))
        for k, piece in zip(group, flat_rows.split(sizes)):
            out[k] = piece
    return out


@dataclass
class _Part:
    table: object
    ids: torch.Tensor  # the ids whose gradient is applied (admission applied)
    grad: torch.Tensor
    slots: torch.Tensor
    lr: float
    initial: torch.Tensor | None  # rows a pull read for exactly these ids (initial values where not rows)
    step: int  # the table's optimizer steps with this round's
    pushed: int  # ids the round pushed (before admission)
    admission: tuple | None  # (ids, sightings, slots) before admission, counted at commit (min_count > 1)


@dataclass
class _SlabUpdate:
    """One slab's part of a prepared round: the new values of its rows, not written yet."""
    slab: object
    parts: list[_Part]
    slots: torch.Tensor  # int64 [n], -1 where the id is a new row (a slot is taken at commit)
    where: torch.Tensor | None  # positions of the new rows in slots (None: none)
    counts: list[int]  # new rows per part
    new_ids: torch.Tensor | None
    weights: torch.Tensor  # [n, dim] of the slab's dtype: the rows after the update (float16 ones rounded)
    state: dict[str, torch.Tensor]  # {name: float32 [n, width]} after the update
    groups: list[tuple]  # (optimizer, lr, step, tables, positions in the rows or None for all)


@dataclass
class PreparedRound:
    """A round's update computed and checked (:func:`prepare_round`), for :func:`commit_round` to write."""
    parts: list[_Part]
    slabs: list[_SlabUpdate]


def prepare_round(merged: list[tuple], slots: list[torch.Tensor], initial: list[torch.Tensor | None]
                  ) -> PreparedRound:
    """One round's update of several tables, computed into temporaries; nothing of the shard changes.

    ``merged[k] = (table, ids, grad, sightings, lr)`` (unique int64 ids ``[n]``, the averaged float32 gradient
    ``[n, dim]``, int64 sightings ``[n]``), ``slots[k]`` the ids' slots (-1: not a row), ``initial[k]`` the
    rows a pull read for exactly ``ids`` or None. Admission (``min_count``) drops the gradients of ids that
    would not be admitted; new ids start from their initial rows and state; then every table's optimizer
    steps the gathered copies (its step count + 1), and one check over every updated row and state value
    (a sum per tensor; exact where that is not finite) proves them finite. The slabs grow here, if they
    must, so that :func:`commit_round` allocates nothing.

    Raises:
        InvalidArgument: a step raised on the round's input (lr past what the update can represent, say) or
            its result is not finite; the message names the tables, optimizer, lr and step.
        ShardError: another failure of the step (see ``rounds.step_failed``).
    """
    parts = []
    for (table, ids, grad, sightings, lr), found, init in zip(merged, slots, initial):
        pushed, admission = ids.numel(), None
        if table.spec.min_count > 1:
            admission = (ids, sightings, found)
            keep = table.would_admit(ids, sightings, found)
            if keep is not None:
                ids, grad, found, init = ids[keep], grad[keep], found[keep], None
        parts.append(_Part(table, ids, grad, found, lr, init, table.step + 1, pushed, admission))
    updates = [_prepare_slab(slab, [parts[k] for k in group]) for slab, group in _by_slab([p.table for p in parts])]
    updates = [u for u in updates if u is not None]
    _check_finite(updates)
    for u in updates:
        if u.where is not None:
            u.slab.reserve(u.where.numel())
    return PreparedRound(parts, updates)


def commit_round(prepared: PreparedRound, round_: int, event_time: float = 0.0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Write a :func:`prepare_round` result: step counts, admission counts, new rows' slots, rows, optimizer
    state and last-pushed rounds, and where ``event_time`` (seconds, > 0) is given, the rows' last event time
    (slabs that keep it) and the tables' event clocks. Returns ``(ids, slots, tags)`` of the rows made (int64
    ``[m]`` each), for the caller to insert into the index."""
    for p in prepared.parts:
        if event_time > 0:
            p.table.clock = max(p.table.clock, event_time)
        p.table.counts["rows_pushed"] += p.pushed
        p.table.step = p.step
        if p.admission is not None:
            p.table.admit(*p.admission, round_)
    made = []
    for u in prepared.slabs:
        slab, slots = u.slab, u.slots
        if u.where is not None:
            fresh = slab.take(u.where.numel())
            slots.index_copy_(0, u.where, fresh)
            for p, c in zip(u.parts, u.counts):
                p.table.rows += c
                p.table.counts["admitted"] += c
            tags = _per_row([p.table.tag for p in u.parts], u.counts, torch.int64)
            if not isinstance(tags, torch.Tensor):
                tags = torch.full((u.where.numel(),), tags, dtype=torch.int64)
            made.append((u.new_ids, fresh, tags))
        slab.weights.index_copy_(0, slots, u.weights)
        for name, t in u.state.items():
            slab.state[name].index_copy_(0, slots, t)
        slab.touched.index_fill_(0, slots, round_)
        if slab.seen is not None and event_time > 0:  # a row's time never goes back (late or skewed pushes)
            times = slab.seen.index_select(0, slots)
            if u.where is not None:
                times.index_fill_(0, u.where, 0)  # new rows: their slot's old value is not theirs
            slab.seen.index_copy_(0, slots, times.clamp_(min=math.ceil(event_time)))
    if not made:
        empty = torch.empty(0, dtype=torch.int64)
        return empty, empty, empty
    return tuple(torch.cat(x) for x in zip(*made))


def apply_round(merged: list[tuple], slots: list[torch.Tensor], initial: list[torch.Tensor | None],
                round_: int, event_time: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`prepare_round`, then :func:`commit_round`: all of the round, or (it raises) nothing of it."""
    return commit_round(prepare_round(merged, slots, initial), round_, event_time)


def _prepare_slab(slab, parts: list[_Part]) -> _SlabUpdate | None:
    sizes = [p.ids.numel() for p in parts]
    if not sum(sizes):
        return None
    grad = torch.cat([p.grad for p in parts])
    slots = torch.cat([p.slots for p in parts])  # a new tensor: the callers' slots stay as they were
    new = slots < 0
    counts = _counts(new, sizes)
    at = slots.clamp(min=0)  # new rows gather slot 0 (the slab is never empty) and are overwritten below
    weights = slab.weights.index_select(0, at).float()  # float16 rows step in float32, rounded back below
    state = {name: t.index_select(0, at) for name, t in slab.state.items()}
    where = new_ids = None
    if sum(counts):
        where = new.nonzero().reshape(-1)
        new_ids = torch.cat([p.ids for p in parts]).index_select(0, where)
        if all(p.initial is not None for p in parts):
            rows = torch.cat([p.initial for p in parts]).index_select(0, where).float()
        else:  # as a read shows them: rounded to the slab's dtype
            rows = _initial([p.table for p in parts], new_ids, counts, slab.dim).to(slab.dtype).float()
        weights.index_copy_(0, where, rows)
        for name in slab.widths:
            values = [optimizers.initial_values(p.table.spec.optimizer, p.table.spec.hyperparams)[name] for p in parts]
            value = _per_row(values, counts, torch.float32)
            if isinstance(value, torch.Tensor):
                state[name].index_copy_(0, where, value[:, None].expand(-1, slab.widths[name]))
            else:
                state[name].index_fill_(0, where, value)
    # one update per group of tables with the same optimizer, hyperparameters, lr and step count
    keyed: dict[tuple, list[int]] = {}
    for k, p in enumerate(parts):
        s = p.table.spec
        keyed.setdefault((s.optimizer, tuple(sorted(s.hyperparams.items())), p.lr, p.step), []).append(k)
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    groups = []
    for (optimizer, hyper, lr, step), members in keyed.items():
        tables = [parts[k].table for k in members]
        if len(members) == len(parts):
            sel, w, st, g = None, weights, state, grad  # the whole gather, stepped in place
        else:
            sel = torch.cat([torch.arange(starts[k], starts[k + 1]) for k in members])
            if not sel.numel():
                continue
            w, g = weights.index_select(0, sel), grad.index_select(0, sel)
            st = {name: t.index_select(0, sel) for name, t in state.items()}
        try:
            optimizers.update(optimizer, dict(hyper), w, st, g, lr, step)
        except Exception as exc:  # nothing of the shard changed: the round is refused, naming the tables
            raise rounds.step_failed(exc, tables, optimizer, lr, step) from exc
        if sel is not None:
            weights.index_copy_(0, sel, w)
            for name, t in st.items():
                state[name].index_copy_(0, sel, t)
        groups.append((optimizer, lr, step, tables, sel))
    weights = weights.to(slab.dtype)  # float16 tables: rounded to nearest; a value past float16's range is Inf
    return _SlabUpdate(slab, parts, slots, where, counts, new_ids, weights, state, groups)


def _check_finite(updates: list[_SlabUpdate]) -> None:
    """Refuse a round whose updated rows or state hold Inf or NaN: one sum per tensor, stacked and read once;
    where that sum is not finite (Inf/NaN, or finite values whose sum overflows), each group is checked exactly.

    Raises:
        InvalidArgument: naming the first group's tables that are not finite (``rounds.not_finite``).
    """
    tensors = [t for u in updates for t in (u.weights, *u.state.values()) if t.numel()]
    if not tensors or math.isfinite(torch.stack([t.sum(dtype=torch.float32) for t in tensors]).sum().item()):
        return
    for u in updates:
        for optimizer, lr, step, tables, sel in u.groups:
            pieces = [u.weights, *u.state.values()]
            if sel is not None:
                pieces = [t.index_select(0, sel) for t in pieces]
            if not all(bool(torch.isfinite(t).all()) for t in pieces):
                raise rounds.not_finite(tables, optimizer, lr, step)


def found_in(found: list[torch.Tensor], parts: list[tuple], made_ids: torch.Tensor, made_tags: torch.Tensor,
             made_slots: torch.Tensor, index) -> list[torch.Tensor]:
    """``found`` (slots of ``parts`` ``[(table, int64 ids [n])]``, -1: not a row) after one round that made the
    rows ``(made_ids, made_tags, made_slots)`` (int64 ``[m]`` each) and evicted none: the ids not found are
    matched against the new rows (a sort and a binary search on a 64-bit mix of (tag, id), then an exact
    comparison; an id whose mix matches another key is looked up in ``index``). Returns int64 ``[n]`` per part."""
    flat = torch.cat(found)
    missing = (flat < 0).nonzero().reshape(-1)
    if not missing.numel() or not made_ids.numel():
        return found
    sizes = [i.numel() for _, i in parts]
    ids = torch.cat([i for _, i in parts]).index_select(0, missing)
    tags = torch.tensor([t.tag for t, _ in parts]).repeat_interleave(torch.tensor(sizes)).index_select(0, missing)
    direct = index.direct_keys(tags)  # bounded tables' keys: looked up again (one gather; never held back)
    if direct is not False:
        flat = flat.clone()
        if direct is True:
            flat[missing] = index.find_direct(ids, tags)
            return list(flat.split(sizes))
        at = direct.nonzero().reshape(-1)
        flat[missing.index_select(0, at)] = index.find_direct(ids.index_select(0, at), tags.index_select(0, at))
        rest = (~direct).nonzero().reshape(-1)
        missing, ids, tags = missing.index_select(0, rest), ids.index_select(0, rest), tags.index_select(0, rest)
    made_keys = index.keys_mix(made_ids, made_tags)
    order = torch.argsort(made_keys)
    sorted_keys = made_keys.index_select(0, order)
    keys = index.keys_mix(ids, tags)
    at = torch.searchsorted(sorted_keys, keys).clamp_(max=sorted_keys.numel() - 1)
    cand = order.index_select(0, at)
    same_mix = sorted_keys.index_select(0, at) == keys
    hit = same_mix & (made_ids.index_select(0, cand) == ids) & (made_tags.index_select(0, cand) == tags)
    flat = flat.clone()
    where = hit.nonzero().reshape(-1)
    flat[missing.index_select(0, where)] = made_slots.index_select(0, cand.index_select(0, where))
    doubt = (same_mix & ~hit).nonzero().reshape(-1)  # another key with the same mix: ask the index
    if doubt.numel():
        flat[missing.index_select(0, doubt)] = index.find(ids.index_select(0, doubt), tags.index_select(0, doubt))
    return list(flat.split(sizes))

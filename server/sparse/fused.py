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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardps.common.rows import initial_rows_salted, salt
from shardps.server.sparse import optimizers

__all__ = ["new_counts", "read_rows", "reread_rows", "apply_round", "found_in"]


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
    salts = _per_row([salt(t.spec.name, t.spec.seed) for t in tables], counts, torch.int64)
    scales = _per_row([float(t.spec.init_scale) for t in tables], counts, torch.float32)
    return initial_rows_salted(ids, salts, dim, scales)


def read_rows(tables: list, ids: list[torch.Tensor], slots: list[torch.Tensor]) -> list[torch.Tensor]:
    """Rows of ``ids[k]`` (int64 ``[n_k]``) of ``tables[k]`` at ``slots[k]`` (the index's answer, -1: not a
    row, which reads as its initial value; the padding id as zeros): float32 ``[n_k, dim]`` per table."""
    out: list[torch.Tensor | None] = [None] * len(tables)
    for slab, group in _by_slab(tables):
        sizes = [ids[k].numel() for k in group]
        flat_ids, flat_slots = torch.cat([ids[k] for k in group]), torch.cat([slots[k] for k in group])
        rows = slab.weights.index_select(0, flat_slots.clamp(min=0))
        missing = flat_slots < 0
        counts = _counts(missing, sizes)
        if sum(counts):
            where = missing.nonzero().reshape(-1)
            rows.index_copy_(0, where, _initial([tables[k] for k in group], flat_ids.index_select(0, where), counts,
                                                slab.dim))
        for k, piece in zip(group, rows.split(sizes)):
            out[k] = piece
            table = tables[k]
            table.counts["rows_pulled"] += ids[k].numel()
            if table.spec.padding_idx >= 0:
                piece[ids[k] == table.spec.padding_idx] = 0.0
    return out


def reread_rows(tables: list, ids: list[torch.Tensor], before: list[torch.Tensor], slots: list[torch.Tensor],
                rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """``rows`` (float32 ``[n_k, dim]`` per table), read when ``ids[k]`` were at slots ``before[k]``, as they read
    now that they are at ``slots[k]``: rows are read again from the slabs, ids that were not rows and still are
    not keep their initial values, and ids no longer rows (evicted since) read as initial values again. New
    tensors, same shapes."""
    out: list[torch.Tensor | None] = [None] * len(tables)
    for slab, group in _by_slab(tables):
        sizes = [slots[k].numel() for k in group]
        flat_rows = torch.cat([rows[k] for k in group])
        flat_slots = torch.cat([slots[k] for k in group])
        present = (flat_slots >= 0).nonzero().reshape(-1)
        flat_rows.index_copy_(0, present, slab.weights.index_select(0, flat_slots.index_select(0, present)))
        lost = ((flat_slots < 0) & (torch.cat([before[k] for k in group]) >= 0))
        counts = _counts(lost, sizes)
        if sum(counts):
            where = lost.nonzero().reshape(-1)
            flat_ids = torch.cat([ids[k] for k in group]).index_select(0, where)
            flat_rows.index_copy_(0, where, _initial([tables[k] for k in group], flat_ids, counts, slab.dim))
        for k, piece in zip(group, flat_rows.split(sizes)):
            out[k] = piece
    return out


@dataclass
class _Part:
    table: object
    ids: torch.Tensor
    grad: torch.Tensor
    slots: torch.Tensor
    lr: float
    initial: torch.Tensor | None  # rows a pull read for exactly these ids (initial values where not rows)


def apply_round(merged: list[tuple], slots: list[torch.Tensor], initial: list[torch.Tensor | None],
                round_: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One round's update of several tables: ``merged[k] = (table, ids, grad, sightings, lr)`` (unique int64
    ids ``[n]``, the averaged float32 gradient ``[n, dim]``, int64 sightings ``[n]``), ``slots[k]`` the ids'
    slots (-1: not a row), ``initial[k]`` the rows a pull read for exactly ``ids`` or None.

    Admission (``min_count``) drops the gradients of ids not admitted; the other new ids become rows
    (their slab's free slots), then every table's optimizer updates its rows. Returns ``(ids, slots,
    tags)`` of the rows made (int64 ``[m]`` each), for the caller to insert into the index."""
    parts = []
    for (table, ids, grad, sightings, lr), found, init in zip(merged, slots, initial):
        table.counts["rows_pushed"] += ids.numel()
        table.step += 1
        if table.spec.min_count > 1:
            keep = table.admit(ids, sightings, found, round_)
            if keep is not None:
                ids, grad, found, init = ids[keep], grad[keep], found[keep], None
        parts.append(_Part(table, ids, grad, found, lr, init))
    made = [_apply_slab(slab, [parts[k] for k in group], round_) for slab, group in _by_slab([p.table for p in parts])]
    made = [m for m in made if m is not None]
    if not made:
        empty = torch.empty(0, dtype=torch.int64)
        return empty, empty, empty
    return tuple(torch.cat(x) for x in zip(*made))


def _apply_slab(slab, parts: list[_Part], round_: int) -> tuple[torch.Tensor, ...] | None:
    sizes = [p.ids.numel() for p in parts]
    if not sum(sizes):
        return None
    ids, grad = torch.cat([p.ids for p in parts]), torch.cat([p.grad for p in parts])
    slots = torch.cat([p.slots for p in parts])  # a new tensor: the callers' slots stay as they were
    new = slots < 0
    counts = _counts(new, sizes)
    made = None
    if sum(counts):
        where = new.nonzero().reshape(-1)
        fresh = slab.take(len(where))
        slots.index_copy_(0, where, fresh)
        new_ids = ids.index_select(0, where)
        if all(p.initial is not None for p in parts):
            rows = torch.cat([p.initial for p in parts]).index_select(0, where)
        else:
            rows = _initial([p.table for p in parts], new_ids, counts, slab.dim)
        slab.weights.index_copy_(0, fresh, rows)
        for name in slab.widths:
            values = [optimizers.initial_values(p.table.spec.optimizer, p.table.spec.hyperparams)[name] for p in parts]
            value = _per_row(values, counts, torch.float32)
            if isinstance(value, torch.Tensor):
                slab.state[name].index_copy_(0, fresh, value[:, None].expand(-1, slab.widths[name]))
            else:
                slab.state[name].index_fill_(0, fresh, value)
        for p, c in zip(parts, counts):
            p.table.rows += c
            p.table.counts["admitted"] += c
        tags = _per_row([p.table.tag for p in parts], counts, torch.int64)
        if not isinstance(tags, torch.Tensor):
            tags = torch.full((len(where),), tags, dtype=torch.int64)
        made = (new_ids, fresh, tags)
    # one update per group of tables with the same optimizer, hyperparameters, lr and step count
    groups: dict[tuple, list[int]] = {}
    for k, p in enumerate(parts):
        s = p.table.spec
        groups.setdefault((s.optimizer, tuple(sorted(s.hyperparams.items())), p.lr, p.table.step), []).append(k)
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    for (optimizer, hyper, lr, step), members in groups.items():
        if len(members) == len(parts):
            at, g = slots, grad
        else:
            sel = torch.cat([torch.arange(starts[k], starts[k + 1]) for k in members])
            at, g = slots.index_select(0, sel), grad.index_select(0, sel)
        if not at.numel():
            continue
        weights = slab.weights.index_select(0, at)
        state = {name: t.index_select(0, at) for name, t in slab.state.items()}
        optimizers.update(optimizer, dict(hyper), weights, state, g, lr, step)
        slab.weights.index_copy_(0, at, weights)
        for name, t in state.items():
            slab.state[name].index_copy_(0, at, t)
    slab.touched.index_fill_(0, slots, round_)
    return made


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

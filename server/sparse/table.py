"""``RowTable``: one sparse table's rows on one shard, their optimizer state, admission and eviction.

Rows live in tensors grown by 1/8 at a time (float32 weights ``[capacity,
dim]`` and state ``[capacity, width]`` per entry; int32 ``[capacity]``, the
round each row was last pushed (-1: a free slot; rounds count up to
2**31)), addressed through the shard's :class:`~shardps.server.sparse.index.IdIndex` under the table's
tag; freed slots are reused. Callers that look up several tables at once
(``shardps.server.sparse.tables``) pass each table its slots and insert
the new rows' keys that :meth:`RowTable.apply` returns. An id that is not a row reads as its initial value
(``shardps.common.rows.initial_rows``), so a row is created only when a
gradient is applied to it.

Admission (``min_count > 1``): each push that carries an id counts one
sighting; an id becomes a row in the round its count reaches ``min_count``
(that round's gradient is applied), and until then its gradients are
dropped (Monolith's frequency filter). Counts of ids not seen for
``ttl_rounds`` are forgotten with the rows. Eviction, after each round's
update: rows not pushed for ``ttl_rounds`` rounds, then, beyond
``capacity`` rows, the least recently pushed ones. An evicted id reads as
its initial value again.
"""

from __future__ import annotations

import torch

from shardps.common.rows import TableSpec, initial_rows, placement_salt, state_widths
from shardps.server.errors import ResourceExhausted
from shardps.server.sparse import optimizers
from shardps.server.sparse.index import IdIndex

#: Initial rows a table keeps from its reads until the next round (see ``RowTable._initial``).
_FRESH_ROWS = 1 << 16

#: Counters each table keeps (metrics and Stats read them).
COUNTERS = ("admitted", "evicted_ttl", "evicted_capacity", "rows_pulled", "rows_pushed", "dropped_unadmitted")


class RowTable:
    """The rows of table ``spec`` held by one shard (see the module docstring).

    Args:
        spec: the table as the workers declared it.
        max_bytes: the table's memory limit on this shard (bytes of rows, state and index).
        index: the shard's id index, shared by its tables; tag: this table's tag in it.
    """

    def __init__(self, spec: TableSpec, max_bytes: int, index: IdIndex, tag: int) -> None:
        self.spec, self.max_bytes, self.index, self.tag = spec, max_bytes, index, tag
        self.place_salt = placement_salt(spec.name)
        self.widths = state_widths(spec.optimizer, spec.embedding_dim)
        self.rows = 0
        # initial rows computed by the reads since the last round ((ids, rows) pairs, at most _FRESH_ROWS
        # rows): the round that creates those rows takes them from here instead of computing them again
        self._fresh: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._fresh_rows = 0
        self.step = 0  # optimizer steps of the table (rounds that pushed any of its ids)
        self.counts = dict.fromkeys(COUNTERS, 0)
        self._slots = 0  # high-water mark of slots in use
        self._free = torch.empty(0, dtype=torch.int64)
        self._grow(0)
        self.candidates = IdIndex()
        self._cand = torch.zeros(0, 2, dtype=torch.int64)  # (count, last round seen) per candidate slot
        self._cand_used = 0
        self._cand_free = torch.empty(0, dtype=torch.int64)

    # ------------------------------------------------------------ storage
    def _grow(self, need: int) -> None:
        old = getattr(self, "weights", None)
        cap = 0 if old is None else old.shape[0]
        if old is not None and need <= cap:
            return
        new = max(need, int(cap * 1.125) + 64)
        dim = self.spec.embedding_dim
        def grown(t: torch.Tensor | None, shape: tuple[int, ...], fill, dtype=torch.float32) -> torch.Tensor:
            out = torch.empty(shape, dtype=dtype)
            out[cap:] = fill  # only the new part is filled; the old part is copied
            if t is not None:
                out[:cap] = t
            return out

        self.weights = grown(old, (new, dim), 0.0)
        self.touched = grown(None if old is None else self.touched, (new,), -1, torch.int32)
        self.state = {name: grown(None if old is None else self.state[name], (new, w), 0.0)
                      for name, w in self.widths.items()}

    def _take_slots(self, n: int) -> torch.Tensor:
        reuse = self._free[-n:] if n else self._free[:0]
        self._free = self._free[: self._free.numel() - reuse.numel()]
        fresh = torch.arange(self._slots, self._slots + n - reuse.numel())
        self._slots += fresh.numel()
        self._grow(self._slots)
        return torch.cat([reuse, fresh])

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each of ``ids`` (int64 ``[n]``), -1 where it is not a row."""
        return self.index.find(ids, self.tag)

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, slots)`` of every row, int64 ``[rows]`` each (a pass over the shard's whole index)."""
        ids, slots, _ = self.index.items(self.tag)
        return ids, slots

    def nbytes(self) -> int:
        """Bytes this table holds on the shard: row storage (allocated), its share of the index (by rows),
        admission counts."""
        per_slot = 4 * (self.spec.embedding_dim + sum(self.widths.values())) + 4
        share = self.index.nbytes() * self.rows // max(1, len(self.index))
        return self.weights.shape[0] * per_slot + share + self.candidates.nbytes() + self._cand.numel() * 8

    # ------------------------------------------------------------ reads
    def read(self, ids: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of ``ids`` (int64 ``[n]``): float32 ``[n, dim]``; ids that are not rows read as initialised.
        ``slots``: :meth:`find`'s answer for ``ids`` (None: looked up here)."""
        s = self.spec
        slots = self.find(ids) if slots is None else slots
        found = slots >= 0
        out = self.weights[slots.clamp(min=0)]
        if not bool(found.all()):
            missing = ~found
            fresh = initial_rows(s.name, ids[missing], s.embedding_dim, s.seed, s.init_scale, s.padding_idx)
            out[missing] = fresh
            if self._fresh_rows + fresh.shape[0] <= _FRESH_ROWS:
                self._fresh.append((ids[missing], fresh))
                self._fresh_rows += fresh.shape[0]
        self.counts["rows_pulled"] += ids.numel()
        return out

    # ------------------------------------------------------------ a round
    def row_cost(self) -> int:
        """Bytes one more row may cost at most: weights and state, its last-pushed round, its index entries."""
        return self.spec.row_bytes() + 4 + 38

    def check_room(self, ids: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        """Refuse a round that would take the table past ``max_bytes`` (nothing changed); returns the slot of
        each id (-1: not a row), for :meth:`apply`. ``slots``: :meth:`find`'s answer (None: looked up here).

        Raises:
            ResourceExhausted: the message names the table, its limit and what the round needs.
        """
        slots = self.find(ids) if slots is None else slots
        new = int((slots < 0).sum())
        need = (self.rows + new) * self.row_cost()
        if self.max_bytes and need > self.max_bytes:
            raise ResourceExhausted(
                f"table {self.spec.name!r} would need about {need} bytes on this shard for {self.rows + new} rows "
                f"(limit {self.max_bytes} bytes): raise the table's max_bytes or the shard's "
                "--table-max-bytes, add shards, or set capacity/ttl_rounds so rows are evicted")
        return slots

    def apply(self, ids: torch.Tensor, grad: torch.Tensor, sightings: torch.Tensor, lr: float, round_: int,
              slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One round's update: ``ids`` unique int64 ``[n]``, ``grad`` the averaged float32 ``[n, dim]``,
        ``sightings`` int64 ``[n]`` (pushes that carried each id), ``round_`` the round's number;
        ``slots``: :meth:`check_room`'s answer for ``ids``.

        Returns ``(ids, slots)`` of the rows made now: the caller inserts them into the index under
        :attr:`tag`, then calls :meth:`evict`."""
        s = self.spec
        self.counts["rows_pushed"] += ids.numel()
        self.step += 1
        slots = slots.clone()
        made = (ids[:0], slots[:0])
        new = slots < 0
        if s.min_count > 1 and bool(new.any()):
            admit = self._count(ids[new], sightings[new], round_)
            keep = ~new
            keep[new.nonzero().reshape(-1)[admit]] = True
            self.counts["dropped_unadmitted"] += int((~keep).sum())
            ids, grad, slots, new = ids[keep], grad[keep], slots[keep], new[keep]
        if bool(new.any()):
            fresh = self._take_slots(int(new.sum()))
            made = (ids[new], fresh)
            self.rows += fresh.numel()
            self.weights[fresh] = self._initial(ids[new])
            for name, value in optimizers.initial_state(s.optimizer, s.hyperparams, fresh.numel(),
                                                        s.embedding_dim).items():
                self.state[name][fresh] = value
            slots[new] = fresh
            self.counts["admitted"] += fresh.numel()
        if ids.numel():
            weights = self.weights[slots]
            state = {name: t[slots] for name, t in self.state.items()}
            optimizers.update(s.optimizer, s.hyperparams, weights, state, grad, lr, self.step)
            self.weights[slots] = weights
            for name, t in state.items():
                self.state[name][slots] = t
            self.touched[slots] = round_
        self._fresh, self._fresh_rows = [], 0
        return made

    def _initial(self, ids: torch.Tensor) -> torch.Tensor:
        """``initial_rows`` of ``ids`` (int64 ``[n]``, none the padding id): those the reads since the last round
        computed are copied, the others computed."""
        s = self.spec
        if not self._fresh:
            return initial_rows(s.name, ids, s.embedding_dim, s.seed, s.init_scale)
        known = torch.cat([i for i, _ in self._fresh])
        rows = torch.cat([r for _, r in self._fresh])
        order = torch.argsort(known)
        known = known[order]
        at = torch.searchsorted(known, ids).clamp(max=known.numel() - 1)
        hit = known[at] == ids
        out = torch.empty(ids.numel(), s.embedding_dim)
        out[hit] = rows[order[at[hit]]]
        if not bool(hit.all()):
            out[~hit] = initial_rows(s.name, ids[~hit], s.embedding_dim, s.seed, s.init_scale)
        return out

    def _count(self, ids: torch.Tensor, sightings: torch.Tensor, round_: int) -> torch.Tensor:
        """Count sightings of ids that are not rows; the mask of those admitted now (their counts dropped)."""
        cslots = self.candidates.find(ids)
        new = cslots < 0
        if bool(new.any()):
            n = int(new.sum())
            reuse = self._cand_free[-n:]
            self._cand_free = self._cand_free[: self._cand_free.numel() - reuse.numel()]
            fresh = torch.cat([reuse, torch.arange(self._cand_used, self._cand_used + n - reuse.numel())])
            self._cand_used += n - reuse.numel()
            if self._cand_used > self._cand.shape[0]:
                grown = torch.zeros(max(self._cand_used, int(self._cand.shape[0] * 1.25) + 64), 2, dtype=torch.int64)
                grown[: self._cand.shape[0]] = self._cand
                self._cand = grown
            self._cand[fresh] = 0
            self.candidates.insert(ids[new], fresh)
            cslots[new] = fresh
        self._cand[cslots, 0] += sightings
        self._cand[cslots, 1] = round_
        admit = self._cand[cslots, 0] >= self.spec.min_count
        if bool(admit.any()):
            self._cand_free = torch.cat([self._cand_free, self.candidates.remove(ids[admit])])
        return admit

    def evicts(self) -> bool:
        """Whether :meth:`evict` has anything to do (``ttl_rounds`` or ``capacity`` set)."""
        return bool(self.spec.ttl_rounds or self.spec.capacity)

    def evict(self, round_: int, held: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """After round ``round_``'s update (and the index insert of its new rows): drop the rows past
        ``ttl_rounds`` or ``capacity``, and the admission counts past ``ttl_rounds``. ``held``: :meth:`items`'
        answer, when the caller read the index for several tables at once."""
        s = self.spec
        if not self.evicts():
            return
        ids, slots = self.items() if held is None else held
        if s.ttl_rounds and ids.numel():
            old = round_ - self.touched[slots] >= s.ttl_rounds
            if bool(old.any()):
                self._drop(ids[old], slots[old], "evicted_ttl")
                ids, slots = ids[~old], slots[~old]
        if s.ttl_rounds and len(self.candidates):
            cand_ids, cslots, _ = self.candidates.items()
            old = round_ - self._cand[cslots, 1] >= s.ttl_rounds
            if bool(old.any()):
                self._cand_free = torch.cat([self._cand_free, self.candidates.remove(cand_ids[old])])
        if s.capacity and self.rows > s.capacity:
            lru = torch.topk(self.touched[slots], self.rows - s.capacity, largest=False).indices
            self._drop(ids[lru], slots[lru], "evicted_capacity")

    def _drop(self, ids: torch.Tensor, slots: torch.Tensor, why: str) -> None:
        self.index.remove(ids, self.tag)
        self.touched[slots] = -1
        self.rows -= ids.numel()
        self._free = torch.cat([self._free, slots])
        self.counts[why] += ids.numel()

    # ------------------------------------------------------------ export and checkpoints
    def export(self, offset: int = 0, max_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """``(ids int64 [n], weights float32 [n, dim], {state name: float32 [n, width]})`` in id order: rows
        ``[offset, offset + max_rows)`` of them (``max_rows`` 0: all); only those rows are copied."""
        ids, slots = self.items()
        order = torch.argsort(ids)[offset: offset + max_rows if max_rows else None]
        ids, slots = ids[order], slots[order]
        return ids, self.weights[slots].clone(), {name: t[slots].clone() for name, t in self.state.items()}

    def snapshot(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Tensors and numbers that :meth:`restore` turns back into this table, bit for bit."""
        ids, weights, state = self.export()
        touched = self.touched[self.find(ids)].to(torch.int64) if ids.numel() else \
            torch.zeros(0, dtype=torch.int64)
        cand_ids, cslots, _ = self.candidates.items()
        tensors = {"ids": ids, "weights": weights, "touched": touched, "cand_ids": cand_ids,
                   "cand": self._cand[cslots].clone() if cand_ids.numel() else torch.zeros(0, 2, dtype=torch.int64)}
        tensors.update({f"state.{name}": t for name, t in state.items()})
        return tensors, {"step": self.step, "counts": dict(self.counts)}

    def restore(self, tensors: dict[str, torch.Tensor], numbers: dict) -> None:
        """Load what :meth:`snapshot` returned into this (empty) table.

        Raises:
            ValueError: the tensors do not fit the table's spec (the message names the table).
        """
        ids, weights = tensors["ids"], tensors["weights"]
        n = ids.numel()
        shapes_ok = weights.shape == (n, self.spec.embedding_dim) and tensors["touched"].shape == (n,) and all(
            tensors.get(f"state.{k}") is not None and tensors[f"state.{k}"].shape == (n, w)
            for k, w in self.widths.items())
        if not shapes_ok:
            raise ValueError(f"table {self.spec.name!r}: the checkpoint's rows do not match its spec")
        slots = self._take_slots(n)
        self.index.insert(ids, slots, self.tag)
        self.rows += n
        self.weights[slots] = weights
        self.touched[slots] = tensors["touched"].to(torch.int32)
        for k in self.widths:
            self.state[k][slots] = tensors[f"state.{k}"]
        cand_ids = tensors["cand_ids"]
        if cand_ids.numel():
            self._cand = tensors["cand"].clone()
            self._cand_used = cand_ids.numel()
            self.candidates.insert(cand_ids, torch.arange(cand_ids.numel()))
        self.step = int(numbers["step"])
        self.counts.update({k: int(v) for k, v in numbers.get("counts", {}).items() if k in self.counts})

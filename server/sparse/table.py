"""``RowTable``: one sparse table's rows on one shard: counts, admission, eviction, export and checkpoints.

A table's rows live in the :class:`~shardps.server.sparse.slab.RowSlab` it
shares with the shard's other tables of its shape (weights, optimizer
state, the round each row was last pushed), addressed through the shard's
:class:`~shardps.server.sparse.index.IdIndex` under the table's tag; freed
slots are reused. Pulls and rounds read and update the rows of all their
tables at once (``shardps.server.sparse.fused``); an id that is not a row
reads as its initial value (``shardps.common.rows.initial_rows``), so a row
is created only when a gradient is applied to it.

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

import math

import torch

from shardps.common.rows import TableSpec, placement_salt, state_widths
from shardps.server.errors import ResourceExhausted
from shardps.server.sparse.deltas import EvictionLog
from shardps.server.sparse.index import DIRECT_MAX_IDS, IdIndex
from shardps.server.sparse.slab import RowSlab

#: Counters each table keeps (metrics and Stats read them).
COUNTERS = ("admitted", "evicted_ttl", "evicted_capacity", "rows_pulled", "rows_pushed", "dropped_unadmitted")


class RowTable:
    """The rows of table ``spec`` held by one shard (see the module docstring).

    Args:
        spec: the table as the workers declared it.
        max_bytes: the table's memory limit on this shard (bytes of rows, state and index).
        index: the shard's id index, shared by its tables; tag: this table's tag in it.
        slab: the row storage it shares with the shard's tables of its shape (None: a slab of its own).
    """

    def __init__(self, spec: TableSpec, max_bytes: int, index: IdIndex, tag: int, slab: RowSlab | None = None) -> None:
        self.spec, self.max_bytes, self.index, self.tag = spec, max_bytes, index, tag
        if 0 < spec.num_embeddings <= DIRECT_MAX_IDS:  # bounded and small enough: its slots in an array (index.py)
            index.make_direct(tag, spec.num_embeddings)
        self.place_salt = placement_salt(spec.name)
        self.widths = state_widths(spec.optimizer, spec.embedding_dim)
        self.slab = RowSlab(spec.embedding_dim, self.widths, spec.row_dtype, spec.ttl_seconds > 0) if slab is None \
            else slab
        if (self.slab.dim, self.slab.widths, self.slab.dtype, self.slab.seen is not None) != \
                (spec.embedding_dim, self.widths, spec.row_dtype, spec.ttl_seconds > 0):
            raise ValueError(f"table {spec.name!r} does not fit its slab's row shape")
        self.rows = 0
        self.step = 0  # optimizer steps of the table (rounds that pushed any of its ids)
        self.clock = 0.0  # the latest event time pushed to the table, seconds (ttl_seconds tables)
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.evictions = EvictionLog()  # ids evicted per round, for deltas (deltas.py)
        self._round = 0
        self.candidates = IdIndex()
        self._cand = torch.zeros(0, 2, dtype=torch.int64)  # (count, last round seen) per candidate slot
        self._cand_used = 0
        self._cand_free = torch.empty(0, dtype=torch.int64)

    # ------------------------------------------------------------ storage (the slab's; slots index it)
    @property
    def weights(self) -> torch.Tensor:
        return self.slab.weights

    @property
    def state(self) -> dict[str, torch.Tensor]:
        return self.slab.state

    @property
    def touched(self) -> torch.Tensor:
        return self.slab.touched

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each of ``ids`` (int64 ``[n]``), -1 where it is not a row."""
        return self.index.find(ids, self.tag)

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, slots)`` of every row, int64 ``[rows]`` each (a pass over the shard's whole index)."""
        ids, slots, _ = self.index.items(self.tag)
        return ids, slots

    def nbytes(self) -> int:
        """Bytes this table holds on the shard: its share of the slab's storage and of the index (by rows),
        admission counts."""
        storage = self.slab.nbytes() * self.rows // max(1, self.slab.rows)
        share = self.index.nbytes() * self.rows // max(1, len(self.index))
        return storage + share + self.candidates.nbytes() + self._cand.numel() * 8

    # ------------------------------------------------------------ a round
    def row_cost(self) -> int:
        """Bytes one more row may cost at most: weights and state, its last-pushed round, its index entries."""
        return self.spec.row_bytes() + 4 + (8 if self.slab.seen is not None else 0) + 38

    def check_room(self, new: int) -> None:
        """Refuse a round that would make ``new`` rows and take the table past ``max_bytes`` (nothing changed).

        Raises:
            ResourceExhausted: the message names the table, its limit and what the round needs.
        """
        need = (self.rows + new) * self.row_cost()
        if self.max_bytes and need > self.max_bytes:
            raise ResourceExhausted(
                f"table {self.spec.name!r} would need about {need} bytes on this shard for {self.rows + new} rows "
                f"(limit {self.max_bytes} bytes): raise the table's max_bytes or the shard's "
                "--table-max-bytes, add shards, or set capacity/ttl_rounds so rows are evicted")

    def admit(self, ids: torch.Tensor, sightings: torch.Tensor, slots: torch.Tensor,
              round_: int) -> torch.Tensor | None:
        """Admission of a round's ids (``min_count > 1``): ``ids`` unique int64 ``[n]``, ``sightings`` int64
        ``[n]`` (pushes that carried each id), ``slots`` their slots (-1: not a row). Counts the sightings of
        the ids that are not rows; returns the bool mask ``[n]`` of the ids whose gradient is applied (rows
        and ids admitted now), or None when that is all of them."""
        new = slots < 0
        if not bool(new.any()):
            return None
        admit = self._count(ids[new], sightings[new], round_)
        keep = ~new
        keep[new.nonzero().reshape(-1)[admit]] = True
        self.counts["dropped_unadmitted"] += int((~keep).sum())
        return keep

    def would_admit(self, ids: torch.Tensor, sightings: torch.Tensor, slots: torch.Tensor) -> torch.Tensor | None:
        """What :meth:`admit` of the same arguments would return, changing nothing (a round's update is
        computed before anything is written): the bool mask ``[n]`` of the ids whose gradient is applied, or
        None when that is all of them."""
        new = slots < 0
        if not bool(new.any()):
            return None
        fresh, seen = ids[new], sightings[new]
        cslots = self.candidates.find(fresh)
        counted = torch.zeros(fresh.numel(), dtype=torch.int64)  # sightings so far (0: not a candidate)
        hit = cslots >= 0
        if bool(hit.any()):
            counted[hit] = self._cand[cslots[hit], 0]
        keep = ~new
        keep[new.nonzero().reshape(-1)[counted + seen >= self.spec.min_count]] = True
        return keep

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
        """Whether :meth:`evict` has anything to do (``ttl_rounds``, ``ttl_seconds`` or ``capacity`` set)."""
        return bool(self.spec.ttl_rounds or self.spec.ttl_seconds or self.spec.capacity)

    def evict(self, round_: int, held: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """After round ``round_``'s update (and the index insert of its new rows): drop the rows past
        ``ttl_rounds`` or ``capacity``, and the admission counts past ``ttl_rounds``. ``held``: :meth:`items`'
        answer, when the caller read the index for several tables at once."""
        s = self.spec
        if not self.evicts():
            return
        self._round = round_  # the round the drops below are of (the eviction log's)
        ids, slots = self.items() if held is None else held
        if s.ttl_rounds and ids.numel():
            old = round_ - self.touched[slots] >= s.ttl_rounds
            if bool(old.any()):
                self._drop(ids[old], slots[old], "evicted_ttl")
                ids, slots = ids[~old], slots[~old]
        if s.ttl_seconds and ids.numel() and self.clock > 0:  # unseen for ttl_seconds of event time
            old = self.slab.seen[slots].to(torch.float64) < self.clock - s.ttl_seconds
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
        self.evictions.note(self._round, ids)
        self.index.remove(ids, self.tag)
        self.slab.release(slots)
        self.rows -= ids.numel()
        self.counts[why] += ids.numel()

    # ------------------------------------------------------------ export and checkpoints
    def export(self, offset: int = 0, max_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """``(ids int64 [n], weights [n, dim] of the table's dtype, {state name: float32 [n, width]})`` in id order: rows
        ``[offset, offset + max_rows)`` of them (``max_rows`` 0: all); only those rows are copied."""
        ids, slots = self.items()
        order = torch.argsort(ids)[offset: offset + max_rows if max_rows else None]
        ids, slots = ids[order], slots[order]
        return ids, self.weights[slots].clone(), {name: t[slots].clone() for name, t in self.state.items()}

    def snapshot_layout(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """``(name, safetensors dtype, shape)`` of each tensor :meth:`write_snapshot` writes, as the table is now:
        ``ids`` I64 ``[rows]`` (ascending), ``weights`` F32 (F16 for a float16 table) ``[rows, dim]``, ``touched`` I64 ``[rows]`` (the
        round each row was last pushed), ``state.<name>`` F32 ``[rows, width]``, ``cand_ids`` I64 ``[c]`` and
        ``cand`` I64 ``[c, 2]`` (admission counts and last round seen of the ``c`` ids not yet rows)."""
        n, c = self.rows, len(self.candidates)
        weights = "F16" if self.spec.dtype == "float16" else "F32"
        out = [("ids", "I64", (n,)), ("weights", weights, (n, self.spec.embedding_dim)), ("touched", "I64", (n,)),
               ("cand_ids", "I64", (c,)), ("cand", "I64", (c, 2))]
        seen = [("seen", "I64", (n,))] if self.slab.seen is not None else []  # last event times, whole seconds
        return out + seen + [(f"state.{name}", "F32", (n, width)) for name, width in self.widths.items()]

    def snapshot_numbers(self) -> dict:
        """The numbers :meth:`restore` takes besides the tensors: optimizer steps and counters."""
        return {"step": self.step, "counts": dict(self.counts), "clock": self.clock}

    def write_snapshot(self, write, block_bytes: int) -> None:
        """Hand every tensor of :meth:`snapshot_layout` to ``write(name, tensor)``, rows in id order, ``block_bytes``
        of rows at a time (at least one row): the rows are read from the slab a block at a time, never copied
        whole. Memory besides the block: the table's ids and slots sorted (about 32 bytes per row at the peak,
        16 after the sort). Runs where no round changes the table meanwhile (the compute thread, between rounds).

        Raises:
            RuntimeError: the table holds another number of rows or candidates than its layout says (it changed
                since :meth:`snapshot_layout`).
        """
        ids, slots = self.items()
        cand_ids, cslots, _ = self.candidates.items()
        if ids.numel() != self.rows or cand_ids.numel() != len(self.candidates):
            raise RuntimeError(f"table {self.spec.name!r} changed while it was written")
        ids, order = torch.sort(ids)
        slots = slots[order]
        del order
        write("ids", ids)
        del ids
        per = max(1, block_bytes // (4 * max(self.spec.embedding_dim, *self.widths.values(), 2)))
        for begin in range(0, slots.numel(), per):
            part = slots[begin: begin + per]
            write("weights", self.weights[part])
            write("touched", self.touched[part].to(torch.int64))
            if self.slab.seen is not None:
                write("seen", self.slab.seen[part])
            for name in self.widths:
                write(f"state.{name}", self.state[name][part])
        write("cand_ids", cand_ids)
        for begin in range(0, cslots.numel(), per):
            write("cand", self._cand[cslots[begin: begin + per]])

    def restore(self, tensors: dict[str, torch.Tensor], numbers: dict) -> None:
        """Load the tensors :meth:`write_snapshot` wrote (by their names there) and :meth:`snapshot_numbers` into
        this (empty) table.

        Raises:
            ValueError: the tensors do not fit the table's spec (the message names the table).
        """
        ids, weights = tensors["ids"], tensors["weights"]
        n = ids.numel()
        shapes_ok = weights.shape == (n, self.spec.embedding_dim) and weights.dtype == self.spec.row_dtype and tensors["touched"].shape == (n,) and all(
            tensors.get(f"state.{k}") is not None and tensors[f"state.{k}"].shape == (n, w)
            for k, w in self.widths.items())
        if not shapes_ok:
            raise ValueError(f"table {self.spec.name!r}: the checkpoint's rows do not match its spec")
        slots = self.slab.take(n)
        self.index.insert(ids, slots, self.tag)
        self.rows += n
        self.weights[slots] = weights
        self.touched[slots] = tensors["touched"].to(torch.int32)
        for k in self.widths:
            self.state[k][slots] = tensors[f"state.{k}"]
        if self.slab.seen is not None:  # a checkpoint before event times were kept: the rows count as seen now
            seen = tensors.get("seen")
            self.slab.seen[slots] = seen.to(torch.int64) if seen is not None else \
                math.ceil(float(numbers.get("clock", 0.0)))
        self.clock = float(numbers.get("clock", 0.0))
        cand_ids = tensors["cand_ids"]
        if cand_ids.numel():
            self._cand = tensors["cand"].clone()
            self._cand_used = cand_ids.numel()
            self.candidates.insert(cand_ids, torch.arange(cand_ids.numel()))
        self.step = int(numbers["step"])
        self.counts.update({k: int(v) for k, v in numbers.get("counts", {}).items() if k in self.counts})

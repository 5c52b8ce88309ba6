"""``IdIndex``: (tag, int64 id) -> slot, an open-addressing hash map in tensors, looked up a batch at a time.

One index holds the ids of every sparse table of a shard, each table's
under its own ``tag`` (a small int), so a round or a pull looks up all
its tables' ids in one batch: the cost is a few dozen tensor operations
per batch, not per table.

Linear probing over a power-of-two table kept at most 3/4 full (more than
3/8 after growing) (Knuth, TAOCP vol. 3, 6.4), with tombstones for removed
ids. Each entry is an int64 id, an int16 tag and an int32 slot, the slot
doubling as the entry's state (-1 empty, -2 removed): 14 bytes per entry,
19 to 38 bytes per id held.

A batch is looked up in windows: one pass gathers ``_WINDOW`` consecutive
entries from each key's home position and decides every key whose window
holds it or an empty entry (almost all of them); the few left go on, a
window further, in the next pass. A key held is always before the first
empty entry of its probe sequence (removal leaves a tombstone, never an
empty entry) and held at most once, so the hit is the window's only entry
with its key. Inserting, keys that pick the same free entry take the
first, second, ... free entries of their window by rank, so a pass
places almost every key.
"""

from __future__ import annotations

import torch

from shardps.common.rows import mix

_EMPTY, _TOMB = -1, -2
_WINDOW = 8  # entries looked at per key in the first probe pass
_WIDE = 16  # and in each later pass (the few keys left, in long clusters)
_TAG_MUL = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: spreads tags over the id bits
#: Tags an index takes: [0, MAX_TAG].
MAX_TAG = 2**15 - 1


class IdIndex:
    """A map from unique ``(tag, id)`` keys (``tag`` in ``[0, MAX_TAG]``, any int64 ``id``) to slots in
    ``[0, 2**31)`` (see the module docstring). Not thread-safe, except ``len`` and :meth:`nbytes`.

    ``tags`` arguments are an int (every id of the batch) or an int64 tensor ``[n]``, one per id.
    """

    def __init__(self, capacity: int = 1024) -> None:
        cap = 16
        while cap < capacity:
            cap *= 2
        self._alloc(cap)
        self.size = 0
        self._window, self._wide = torch.arange(_WINDOW), torch.arange(_WIDE)
        self._later: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # see insert_later

    def _alloc(self, cap: int) -> None:
        self.cap = cap
        self.keys = torch.zeros(cap, dtype=torch.int64)
        self.tags = torch.zeros(cap, dtype=torch.int16)
        self.slots = torch.full((cap,), _EMPTY, dtype=torch.int32)
        self.tombs = 0

    def __len__(self) -> int:
        """Keys held, those of :meth:`insert_later` included (read-only: safe from a metrics thread)."""
        return self.size + sum(ids.numel() for ids, _, _ in list(self._later))

    def nbytes(self) -> int:
        """Bytes of the index's tensors (read-only: safe from a metrics thread)."""
        return self.cap * 14

    def insert_later(self, ids: torch.Tensor, slots: torch.Tensor, tags) -> None:
        """:meth:`insert`, done by :meth:`flush` or the next call of any other method (a round's new keys go in
        while the shard would otherwise wait: after its answer, before the next lookup). ``tags``: int64 ``[n]``."""
        if ids.numel():
            self._later.append((ids, slots, torch.as_tensor(tags, dtype=torch.int64).expand(ids.numel())))

    @property
    def pending(self) -> bool:
        """Whether keys of :meth:`insert_later` wait for :meth:`flush`."""
        return bool(self._later)

    def flush(self) -> None:
        """Insert what :meth:`insert_later` holds now (every other method does it first; a caller with idle
        time does it early)."""
        if self._later:
            later, self._later = self._later, []
            self.insert(*(torch.cat(parts) for parts in zip(*later)))

    @staticmethod
    def keys_mix(ids: torch.Tensor, tags) -> torch.Tensor:
        """A 64-bit mix of each ``(tag, id)`` key (int64 ``[n]``): equal keys, equal mixes (the home position's
        bits)."""
        return mix(ids ^ (tags * _TAG_MUL))

    def _home(self, ids: torch.Tensor, tags) -> torch.Tensor:
        return self.keys_mix(ids, tags) & (self.cap - 1)

    def _windows(self, pos: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        """Table positions of the window starting at each of ``pos`` (int64 ``[n]``): int64 ``[n, window]``."""
        return (pos[:, None] + window) & (self.cap - 1)

    @staticmethod
    def _gather(t: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """``t[at]`` for 2-D ``at`` (a flat ``index_select``: about half the time of advanced indexing)."""
        return t.index_select(0, at.reshape(-1)).view(at.shape)

    def _locate(self, ids: torch.Tensor, tags) -> torch.Tensor:
        """The table position of each key (int64 ``[n]``), -1 where absent."""
        n = ids.numel()
        tags = torch.as_tensor(tags, dtype=torch.int64).expand(n)
        where = torch.full((n,), -1, dtype=torch.int64)
        active, keys = None, ids
        pos, window = self._home(ids, tags), self._window
        for _ in range(self.cap // _WINDOW + 1):
            at = self._windows(pos, window)
            st = self._gather(self.slots, at)
            hit = (self._gather(self.keys, at) == keys[:, None]) & (self._gather(self.tags, at) == tags[:, None]) & \
                (st >= 0)
            found = hit.any(1)
            place = (hit * at).sum(1)  # at most one hit per key
            go = ~found & (st != _EMPTY).all(1)  # neither the key nor an empty entry in the window: look further
            if active is None:
                where = torch.where(found, place, -1)
            else:
                where[active[found]] = place[found]
            if not bool(go.any()):
                break
            idx = go.nonzero().reshape(-1)
            active = idx if active is None else active[idx]
            keys, tags, pos = keys[idx], tags[idx], (pos[idx] + window.numel()) & (self.cap - 1)
            window = self._wide
        return where

    def find(self, ids: torch.Tensor, tags=0) -> torch.Tensor:
        """The slot of each key (int64 ``[n]``), -1 where absent."""
        self.flush()
        if not ids.numel():
            return torch.empty(0, dtype=torch.int64)
        where = self._locate(ids, tags)
        return torch.where(where >= 0, self.slots[where.clamp(min=0)].to(torch.int64), -1)

    def insert(self, ids: torch.Tensor, slots: torch.Tensor, tags=0) -> None:
        """Add keys (unique, none present) with their ``slots`` (int64 ``[n]``)."""
        self.flush()
        n = ids.numel()
        if not n:
            return
        if 4 * (self.size + self.tombs + n) > 3 * self.cap:  # at most 3/4 full
            self._rehash(self.size + n)
        tags = torch.as_tensor(tags, dtype=torch.int64).expand(n)
        pending = torch.arange(n)
        pos, window = self._home(ids, tags), self._window
        for _ in range(self.cap):
            at = self._windows(pos, window)
            free = self._gather(self.slots, at) < 0
            count = free.cumsum(1)  # free entries up to each entry of the window
            width = window.numel()
            off = (count == 0).sum(1)  # each window's first free entry, in probe order (width: none)
            first = torch.where(off < width, (pos + off) & (self.cap - 1), self.cap)
            # keys whose first free entry is the same take its 1st, 2nd, ... free entry of their window by rank
            order = torch.argsort(first, stable=True)
            sorted_first = first.index_select(0, order)
            starts = torch.ones_like(sorted_first, dtype=torch.bool)
            starts[1:] = sorted_first[1:] != sorted_first[:-1]
            index = torch.arange(first.numel())
            group_start = torch.cummax(index * starts, 0).values
            rank = torch.empty_like(first).index_copy_(0, order, index - group_start)
            pick = free & (count == rank[:, None] + 1)
            hidx = pick.any(1).nonzero().reshape(-1)
            cand, cpos = pending.index_select(0, hidx), (pick * at).sum(1).index_select(0, hidx)
            cand_ids, cand_tags = ids.index_select(0, cand), tags.index_select(0, cand)
            self.keys.index_copy_(0, cpos, cand_ids)  # keys sharing an entry: one write wins, checked below
            self.tags.index_copy_(0, cpos, cand_tags.to(torch.int16))
            won = ((self.keys.index_select(0, cpos) == cand_ids) &
                   (self.tags.index_select(0, cpos) == cand_tags)).nonzero().reshape(-1)
            wpos, wid = cpos.index_select(0, won), cand.index_select(0, won)
            self.tombs -= int((self.slots.index_select(0, wpos) == _TOMB).sum())
            self.slots.index_copy_(0, wpos, slots.index_select(0, wid).to(torch.int32))
            # losers and keys without an entry look again from their window's first entry still free,
            # or a window further when the window is full
            keep = torch.ones(pending.numel(), dtype=torch.bool)
            keep[hidx.index_select(0, won)] = False
            keep = keep.nonzero().reshape(-1)
            if not keep.numel():
                break
            nxt = pos + off  # off is the width where the window is full
            pending, pos = pending.index_select(0, keep), nxt.index_select(0, keep) & (self.cap - 1)
            window = self._wide
        self.size += n

    def remove(self, ids: torch.Tensor, tags=0) -> torch.Tensor:
        """Remove the keys present; returns their slots (int64, in ``ids``' order, absent ones left out)."""
        self.flush()
        where = self._locate(ids, tags)
        where = where[where >= 0]
        slots = self.slots[where].to(torch.int64)
        self.slots[where] = _TOMB
        self.tombs += where.numel()
        self.size -= where.numel()
        if self.tombs > self.cap // 4:
            self._rehash(self.cap)
        return slots

    def items(self, tag: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every ``(ids, slots, tags)`` held (under ``tag`` only, if given), int64 ``[n]`` each, in table order.
        One pass over the whole table."""
        self.flush()
        used = self.slots >= 0
        if tag is not None:
            used &= self.tags == tag
        return self.keys[used].clone(), self.slots[used].to(torch.int64), self.tags[used].to(torch.int64)

    def _rehash(self, want: int) -> None:
        ids, slots, tags = self.items()
        cap = 16
        while 4 * want > 3 * cap:  # at most 3/4 full, more than 3/8 after growing
            cap *= 2
        self._alloc(cap)
        self.size = 0
        if not ids.numel():
            return
        # Into an empty table, linear probing in order of home position places the i-th key at
        # max(its home, the (i-1)-th key's place + 1) = i + max over j <= i of (home_j - j): one sort and
        # one running maximum instead of probe passes. Keys placed past the end wrap around: the
        # ordinary insert places those few.
        home = self._home(ids, tags)
        order = torch.argsort(home)
        rank = torch.arange(ids.numel())
        place = rank + torch.cummax(home[order] - rank, 0).values
        inside = place < cap
        put, sel = place[inside], order[inside]
        self.keys[put], self.tags[put], self.slots[put] = ids[sel], tags[sel].to(torch.int16), slots[sel].to(torch.int32)
        self.size = put.numel()
        rest = order[~inside]
        self.insert(ids[rest], slots[rest], tags[rest])

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

A bounded table of at most :data:`DIRECT_MAX_IDS` ids (every id in ``[0,
num_embeddings)``, checked where a request comes in) keeps its slots in a
direct array instead (:meth:`IdIndex.make_direct`): 4 bytes per id of the
table, and a lookup is one gather, where probing the hash takes three
gathers of a window per key, each a cache miss in a large table (48,000
keys looked up among 2.6 million held: 26 ms probing, 0.8 ms direct, on
the 2-core machine).
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
#: The most ids a bounded table may have to keep its slots in a direct array (16 MiB of int32 slots).
DIRECT_MAX_IDS = 2**22


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
        self.size = 0  # keys in the hash (those of direct tags are direct_size)
        self._window, self._wide = torch.arange(_WINDOW), torch.arange(_WIDE)
        self._later: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # see insert_later
        self._direct = torch.empty(0, dtype=torch.int32)  # the slots of every direct tag's ids, -1: absent
        self._start = torch.empty(0, dtype=torch.int64)  # per tag: where its ids start in _direct, -1: hashed
        self._limit = torch.empty(0, dtype=torch.int64)  # per tag: its num_embeddings (direct tags)
        self.direct_size = 0  # keys held in _direct
        self._direct_used = 0  # entries of _direct that belong to a tag (the rest: room to grow)

    def _alloc(self, cap: int) -> None:
        self.cap = cap
        self.keys = torch.zeros(cap, dtype=torch.int64)
        self.tags = torch.zeros(cap, dtype=torch.int16)
        self.slots = torch.full((cap,), _EMPTY, dtype=torch.int32)
        self.tombs = 0

    def __len__(self) -> int:
        """Keys held, those of :meth:`insert_later` included (read-only: safe from a metrics thread)."""
        return self.size + self.direct_size + sum(ids.numel() for ids, _, _ in list(self._later))

    def nbytes(self) -> int:
        """Bytes of the index's tensors (read-only: safe from a metrics thread)."""
        return self.cap * 14 + self._direct_used * 4

    def make_direct(self, tag: int, num_embeddings: int) -> None:
        """Keep the slots of ``tag``'s keys, whose ids are all in ``[0, num_embeddings)``, in a direct array (see
        the module docstring); :meth:`find` answers -1 for an id outside that range.

        Raises:
            ValueError: ``num_embeddings`` not in ``[1, DIRECT_MAX_IDS]``, ``tag`` outside ``[0, MAX_TAG]``, or the
                tag holds keys already.
        """
        if not 0 < num_embeddings <= DIRECT_MAX_IDS or not 0 <= tag <= MAX_TAG:
            raise ValueError(f"a direct tag takes 1 to {DIRECT_MAX_IDS} ids and a tag in [0, {MAX_TAG}], got "
                             f"{num_embeddings} ids under tag {tag}")
        if self._start_of(tag) >= 0 or self.items(tag)[0].numel():
            raise ValueError(f"tag {tag} holds keys already: make it direct before inserting any")
        if tag >= self._start.numel():
            grow = tag + 1 - self._start.numel()
            self._start = torch.cat([self._start, torch.full((grow,), -1, dtype=torch.int64)])
            self._limit = torch.cat([self._limit, torch.zeros(grow, dtype=torch.int64)])
        start = self._direct_used
        if start + num_embeddings > self._direct.numel():  # grown by doubling: declaring many tables copies little
            grown = torch.empty(max(start + num_embeddings, 2 * self._direct.numel()), dtype=torch.int32)
            grown[:start] = self._direct[:start]
            self._direct = grown
        self._direct[start:start + num_embeddings] = _EMPTY
        self._direct_used = start + num_embeddings
        self._start[tag], self._limit[tag] = start, num_embeddings

    def _start_of(self, tag: int) -> int:
        return int(self._start[tag]) if 0 <= tag < self._start.numel() else -1

    def _direct_at(self, ids: torch.Tensor, tags) -> tuple[torch.Tensor | None, torch.Tensor | bool]:
        """``(position of each key in _direct, -1 where its id is out of its tag's range; which keys are of direct
        tags: a bool [n], or True/False for all of them)``; ``(None, False)`` where none is."""
        if not self._start.numel():
            return None, False
        if not isinstance(tags, torch.Tensor) or tags.dim() == 0:
            start = self._start_of(int(tags))
            if start < 0:
                return None, False
            ok = (ids >= 0) & (ids < int(self._limit[int(tags)]))
            return torch.where(ok, ids + start, -1), True
        known = (tags >= 0) & (tags < self._start.numel())
        t = torch.where(known, tags, 0)
        start = torch.where(known, self._start.index_select(0, t), -1)
        direct = start >= 0
        if not bool(direct.any()):
            return None, False
        ok = direct & (ids >= 0) & (ids < self._limit.index_select(0, t))
        return torch.where(ok, ids + start, -1), (True if bool(direct.all()) else direct)

    def direct_keys(self, tags) -> torch.Tensor | bool:
        """Which keys of ``tags`` (an int, or int64 ``[n]``) are held in direct arrays: a bool ``[n]``, or True/False
        for all of them. A direct key's :meth:`find` is one gather, cheaper than any search for it elsewhere."""
        if not isinstance(tags, torch.Tensor) or tags.dim() == 0:
            return self._start_of(int(tags)) >= 0
        return self._direct_at(torch.zeros_like(tags), tags)[1]

    def _direct_slots(self, at: torch.Tensor) -> torch.Tensor:
        """The slot at each position ``at`` of _direct (int64), -1 where ``at`` is -1."""
        return torch.where(at >= 0, self._direct.index_select(0, at.clamp(min=0)).to(torch.int64), -1)

    def insert_later(self, ids: torch.Tensor, slots: torch.Tensor, tags) -> None:
        """:meth:`insert`, done by :meth:`flush` or the next call of any other method (a round's new keys go in
        while the shard would otherwise wait: after its answer, before the next lookup); keys of direct tags go in
        at once (one scatter). ``tags``: int64 ``[n]``."""
        if ids.numel():
            tags = torch.as_tensor(tags, dtype=torch.int64).expand(ids.numel())
            ids, slots, tags = self._insert_direct(ids, slots, tags)
            if ids.numel():
                self._later.append((ids, slots, tags))

    def _insert_direct(self, ids: torch.Tensor, slots: torch.Tensor, tags) -> tuple:
        """Put the keys of direct tags in their arrays; the others, ``(ids, slots, tags)``, are the caller's."""
        at, direct = self._direct_at(ids, tags) if ids.numel() else (None, False)
        if direct is False:
            return ids, slots, tags
        mine = slice(None) if direct is True else direct
        put = at[mine]
        if bool((put < 0).any()):
            raise ValueError("an id outside its bounded table's range cannot be inserted")
        self._direct.index_copy_(0, put, slots[mine].to(torch.int32))
        self.direct_size += put.numel()
        if direct is True:
            return ids[:0], slots[:0], ids[:0]
        rest = (~direct).nonzero().reshape(-1)
        return ids.index_select(0, rest), slots.index_select(0, rest), tags.index_select(0, rest)

    def find_direct(self, ids: torch.Tensor, tags) -> torch.Tensor:
        """:meth:`find` of keys all of direct tags (:meth:`direct_keys`), without flushing the keys of hashed tags
        that :meth:`insert_later` holds (those of direct tags never wait). Int64 ``[n]``, -1 where absent."""
        at, direct = self._direct_at(ids, tags) if ids.numel() else (None, True)
        if direct is not True:
            raise ValueError("find_direct takes keys of direct tags only")
        return self._direct_slots(at) if ids.numel() else torch.empty(0, dtype=torch.int64)

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
        at, direct = self._direct_at(ids, tags)
        if direct is True:
            return self._direct_slots(at)
        if direct is False:
            return self._find_hashed(ids, tags)
        out = self._direct_slots(at)
        hashed = (~direct).nonzero().reshape(-1)
        out[hashed] = self._find_hashed(ids.index_select(0, hashed), tags.index_select(0, hashed))
        return out

    def _find_hashed(self, ids: torch.Tensor, tags) -> torch.Tensor:
        where = self._locate(ids, tags)
        return torch.where(where >= 0, self.slots[where.clamp(min=0)].to(torch.int64), -1)

    def insert(self, ids: torch.Tensor, slots: torch.Tensor, tags=0) -> None:
        """Add keys (unique, none present) with their ``slots`` (int64 ``[n]``)."""
        self.flush()
        ids, slots, tags = self._insert_direct(ids, slots, tags)
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
        at, direct = self._direct_at(ids, tags) if ids.numel() else (None, False)
        if direct is not False:
            found = self.find(ids, tags)  # in ids' order, as the answer
            gone = at[(found >= 0) & (direct if direct is not True else True)]
            self._direct.index_fill_(0, gone, _EMPTY)
            self.direct_size -= gone.numel()
            if direct is not True:
                rest = (~direct).nonzero().reshape(-1)
                self._remove_hashed(ids.index_select(0, rest), tags.index_select(0, rest))
            return found[found >= 0]
        return self._remove_hashed(ids, tags)

    def _remove_hashed(self, ids: torch.Tensor, tags) -> torch.Tensor:
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
        One pass over the whole table (a direct tag: over its array, ids in increasing order)."""
        self.flush()
        if tag is not None and self._start_of(tag) >= 0:
            return self._direct_items(tag)
        hashed = self._hashed_items(tag)
        if tag is not None or not self.direct_size:
            return hashed
        parts = [hashed, *(self._direct_items(t) for t in (self._start >= 0).nonzero().reshape(-1).tolist())]
        return tuple(torch.cat(p) for p in zip(*parts))

    def _direct_items(self, tag: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        start = self._start_of(tag)
        region = self._direct[start:start + int(self._limit[tag])]
        ids = (region >= 0).nonzero().reshape(-1)
        return ids, region.index_select(0, ids).to(torch.int64), torch.full_like(ids, tag)

    def _hashed_items(self, tag: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        used = self.slots >= 0
        if tag is not None:
            used &= self.tags == tag
        return self.keys[used].clone(), self.slots[used].to(torch.int64), self.tags[used].to(torch.int64)

    def _rehash(self, want: int) -> None:
        ids, slots, tags = self._hashed_items()
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

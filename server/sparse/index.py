"""``IdIndex``: int64 id -> int64 slot, an open-addressing hash map in tensors, looked up a batch at a time.

Linear probing over a power-of-two table kept at most 3/4 full (1/4 to 1/2 after growing) (Knuth,
TAOCP vol. 3, 6.4), with tombstones for removed ids; every operation is a
few vectorised passes over the batch (one per probe step), so a batch of
thousands of ids costs microseconds per id and no Python object per id.
Memory: 17 bytes per table entry, 23 to 68 bytes per id held.
"""

from __future__ import annotations

import torch

from shardps.common.rows import mix

_EMPTY, _USED, _TOMB = 0, 1, 2


class IdIndex:
    """A map from unique int64 ids to int64 slots (see the module docstring). Not thread-safe."""

    def __init__(self, capacity: int = 1024) -> None:
        cap = 1
        while cap < max(capacity, 16):
            cap *= 2
        self._alloc(cap)
        self.size = 0

    def _alloc(self, cap: int) -> None:
        self.cap = cap
        self.keys = torch.zeros(cap, dtype=torch.int64)
        self.slots = torch.zeros(cap, dtype=torch.int64)
        self.state = torch.zeros(cap, dtype=torch.int8)
        self.tombs = 0

    def __len__(self) -> int:
        return self.size

    def nbytes(self) -> int:
        """Bytes of the index's tensors."""
        return self.cap * 17

    def _locate(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions of ``ids`` (int64 ``[n]``) in the table and whether each was found."""
        n = ids.numel()
        where = torch.full((n,), -1, dtype=torch.int64)
        active = torch.arange(n)
        pos = mix(ids) & (self.cap - 1)
        keys = ids
        for _ in range(self.cap):
            if not active.numel():
                break
            st = self.state[pos]
            hit = (st == _USED) & (self.keys[pos] == keys)
            where[active[hit]] = pos[hit]
            go = ~hit & (st != _EMPTY)
            active, pos, keys = active[go], (pos[go] + 1) & (self.cap - 1), keys[go]
        return where, where >= 0

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each id (int64 ``[n]``), -1 where absent."""
        where, found = self._locate(ids)
        out = torch.full_like(ids, -1)
        out[found] = self.slots[where[found]]
        return out

    def insert(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Add ``ids`` (unique, none present) with their ``slots`` (both int64 ``[n]``)."""
        if not ids.numel():
            return
        if 4 * (self.size + self.tombs + ids.numel()) > 3 * self.cap:  # at most 3/4 full
            self._rehash(self.size + ids.numel())
        pending = torch.arange(ids.numel())
        pos = mix(ids) & (self.cap - 1)
        for _ in range(self.cap):
            if not pending.numel():
                break
            free = self.state[pos] != _USED
            cand, cpos = pending[free], pos[free]
            self.keys[cpos] = ids[cand]  # duplicates of a position: one write wins, the check below finds it
            won = self.keys[cpos] == ids[cand]
            wpos = cpos[won]
            self.tombs -= int((self.state[wpos] == _TOMB).sum())
            self.state[wpos] = _USED
            self.slots[wpos] = slots[cand[won]]
            done = torch.zeros(ids.numel(), dtype=torch.bool)
            done[cand[won]] = True
            keep = ~done[pending]
            pending, pos = pending[keep], (pos[keep] + 1) & (self.cap - 1)
        self.size += ids.numel()

    def remove(self, ids: torch.Tensor) -> torch.Tensor:
        """Remove the present ``ids``; returns their slots (int64, in ``ids``' order, absent ones left out)."""
        where, found = self._locate(ids)
        where = where[found]
        self.state[where] = _TOMB
        self.tombs += where.numel()
        self.size -= where.numel()
        slots = self.slots[where]
        if self.tombs > self.cap // 4:
            self._rehash(self.cap)
        return slots

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every ``(ids, slots)`` held, int64 ``[size]`` each, in table order."""
        used = self.state == _USED
        return self.keys[used].clone(), self.slots[used].clone()

    def _rehash(self, want: int) -> None:
        ids, slots = self.items()
        cap = 16
        while cap < 2 * want:
            cap *= 2
        self._alloc(cap)
        self.size = 0
        self.insert(ids, slots)

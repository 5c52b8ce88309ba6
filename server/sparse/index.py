"""``IdIndex``: int64 id -> int64 slot, an open-addressing hash map in tensors, looked up a batch at a time.

Linear probing over a power-of-two table kept at most 3/4 full (more than 3/8 after growing) (Knuth,
TAOCP vol. 3, 6.4), with tombstones for removed ids; every operation is a
few vectorised passes over the batch (one per probe step), so a batch of
thousands of ids costs microseconds per id and no Python object per id.
Memory: 13 bytes per table entry (int64 id, int32 slot, state byte), 17 to 35 bytes per id held.
"""

from __future__ import annotations

import torch

from shardps.common.rows import mix

_EMPTY, _USED, _TOMB = 0, 1, 2
_WINDOW = 32  # entries looked at per probe pass


class IdIndex:
    """A map from unique int64 ids to slots in ``[0, 2**31)`` (see the module docstring). Not thread-safe."""

    def __init__(self, capacity: int = 1024) -> None:
        cap = 1
        while cap < max(capacity, 16):
            cap *= 2
        self._alloc(cap)
        self.size = 0

    def _alloc(self, cap: int) -> None:
        self.cap = cap
        self.keys = torch.zeros(cap, dtype=torch.int64)
        self.slots = torch.zeros(cap, dtype=torch.int32)
        self.state = torch.zeros(cap, dtype=torch.int8)
        self.tombs = 0

    def __len__(self) -> int:
        return self.size

    def nbytes(self) -> int:
        """Bytes of the index's tensors."""
        return self.cap * 13

    def _locate(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions of ``ids`` (int64 ``[n]``) in the table and whether each was found.

        Each pass looks at a window of ``_WINDOW`` consecutive entries per id (one gather), so
        almost every id resolves in the first pass; the few still undecided go on past the window.
        """
        n = ids.numel()
        where = torch.full((n,), -1, dtype=torch.int64)
        active = torch.arange(n)
        pos = mix(ids) & (self.cap - 1)
        keys = ids
        window = torch.arange(_WINDOW)
        for _ in range(self.cap // _WINDOW + 1):
            if not active.numel():
                break
            at = (pos[:, None] + window) & (self.cap - 1)
            st = self.state[at]
            hit = (st == _USED) & (self.keys[at] == keys[:, None])
            empty = st == _EMPTY
            # the first hit or empty entry of each window decides (an empty one ends the probe)
            decisive = hit | empty
            first = torch.where(decisive.any(1), decisive.to(torch.int8).argmax(1), _WINDOW)
            rows = torch.arange(active.numel())
            found = (first < _WINDOW) & hit[rows, first.clamp(max=_WINDOW - 1)]
            where[active[found]] = at[rows[found], first[found]]
            go = first == _WINDOW
            active, pos, keys = active[go], (pos[go] + _WINDOW) & (self.cap - 1), keys[go]
        return where, where >= 0

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each id (int64 ``[n]``), -1 where absent."""
        where, found = self._locate(ids)
        out = torch.full_like(ids, -1)
        out[found] = self.slots[where[found]].to(torch.int64)
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
            self.slots[wpos] = slots[cand[won]].to(torch.int32)
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
        slots = self.slots[where].to(torch.int64)
        if self.tombs > self.cap // 4:
            self._rehash(self.cap)
        return slots

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every ``(ids, slots)`` held, int64 ``[size]`` each, in table order."""
        used = self.state == _USED
        return self.keys[used].clone(), self.slots[used].to(torch.int64)

    def _rehash(self, want: int) -> None:
        ids, slots = self.items()
        cap = 16
        while 4 * want > 3 * cap:  # at most 3/4 full, more than 3/8 after growing
            cap *= 2
        self._alloc(cap)
        self.size = 0
        self.insert(ids, slots)

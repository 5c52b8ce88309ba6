"""``RowSlab``: the row storage a shard's tables of one shape share, so a round touches them all at once.

Every table of a shard with the same ``embedding_dim`` and optimizer-state
widths (``shardps.common.rows.state_widths``) keeps its rows in one slab:
weights ``[capacity, dim]`` (float32, or float16 for float16 tables: a slab holds
one dtype), float32 state ``[capacity, width]``
per state entry, and int32 ``[capacity]``, the round each row was last
pushed (-1: a free slot; rounds count up to 2**31). The shard's id index
maps ``(table tag, id)`` to a slot of the table's slab, and slots of
different tables never overlap, so a pull or a round of 26 tables gathers,
updates and scatters their rows with a handful of tensor operations
instead of a handful per table (the per-table layout cost about 0.6 ms of
operator overhead per table and round). This is the same reason FBGEMM's
table-batched embedding (``SplitTableBatchedEmbeddingBagsCodegen``) puts
tables of one kind in one weight tensor.

The slab doubles its capacity when full. The part past the slots handed
out is never written until it is handed out (a new row's weights, state
and round are written then), so its pages are not resident: growing costs
one copy of the rows held, and memory follows the rows, not the capacity.
Freed slots are reused, the most recently freed first.
"""

from __future__ import annotations

import torch

__all__ = ["RowSlab"]


class RowSlab:
    """Rows of ``dim`` weights of ``dtype`` (float32 or float16) and ``widths`` (``{state name: width}``) float32
    state, in shared tensors.

    Attributes:
        weights: ``dtype`` ``[capacity, dim]``; state: ``{name: float32 [capacity, width]}``;
        touched: int32 ``[capacity]``, the round each row was last pushed (-1 for a freed slot; slots never
            handed out hold garbage).
    """

    def __init__(self, dim: int, widths: dict[str, int], dtype: torch.dtype = torch.float32,
                 event_times: bool = False) -> None:
        self.dim, self.widths, self.dtype = dim, dict(widths), dtype
        #: int64 ``[capacity]``: each row's latest event time, whole seconds rounded up (slabs of tables with
        #: ``ttl_seconds`` only, else None)
        self.seen: torch.Tensor | None = torch.empty(0, dtype=torch.int64) if event_times else None
        self.used = 0  # high-water mark of slots handed out
        self.free = torch.empty(0, dtype=torch.int64)
        self.weights = torch.empty(0, dim, dtype=dtype)
        self.touched = torch.empty(0, dtype=torch.int32)
        self.state = {name: torch.empty(0, w) for name, w in self.widths.items()}
        self._grow(1)  # never empty: reads gather slot 0 for ids that are not rows

    @property
    def rows(self) -> int:
        """Slots in use (rows of every table in this slab)."""
        return self.used - self.free.numel()

    def slot_bytes(self) -> int:
        """Bytes of one slot: weights, state and its last-pushed round."""
        return self.dtype.itemsize * self.dim + 4 * sum(self.widths.values()) + 4 + (8 if self.seen is not None else 0)

    def nbytes(self) -> int:
        """Bytes of the slots ever handed out (in use or freed for reuse). The capacity past them is allocated
        but never written, so its pages are not resident (virtual memory only) and not counted."""
        return self.used * self.slot_bytes()

    def take(self, n: int) -> torch.Tensor:
        """``n`` slots for new rows (int64 ``[n]``): freed ones first, then new ones (growing the tensors)."""
        reuse = self.free[self.free.numel() - min(n, self.free.numel()):]
        self.free = self.free[: self.free.numel() - reuse.numel()]
        fresh = torch.arange(self.used, self.used + n - reuse.numel())
        self.used += fresh.numel()
        self._grow(self.used)
        return torch.cat([reuse, fresh])

    def reserve(self, n: int) -> None:
        """Grow now (if needed) so that :meth:`take` of ``n`` slots does not grow: a caller with idle time
        moves the copy of a doubling off the next round's critical path."""
        self._grow(self.used + max(0, n - self.free.numel()))

    def release(self, slots: torch.Tensor) -> None:
        """Free ``slots`` (int64 ``[n]``, in use): they read as free (touched -1) and are handed out again."""
        self.touched[slots] = -1
        self.free = torch.cat([self.free, slots])

    def _grow(self, need: int) -> None:
        cap = self.weights.shape[0]
        if need <= cap:
            return
        new = max(need, 2 * cap, 64)

        def grown(t: torch.Tensor) -> torch.Tensor:
            out = torch.empty((new, *t.shape[1:]), dtype=t.dtype)  # the new part is never read before written
            out[:cap] = t
            return out

        self.weights = grown(self.weights)
        self.touched = grown(self.touched)
        if self.seen is not None:
            self.seen = grown(self.seen)
        self.state = {name: grown(t) for name, t in self.state.items()}

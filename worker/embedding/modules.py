"""``ShardedEmbedding`` and ``ShardedEmbeddingBag``: ``nn.Embedding``/``nn.EmbeddingBag`` whose rows live on the shards.

Forward takes int64 ids, de-duplicates them for the batch, pulls only
those rows (each from the shard ``shardps.common.rows.shard_of`` places it
on), and runs the lookup locally under autograd on a small float32 leaf
``[unique ids, embedding_dim]``; backward fills that leaf's gradient,
one row per unique id, which ``DistributedOptimizer.step()`` pushes with
the round (summed over every lookup of the step). The rows of a step are
pulled after the previous step's push is applied on every shard, so sync
training sees exactly what one process would (Li et al., "Scaling
distributed machine learning with the parameter server", OSDI 2014;
TorchRec's sharded tables).

The module's only parameter is ``handle``, an empty placeholder: give it
to the sparse optimizer (``DistributedOptimizer(..., sparse_optimizer=)``),
whose param group sets the table's optimizer, learning rate (read at
every step, so LR schedulers work) and hyperparameters.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from shardps.common.rows import check_ids

__all__ = ["ShardedEmbedding", "ShardedEmbeddingBag", "ShardedTable", "is_table_handle", "table_of"]

_HANDLES: "weakref.WeakValueDictionary[int, ShardedTable]" = weakref.WeakValueDictionary()  # id(handle) -> module


def is_table_handle(p: torch.Tensor) -> bool:
    """True for the ``handle`` placeholder of a sharded table module."""
    return _HANDLES.get(id(p)) is not None and _HANDLES[id(p)].handle is p


def table_of(p: torch.Tensor) -> "ShardedTable":
    """The sharded table module whose ``handle`` is ``p``. Raises KeyError: ``p`` is not a handle."""
    if not is_table_handle(p):
        raise KeyError("not the handle of a sharded table")
    return _HANDLES[id(p)]


class ShardedTable(nn.Module):
    """What both modules share: the table's settings, the pull, the lookups of the step waiting for their push.

    Args:
        embedding_dim: values per row.
        num_embeddings: None: hashed, any int64 id (a row is created when first trained); N: ids in ``[0, N)``
            (others raise ValueError naming the id), exportable as a plain ``weight`` matrix.
        name: the table's name on the shards (default: the module's name in ``model``).
        padding_idx: an id that reads as zeros and is never trained (as ``nn.Embedding``'s).
        seed, init_scale: rows start uniform in ``[-init_scale, init_scale)``, a function of
            (name, id, seed) only (``shardps.common.rows``); init_scale None: ``1/sqrt(embedding_dim)``.
        min_count: sightings (pushes carrying the id) before an id becomes a trained row; until then it
            reads as its initial value and its gradient is dropped (0 or 1: at once).
        ttl_rounds: evict rows not pushed for this many rounds (0: never).
        capacity: rows per shard; beyond it the least recently pushed are evicted (0: no limit).
        max_bytes: memory limit of the table per shard, bytes (0: the shard's ``--table-max-bytes``).

    Raises:
        ValueError: a setting out of range.
    """

    def __init__(self, embedding_dim: int, num_embeddings: int | None = None, *, name: str | None = None,
                 padding_idx: int | None = None, seed: int = 0, init_scale: float | None = None,
                 min_count: int = 0, ttl_rounds: int = 0, capacity: int = 0, max_bytes: int = 0) -> None:
        super().__init__()
        if num_embeddings is not None and num_embeddings < 1:
            raise ValueError(f"num_embeddings must be >= 1 or None (hashed), got {num_embeddings}")
        if padding_idx is not None and num_embeddings is not None and padding_idx < 0:
            padding_idx += num_embeddings  # as nn.Embedding
        if padding_idx is not None and padding_idx < 0:
            raise ValueError(f"padding_idx must be an id >= 0, got {padding_idx}")
        self.embedding_dim, self.num_embeddings, self.name = embedding_dim, num_embeddings, name
        self.padding_idx, self.seed, self.init_scale = padding_idx, seed, init_scale
        self.min_count, self.ttl_rounds, self.capacity, self.max_bytes = min_count, ttl_rounds, capacity, max_bytes
        self.handle = nn.Parameter(torch.empty(0))
        _HANDLES[id(self.handle)] = self
        self.tables = None  # the DistributedOptimizer's SparseTables once attached (``attach``)
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (unique ids, leaf) per lookup of the step

    def extra_repr(self) -> str:
        size = "hashed" if self.num_embeddings is None else str(self.num_embeddings)
        return f"{size}, {self.embedding_dim}, name={self.name!r}"

    def attach(self, tables) -> None:
        """Pull and push through ``tables`` (a ``SparseTables``); None detaches (forward then raises)."""
        self.tables = tables
        self.pending.clear()

    def check_lookup(self, ids: torch.Tensor) -> None:
        """Refuse ids this table cannot look up.

        Raises:
            RuntimeError: not attached. TypeError, ValueError: see ``check_ids``.
        """
        what = f"{type(self).__name__} {self.name!r}"
        if self.tables is None:
            raise RuntimeError(f"{what} is not attached to shards yet: pass its handle to "
                               "DistributedOptimizer(..., sparse_optimizer=) before the first forward")
        check_ids(ids, what, self.num_embeddings or 0)

    def prepare_lookup(self, ids: torch.Tensor, unique_inverse: tuple[torch.Tensor, torch.Tensor] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """``(unique ids to pull [m], local index of each id (ids' shape, CPU), local padding index or None)``.
        ``unique_inverse``: ``torch.unique(ids.reshape(-1), return_inverse=True)`` when the caller has it.

        Raises:
            RuntimeError: not attached. TypeError, ValueError: see ``check_ids``.
        """
        self.check_lookup(ids)
        unique, inverse = torch.unique(ids.reshape(-1).cpu(), return_inverse=True) if unique_inverse is None \
            else unique_inverse
        pad = None
        if self.padding_idx is not None:
            is_pad = unique == self.padding_idx
            if bool(is_pad.any()):
                keep = ~is_pad
                local = torch.cumsum(keep.to(torch.int64), 0) - 1
                pad = int(keep.sum())
                local[is_pad] = pad
                unique, inverse = unique[keep], local[inverse]
        return unique, inverse.view(ids.shape), pad

    def finish_lookup(self, unique: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor,
                pad: int | None) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """``(weight [m (+1), dim], local index of each id, local padding index or None)`` on the handle's
        device, from the pulled ``rows`` (float32 ``[m, dim]``); keeps the rows for the step's push."""
        device = self.handle.device
        rows = rows.to(device)
        if torch.is_grad_enabled() and self.training:
            rows.requires_grad_(True)
            self.pending.append((unique, rows))
        weight = rows if pad is None else torch.cat([rows, torch.zeros(1, self.embedding_dim, device=device)])
        return weight, inverse.to(device), pad

    def _lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        unique, inverse, pad = self.prepare_lookup(ids)
        return self.finish_lookup(unique, self.tables.pull(self.name, unique), inverse, pad)


class ShardedEmbedding(ShardedTable):
    """``nn.Embedding`` (``sparse=True``) with its rows on the shards: ``forward(input)`` -> ``[*input.shape, dim]``.

    ``input``: int64 ids of any shape (see :class:`ShardedTable` for the arguments).

    Raises:
        TypeError: ids that are not int64.
        ValueError: an id outside ``[0, num_embeddings)`` of a bounded table.
        RuntimeError: the module is not attached to a ``DistributedOptimizer``.
    """

    def __init__(self, num_embeddings: int | None, embedding_dim: int, padding_idx: int | None = None, **kw) -> None:
        super().__init__(embedding_dim, num_embeddings, padding_idx=padding_idx, **kw)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight, index, _ = self._lookup(input)
        # F.embedding(index, weight), as a gather: the same values, and a backward of one index_add_ (no sort)
        return weight.index_select(0, index.reshape(-1)).view(*index.shape, weight.shape[1])


class ShardedEmbeddingBag(ShardedTable):
    """``nn.EmbeddingBag`` (``sparse=True``) with its rows on the shards.

    ``forward(input, offsets=None, per_sample_weights=None)`` as ``nn.EmbeddingBag``'s: 2-D ``input``
    ``[B, L]`` makes B bags of L ids; 1-D ``input`` with ``offsets`` ``[B]`` (or ``[B + 1]`` with
    ``include_last_offset``) makes B bags; ``mode`` ``sum``, ``mean`` or ``max``; ``per_sample_weights``
    (float, ``input``'s shape) with ``sum`` only; the padding id is left out of its bag. Returns ``[B, dim]``.

    Raises:
        TypeError: ids that are not int64.
        ValueError: an id outside ``[0, num_embeddings)``; a ``mode`` that is not sum, mean or max.
        RuntimeError: the module is not attached to a ``DistributedOptimizer``.
    """

    def __init__(self, num_embeddings: int | None, embedding_dim: int, mode: str = "mean",
                 include_last_offset: bool = False, padding_idx: int | None = None, **kw) -> None:
        if mode not in ("sum", "mean", "max"):
            raise ValueError(f"mode must be sum, mean or max, got {mode!r}")
        super().__init__(embedding_dim, num_embeddings, padding_idx=padding_idx, **kw)
        self.mode, self.include_last_offset = mode, include_last_offset

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        weight, index, pad = self._lookup(input)
        return bags(index, weight, offsets, self.mode, per_sample_weights, self.include_last_offset, pad)


def bags(index: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor | None, mode: str,
         per_sample_weights: torch.Tensor | None, include_last_offset: bool, pad: int | None) -> torch.Tensor:
    """``F.embedding_bag`` of the local ``index`` (int64 ``[B, L]``, or ``[n]`` with ``offsets``) into ``weight``
    (float ``[m, dim]``): float ``[B, dim]``. When every bag is one id (``[B, 1]``, no weights, no padding id,
    the shape of a DLRM's categorical features) it is a row gather: the same values (the sum, mean or max of
    one row is that row), and a backward of one ``index_add_`` instead of ``embedding_bag``'s sort of the
    indices (about 3x faster on CPU, 26 times a step for a DLRM)."""
    if offsets is None and index.dim() == 2 and index.shape[1] == 1 and per_sample_weights is None and pad is None:
        return weight.index_select(0, index.reshape(-1))
    return F.embedding_bag(index, weight, offsets, mode=mode, per_sample_weights=per_sample_weights,
                           include_last_offset=include_last_offset, padding_idx=pad)

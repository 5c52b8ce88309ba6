"""Prefetching from the data loader: the next batch's rows pulled while this step computes, whoever owns the loop.

A model ported from a recommender library keeps one sharded module per
feature (``shardps.worker.embedding.porting.shard_embeddings``) and its
library's trainer owns the training loop, so nothing can call
``ShardedEmbeddingBagCollection.prefetch`` between a step's forward and its
``step()``. Each module would then pull its own rows, one round trip per
module and shard, in sequence. Wrapping the trainer's data loader is one
line::

    loader = shardps.prefetching(loader, dist, lambda batch: {model.user: batch["user"], ...})

When the trainer takes batch ``k`` (after step ``k - 1``'s ``step()``), the
wrapper reads batch ``k + 1`` from the loader and asks the shards for the
rows of all its tables, one call per shard, answered once step ``k``'s push
is applied there (``SparseTables.prefetch_tables``; TorchRec's prefetching
train pipeline overlaps its input lookups the same way). During step ``k +
1``'s forward, each module's lookup whose ids are all among the prefetched
ones reads its rows from that answer, the values a pull would return then
(the sync oracle holds); a lookup with other ids (an evaluation batch, an
``ids_of`` that misses a field) pulls as before, so a wrong ``ids_of``
costs speed, never correctness. A lookup of the very tensor ``ids_of``
named for a table (not edited since) reuses the unique ids, the padding
and the range check made here, also where a table is called for several
fields (each tensor of the list ``ids_of`` gave) or has a ``padding_idx``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

import torch

from shardps.worker.embedding.modules import ShardedTable, bitmap_lookup, drop_padding, unique_ids

__all__ = ["prefetching", "Prefetching"]


def _in_range(ids: torch.Tensor, n: int) -> bool:
    """Every id of ``ids`` (int64 ``[k]``) in ``[0, n)``: it passes the forward's ``check_ids`` (its dtype aside)."""
    if not ids.numel():
        return True
    low, high = torch.aminmax(ids)
    return 0 <= int(low) and int(high) < n


def _tables_of(dist):
    tables = getattr(dist, "tables", None)
    if tables is None or not hasattr(tables, "prefetch_tables"):
        raise TypeError("prefetching takes the DistributedOptimizer that trains the tables "
                        "(DistributedOptimizer(..., sparse_optimizer=)), got "
                        f"{type(dist).__name__}" + (" without sparse tables" if hasattr(dist, "tables") else ""))
    return tables


class Prefetching:
    """Iterates ``loader`` one batch ahead, prefetching the next batch's rows (module docstring).

    Args:
        loader: any iterable of batches (a ``torch.utils.data.DataLoader``, a list...); ``len()`` is its own.
        dist: the ``DistributedOptimizer`` (or ``NodeOptimizer``) whose ``sparse_optimizer`` trains the tables.
        ids_of: ``batch -> {module or table name: ids}``: the ids each sharded module will look up in that
            batch (int tensors of any shape; a module called for two fields takes both fields' ids, as a
            list of tensors or concatenated).

    Raises (while iterating):
        TypeError: ``dist`` trains no sharded tables; ``ids_of`` returned something else than a mapping of
            ``ShardedTable`` modules or table names to int tensors.
        KeyError: a module or name that is not a table of ``dist``.
    """

    def __init__(self, loader: Iterable, dist, ids_of: Callable[[object], Mapping]) -> None:
        self.loader, self.ids_of = loader, ids_of
        self._tables = _tables_of(dist)

    def __len__(self) -> int:
        return len(self.loader)  # TypeError where the loader has none, as the loader itself

    def _wanted(self, batch) -> dict[str, torch.Tensor]:
        got = self.ids_of(batch)
        if not isinstance(got, Mapping):
            raise TypeError(f"ids_of must return {{module or table name: ids}}, got {type(got).__name__}")
        wanted: dict[str, list[torch.Tensor]] = {}
        sources: dict[str, list[torch.Tensor]] = {}  # the tensors as ids_of gave them
        for key, ids in got.items():
            name = key.name if isinstance(key, ShardedTable) else key
            if not isinstance(name, str):
                raise TypeError(f"ids_of's keys are sharded modules or table names, got {type(key).__name__}")
            for t in (ids if isinstance(ids, (list, tuple)) else [ids]):
                if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex():
                    raise TypeError(f"ids_of gave table {name!r} a {type(t).__name__} "
                                    f"{getattr(t, 'dtype', '')}, not an int tensor of ids")
                wanted.setdefault(name, []).append(t.reshape(-1).to("cpu", torch.int64))
                sources.setdefault(name, []).append(t)
        out = {}
        for name, parts in wanted.items():
            module = self._tables.tables[name][0] if name in self._tables.tables else None
            if module is None:
                raise KeyError(f"no sharded table named {name!r} (tables: {', '.join(self._tables.tables)})")
            n = module.num_embeddings or 0
            total = sum(part.numel() for part in parts)  # checked: as the forward's check_ids would (dtype aside)
            checked = not n or (total > 0 and all(_in_range(part, n) for part in parts))
            if n and checked and n <= 4 * total:  # a bitmap of the table
                seen = None  # each tensor's own lookup from a bitmap of its ids; the table's the union of them
                for source, part in zip(sources[name], parts):
                    part_seen, unique, inverse, pad = bitmap_lookup(part, n, module.padding_idx)
                    self._know(module, source, unique, inverse, pad, True)
                    seen = part_seen if seen is None else seen.logical_or_(part_seen)
                out[name] = unique if len(parts) == 1 else seen.nonzero().reshape(-1)
                continue
            ids = parts[0] if len(parts) == 1 else torch.cat(parts)
            unique, inverse = unique_ids(ids)
            if len(parts) == 1:
                unique, inverse, pad = drop_padding(unique, inverse, module.padding_idx)
                self._know(module, sources[name][0], unique, inverse, pad, checked)
            else:  # each tensor's own lookup, from its slice of the union's inverse
                start = 0
                for source, part in zip(sources[name], parts):
                    where, local = unique_ids(inverse[start:start + part.numel()], unique.numel())
                    self._know(module, source, *drop_padding(unique.index_select(0, where), local,
                                                             module.padding_idx), checked)
                    start += part.numel()
                unique = drop_padding(unique, inverse, module.padding_idx)[0]
            out[name] = unique
        return out

    @staticmethod
    def _know(module: ShardedTable, source: torch.Tensor, unique: torch.Tensor, inverse: torch.Tensor,
              pad: int | None, checked: bool) -> None:
        """The forward's lookup of this very tensor (checked here as the forward would) reuses ``unique``,
        ``inverse`` and ``pad`` (``ShardedTable.prepare_lookup``) where it still equals a copy taken now (an
        edit that bypassed autograd's version counter is caught); the prefetched rows are read whole where
        ``unique`` is the tensor prefetched, else found in them."""
        if checked and source.dtype in (torch.int64, torch.int32):
            module.known.append((source, source._version, source.clone(), unique, inverse, pad))

    def __iter__(self) -> Iterator:
        it = iter(self.loader)
        try:
            ahead = next(it)
        except StopIteration:
            return
        while True:
            batch = ahead
            try:
                ahead = next(it)
            except StopIteration:
                yield batch
                return
            # the trainer took `batch` after its last step(): `ahead` is the batch after the next step()
            self._tables.prefetch_tables(self._wanted(ahead))
            yield batch


def prefetching(loader: Iterable, dist, ids_of: Callable[[object], Mapping]) -> Prefetching:
    """``loader`` with the next batch's rows prefetched while each step computes: :class:`Prefetching`.

    Raises:
        TypeError: ``dist`` trains no sharded tables.
    """
    return Prefetching(loader, dist, ids_of)

"""``ShardedEmbeddingBagCollection``: several ``ShardedEmbeddingBag`` looked up in one pull per shard.

A model with many tables (DLRM's 26 categorical features) that looks each
up on its own makes one round trip per table and step; the collection
de-duplicates every table's ids, pulls the rows of all its tables in one
``PullRows`` call per shard (the shard looks them all up in one index
batch), then runs each bag as ``ShardedEmbeddingBag.forward`` would
(TorchRec's ``EmbeddingBagCollection``; Naumov et al., "Deep learning
recommendation model for personalization and recommendation systems",
2019). Training is the same as with the bags called one by one: each bag
keeps its own rows and gradients, and ``step()`` pushes them all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from shardps.worker.embedding import fused, keyed
from shardps.worker.embedding.modules import ShardedEmbeddingBag, bags

__all__ = ["ShardedEmbeddingBagCollection", "merged", "spread"]


def unique_rows(ids: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``torch.unique(t.reshape(-1), return_inverse=True)`` of each int64 tensor of ``ids`` (CPU results), the
    tensors with as many ids as each other sorted as one batch (one ``sort`` of ``[k, n]`` instead of k calls:
    a DLRM's 26 features in one go). Same values as ``torch.unique``: sorted unique ids, int64 inverse."""
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(ids)
    groups: dict[int, list[int]] = {}
    for k, t in enumerate(ids):
        groups.setdefault(t.numel(), []).append(k)
    for n, members in groups.items():
        if n == 0 or len(members) == 1:
            for k in members:
                out[k] = torch.unique(ids[k].reshape(-1).cpu(), return_inverse=True)
            continue
        rows, order = torch.stack([ids[k].reshape(-1).cpu() for k in members]).sort(dim=1)
        first = torch.ones_like(rows, dtype=torch.bool)
        first[:, 1:] = rows[:, 1:] != rows[:, :-1]
        inverse = torch.empty_like(order).scatter_(1, order, first.cumsum(1) - 1)
        for k, unique, inv in zip(members, rows[first].split(first.sum(1).tolist()), inverse):
            out[k] = (unique, inv)
    return out


def merged(parts: list[tuple[str, torch.Tensor]]) -> tuple[list[tuple[str, torch.Tensor]], list[tuple]]:
    """One part per table of ``parts`` (``[(table name, sorted unique int64 ids)]``, a table possibly several
    times: one table serving several features): ``(the parts to pull, one per table with the union of its ids;
    for each of ``parts``, (its merged part, the positions of its ids in that union or None where the same))``."""
    by_name: dict[str, list[int]] = {}
    for k, (name, _) in enumerate(parts):
        by_name.setdefault(name, []).append(k)
    out: list[tuple[str, torch.Tensor]] = []
    where: list[tuple] = [()] * len(parts)
    for name, ks in by_name.items():
        if len(ks) == 1:
            where[ks[0]] = (len(out), None)
            out.append(parts[ks[0]])
            continue
        union = torch.unique(torch.cat([parts[k][1] for k in ks]))
        for k in ks:
            where[k] = (len(out), torch.searchsorted(union, parts[k][1]))
        out.append((name, union))
    return out, where


def spread(rows: list[torch.Tensor], where: list[tuple]) -> list[torch.Tensor]:
    """The rows of each part :func:`merged` merged, from the rows of its merged parts (a tensor of its own each)."""
    return [rows[k] if at is None else rows[k].index_select(0, at) for k, at in where]


def _local_bag(bag: nn.Module, value) -> torch.Tensor:
    """A local bag (``nn.EmbeddingBag``) of one feature value: ids, ``(ids, offsets)`` or ``(ids, offsets,
    weights)``, the offsets in the ids' dtype (``nn.EmbeddingBag`` takes one dtype for both)."""
    ids, offsets, weights = (*((value,) if isinstance(value, torch.Tensor) else tuple(value)), None, None)[:3]
    return bag(ids, None if offsets is None else offsets.to(ids.dtype), weights)


class ShardedEmbeddingBagCollection(nn.Module):
    """Several :class:`ShardedEmbeddingBag` under their keys, looked up together.

    Args:
        bags: ``{key: ShardedEmbeddingBag}`` (kept in a ``ModuleDict``; a bag without ``name`` takes its
            name in the model, as any sharded table). One bag may serve several keys (one table for several
            features, as TorchRec's ``feature_names``): its rows are pulled once per step, for the union of
            those features' ids, and each feature's lookup keeps its own gradient (summed in the push).
            Or TorchRec's ``EmbeddingBagCollection`` arguments: a list of ``EmbeddingBagConfig`` (``tables``)
            and ``is_weighted`` (``shardps.worker.embedding.keyed`` says what each config field becomes).
        tables, is_weighted, device: TorchRec's (``bags`` and ``tables`` are one argument: give one).
            ``device`` is kept for TorchRec's ``device`` property; the outputs are on the ids' device.
        seed: the seed of the configs' row initialisers (``tables`` only).

    ``forward(features)``: ``features`` maps keys to what the bag's forward takes: an int64 or int32 ids tensor
    (2-D ``[B, L]``), or a tuple ``(ids, offsets)`` or ``(ids, offsets, per_sample_weights)``. Returns
    ``{key: float [B, dim]}`` for the keys given (a subset of the bags is fine). Or ``features`` is a TorchRec
    ``KeyedJaggedTensor`` (int32 or int64 ids, B + 1 offsets, weights when weighted): returns a ``KeyedTensor``
    of float ``[B, sum of dims]`` keyed as TorchRec's ``EmbeddingBagCollection`` keys it.
    ``embedding_bag_configs()`` and ``is_weighted()`` answer as TorchRec's.

    A copy made by ``shardps.local_model`` (its bags turned into ``nn.EmbeddingBag``) looks each bag up
    locally, with the same outputs.

    Raises:
        TypeError: a bag that is not a ``ShardedEmbeddingBag``; a feature that is not ids or a tuple of 2 or 3;
            ids that are not int64 or int32; configs that are not ``EmbeddingBagConfig``.
        KeyError: a feature key with no bag.
        ValueError, RuntimeError: as ``ShardedEmbeddingBag.forward``; configs the shards cannot hold
            (``keyed.bags_from_configs``).
        ImportError: configs or a ``KeyedJaggedTensor`` without torchrec installed.
    """

    def __init__(self, bags: Mapping[str, ShardedEmbeddingBag] | Sequence | None = None, *,
                 tables: Sequence | None = None, is_weighted: bool = False, device=None, seed: int = 0) -> None:
        super().__init__()
        if bags is not None and tables is not None:
            raise TypeError("give bags or tables (EmbeddingBagConfigs), not both")
        configs = tables if tables is not None else None if bags is None or isinstance(bags, Mapping) else bags
        if configs is not None:
            bags, self._keys, self._dims = keyed.bags_from_configs(list(configs), seed=seed)
            self._configs: list | None = list(configs)
        elif bags is None:
            raise TypeError("ShardedEmbeddingBagCollection takes bags ({key: ShardedEmbeddingBag}) or tables "
                            "(a list of EmbeddingBagConfig)")
        else:
            self._configs, self._keys = None, [(key, key) for key in bags]
            self._dims = [getattr(bag, "embedding_dim", 0) for bag in bags.values()]
        for key, bag in bags.items():
            if not isinstance(bag, ShardedEmbeddingBag):
                raise TypeError(f"bag {key!r} is a {type(bag).__name__}, not a ShardedEmbeddingBag")
        self._weighted, self._device = bool(is_weighted), torch.device(device) if device is not None else None
        self.bags = nn.ModuleDict(bags)
        self._prefetched: tuple | None = None  # (calls, SparseTables.prefetch) of prefetch(), until forward

    def embedding_bag_configs(self) -> list:
        """TorchRec's ``EmbeddingBagConfig`` list: the one the collection was built from, or one per table of
        its bags (``keyed.configs_of``; ValueError for a hashed table or a max bag)."""
        return self._configs if self._configs is not None else keyed.configs_of(dict(self.bags))

    def is_weighted(self) -> bool:
        """Whether a ``KeyedJaggedTensor`` batch carries per-id weights (TorchRec's ``is_weighted``)."""
        return self._weighted

    @property
    def device(self) -> torch.device:
        """TorchRec's ``device``: the one given, else the CPU."""
        return self._device or torch.device("cpu")

    def _features(self, features):
        """``features`` as keys to ids/tuples: a ``KeyedJaggedTensor`` converted (``keyed.features_of``)."""
        if keyed.is_keyed_jagged(features):
            weighted = self._weighted if self._configs is not None else features.weights_or_none() is not None
            return keyed.features_of(features, self._keys, weighted)
        return features

    def _calls(self, features: Mapping[str, torch.Tensor | tuple]) -> list[tuple]:
        """``[(key, bag, prepare_lookup(ids), offsets, per_sample_weights, ids)]`` of ``features``, checked."""
        unknown = [k for k in features if k not in self.bags]
        if unknown:
            raise KeyError(f"no bag for feature {unknown[0]!r} (bags: {', '.join(self.bags)})")
        calls = []
        for key, value in features.items():
            if isinstance(value, torch.Tensor):
                value = (value,)
            if not isinstance(value, (tuple, list)) or not 1 <= len(value) <= 3:
                raise TypeError(f"feature {key!r} takes ids, (ids, offsets) or (ids, offsets, per_sample_weights), "
                                f"got {type(value).__name__}" + (f" of {len(value)}" if isinstance(
                                    value, (tuple, list)) else ""))
            ids, offsets, weights = (*value, None, None)[:3]
            self.bags[key].check_lookup(ids)
            calls.append((key, self.bags[key], ids, offsets, weights))
        if calls and any(bag.tables is not calls[0][1].tables for _, bag, *_ in calls):
            raise RuntimeError("the bags of a collection must be attached to the same DistributedOptimizer")
        found = unique_rows([ids if ids.dtype == torch.int64 else ids.long() for _, _, ids, _, _ in calls])
        return [(key, bag, bag.prepare_lookup(ids, got), offsets, weights, ids)
                for (key, bag, ids, offsets, weights), got in zip(calls, found)]

    def prefetch(self, features: Mapping[str, torch.Tensor | tuple]) -> None:
        """Start pulling the rows of ``features`` (what :meth:`forward` takes) for the forward after the next
        ``step()``: call it after this step's forward and before ``step()``; the shards look the ids up while
        the step computes and answer once its push is applied, so the next forward with the same ids (compared
        exactly) waits only for the rows (TorchRec's prefetching train pipeline). A forward with other ids
        drops the prefetch and pulls as usual; so does one where the prefetch could not be answered.

        Raises: as :meth:`forward`, for the features.
        """
        self.drop_prefetch()
        calls = [(*c[:5], c[5].clone()) for c in self._calls(self._features(features))]  # the ids as they are now
        if calls:
            tables = calls[0][1].tables
            self._prefetched = (calls, tables.prefetch(merged([(bag.name, prep[0]) for _, bag, prep, *_ in calls])[0]))

    def drop_prefetch(self) -> None:
        """Cancel a :meth:`prefetch` not used yet (none: nothing happens)."""
        pending, self._prefetched = self._prefetched, None
        if pending is not None:
            pending[1].drop(pending[0][0][1].tables)

    def forward(self, features):
        if keyed.is_keyed_jagged(features):
            return keyed.keyed_tensor(self._pool(self._features(features)), self._keys, self._dims)
        return self._pool(features)

    def _pool(self, features: Mapping[str, torch.Tensor | tuple]) -> dict[str, torch.Tensor]:
        """``{key: float [B, dim]}`` of ``features`` (keys to ids or tuples): pulled together, or looked up in
        the local bags of a ``shardps.local_model`` copy."""
        if not all(isinstance(self.bags[key], ShardedEmbeddingBag) for key in features if key in self.bags):
            return {key: _local_bag(self.bags[key], value) for key, value in features.items()}
        pending, self._prefetched = self._prefetched, None
        if pending is not None and self._same_ids(pending[0], features):
            calls = [(key, bag, prep, *self._extras(features[key]), ids) for key, bag, prep, _, _, ids in pending[0]]
            rows = calls[0][1].tables.collect(pending[1])  # None: pull them below
        else:
            if pending is not None:
                pending[1].drop(pending[0][0][1].tables)
            calls, rows = self._calls(features), None
        if not calls:
            return {}
        parts, where = merged([(bag.name, prep[0]) for _, bag, prep, *_ in calls])
        if rows is None:
            rows = calls[0][1].tables.pull_many(parts)
        looked = [(key, bag, bag.finish_lookup(unique, got, inverse, pad), offsets, weights)
                  for (key, bag, (unique, inverse, pad), offsets, weights, _), got in zip(calls, spread(rows, where))]
        pooled, whole = fused.pooled_by_mode([(weight, index, offsets, weights, bag.include_last_offset, bag.mode,
                                                pad) for _, bag, (weight, index, pad), offsets, weights in looked])
        out = fused.PooledFeatures(
            (key, bags(index, weight, offsets, bag.mode, weights, bag.include_last_offset, pad) if got is None else got)
            for (key, bag, (weight, index, pad), offsets, weights), got in zip(looked, pooled))
        out.whole = whole
        return out

    @staticmethod
    def _extras(value) -> tuple:
        """``(offsets, per_sample_weights)`` of one feature value (None where not given)."""
        value = (value,) if isinstance(value, torch.Tensor) else tuple(value)
        return (*value[1:], None, None)[:2]

    @staticmethod
    def _same_ids(calls: list[tuple], features: Mapping) -> bool:
        """Whether ``features`` name the same keys, in order, with equal ids as the prefetched ``calls``."""
        if [c[0] for c in calls] != list(features):
            return False
        for (_, _, _, _, _, ids), value in zip(calls, features.values()):
            now = value if isinstance(value, torch.Tensor) else (value[0] if isinstance(value, (tuple, list)) and
                                                                 1 <= len(value) <= 3 else None)
            if not isinstance(now, torch.Tensor) or now.dtype != ids.dtype or not torch.equal(now, ids):
                return False
        return True

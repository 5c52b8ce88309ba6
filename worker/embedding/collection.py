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

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from shardps.worker.embedding.modules import ShardedEmbeddingBag

__all__ = ["ShardedEmbeddingBagCollection"]


class ShardedEmbeddingBagCollection(nn.Module):
    """Several :class:`ShardedEmbeddingBag` under their keys, looked up together.

    Args:
        bags: ``{key: ShardedEmbeddingBag}`` (kept in a ``ModuleDict``; a bag without ``name`` takes its
            name in the model, as any sharded table).

    ``forward(features)``: ``features`` maps keys to what the bag's forward takes: an int64 ids tensor
    (2-D ``[B, L]``), or a tuple ``(ids, offsets)`` or ``(ids, offsets, per_sample_weights)``. Returns
    ``{key: float [B, dim]}`` for the keys given (a subset of the bags is fine).

    Raises:
        TypeError: a bag that is not a ``ShardedEmbeddingBag``; a feature that is not ids or a tuple of 2 or 3;
            ids that are not int64.
        KeyError: a feature key with no bag.
        ValueError, RuntimeError: as ``ShardedEmbeddingBag.forward``.
    """

    def __init__(self, bags: Mapping[str, ShardedEmbeddingBag]) -> None:
        super().__init__()
        for key, bag in bags.items():
            if not isinstance(bag, ShardedEmbeddingBag):
                raise TypeError(f"bag {key!r} is a {type(bag).__name__}, not a ShardedEmbeddingBag")
        self.bags = nn.ModuleDict(bags)

    def forward(self, features: Mapping[str, torch.Tensor | tuple]) -> dict[str, torch.Tensor]:
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
            bag = self.bags[key]
            calls.append((key, bag, bag.prepare_lookup(ids), offsets, weights))
        if not calls:
            return {}
        tables = calls[0][1].tables
        if any(bag.tables is not tables for _, bag, *_ in calls):
            raise RuntimeError("the bags of a collection must be attached to the same DistributedOptimizer")
        rows = tables.pull_many([(bag.name, prep[0]) for _, bag, prep, _, _ in calls])
        out = {}
        for (key, bag, (unique, inverse, pad), offsets, weights), got in zip(calls, rows):
            weight, index, pad = bag.finish_lookup(unique, got, inverse, pad)
            out[key] = F.embedding_bag(index, weight, offsets, mode=bag.mode, per_sample_weights=weights,
                                       include_last_offset=bag.include_last_offset, padding_idx=pad)
        return out

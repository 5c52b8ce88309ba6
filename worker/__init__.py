"""shardps worker side: ``DistributedOptimizer``, its option groups, ``LocalCluster`` and the ``shardps`` CLI.

The names are imported on first use (PEP 562), so that operator commands
(``shardps stats``, ``shardps health``) start without importing torch.
"""

from __future__ import annotations

import importlib

__all__ = ["ConsistencyOptions", "DistributedOptimizer", "LocalCluster", "ObservabilityOptions", "RowWiseAdagrad",
           "ShardedEmbedding", "ShardedEmbeddingBag", "ShardedEmbeddingBagCollection", "WireOptions"]
_WHERE = {
    "DistributedOptimizer": "shardps.worker.optimizer",
    "ConsistencyOptions": "shardps.worker.config",
    "WireOptions": "shardps.worker.config",
    "ObservabilityOptions": "shardps.worker.config",
    "LocalCluster": "shardps.worker.cluster",
    "ShardedEmbedding": "shardps.worker.embedding.modules",
    "ShardedEmbeddingBag": "shardps.worker.embedding.modules",
    "ShardedEmbeddingBagCollection": "shardps.worker.embedding.collection",
    "RowWiseAdagrad": "shardps.worker.embedding.specs",
}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'shardps.worker' has no attribute {name!r}")

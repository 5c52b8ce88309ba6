"""shardps: a sharded parameter server for PyTorch training over gRPC.

The public names, importable from here (``from shardps import DistributedOptimizer``).
Each is imported on first use (PEP 562), so that a shard process never imports the
worker side, and operator commands start without importing torch:

- worker side: :class:`DistributedOptimizer` and its option groups
  (:class:`ConsistencyOptions`, :class:`WireOptions`, :class:`ObservabilityOptions`),
  :class:`NodeOptimizer` (reduction within a node),
  :class:`LocalCluster` (shard processes on this machine), :class:`ShardRpcError`,
  :class:`GradientEditedError`, and :mod:`shardps.worker.export` as ``export``;
- recommender models: the sharded tables (:class:`ShardedEmbedding`, :class:`ShardedEmbeddingBag`,
  :class:`ShardedEmbeddingBagCollection`, :class:`RowWiseAdagrad`), porting a library's model
  (:func:`shard_embeddings`, :func:`sharded_parameters`, :func:`prefetching`) and taking it out of the
  job (:func:`local_model`, :class:`HashedEmbedding`, :class:`HashedEmbeddingBag`, :class:`TableExport`);
- shared: :class:`ChannelSecurity` (TLS, mutual TLS, bearer token),
  :class:`OptimizerSpecError`;
- server side: :class:`ShardConfig` and :func:`create_server` (run a shard in-process).
"""

from __future__ import annotations

import importlib

#: public name -> the module that defines it
_WHERE = {
    "DistributedOptimizer": "shardps.worker.optimizer",
    "ConsistencyOptions": "shardps.worker.config",
    "WireOptions": "shardps.worker.config",
    "ObservabilityOptions": "shardps.worker.config",
    "GradientEditedError": "shardps.worker.pipeline.streams",
    "NodeOptimizer": "shardps.worker.node.optimizer",
    "LocalCluster": "shardps.worker.cluster",
    "ShardedEmbedding": "shardps.worker.embedding.modules",
    "ShardedEmbeddingBag": "shardps.worker.embedding.modules",
    "ShardedEmbeddingBagCollection": "shardps.worker.embedding.collection",
    "RowWiseAdagrad": "shardps.worker.embedding.specs",
    "TableExport": "shardps.worker.embedding.export",
    "local_model": "shardps.worker.embedding.local",
    "HashedEmbedding": "shardps.worker.embedding.local",
    "HashedEmbeddingBag": "shardps.worker.embedding.local",
    "shard_embeddings": "shardps.worker.embedding.porting",
    "sharded_parameters": "shardps.worker.embedding.porting",
    "prefetching": "shardps.worker.embedding.prefetch",
    "ShardRpcError": "shardps.worker.session.client",
    "ChannelSecurity": "shardps.common.security",
    "OptimizerSpecError": "shardps.common.optim",
    "ShardConfig": "shardps.server.config",
    "create_server": "shardps.server.service",
}
__all__ = [*_WHERE, "export", "__version__"]


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    if name == "export":
        return importlib.import_module("shardps.worker.export")
    if name == "__version__":
        return importlib.import_module("shardps.common.version").shardps_version()
    raise AttributeError(f"module 'shardps' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)

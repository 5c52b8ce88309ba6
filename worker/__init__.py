"""shardps worker side: ``DistributedOptimizer``, ``LocalCluster`` and the ``shardps`` CLI."""

from shardps.worker.cluster import LocalCluster
from shardps.worker.optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer", "LocalCluster"]

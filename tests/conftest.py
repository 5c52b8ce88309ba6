"""Shared fixtures: real shard processes on 127.0.0.1 free ports, always stopped.

Shards are forked from a preloaded interpreter (``tests.support.forked``): the same
``shardps-server`` code in its own process, without paying torch's import
for each of the ~100 shards the suite starts.
"""

from __future__ import annotations

import pytest
import torch

from shardps.worker.cluster import LocalCluster
from tests.support.forked import ForkedCluster


@pytest.fixture
def start_cluster():
    """``start_cluster(num_shards, **kwargs) -> LocalCluster``; every cluster is stopped after the test."""
    clusters: list[LocalCluster] = []

    def start(num_shards: int, **kwargs) -> LocalCluster:
        cluster = ForkedCluster(num_shards, **kwargs).start()
        clusters.append(cluster)
        return cluster

    yield start
    for cluster in clusters:
        cluster.stop()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA; this machine has no GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

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


#: Test files that take minutes (real jobs, benchmarks, soak, fuzz): marked ``slow``.
SLOW_FILES = ("tests/distributed/", "tests/integration/test_soak.py", "tests/integration/test_fuzz.py")


def pytest_collection_modifyitems(config, items):
    """Markers a user selects on purpose (``pytest -m "not slow"``; pyproject.toml lists them).

    - ``slow``: every test in :data:`SLOW_FILES`;
    - ``prometheus``: every test that needs Debian's ``prometheus`` package (fixture ``prometheus_package``);
    - ``gpu``: marked in the test file; skipped here when CUDA is absent (the only skip besides namespaces).
    """
    skip_gpu = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs CUDA; this machine has no GPU")
    root = config.rootpath
    for item in items:
        where = item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else ""
        if where.startswith(SLOW_FILES):
            item.add_marker(pytest.mark.slow)
        if "prometheus_package" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.prometheus)
        if skip_gpu is not None and "gpu" in item.keywords:
            item.add_marker(skip_gpu)

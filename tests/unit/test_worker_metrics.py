"""The worker's metrics endpoint says where it listens when the port was picked for it."""

from __future__ import annotations

import logging
import urllib.request

from prometheus_client import CollectorRegistry

from shardps.worker.metrics import WorkerMetrics


def test_a_free_port_is_logged_and_serves(caplog) -> None:
    metrics = WorkerMetrics(CollectorRegistry())
    with caplog.at_level(logging.INFO, logger="shardps.worker.metrics"):
        port = metrics.serve("127.0.0.1", 0)
    try:
        assert port > 0
        assert f"http://127.0.0.1:{port}/metrics" in caplog.text
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            assert b"shardps_worker_samples_total" in reply.read()
    finally:
        metrics.close()

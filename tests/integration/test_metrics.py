"""Prometheus metrics of real shards and a real worker, scraped over HTTP and checked against Stats.

Shards run with ``--metrics-port 0``; the worker serves its own endpoint
(``metrics_port=0``) from a registry the test injects, so the numbers are
read both over HTTP (as Prometheus does) and from the registry itself.
"""

from __future__ import annotations


import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry

from shardps.worker.session.client import ShardClient
from shardps.worker.config import ObservabilityOptions
from shardps.worker.optimizer import DistributedOptimizer
from tests.support.prom import scrape, value
from tests.support.raw import raw_call

STEPS = 6
BATCH = 8


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two shards with metrics and checkpoints; one worker ran STEPS steps, then made one bad call."""
    from tests.support.forked import ForkedCluster

    directory = tmp_path_factory.mktemp("ckpt")
    cluster = ForkedCluster(2, extra_args=("--metrics-port", "0", "--checkpoint-dir", str(directory))).start()
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        registry = CollectorRegistry()
        opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model.named_parameters(),
                                   servers=cluster.servers, worker_id="metrics-w0",
                                   observability=ObservabilityOptions(metrics_port=0, metrics_host="127.0.0.1",
                                                                      metrics_registry=registry))
        with opt:
            for _ in range(STEPS):
                opt.zero_grad()
                model(torch.randn(BATCH, 32)).square().mean().backward()
                opt.metrics.count_samples(BATCH)
                opt.step()
            worker = scrape(f"127.0.0.1:{opt.metrics_port}")
            live = [scrape(a) for a in cluster.metrics_addresses]
        code, _ = raw_call(cluster.addresses[0], "Join", b"\xff\xff not a JoinRequest")
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        stats = []
        for i, address in enumerate(cluster.addresses):
            client = ShardClient(address, index=i, connect_timeout=10.0)
            try:
                client.checkpoint()
                stats.append(client.stats())
            finally:
                client.close()
        shards = [scrape(a) for a in cluster.metrics_addresses]
        yield {"worker": worker, "registry": registry, "live": live, "shards": shards, "stats": stats}
    finally:
        cluster.stop()


def test_shard_metrics_match_the_shards_own_counts(trained):
    for i, (samples, live, stats) in enumerate(zip(trained["shards"], trained["live"], trained["stats"])):
        assert value(samples, "shardps_shard_version", shard=i) == stats.version == STEPS
        assert value(samples, "shardps_shard_rounds_total", shard=i, mode="sync") == STEPS
        assert value(samples, "shardps_shard_rounds_total", shard=i, mode="async") == 0
        assert value(samples, "shardps_shard_received_bytes_total", shard=i) == stats.push_bytes_total > 0
        assert value(samples, "shardps_shard_sent_bytes_total", shard=i) == stats.pull_bytes_total > 0
        assert value(samples, "shardps_shard_rpcs_total", shard=i, method="PushPull", code="OK") == STEPS
        assert value(samples, "shardps_shard_rpcs_total", shard=i, method="Join", code="OK") == 1
        assert value(samples, "shardps_shard_rpc_seconds_count", shard=i, method="PushPull") == STEPS
        assert value(samples, "shardps_shard_update_seconds_count", shard=i) == STEPS
        assert value(samples, "shardps_shard_staleness_versions_count", shard=i) == STEPS  # one contributor
        assert value(samples, "shardps_shard_staleness_versions_bucket", shard=i, le="0.0") == STEPS  # sync: 0
        assert value(samples, "shardps_shard_joins_total", shard=i) == 1
        assert value(samples, "shardps_shard_leaves_total", shard=i) == 1
        assert value(samples, "shardps_shard_lease_expiries_total", shard=i) == 0
        assert value(samples, "shardps_shard_min_workers", shard=i) == 1
        assert value(live, "shardps_shard_live_workers", shard=i) == 1  # scraped while the worker trained
        assert value(samples, "shardps_shard_live_workers", shard=i) == 0  # after it left
        assert value(samples, "shardps_shard_checkpoint_seconds_count", shard=i) == 1
        assert value(samples, "shardps_shard_last_checkpoint_timestamp_seconds", shard=i) == pytest.approx(
            stats.checkpoint_unix_seconds)
        assert stats.checkpoint_unix_seconds > 0
    bad = value(trained["shards"][0], "shardps_shard_rpcs_total", shard=0, method="Join", code="INVALID_ARGUMENT")
    assert bad == 1  # the malformed Join, counted with its status
    assert value(trained["shards"][1], "shardps_shard_rpcs_total", shard=1, method="Join",
                 code="INVALID_ARGUMENT") == 0


def test_every_label_is_bounded(trained):
    """No series names a parameter or a worker: labels are shard, method, code, mode, le, version, phase, reason
    only, a node phase is one of the three phases and a refusal's reason one of three."""
    allowed = {"shard", "method", "code", "mode", "le", "version", "phase", "reason"}
    for samples in (*trained["shards"], trained["worker"]):
        for _, labels in samples:
            assert {k for k, _ in labels} <= allowed
            assert dict(labels).get("phase", "all_gather") in ("reduce_scatter", "push_pull", "all_gather"), labels
            assert dict(labels).get("reason", "idle") in ("per_peer", "total", "idle"), labels


def test_worker_metrics_count_steps_bytes_and_samples(trained):
    worker, registry, stats = trained["worker"], trained["registry"], trained["stats"]
    assert value(worker, "shardps_worker_steps_total") == STEPS
    assert registry.get_sample_value("shardps_worker_steps_total") == STEPS  # the injected registry
    assert value(worker, "shardps_worker_samples_total") == STEPS * BATCH
    assert value(worker, "shardps_worker_samples_per_second") > 0
    assert value(worker, "shardps_worker_step_seconds_count") == STEPS - 1  # step end to step end
    assert value(worker, "shardps_worker_push_seconds_count") == STEPS
    assert value(worker, "shardps_worker_pull_seconds_count") == STEPS
    # every PushPull byte the shards received came from this worker (Init and the first pull excluded)
    shard_received = sum(s.push_bytes_total for s in stats)
    pushed = value(worker, "shardps_worker_pushed_bytes_total")
    assert 0 < pushed < shard_received
    assert value(worker, "shardps_worker_pulled_bytes_total") > 0
    assert value(worker, "shardps_worker_retries_total", method="join") == 0


def test_a_metrics_port_in_use_is_an_error_on_both_sides(start_cluster) -> None:
    """A shard whose --metrics-port is taken exits 1 naming it; a worker's metrics_port taken raises and leaves."""
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        shard = subprocess.run(
            [sys.executable, "-m", "shardps.cli.server", "--shard-index", "0", "--num-shards", "1",
             "--metrics-port", str(port)], capture_output=True, text=True, timeout=60)
        assert shard.returncode == 1, shard.stderr[-2000:]
        assert f"could not bind the metrics endpoint 127.0.0.1:{port}" in shard.stderr
        assert "listening on" not in shard.stdout  # it never served

        cluster = start_cluster(1)
        model = torch.nn.Linear(4, 2)
        with pytest.raises(RuntimeError, match=f"worker metrics endpoint 127.0.0.1:{port}"):
            DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                 servers=cluster.servers,
                                 observability=ObservabilityOptions(metrics_port=port, metrics_host="127.0.0.1"))
    client = ShardClient(cluster.addresses[0], index=0, connect_timeout=10.0)
    try:
        assert list(client.stats().members) == []  # the worker never joined
    finally:
        client.close()


def test_a_node_phase_outside_the_fixed_set_is_refused_and_changes_nothing() -> None:
    from shardps.worker.metrics import WorkerMetrics

    metrics = WorkerMetrics()
    with pytest.raises(ValueError, match="phase must be one of"):
        metrics.node_phase("reduce", 0.1)
    metrics.node_phase("push_pull", 0.25)
    names = {labels.get("phase") for m in metrics.registry.collect() for s in m.samples for labels in [s.labels]}
    assert names - {None} == {"reduce_scatter", "push_pull", "all_gather"}
    assert metrics.registry.get_sample_value("shardps_worker_node_phase_seconds_sum", {"phase": "push_pull"}) == 0.25

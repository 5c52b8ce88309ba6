"""SIGTERM: NOT_SERVING, waiting pulls fail with UNAVAILABLE, exit code 0."""

from __future__ import annotations

import signal
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

import torch

from shardps.worker.session.client import ShardClient, ShardRpcError
from tests.support.raw import RawWorker, plan_and_spec


def test_sigterm_stops_cleanly_and_wakes_waiting_pulls(start_cluster) -> None:
    cluster = start_cluster(1)
    address = cluster.addresses[0]
    channel = grpc.insecure_channel(address)
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(service="shardps.v1.Shard"), timeout=5).status == \
        health_pb2.HealthCheckResponse.SERVING

    client = ShardClient(address, index=0, rpc_timeout=60.0)
    m = torch.nn.Linear(4, 2)
    member = RawWorker(client, "w0", *plan_and_spec(m, torch.optim.SGD(m.parameters(), lr=0.1)))
    member.join()
    member.init(0, dict(m.named_parameters()))
    outcome: dict = {}

    def waiting_pull() -> None:  # version 5 never comes: this pull waits on the shard
        try:
            member.pull(5)
            outcome["result"] = "returned"
        except ShardRpcError as exc:
            outcome["result"] = exc.code
        outcome["at"] = time.monotonic()

    t = threading.Thread(target=waiting_pull, daemon=True)
    t.start()
    time.sleep(0.5)
    proc = cluster.processes[0]
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0
    t.join(timeout=10)
    assert outcome["result"] == grpc.StatusCode.UNAVAILABLE
    assert outcome["at"] - sent < 10
    log = cluster.log_tail(0)
    assert "stopping" in log and "stopped" in log
    client.close()
    channel.close()

"""The processes of ``tests/integration/test_lease_under_load.py``: a shard, or a worker whose link a test saturates.

    python -m tests.support.lease_load_proc shard [--old-renewal] SHARDPS-SERVER-ARGS...
    python -m tests.support.lease_load_proc worker --servers A,B --params N --chunk-bytes B --steps K [--old-renewal]

``shard`` runs ``shardps-server`` with its arguments. ``worker`` trains a
linear model of about ``--params`` parameters (sync, streamed rounds, SGD)
with one ``DistributedOptimizer``: it joins, initialises the shards and
trains one step, prints ``@@{"event": "ready"}`` and waits for a line on
stdin (the test slows its link meanwhile), then trains ``--steps`` steps
and prints ``@@{"event": "done", ...}``: the steps done and their seconds,
the error that stopped it (or null), every membership change it saw, the
heartbeats it sent during the steps (how many, how many failed, the
slowest), the round trip of one Heartbeat sent
on the bulk connection 0.5 s into the first step (``bulk_heartbeat_s``:
what a heartbeat waited before it had a connection of its own), and every
shard's Stats (asked after the steps, over the same link).

``--old-renewal`` runs the renewal as it was before issue 44 item 6, to show
what it did: the shard renews a member's lease at the start of a call only
(``Membership.renewing`` hands the frames back unwrapped), and the worker
sends its heartbeats on the channel that carries its pushes (one connection
per shard).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time


def say(**event) -> None:
    print("@@" + json.dumps(event), flush=True)


def shard(argv: list[str]) -> int:
    old = "--old-renewal" in argv
    if old:
        argv = [a for a in argv if a != "--old-renewal"]
        from shardps.server.membership.members import Membership

        Membership.renewing = lambda self, member, frames: frames  # renewed at the call's start only
    from shardps.cli.server import main

    return main(argv)


class HeartbeatClock:
    """Times every heartbeat the worker's lease thread sends (from the call's start to its reply or error)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counting = False
        self.sent = self.failed = 0
        self.slowest = 0.0

    def wrap(self, client_class) -> None:
        start = client_class.heartbeat_future
        clock = self

        def heartbeat_future(client, worker_id, session, timeout):
            call = start(client, worker_id, session, timeout)
            began = time.monotonic()

            def done(future) -> None:
                with clock.lock:
                    if not clock.counting:
                        return
                    clock.sent += 1
                    clock.slowest = max(clock.slowest, time.monotonic() - began)
                    clock.failed += future.exception() is not None

            call.add_done_callback(done)
            return call

        client_class.heartbeat_future = heartbeat_future


def old_heartbeats(client_class) -> None:
    """Heartbeats on the main channel: the connection that carries the pushes (as before issue 44 item 6)."""
    from shardps.proto import shardps_pb2 as pb

    def heartbeat_future(client, worker_id, session, timeout):
        return client.stub.Heartbeat.future(pb.HeartbeatRequest(worker_id=worker_id, session=session),
                                            timeout=timeout)

    client_class.heartbeat_future = heartbeat_future


def worker(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--servers", required=True)
    p.add_argument("--worker-id", default="w0")
    p.add_argument("--params", type=int, required=True)
    p.add_argument("--chunk-bytes", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--old-renewal", action="store_true")
    args = p.parse_args(argv)

    import torch
    from torch import nn

    from shardps.proto import shardps_pb2 as pb
    from shardps.worker.config import ObservabilityOptions, WireOptions
    from shardps.worker.optimizer import DistributedOptimizer
    from shardps.worker.session.client import ShardClient

    torch.set_num_threads(1)
    if args.old_renewal:
        old_heartbeats(ShardClient)
    heartbeats = HeartbeatClock()
    heartbeats.wrap(ShardClient)
    torch.manual_seed(0)
    width = 256
    model = nn.Linear(width, max(1, args.params // width), bias=False)
    x = torch.randn(32, width)
    y = torch.randn(32, model.out_features)
    changes: list[list[str]] = []
    dist = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(), servers=args.servers,
        worker_id=args.worker_id,
        wire=WireOptions(chunk_bytes=args.chunk_bytes, rpc_timeout=120.0, connect_timeout=30.0),
        observability=ObservabilityOptions(on_membership_change=lambda ids: changes.append(list(ids))))

    def step() -> None:
        dist.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        dist.step()

    step()
    dist.synchronize()
    say(event="ready", version=dist.version, epoch=dist.membership_epoch)
    if sys.stdin.readline().strip() != "go":
        return 2
    with heartbeats.lock:
        heartbeats.counting = True
    bulk: dict[str, float | str] = {}

    # a channel with the main channel's target and options shares its connection (gRPC's global subchannel
    # pool): a heartbeat on it goes where heartbeats went before, behind the pushes
    shared = ShardClient(args.servers.split(",")[0], index=0, connect_timeout=30.0)

    def probe() -> None:
        time.sleep(0.5)
        began = time.monotonic()
        try:
            shared.stub.Heartbeat(pb.HeartbeatRequest(worker_id=dist.worker_id, session=dist.session), timeout=60.0)
            bulk["seconds"] = time.monotonic() - began
        except Exception as exc:  # (reported, never raised)
            bulk["error"] = f"{type(exc).__name__}: {exc}"

    prober = threading.Thread(target=probe, daemon=True)
    if not args.old_renewal:
        prober.start()
    seconds: list[float] = []
    error = None
    try:
        for _ in range(args.steps):
            began = time.monotonic()
            step()
            seconds.append(time.monotonic() - began)
        dist.synchronize()
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    with heartbeats.lock:
        heartbeats.counting = False
    if prober.is_alive():
        prober.join(timeout=30)
    shared.close()
    stats = []
    for i, address in enumerate(args.servers.split(",")):
        client = ShardClient(address, index=i, connect_timeout=30.0)
        try:
            s = client.stats(timeout=30.0)
        finally:
            client.close()
        stats.append({"lease_expiries": s.lease_expiries, "membership_epoch": s.membership_epoch,
                      "members": list(s.members), "version": s.version})
    say(event="done", steps=len(seconds), step_seconds=seconds, error=error, membership_changes=changes,
        epoch=dist.membership_epoch, heartbeats_sent=heartbeats.sent,
        heartbeats_failed=heartbeats.failed, slowest_heartbeat_s=heartbeats.slowest,
        bulk_heartbeat_s=bulk.get("seconds"), bulk_heartbeat_error=bulk.get("error"), stats=stats)
    try:
        dist.close()
    except Exception:  # a dropped worker's close may fail: the figures above are what the test reads
        pass
    return 0


def main() -> int:
    role, argv = sys.argv[1], sys.argv[2:]
    return shard(argv) if role == "shard" else worker(argv)


if __name__ == "__main__":
    sys.exit(main())

"""Hundreds of workers on one shard: rounds complete, waiting calls hold no thread, health always answers.

256 lightweight asyncio gRPC clients (one joined member each) run sync
rounds on a tiny model against one real shard process while a monitor
process calls Stats and the gRPC health check every 100 ms the whole time.
The bounds are the shard manifest's own probes (``deploy/k8s/base``, as built):
every call answers within the liveness probe's timeout (5 s), and the
readiness probe would never have failed: no span of ``failureThreshold x
periodSeconds`` (2 x 5 s) holds ``failureThreshold`` answers slower than its
``timeoutSeconds`` (1 s). A blocked event loop or a thread held per waiting
call fails both (two 1.5 s stops of the shard, 3.5 s apart, fail it: checked);
one answer at 1.04 s on a 2-core machine shared with another test process
(seen once) is what a readiness probe forgives. Then 500 Pulls park on a
future version and are cancelled by their clients; the shard must free them
at once. Sizes are configurable: ``SHARDPS_TEST_CLIENTS``,
``SHARDPS_TEST_ROUNDS``, ``SHARDPS_TEST_PULLS``.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
import uuid
from dataclasses import dataclass

import grpc
import torch

from shardps.proto import shardps_pb2 as pb
from shardps.common.codec import copy_payload, decode_frame, encode_chunk, encode_control, encode_round
from shardps.common.optim import optimizer_spec
from shardps.common.plan import KeyInfo, PartitionPlan
from shardps.worker.session.client import ShardClient
from tests.support.manifests import K8S, objects, the_container
from tests.support.raw import SERVING, health_status

CLIENTS = int(os.environ.get("SHARDPS_TEST_CLIENTS", 256))
ROUNDS = int(os.environ.get("SHARDPS_TEST_ROUNDS", 20))
PULLS = int(os.environ.get("SHARDPS_TEST_PULLS", 500))
LR = 0.01
NUMEL = 16
PATH = "/shardps.v1.Shard/"


@dataclass(frozen=True)
class Probe:
    """One Kubernetes probe of the shard container: seconds, with Kubernetes' defaults where the manifest is silent."""

    timeout: float
    period: float
    failure_threshold: int

    @classmethod
    def from_manifest(cls, name: str) -> "Probe":
        """Probe ``name`` (``readinessProbe``, ...) of the shard StatefulSet in ``deploy/k8s/base``, as built."""
        probe = the_container(objects(K8S / "base")["StatefulSet", "shardps-shard"])[name]
        return cls(float(probe.get("timeoutSeconds", 1)), float(probe.get("periodSeconds", 10)),
                   int(probe.get("failureThreshold", 3)))


READINESS, LIVENESS = Probe.from_manifest("readinessProbe"), Probe.from_manifest("livenessProbe")
FREED_WITHIN = 1.0  # s after the cancels: "at once", against the pulls' 300 s deadline


def _monitor(address: str, deadline: float, stop, out) -> None:
    """Call health and Stats every 100 ms with a ``deadline`` (s), no retries, until ``stop``; put the checks:
    ``(name, started (s since the first), answered in (s), error or None)``."""
    checks, first = [], time.monotonic()
    with grpc.insecure_channel(address) as channel:
        stats = channel.unary_unary(PATH + "Stats")
        try:
            while not stop.wait(0.1):
                for name, call in (("health", lambda: health_status(address, timeout=deadline)),
                                   ("stats", lambda: stats(pb.StatsRequest().SerializeToString(), timeout=deadline))):
                    started = time.monotonic()
                    try:
                        call()
                        error = None
                    except grpc.RpcError as exc:  # a deadline or an error: the shard did not answer in time
                        error = f"{exc.code()}: {exc.details()}"
                    checks.append((name, started - first, time.monotonic() - started, error))
        finally:
            out.put(checks)


class Monitor:
    """Health and Stats checks every 100 ms from a process of its own (this one's 256 asyncio clients would
    otherwise hold its GIL while a check waits); ``checks`` (see ``_monitor``) are read after :meth:`join`."""

    def __init__(self, address: str, deadline: float) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process with gRPC threads
        self.stop, self._out = ctx.Event(), ctx.Queue()
        self._process = ctx.Process(target=_monitor, args=(address, deadline, self.stop, self._out), daemon=True)
        self.checks: list[tuple[str, float, float, str | None]] = []

    def start(self) -> None:
        self._process.start()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the checks (after ``stop`` is set); kill it if late."""
        try:
            self.checks = self._out.get(timeout=timeout)
        finally:
            self._process.join(timeout=5)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()

    def readiness_failures(self, probe: Probe) -> list[list[float]]:
        """Runs of ``probe.failure_threshold`` answers slower than ``probe.timeout`` within ``failure_threshold x
        period`` seconds: a probe sent then would have failed as often (start times, s). Health and Stats count
        alike: the calls are sequential, so a late one of either means the shard did not answer then."""
        late = [at for _, at, took, _ in self.checks if took > probe.timeout]
        n, window = probe.failure_threshold, probe.failure_threshold * probe.period
        return [late[i:i + n] for i in range(len(late) - n + 1) if late[i + n - 1] - late[i] < window]


def plan_and_spec() -> tuple[PartitionPlan, pb.OptimizerSpec]:
    plan = PartitionPlan.build([KeyInfo("w", (NUMEL,), 0)], num_shards=1, chunk_bytes=NUMEL * 4)
    spec = optimizer_spec(torch.optim.SGD([torch.nn.Parameter(torch.zeros(NUMEL))], lr=LR))
    return plan, spec


async def scenario(address: str) -> None:
    plan, spec = plan_and_spec()
    channels = [grpc.aio.insecure_channel(address) for _ in range(8)]
    workers = [(f"w{i:04d}", uuid.uuid4().hex, channels[i % len(channels)]) for i in range(CLIENTS)]
    initial = torch.arange(NUMEL, dtype=torch.float32)

    async def join(worker_id: str, session: str, channel) -> pb.JoinReply:
        request = pb.JoinRequest(worker_id=worker_id, session=session, plan=plan.to_proto(),
                                 plan_fingerprint=plan.fingerprint, optimizer=spec)
        reply = await channel.unary_unary(PATH + "Join")(request.SerializeToString(), timeout=60)
        return pb.JoinReply.FromString(reply)

    replies = await asyncio.gather(*(join(*w) for w in workers))
    assert sum(r.initialise for r in replies) == 1 and replies[-1].members <= CLIENTS
    initialiser = next(w for w, r in zip(workers, replies) if r.initialise)
    header = pb.RoundHeader(worker_id=initialiser[0], session=initialiser[1], plan_fingerprint=plan.fingerprint)
    await initialiser[2].stream_unary(PATH + "Init")(
        iter([encode_round(header), encode_chunk("w", 0, initial, 0)]), timeout=60)

    async def push_pull(index: int, worker_id: str, session: str, channel, rnd: int) -> torch.Tensor:
        header = pb.RoundHeader(worker_id=worker_id, session=session, round=rnd, plan_fingerprint=plan.fingerprint)
        grad = torch.full((NUMEL,), float(index))  # worker i pushes i everywhere: the mean is (CLIENTS - 1) / 2
        call = channel.stream_stream(PATH + "PushPull")(
            iter([encode_round(header), encode_chunk("w", 0, grad, rnd),
                  encode_control(trailer=pb.RoundTrailer(lrs=[LR]))]), timeout=120)
        out = torch.empty(NUMEL)
        async for raw in call:
            frame = decode_frame(raw)
            assert frame.header.version == rnd + 1
            copy_payload(frame.header, frame.payload, out)
        return out

    for rnd in range(ROUNDS):
        results = await asyncio.gather(*(push_pull(i, *w, rnd) for i, w in enumerate(workers)))
    expected = initial.clone()
    for _ in range(ROUNDS):  # what torch.optim.SGD gives for the averaged gradient, round after round
        expected -= LR * torch.full((NUMEL,), float(sum(range(CLIENTS))) * (1.0 / CLIENTS))
    for got in results:
        assert torch.allclose(got, expected, rtol=0, atol=1e-4), (got, expected)

    # PULLS pulls park on a version that never comes, then their clients cancel them.
    async def park(worker_id: str, session: str, channel) -> None:
        request = pb.PullRequest(min_version=10_000, plan_fingerprint=plan.fingerprint, worker_id=worker_id,
                                 session=session)
        async for _ in channel.unary_stream(PATH + "Pull")(request.SerializeToString(), timeout=300):
            pass

    parked = [asyncio.ensure_future(park(*workers[i % CLIENTS])) for i in range(PULLS)]
    stats = ShardClient(address, index=0, rpc_timeout=1.0)
    try:
        deadline = time.monotonic() + 60
        while stats.stats().waiting < PULLS:
            assert time.monotonic() < deadline, f"only {stats.stats().waiting} pulls are waiting"
            await asyncio.sleep(0.1)
        assert health_status(address, timeout=LIVENESS.timeout) == SERVING  # the probe answers beside 500 pulls
        for task in parked:
            task.cancel()
        cancelled = time.monotonic()
        await asyncio.gather(*parked, return_exceptions=True)
        assert health_status(address, timeout=LIVENESS.timeout) == SERVING
        while stats.stats().waiting:  # freed at once, not at the pulls' deadline
            assert time.monotonic() - cancelled < FREED_WITHIN, f"{stats.stats().waiting} pulls still wait"
            await asyncio.sleep(0.02)
        assert stats.stats().version == ROUNDS
    finally:
        stats.close()
        for channel in channels:
            await channel.close()


def test_hundreds_of_clients_and_cancelled_waits(start_cluster) -> None:
    assert READINESS.timeout < LIVENESS.timeout
    cluster = start_cluster(1, min_workers=CLIENTS)
    monitor = Monitor(cluster.addresses[0], deadline=LIVENESS.timeout)
    monitor.start()
    started = time.monotonic()
    try:
        asyncio.run(asyncio.wait_for(scenario(cluster.addresses[0]), timeout=600))
    finally:
        monitor.stop.set()
        monitor.join(10)
    took = sorted(t for _, _, t, _ in monitor.checks)
    late = [c for c in monitor.checks if c[2] > READINESS.timeout]
    print(f"{CLIENTS} clients x {ROUNDS} rounds + {PULLS} cancelled pulls in {time.monotonic() - started:.1f}s; "
          f"{len(took)} health/Stats checks, median {took[len(took) // 2]:.3f}s, slowest {took[-1]:.3f}s; "
          f"slower than the readiness probe's timeout ({READINESS.timeout:g}s): {late}")
    assert len(took) > 20
    failed = [c for c in monitor.checks if c[3] is not None]
    assert not failed, f"not answered within the liveness probe's timeout ({LIVENESS.timeout:g}s): {failed[:5]}"
    assert not monitor.readiness_failures(READINESS), (
        f"a readiness probe (timeout {READINESS.timeout:g}s, every {READINESS.period:g}s, "
        f"failureThreshold {READINESS.failure_threshold}) would have failed: {late}")

"""Hundreds of workers on one shard: rounds complete, waiting calls hold no thread, health always answers.

256 lightweight asyncio gRPC clients (one joined member each) run sync
rounds on a tiny model against one real shard process while a monitor
process checks that Stats and the gRPC health check each answer within 1 s
the whole time. Then 500 Pulls park on a future version and are cancelled
by their clients; the shard must free them at once. Sizes are configurable:
``SHARDPS_TEST_CLIENTS``, ``SHARDPS_TEST_ROUNDS``, ``SHARDPS_TEST_PULLS``.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
import uuid

import grpc
import torch

from shardps.proto import shardps_pb2 as pb
from shardps.common.codec import copy_payload, decode_frame, encode_chunk, encode_control, encode_round
from shardps.common.optim import optimizer_spec
from shardps.common.plan import KeyInfo, PartitionPlan
from shardps.worker.session.client import ShardClient
from tests.support.raw import SERVING, health_status

CLIENTS = int(os.environ.get("SHARDPS_TEST_CLIENTS", 256))
ROUNDS = int(os.environ.get("SHARDPS_TEST_ROUNDS", 20))
PULLS = int(os.environ.get("SHARDPS_TEST_PULLS", 500))
LR = 0.01
NUMEL = 16
PATH = "/shardps.v1.Shard/"


def _monitor(address: str, stop, out) -> None:
    """Call health and Stats every 100 ms with a 1 s deadline until ``stop``; put ``(failures, slowest, checks)``."""
    client = ShardClient(address, index=0, rpc_timeout=1.0)
    failures, slowest, checks = [], 0.0, 0
    try:
        while not stop.wait(0.1):
            for name, call in (("health", lambda: health_status(address, timeout=1.0)), ("stats", client.stats)):
                started = time.monotonic()
                try:
                    call()
                except Exception as exc:  # a deadline or an error: the shard did not answer in 1 s
                    failures.append(f"{name}: {exc}")
                slowest = max(slowest, time.monotonic() - started)
                checks += 1
    finally:
        client.close()
        out.put((failures, slowest, checks))


class Monitor:
    """Health and Stats checks every 100 ms with a 1 s deadline, from a process of its own (this one's 256
    asyncio clients would otherwise hold its GIL while a check waits): ``failures``, the ``slowest`` answer
    (seconds, wall time around the call) and the number of ``checks``, read after :meth:`join`."""

    def __init__(self, address: str) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process with gRPC threads
        self.stop, self._out = ctx.Event(), ctx.Queue()
        self._process = ctx.Process(target=_monitor, args=(address, self.stop, self._out), daemon=True)
        self.failures: list[str] = []
        self.slowest, self.checks = 0.0, 0

    def start(self) -> None:
        self._process.start()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the checks' figures (after ``stop`` is set); kill it if late."""
        try:
            self.failures, self.slowest, self.checks = self._out.get(timeout=timeout)
        finally:
            self._process.join(timeout=5)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()


def plan_and_spec() -> tuple[PartitionPlan, pb.OptimizerSpec]:
    plan = PartitionPlan.build([KeyInfo("w", (NUMEL,), 0)], num_shards=1, chunk_bytes=NUMEL * 4)
    spec = optimizer_spec(torch.optim.SGD([torch.nn.Parameter(torch.zeros(NUMEL))], lr=LR))
    return plan, spec


async def scenario(address: str, monitor: Monitor) -> None:
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
        assert health_status(address, timeout=1.0) == SERVING  # the probe answers beside 500 waiting pulls
        for task in parked:
            task.cancel()
        cancelled = time.monotonic()
        await asyncio.gather(*parked, return_exceptions=True)
        assert health_status(address, timeout=1.0) == SERVING
        while stats.stats().waiting:  # freed at once, not at the pulls' deadline
            assert time.monotonic() - cancelled < 1.0, f"{stats.stats().waiting} pulls still wait"
            await asyncio.sleep(0.02)
        assert stats.stats().version == ROUNDS
    finally:
        stats.close()
        for channel in channels:
            await channel.close()


def test_hundreds_of_clients_and_cancelled_waits(start_cluster) -> None:
    cluster = start_cluster(1, min_workers=CLIENTS)
    monitor = Monitor(cluster.addresses[0])
    monitor.start()
    started = time.monotonic()
    try:
        asyncio.run(asyncio.wait_for(scenario(cluster.addresses[0], monitor), timeout=600))
    finally:
        monitor.stop.set()
        monitor.join(10)
    print(f"{CLIENTS} clients x {ROUNDS} rounds + {PULLS} cancelled pulls in {time.monotonic() - started:.1f}s; "
          f"{monitor.checks} health/Stats checks, slowest {monitor.slowest:.3f}s")
    assert monitor.checks > 20
    assert not monitor.failures, monitor.failures[:5]
    assert monitor.slowest < 1.0

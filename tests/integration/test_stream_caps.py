"""Slow and idle streams against a real shard: caps per peer and in total, the idle timeout, bounded descriptors.

A hostile or stuck client opens streams of the client-streaming methods
(Push, PushPull, Init, SetState) and never finishes them. The shard refuses
those over ``--max-streams-per-peer`` / ``--max-streams`` with
RESOURCE_EXHAUSTED, ends the ones it waits on for ``--stream-idle-seconds``
with DEADLINE_EXCEEDED, closes connections over ``--max-connections`` at
once, counts every refusal in ``shardps_shard_streams_refused_total``, and
keeps answering health checks. Calls that wait for a round or a version are
not idle and are never ended.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from torch import nn

from shardps.proto import shardps_pb2 as pb
from shardps.common.codec import decode_frame, encode_round
from shardps.server.streams import peer_host
from shardps.worker.session.client import ShardClient
from tests.support.procs import wait_until
from tests.support.prom import scrape
from tests.support.raw import SERVING, RawWorker, health_status, plan_and_spec, raw_call, snapshot

PATH = "/shardps.v1.Shard/"
STREAMS = 1500  # idle streams opened at once
CONNECTIONS = 100  # the client connections they are spread over (more than --max-connections)
MAX_CONNECTIONS = 64
PER_PEER = 200
IDLE = 3.0
MEMBERS = 8  # of the streams, pushes that send a member's valid round header and then nothing
#: descriptors a shard may hold beyond those at start and its connections: a health probe's
#: connection, a metrics scrape and a connection accepted only to be closed (over the cap)
FD_SLACK = 8


def fd_count(pid: int) -> int:
    """Open file descriptors of process ``pid``."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def refused(address: str, reason: str) -> float:
    return scrape(address)[("shardps_shard_streams_refused_total", frozenset({"shard": "0", "reason": reason}.items()))]


def open_streams(address: str) -> float:
    return scrape(address)[("shardps_shard_open_streams", frozenset({"shard": "0"}.items()))]


class Watch(threading.Thread):
    """Every 0.2 s: health on the main port (a connection opened before the flood, as a load balancer keeps
    one) and on ``--health-port`` (a fresh connection each time, as a kubelet probe), each within 2 s, and
    the shard's open descriptors."""

    def __init__(self, address: str, health_address: str, pid: int) -> None:
        super().__init__(daemon=True)
        self.address, self.health_address, self.pid = address, health_address, pid
        self.stop, self.failures, self.max_fds, self.checks = threading.Event(), [], 0, 0
        self.channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        self.stub = health_pb2_grpc.HealthStub(self.channel)
        self.stub.Check(health_pb2.HealthCheckRequest(), timeout=5)  # connected before the flood

    def run(self) -> None:
        try:
            while not self.stop.wait(0.2):
                self.max_fds = max(self.max_fds, fd_count(self.pid))
                for name, check in (
                        ("main port", lambda: self.stub.Check(health_pb2.HealthCheckRequest(service="shardps.v1.Shard"),
                                                              timeout=2.0).status),
                        ("health port", lambda: health_status(self.health_address, timeout=2.0))):
                    try:
                        if check() != SERVING:
                            self.failures.append(f"{name}: not SERVING")
                    except grpc.RpcError as exc:
                        self.failures.append(f"{name}: {exc.code()} {exc.details()}")
                self.checks += 1
        finally:
            self.channel.close()


async def flood(address: str, headers: list[bytes]) -> list[tuple[grpc.StatusCode, str]]:
    """Open ``STREAMS`` streams over ``CONNECTIONS`` connections; the first ``len(headers)`` send a header each
    (as Push), the others nothing; none sends more. Returns each call's final status and details."""
    channels = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(CONNECTIONS)]
    release = asyncio.Event()

    async def frames(first: bytes | None):
        if first is not None:
            yield first
        await release.wait()  # set only at the end: the stream never sends more by itself

    async def one(i: int) -> tuple[grpc.StatusCode, str]:
        channel = channels[i % CONNECTIONS]
        method = "Push" if i < len(headers) else ("Push", "PushPull", "Init", "SetState")[i % 4]
        request = frames(headers[i] if i < len(headers) else None)
        try:
            if method == "PushPull":
                async for _ in channel.stream_stream(PATH + method)(request, timeout=60):
                    pass
            else:
                await channel.stream_unary(PATH + method)(request, timeout=60)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""
        return grpc.StatusCode.OK, ""

    try:
        return await asyncio.gather(*(one(i) for i in range(STREAMS)))
    finally:
        release.set()
        for channel in channels:
            await channel.close()


def test_1500_idle_streams_are_capped_ended_and_the_shard_stays_healthy(start_cluster) -> None:
    cluster = start_cluster(1, extra_args=(
        "--max-connections", str(MAX_CONNECTIONS), "--max-streams-per-peer", str(PER_PEER),
        "--stream-idle-seconds", str(IDLE), "--lease-seconds", "120", "--metrics-port", "0", "--health-port", "0"))
    address, pid = cluster.addresses[0], cluster.processes[0].pid
    metrics_address, health_address = cluster.endpoints[0]["metrics"], cluster.endpoints[0]["health"]
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    plan, spec = plan_and_spec(model, torch.optim.SGD(model.parameters(), lr=0.1))
    client = ShardClient(address, index=0)
    try:
        workers = [RawWorker(client, f"w{i}", plan, spec) for i in range(MEMBERS)]
        for w in workers:
            w.join()
        workers[0].init(0, dict(model.named_parameters()))
        before = snapshot(client)
    finally:
        client.close()
    base = fd_count(pid)
    watch = Watch(address, health_address, pid)
    watch.start()
    try:
        outcomes = asyncio.run(flood(address, [encode_round(w.header(0)) for w in workers]))
    finally:
        watch.stop.set()
        watch.join(10)

    codes = {}
    for code, details in outcomes:
        codes[code] = codes.get(code, 0) + 1
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            assert f"--max-streams-per-peer {PER_PEER}" in details, details
        elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
            assert "--stream-idle-seconds" in details, details
        else:  # a connection over --max-connections is closed as soon as it is accepted
            assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
    ended, capped = codes.get(grpc.StatusCode.DEADLINE_EXCEEDED, 0), codes.get(grpc.StatusCode.RESOURCE_EXHAUSTED, 0)
    assert 0 < ended <= PER_PEER and capped > 0 and codes.get(grpc.StatusCode.UNAVAILABLE, 0) > 0, codes
    assert refused(metrics_address, "per_peer") == capped and refused(metrics_address, "idle") == ended
    assert refused(metrics_address, "total") == 0 and open_streams(metrics_address) == 0

    print(f"outcomes {codes}, descriptors: {base} at start, at most {watch.max_fds} during the flood")
    assert watch.checks > 0 and watch.failures == [], watch.failures[:5]
    assert base < watch.max_fds <= base + MAX_CONNECTIONS + FD_SLACK, (base, watch.max_fds)
    wait_until(lambda: fd_count(pid) <= base + FD_SLACK, 10, "the shard to close the flood's connections")

    client = ShardClient(address, index=0)
    try:
        assert snapshot(client) == before  # the members' stalled pushes changed nothing
        for w in workers:  # and each member can still push the round
            w.client = client
            w.push(0, fill=0.5)
        assert client.stats().version == 1
    finally:
        client.close()


def test_waits_are_not_idle_and_the_total_cap_refuses_with_the_flag(start_cluster) -> None:
    cluster = start_cluster(1, min_workers=2, extra_args=(
        "--stream-idle-seconds", "1", "--max-streams", "6", "--lease-seconds", "120", "--metrics-port", "0"))
    address, metrics_address = cluster.addresses[0], cluster.endpoints[0]["metrics"]
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    plan, spec = plan_and_spec(model, torch.optim.SGD(model.parameters(), lr=0.1))
    client = ShardClient(address, index=0)
    try:
        a, b = RawWorker(client, "a", plan, spec), RawWorker(client, "b", plan, spec)
        a.join()
        b.join()
        a.init(0, dict(model.named_parameters()))
    finally:
        client.close()

    async def collect(call) -> list[int]:
        return [decode_frame(raw).header.version async for raw in call]

    async def scenario() -> None:
        channel = grpc.aio.insecure_channel(address)
        pull = pb.PullRequest(min_version=1, plan_fingerprint=plan.fingerprint, worker_id="b",
                              session=b.session).SerializeToString()
        try:
            started = time.monotonic()
            # a's whole push: the shard then waits for b's, for longer than --stream-idle-seconds
            push_pull = asyncio.ensure_future(collect(channel.stream_stream(PATH + "PushPull")(
                iter(list(a.frames(a.header(0), a.chunks(0, 1.0), trailer=a.trailer()))), timeout=60)))
            waiting = asyncio.ensure_future(collect(channel.unary_stream(PATH + "Pull")(pull, timeout=60)))

            release = asyncio.Event()

            async def stalled():  # b's round header, then nothing
                yield encode_round(b.header(0))
                await release.wait()

            try:
                await channel.stream_unary(PATH + "Push")(stalled(), timeout=30)
                raise AssertionError("a push that stopped sending was not ended")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc
                assert "--stream-idle-seconds" in exc.details() and "Push" in exc.details(), exc.details()
            finally:
                release.set()
            await asyncio.sleep(max(0.0, started + 3.0 - time.monotonic()))  # 3x --stream-idle-seconds
            assert not push_pull.done() and not waiting.done()  # waiting for the round is not idle

            # four more waiting pulls fill --max-streams 6; one more call is refused, health still answers
            more = [asyncio.ensure_future(collect(channel.unary_stream(PATH + "Pull")(pull, timeout=60)))
                    for _ in range(4)]
            await asyncio.to_thread(wait_until, lambda: open_streams(metrics_address) == 6, 20, "6 open calls")
            code, details = await asyncio.to_thread(raw_call, address, "Stats", pb.StatsRequest().SerializeToString())
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-streams 6" in details, (code, details)
            assert await asyncio.to_thread(health_status, address, 2.0) == SERVING
            for task in more:
                task.cancel()
            await asyncio.gather(*more, return_exceptions=True)
            await asyncio.to_thread(wait_until, lambda: open_streams(metrics_address) == 2, 20, "2 open calls")

            await channel.stream_unary(PATH + "Push")(
                iter(list(b.frames(b.header(0), b.chunks(0, 3.0), trailer=b.trailer()))), timeout=30)
            assert set(await push_pull) == {1} and set(await waiting) == {1}
        finally:
            await channel.close()

    asyncio.run(scenario())
    assert refused(metrics_address, "idle") == 1 and refused(metrics_address, "total") == 1
    assert refused(metrics_address, "per_peer") == 0
    client = ShardClient(address, index=0)
    try:
        assert client.stats().version == 1
    finally:
        client.close()


def test_a_peer_is_its_host_whatever_its_port() -> None:
    """Calls are counted per client host: every connection of one machine shares its cap."""
    assert peer_host("ipv4:10.0.0.5:4242") == peer_host("ipv4:10.0.0.5:5353") == "10.0.0.5"
    assert peer_host("ipv6:[::1]:4242") == peer_host("ipv6:%5B::1%5D:4242") == "::1"
    assert peer_host("unix:/run/shard.sock") == "unix:/run/shard.sock"

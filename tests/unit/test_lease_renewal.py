"""Lease renewal that bulk data cannot starve: every frame of a member's stream renews its lease (fake clock), and
the heartbeat thread beats every shard at once, at a fixed cadence, however long one shard takes to answer."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc

from shardps.server.membership.members import Membership
from shardps.worker.session.client import ShardRpcError
from shardps.worker.session.leases import Leases


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_every_frame_of_a_stream_renews_its_members_lease() -> None:
    """A push whose frames keep arriving keeps its member for five leases; a member that only made its call
    meanwhile is dropped at its lease, and so is the pusher once its frames stop."""
    clock = Clock()
    members = Membership(8, lease_seconds=10.0, clock=clock)
    pusher, _ = members.admit("a", "s1")
    members.admit("b", "s2")
    dropped: list[list[str]] = []

    async def arriving():
        for _ in range(5):
            clock.now += 9.0  # each frame takes most of a lease to cross the link
            yield b"frame"

    async def read() -> int:
        count = 0
        async for _ in members.renewing(members.get("a", "s1"), arriving()):
            count += 1
            dropped.append([m.worker_id for m in members.expire()])
        return count

    assert asyncio.run(read()) == 5
    assert dropped == [[], ["b"], [], [], []] and members.ids() == ["a"]
    clock.now += 10.5
    assert [m.worker_id for m in members.expire()] == ["a"] and pusher.expires < clock.now


class _Late(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return "deadline exceeded"


class _Call:
    """A heartbeat in flight: answered at once, or (``hangs``) failing with DEADLINE_EXCEEDED at its timeout."""

    def __init__(self, hangs: bool, timeout: float) -> None:
        self.hangs, self.timeout = hangs, timeout

    def result(self):
        if self.hangs:
            time.sleep(self.timeout)
            raise _Late()
        from shardps.proto import shardps_pb2 as pb

        return pb.HeartbeatReply(members=["w0"], membership_epoch=1)


class _Client:
    def __init__(self, index: int, hangs: bool) -> None:
        self.index, self.address, self.hangs = index, f"shard{index}", hangs
        self.sent: list[float] = []
        self.lock = threading.Lock()

    def heartbeat_future(self, worker_id: str, session: str, timeout: float) -> _Call:
        with self.lock:
            self.sent.append(time.monotonic())
        return _Call(self.hangs, timeout)

    def error(self, what: str, exc: grpc.RpcError) -> ShardRpcError:
        return ShardRpcError(self.index, self.address, what, exc.code(), exc.details())


def test_a_shard_that_does_not_answer_delays_no_other_shards_heartbeat() -> None:
    """The first heartbeat goes at once; then one every third of the lease to every shard, even while shard 1's
    heartbeats wait out their whole timeout each time (before, the next beat of every shard waited for them: two
    thirds of the lease apart)."""
    clients = [_Client(0, hangs=False), _Client(1, hangs=True)]
    began = time.monotonic()
    leases = Leases(clients, "w0", "session", lease_seconds=0.9)  # a beat every 0.3 s
    try:
        time.sleep(1.95)
    finally:
        leases.stop()
    sent = clients[0].sent
    assert sent and sent[0] - began < 0.2
    gaps = [b - a for a, b in zip(sent, sent[1:])]
    assert len(sent) >= 6 and max(gaps) < 0.45, gaps  # 7 at 0.0, 0.3, ... 1.8 s
    assert leases.lost == "" and leases.members == ["w0"]

"""Who may push and pull: the shard's members and the rule that tells one process from another.

A member is a ``worker_id`` held by one **session**: a random token each
worker process makes once (one per ``DistributedOptimizer``) and sends with
every call. The rule:

- a Join for an id that is not a member admits it (up to ``max_workers``);
- a Join for a member's id with the **same** session is that member retrying
  (after a lost reply, say): accepted, nothing changes;
- a Join for a member's id with **another** session is a second process
  using the same id: refused with ALREADY_EXISTS, never merged. The live
  member keeps its place until it leaves;
- every later call (Init, Push, Pull, PushPull, Leave) must carry the
  member's session: another session's call is refused and changes nothing,
  so one process can neither drop another's gradients nor make it leave.

After a member leaves, its id is free: the same ``worker_id`` joining again
is the same logical worker coming back (its place in the averaging order
is its id).

Leases: every call a member makes renews its lease for ``lease_seconds``
(workers send a Heartbeat every third of it from a background thread, over
a connection of their own), and so does every frame of its request streams
(:meth:`Membership.renewing`: a push's chunks, an Init's): a worker whose
chunks keep arriving is alive, however long its push takes on a slow link.
A member whose lease runs out (it crashed, hung or lost the network) is
dropped exactly as if it had left; its id is then free, so a restarted
process with the same ``worker_id`` is the same worker coming back.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterable, Callable
from dataclasses import dataclass

import torch

from shardps.server.checks import shown
from shardps.server.errors import AlreadyExists, FailedPrecondition, ResourceExhausted, ShardError


@dataclass(eq=False)
class Member:
    """One joined worker.

    Attributes:
        staging: this worker's gradients of the open round once its push is
            accepted (``{group: 1-D float32}``), else None.
        arena: its buffers of that push (uint8 byte arena), if the plan has buffers.
        pushing: the task receiving this member's push stream, if one is (a Leave cancels it).
        last_round: the last round whose push was accepted (-1: none pending).
        failed: ``(round, error)`` when the round it pushed was refused; its
            waiting calls raise ``error`` until it pushes again.
        expires: when its lease runs out (``time.monotonic()`` seconds).
        clock: async/ssp: its pushes this shard applied (a member that joins
            a running job starts at the slowest live member's clock).
        applied_round: async/ssp: the round of its push applied last (-1: none).
    """

    worker_id: str
    session: str
    staging: dict[int, torch.Tensor] | None = None
    arena: torch.Tensor | None = None
    pushing: asyncio.Task | None = None
    last_round: int = -1
    failed: tuple[int, ShardError] | None = None
    expires: float = 0.0
    clock: int = 0
    applied_round: int = -1


class RenewingFrames:
    """A member's request stream that renews the member's lease as each frame arrives.

    Setting one float per frame, on the event loop that owns the membership
    (no lock); ``benchmarks/lease_renewal.py`` measures the cost per frame.

    Args:
        frames: the call's request frames (any async iterable).
        member: whose lease each frame renews.
        lease_seconds: the lease.
        clock: the membership's clock (``time.monotonic``).
    """

    __slots__ = ("_frames", "_member", "_lease", "_clock")

    def __init__(self, frames: AsyncIterable[bytes], member: Member, lease_seconds: float,
                 clock: Callable[[], float]) -> None:
        self._frames, self._member = frames.__aiter__(), member
        self._lease, self._clock = lease_seconds, clock

    def __aiter__(self) -> RenewingFrames:
        return self

    async def __anext__(self) -> bytes:
        frame = await self._frames.__anext__()
        self._member.expires = self._clock() + self._lease
        return frame


#: Sessions a shard remembers as dropped at lease expiry (the oldest are forgotten past this; 64 bytes each).
MAX_EXPIRED_SESSIONS = 65536


class Membership:
    """The members of one shard, keyed by worker id; at most ``max_workers``, each holding a lease.

    Attributes:
        epoch: incremented on every change (a member admitted, removed or expired).
        expiries: members dropped because their lease ran out.
        joins, leaves: members admitted (new ones) and removed (Leave) since the process started.
    """

    def __init__(self, max_workers: int, lease_seconds: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_workers, self.lease_seconds, self._clock = max_workers, lease_seconds, clock
        self._members: dict[str, Member] = {}
        # sessions dropped at lease expiry, newest last (bounded): such a process never joins again
        self._expired: OrderedDict[str, None] = OrderedDict()
        self.epoch = 0
        self.expiries = self.joins = self.leaves = 0

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._members

    def ids(self) -> list[str]:
        """Member ids in sorted order (the averaging order)."""
        return sorted(self._members)

    def admit(self, worker_id: str, session: str) -> tuple[Member, bool]:
        """Admit ``worker_id`` with ``session``; returns ``(member, is_new)``.

        Raises:
            AlreadyExists: the id is a live member of another session.
            FailedPrecondition: ``session`` was dropped at lease expiry (rounds went on
                without it: that process may not come back, a restarted one may).
            ResourceExhausted: ``max_workers`` members already.
        """
        if session in self._expired:
            raise FailedPrecondition(
                f"worker {shown(worker_id)} was dropped from this shard: its lease expired (no call for "
                f"{self.lease_seconds:g}s) and the rounds went on without it, so this process may not join again; "
                "restart the worker (a new process joins with a new session)"
            )
        member = self._members.get(worker_id)
        if member is not None:
            if member.session != session:
                raise AlreadyExists(
                    f"worker_id {shown(worker_id)} is already a live member of this shard from another process "
                    "(another session): give every worker process its own worker_id, or wait until the "
                    f"other one leaves or its lease expires ({self.lease_seconds:g}s without a call)"
                )
            member.expires = self._clock() + self.lease_seconds
            return member, False
        if len(self._members) >= self.max_workers:
            raise ResourceExhausted(
                f"this shard has {len(self._members)} members, its --max-workers limit; "
                "a worker must leave first, or start the shards with a larger --max-workers"
            )
        member = Member(worker_id, session, expires=self._clock() + self.lease_seconds)
        self._members[worker_id] = member
        self.epoch += 1
        self.joins += 1
        return member, True

    def get(self, worker_id: str, session: str) -> Member:
        """The member ``worker_id`` if ``session`` is its session; renews its lease.

        Raises:
            FailedPrecondition: not a member, or a member of another session.
        """
        member = self._members.get(worker_id)
        if member is None:
            raise FailedPrecondition(
                f"worker {shown(worker_id)} is not a member of this shard (it never joined, it left, or its lease "
                f"expired: no call for {self.lease_seconds:g}s): join again"
            )
        if member.session != session:
            raise FailedPrecondition(
                f"worker {shown(worker_id)} is a member of this shard from another process (another session); "
                "this call was refused and changed nothing"
            )
        member.expires = self._clock() + self.lease_seconds
        return member

    def renewing(self, member: Member, frames: AsyncIterable[bytes]) -> RenewingFrames:
        """``frames``, a request stream of ``member`` (already checked with :meth:`get`), renewing its lease on
        every frame that arrives: a push that takes several leases to cross a slow link keeps its member."""
        return RenewingFrames(frames, member, self.lease_seconds, self._clock)

    def find(self, worker_id: str) -> Member | None:
        """The member ``worker_id`` whatever its session (for the store's own bookkeeping)."""
        return self._members.get(worker_id)

    def remove(self, worker_id: str, session: str) -> Member | None:
        """Remove ``worker_id`` if ``session`` is its session; None if it is not a member.

        Raises:
            FailedPrecondition: ``worker_id`` is a member of another session (it stays).
        """
        member = self._members.get(worker_id)
        if member is None:
            return None
        self.get(worker_id, session)
        self.epoch += 1
        self.leaves += 1
        return self._members.pop(worker_id)

    def expire(self) -> list[Member]:
        """Remove and return the members whose lease has run out."""
        now = self._clock()
        gone = [m for m in self._members.values() if m.expires < now]
        for m in gone:
            del self._members[m.worker_id]
            self._expired[m.session] = None
        while len(self._expired) > MAX_EXPIRED_SESSIONS:
            self._expired.popitem(last=False)
        if gone:
            self.epoch += 1
            self.expiries += len(gone)
        return gone

    def members(self) -> list[Member]:
        return list(self._members.values())

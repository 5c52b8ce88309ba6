"""Bulk synchronous rounds of one shard: staged pushes, the apply on the compute thread, refusals.

Bulk synchronous parallel (Valiant, "A bridging model for parallel
computation", CACM 1990): round ``r`` completes once every member has pushed
its gradients for ``r`` and at least ``min_workers`` workers have joined;
the gradients are averaged (summed in worker-id order, so the result does
not depend on arrival order), the optimizer steps, and the version becomes
``r + 1``. A round whose update would not be finite is refused whole: state
unchanged, every pusher of the round gets the error, and the shard collects
the same round again.

Runs on the shard's event loop beside ``store.py`` and shares its
membership and notifier. Everything a round needs is captured in one
synchronous step when the round closes (:meth:`Rounds.maybe_apply`), so a
Leave or a push arriving while the apply task starts cannot change it.

Staging memory: each member's push is received into a buffer the size of
the shard's parameters, taken when the push starts and given back when the
round is applied, the push fails, or the member leaves (its push is then
cancelled). Spare buffers are kept for reuse, never more than one per
member, so staging is at most one buffer per member.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import torch

from shardps.proto import shardps_pb2 as pb
from shardps.server.checks import shown
from shardps.server.chunks import ChunkTable
from shardps.server.config import ShardConfig
from shardps.server.errors import Aborted, FailedPrecondition, InvalidArgument, Unavailable, stop_call
from shardps.server.membership import Member, Membership
from shardps.server.optimizer import RoundRefused, ShardOptimizer

log = logging.getLogger(__name__)


@dataclass
class _Closed:
    """What a round captured when it closed: applied from this, whatever happens meanwhile."""

    number: int
    members: list[Member]
    grads: list[dict[int, torch.Tensor]]
    lrs: list[float]


class Rounds:
    """The open round of one shard and its applying.

    Attributes:
        version: rounds applied so far.
        applying: a closed round is being applied (pulls do not read the buffers meanwhile).
        pushed: ``{worker_id: lrs}`` of the members whose push of the open round was accepted.
        applied: rounds applied by this process.
        state_bytes: optimizer-state bytes after the last round.

    Args:
        config: the shard's settings.
        members: the shard's membership (shared with the store).
        notify: wakes every waiting call (the store's notifier).
        run: runs a function on the compute thread (``await run(fn, *args)``).
    """

    def __init__(self, config: ShardConfig, members: Membership, notify: Callable[[], None],
                 run: Callable[..., Awaitable]) -> None:
        self.config, self._members, self._notify, self._run = config, members, notify, run
        self.version = 0
        self.applying = False
        self.pushed: dict[str, list[float]] = {}
        self.applied = 0
        self.state_bytes = 0
        self.table: ChunkTable | None = None
        self.optimizer: ShardOptimizer | None = None
        self._spare: list[dict[int, torch.Tensor]] = []
        self._task: asyncio.Task | None = None

    def start(self, table: ChunkTable, optimizer: ShardOptimizer) -> None:
        """The shard was initialised: rounds may begin."""
        self.table, self.optimizer = table, optimizer
        self.state_bytes = optimizer.state_bytes()  # Adagrad's state exists from the start

    def forget(self) -> None:
        """The job was forgotten before initialisation: drop its buffers."""
        self.table, self.optimizer, self._spare = None, None, []

    def waiting_for(self) -> list[str]:
        """Members whose push of the open round has not been accepted, in id order."""
        return [w for w in self._members.ids() if w not in self.pushed]

    # ------------------------------------------------------------------ push
    async def push(self, member: Member, header: pb.RoundHeader, frames: AsyncIterator[bytes]) -> int:
        """Receive ``member``'s push of round ``header.round``; apply the round if it completes.

        The caller has checked the header and the member. Idempotent: a push of a
        round already accepted from this member is ignored, unread.

        Returns:
            Payload bytes received (0 for an ignored retry).

        Raises:
            FailedPrecondition: a round other than the open one.
            InvalidArgument: bad frames, missing chunks, NaN/Inf gradients (state unchanged);
                or the round this push completed was refused (its error).
            Aborted: another push of this member is in flight, the round is being
                applied, or it closed without this push (the member left).
        """
        rnd = header.round
        if member.last_round == rnd:
            return 0  # a retry of an accepted push: never double-count
        if self.applying:
            raise Aborted(
                f"round {self.version} is being applied; pull version {self.version + 1}, "
                f"then push round {self.version + 1}"
            )
        if rnd != self.version:
            raise FailedPrecondition(
                f"worker {shown(member.worker_id)} pushed round {rnd} but the shard is collecting round "
                f"{self.version}: pull version {self.version} and push round {self.version}"
            )
        if member.pushing is not None:
            raise Aborted(f"another push from worker {shown(member.worker_id)} is in progress")
        member.pushing = asyncio.current_task()  # a Leave cancels it (and frees its staging)
        staging = self._spare.pop() if self._spare else self.table.allocate()
        try:
            rx = self.table.receiver(rnd, staging, what=f"push of round {rnd}",
                                     reject_nonfinite=self.config.reject_nonfinite)
            async for raw in frames:
                rx.add(raw)
            received = rx.finish()
            if self._members.find(member.worker_id) is not member or self.version != rnd or self.applying:
                raise Aborted(f"round {rnd} closed without worker {shown(member.worker_id)}'s push (it left)")
        except BaseException:
            self._give_back(staging)
            raise
        finally:
            member.pushing = None
        member.staging, member.last_round, member.failed = staging, rnd, None
        self.pushed[member.worker_id] = list(header.lrs)
        task = self.maybe_apply()
        if task is not None:
            await asyncio.shield(task)  # the last pusher's reply carries the new version
            if member.failed is not None and member.failed[0] == rnd:
                raise member.failed[1]
        return received

    def _give_back(self, staging: dict[int, torch.Tensor]) -> None:
        if self.table is not None and len(self._spare) < max(1, len(self._members)):
            self._spare.append(staging)

    # ------------------------------------------------------------------ apply
    def maybe_apply(self) -> asyncio.Task | None:
        """Close the open round and start applying it if every member has pushed it."""
        if self.applying or not self.pushed or len(self._members) < self.config.min_workers:
            return None
        if self.waiting_for():
            return None
        workers = sorted(self.pushed)
        members = [self._members.find(w) for w in workers]
        closed = _Closed(self.version, members, [m.staging for m in members], self.pushed[workers[0]])
        if any(self.pushed[w] != closed.lrs for w in workers):
            log.warning("round %d: workers pushed different learning rates; using %s's", closed.number,
                        shown(workers[0]))
        for m in members:
            m.staging = None  # the apply owns the buffers now: a member leaving meanwhile frees nothing
        self.applying = True
        self._task = asyncio.get_running_loop().create_task(self._apply(closed))
        return self._task

    async def _apply(self, closed: _Closed) -> None:
        """Average and step on the compute thread; then advance the version, or refuse the round."""
        try:
            await self._run(self.optimizer.apply, closed.grads, closed.lrs, self.config.reject_nonfinite)
        except RoundRefused as exc:
            where = f" at {self.table.describe(exc.group, exc.start)}" if exc.group >= 0 else ""
            self._refuse(closed, InvalidArgument(
                f"round {closed.number} was refused: {exc.reason}{where}; the shard's parameters and optimizer "
                f"state are unchanged and it collects round {closed.number} again"
            ))
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                log.exception("shard %d: applying round %d failed", self.config.shard_index, closed.number)
            self._refuse(closed, Unavailable(
                f"shard {self.config.shard_index} failed to apply round {closed.number}; see its log"
            ))
            raise
        else:
            self.version += 1
            self.applied += 1
            self.state_bytes = self.optimizer.state_bytes()
        finally:
            for grads in closed.grads:
                self._give_back(grads)
            self.pushed.clear()
            self.applying = False
            self._notify()

    def _refuse(self, closed: _Closed, error: Exception) -> None:
        log.warning("shard %d: %s", self.config.shard_index, error)
        for m in closed.members:
            m.failed, m.last_round = (closed.number, error), -1

    # ------------------------------------------------------------------ leave
    def drop(self, member: Member) -> None:
        """``member`` left: its push of the open round no longer counts, its staging is freed."""
        self.pushed.pop(member.worker_id, None)
        if member.pushing is not None:  # its stream's staging comes back when the task unwinds
            stop_call(member.pushing, Aborted(f"worker {shown(member.worker_id)} left during its push"))
        if member.staging is not None:
            self._give_back(member.staging)
            member.staging = None
        del self._spare[max(1, len(self._members)):]
        self.maybe_apply()

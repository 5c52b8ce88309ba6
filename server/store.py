"""One shard: its job, parameters, membership, and the calls that wait for versions.

A thin gRPC servicer (``service.py``) adapts this class; it knows nothing of
gRPC. Every method runs on the server's one asyncio event loop, so the
fields below need no lock: a method's checks and the changes they guard
happen with no ``await`` between them. Waiting for a version is an
``await`` on a :class:`Notifier` and holds no thread; a cancelled call is
woken at once and frees what it held. Work that reads or writes tensors at
length (building a plan, the trial step, applying a round, the Stats
digest) runs on one compute thread (``self._compute``), one piece at a
time, while the loop keeps answering; while a round is applied
(``rounds.applying``) pulls do not read the buffers. The rounds themselves
are ``consistency/rounds.py`` (ssp's rule: ``consistency/ssp.py``); the
calls made between rounds (optimizer state, export, checkpoint) are
``between_rounds.py``, the checkpoints ``snapshots/checkpoints.py``.
They and ``stats.py`` use only the store's public names (its section "for
collaborators").
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import Executor

from shardps.proto import shardps_pb2 as pb
from shardps.common.codec import FLOAT_DTYPES
from shardps.server import checks
from shardps.server.snapshots.checkpoints import Checkpoints
from shardps.server.checks import shown
from shardps.server.compute import DENSE, PriorityExecutor
from shardps.server.config import ShardConfig
from shardps.server.errors import (
    Aborted, DeadlineExceeded, FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable,
)
from shardps.server.membership.admission import Admission
from shardps.server.membership.job import Job
from shardps.server.membership.members import Member, Membership
from shardps.server.metrics import ShardMetrics
from shardps.server.dense.optimizer import ShardOptimizer
from shardps.server.consistency import ssp
from shardps.server.consistency.rounds import Rounds
from shardps.server.between_rounds import BetweenRounds
from shardps.server.sparse.tables import SparseTables
from shardps.server.stats import Stats, metric_values
from shardps.server.notifier import Notifier

log = logging.getLogger(__name__)


class ShardStore:
    """Parameters and optimizer state of one shard, its job and members; rounds are :class:`Rounds`.

    Tensors: one flat fp32 buffer per param group (``ChunkTable.group_sizes``
    elements); while a round is open, one staged gradient of the same shape
    per member whose push is being received or was accepted. Join checks
    admission's estimate of the peak resident memory (the process, these
    tensors, and each member's streams in flight:
    ``membership.admission.memory_estimate``) against ``config.memory_budget_bytes``.

    Attributes:
        members: the shard's members (others read it: who, their clocks, the epoch).
        notifier: wakes the calls waiting for a change (a version, a member, a round).
        tables: the sparse tables (``sparse/``), their rounds, pulls and exports.
        rounds, checkpoints, between_rounds: the rounds (``consistency/``), checkpoints
            (``snapshots/``), and GetState, SetState, Export and Checkpoint (``between_rounds.py``).

    Args:
        config: the shard's settings and limits.
        compute: where slow work runs (default: one thread of its own).
        metrics: where the shard's Prometheus metrics go (default: a fresh registry, not served).
    """

    def __init__(self, config: ShardConfig, compute: Executor | None = None,
                 metrics: ShardMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else ShardMetrics(config.shard_index)
        self._compute = compute or PriorityExecutor("shard-compute")
        self.notifier = Notifier()
        self._closing = False
        self.members = Membership(config.max_workers, config.lease_seconds)
        self.rounds = Rounds(config, self.members, self.notifier.notify_all, self.run, self.metrics)
        self._admission = Admission(config, self.members, self.rounds, self.notifier.notify_all, self.run,
                                    self.check_open)
        self._waiting = 0
        self._push_bytes = 0
        self._pull_bytes = 0
        self._lease_watch: asyncio.Task | None = None
        self.tables = SparseTables(self)
        self.checkpoints = Checkpoints(self)
        self.between_rounds = BetweenRounds(self)
        self._stats = Stats(self)
        self._last_wait_log = 0.0
        self.incarnation = uuid.uuid4().hex  # tells workers this process apart from the one before a restart
        self.metrics.watch(lambda: metric_values(self))  # read when scraped, from the metrics thread
        self.metrics.watch_tables(lambda: (self.tables.round, self.tables.metric_values()))

    @property
    def version(self) -> int:
        return self.rounds.version

    def warm_up(self) -> None:
        """Build and step a tiny optimizer on the compute thread, in the background.

        Constructing the first ``torch.optim`` optimizer of a process imports
        about two seconds' worth of torch modules; doing it while the shard
        waits for its first worker keeps that out of the first Join.
        """
        spec = pb.OptimizerSpec(class_name="SGD", group_hyperparams_json=['{"lr": 0.1, "momentum": 0.9}'])
        self._compute.submit(ShardOptimizer.trial, spec)

    # ----------------------------------------------------------------- for collaborators
    # Offered on purpose to checkpoints, the between-rounds calls and stats.py; the properties are
    # for reading (only the store's own methods change those fields, on the event loop).

    @property
    def job(self) -> Job | None:
        """The job the shard serves (None before the first Join, and after a reset or a forgotten job)."""
        return self._admission.job

    @property
    def closing(self) -> bool:
        """True once :meth:`close` was called: the shard refuses new work."""
        return self._closing

    @property
    def push_bytes(self) -> int:
        """Payload bytes received so far (pushes, streamed pushes and Init)."""
        return self._push_bytes + self.rounds.streamed.received_bytes

    @property
    def pull_bytes(self) -> int:
        """Payload bytes sent so far (pulls and exports)."""
        return self._pull_bytes

    @property
    def waiting(self) -> int:
        """Calls waiting now for a version (at most ``config.max_waiting``)."""
        return self._waiting

    async def run(self, fn, *args, priority: int = DENSE):
        """Run ``fn(*args)`` on the compute thread, one piece of work at a time; the loop keeps serving meanwhile.
        ``priority`` (``server.compute``: ``DENSE``, ``SPARSE``, ``AHEAD``, ``IDLE``) orders the queued work when the
        compute executor is a ``PriorityExecutor`` (the default); submission order within a priority."""
        if isinstance(self._compute, PriorityExecutor):
            return await asyncio.wrap_future(self._compute.submit_at(priority, fn, *args))
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    def check_open(self) -> None:
        """Refuse a call once the shard is shutting down.

        Raises:
            Unavailable: :meth:`close` was called.
        """
        if self._closing:
            raise Unavailable(f"shard {self.config.shard_index} is shutting down")

    def require_job(self, fingerprint: str) -> Job:
        """The job, if ``fingerprint`` is its plan's (see ``Admission.require_job``).

        Raises:
            FailedPrecondition: no job, or a job of another plan.
        """
        return self._admission.require_job(fingerprint)

    async def restore_job(self, snap) -> None:
        """Before serving: take the job of a checkpoint (``shardps.common.checkpoint.Snapshot``).

        Raises:
            ValueError: the checkpoint does not fit this shard (see ``Admission.restore``).
        """
        await self._admission.restore(snap)

    async def join(self, request: pb.JoinRequest) -> pb.JoinReply:
        """Admit a worker (see ``Admission.join``); from the first Join on, expired leases are dropped."""
        if self._lease_watch is None:
            self._lease_watch = asyncio.get_running_loop().create_task(self._watch_leases())
        reply = await self._admission.join(request)
        reply.incarnation = self.incarnation
        return reply

    async def _watch_leases(self) -> None:
        """Drop members whose lease ran out, checking every quarter lease (at most every second)."""
        tick = min(1.0, self.config.lease_seconds / 4)
        while not self._closing:
            await asyncio.sleep(tick)
            try:
                self._expire_leases()
            except Exception:  # a bug must not stop every later expiry silently
                log.exception("shard %d: dropping expired members failed", self.config.shard_index)

    def _expire_leases(self) -> None:
        """Drop every member whose lease ran out: all of them out of the round before it may close."""
        expired = self.members.expire()
        for member in expired:
            log.warning("shard %d: worker %s dropped: no call for %.1fs (its lease expired); %d members left",
                        self.config.shard_index, shown(member.worker_id), self.config.lease_seconds,
                        len(self.members))
            self._drop(member, apply=False)
        if expired:
            self.rounds.maybe_apply()
            self.notifier.notify_all()

    def reset(self, request: pb.ResetRequest) -> pb.ResetReply:
        """Drop the job of an idle shard (see ``Admission.reset``)."""
        self.check_open()
        if len(request.job_id) > 64:
            raise InvalidArgument("job_id has at most 64 characters")
        job_id, version = self._admission.reset(request.job_id)
        self.tables.reset()
        self._stats.forget()
        return pb.ResetReply(job_id=job_id, version=version)

    def heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        """Renew a member's lease; the current membership.

        Raises:
            InvalidArgument: a malformed id or session.
            FailedPrecondition: not a member (never joined, left, or its lease expired) or another session.
        """
        checks.check_worker_id(request.worker_id, self.config)
        checks.check_session(request.session)
        self.check_open()
        self.members.get(request.worker_id, request.session)
        return pb.HeartbeatReply(members=self.members.ids(), membership_epoch=self.members.epoch,
                                 version=self.version, lease_seconds=self.config.lease_seconds)

    async def init(self, header: pb.RoundHeader, frames: AsyncIterator[bytes]) -> int:
        """Receive the initial parameters (see ``Admission.init``); returns the version."""
        self._push_bytes += await self._admission.init(header, frames)
        return self.version

    # ----------------------------------------------------------------- push
    async def push(self, header: pb.RoundHeader, frames: AsyncIterator[bytes], *, can_commit: bool = False) -> bool:
        """Accept one worker's push of round ``header.round``; apply the round if it is complete.

        Every field of the header is checked before any frame is read, every
        field of the trailer before the push is accepted. Idempotent: a second
        push of a round already accepted from this worker is ignored. The last
        pusher of a round waits for the round to be applied, unless the round
        needs commits (then the caller exchanges report and commit first).

        Args:
            can_commit: the caller can run the report/commit exchange (PushPull).

        Returns:
            True if this round needs the report/commit exchange.

        Raises:
            FailedPrecondition: not a member (of this session), not initialised, plan
                mismatch, or a round other than the open one.
            InvalidArgument: a bad header or frames, missing chunks, NaN/Inf gradients;
                nothing on the shard changed.
            Aborted: another push of this worker is in flight, or the round closed without it.
        """
        checks.check_round_header(header, self.config)
        if header.streamed:
            raise InvalidArgument("a streamed round needs PushPull (its chunks come back while it is pushed)")
        self.check_open()
        job = self.require_job(header.plan_fingerprint)
        member = self.members.get(header.worker_id, header.session)
        if not job.initialised:
            raise FailedPrecondition("this shard has not been initialised yet: pull version 0 first")
        # every chunk that arrives renews the member's lease: a push slower than the lease keeps its member
        received, needs_commit = await self.rounds.push(member, header, self.members.renewing(member, frames),
                                                        can_commit=can_commit)
        self._push_bytes += received
        return needs_commit

    async def push_pull_streamed(self, header: pb.RoundHeader, frames: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """A streamed round's PushPull (``RoundHeader.streamed``): the push in, the new version's chunks out as
        each is applied (``shardps.server.consistency.streamed``). Raises what :meth:`push` raises."""
        checks.check_round_header(header, self.config)
        self.check_open()
        job = self.require_job(header.plan_fingerprint)
        member = self.members.get(header.worker_id, header.session)
        if not job.initialised:
            raise FailedPrecondition("this shard has not been initialised yet: pull version 0 first")
        async for frame in self.rounds.streamed.push_pull(member, header, self.members.renewing(member, frames)):
            yield frame

    async def wait_report(self, worker_id: str, session: str, round_: int, timeout: float | None) -> pb.RoundReport:
        """Wait until round ``round_`` (which this member pushed) is averaged; its report for this member.

        Raises:
            FailedPrecondition: not a member of this session.
            InvalidArgument, Unavailable: the round was refused (its error).
            DeadlineExceeded: the round did not close in time.
        """
        member = self.members.get(worker_id, session)
        limit = self.config.max_wait_seconds if timeout is None else min(timeout, self.config.max_wait_seconds)

        def report() -> pb.RoundReport | None:
            closed = self.rounds.closed
            if closed is not None and closed.number == round_ and closed.report is not None and member in closed.members:
                return closed.report
            return None

        await self.notifier.wait_for(
            lambda: self._closing or report() is not None or (member.failed is not None and member.failed[0] == round_),
            limit,
        )
        self.check_open()
        if member.failed is not None and member.failed[0] == round_:
            raise member.failed[1]
        if report() is None:
            raise DeadlineExceeded(f"round {round_} was not averaged within {limit:.1f}s")
        return report()

    def commit(self, worker_id: str, session: str, commit: pb.RoundCommit) -> None:
        """Record a member's commit of the round waiting for commits (see ``Rounds.commit``)."""
        self.rounds.commit(self.members.get(worker_id, session), commit)

    # ----------------------------------------------------------------- pull
    async def wait_version(self, worker_id: str, session: str, min_version: int, timeout: float | None) -> int:
        """Wait, holding no thread, until the shard is initialised and at ``min_version`` or later.

        Args:
            timeout: seconds; capped at ``config.max_wait_seconds``.

        Raises:
            FailedPrecondition: not a member of this session.
            InvalidArgument: the round this member pushed was refused (its error).
            Aborted: the shard has no initialiser any more (join again to take the role).
            ResourceExhausted: ``max_waiting`` calls wait already.
            DeadlineExceeded: not reached in time (the message names who has not pushed).
            Unavailable: the shard is shutting down.
        """
        member = self.members.get(worker_id, session)
        # answer a little before the caller's deadline, so that it reads who the round waits for
        limit = self.config.max_wait_seconds if timeout is None else min(timeout - min(1.0, timeout / 20),
                                                                          self.config.max_wait_seconds)
        rounds = self.rounds

        def failed() -> bool:
            return member.failed is not None and member.failed[0] == min_version - 1

        def ready() -> bool:
            job = self.job
            return (
                self._closing or failed() or self.members.find(worker_id) is not member
                or (job is not None and not job.initialised and job.initialiser is None)
                or (job is not None and job.initialised and rounds.version >= min_version
                    and not (rounds.applying and rounds.mode.synchronous))  # async pulls read a snapshot
            )

        if not ready():
            if self._waiting >= self.config.max_waiting:
                raise ResourceExhausted(
                    f"{self._waiting} calls already wait on this shard (its --max-waiting limit); retry later"
                )
            self._waiting += 1
            try:
                done = await self.notifier.wait_for(ready, limit)
            finally:
                self._waiting -= 1
        else:
            done = True
        self.check_open()
        if failed():
            raise member.failed[1]
        if self.members.find(worker_id) is not member:
            raise Aborted(f"worker {shown(worker_id)} stopped being a member of this shard while it waited (it left, "
                          f"or its lease expired: no call for {self.config.lease_seconds:g}s): join again")
        job = self.job
        if job is not None and not job.initialised and job.initialiser is None:
            raise Aborted(
                "nobody is initialising this shard (the worker named to do it left or did not complete Init "
                f"within {self.config.init_timeout_seconds:.0f}s): join again and the next worker initialises"
            )
        if not done:
            missing = [shown(w) for w in rounds.waiting_for()]
            now = time.monotonic()
            if now - self._last_wait_log > 10:  # rate-limited: many waiting calls time out together
                self._last_wait_log = now
                log.warning("shard %d: round %d still waits for %s", self.config.shard_index, rounds.version,
                            missing[:20])
            raise DeadlineExceeded(
                f"shard {self.config.shard_index} did not reach version {min_version} within {limit:.1f}s "
                f"(version {rounds.version}, initialised={job is not None and job.initialised}, "
                f"{len(self.members)}/{self.config.min_workers} workers joined, "
                f"round {rounds.version} still waits for {missing[:20]})"
            )
        return rounds.version

    def pull(self, version: int, dtype_code: int) -> AsyncIterator[bytes]:
        """Frames of every chunk at exactly ``version`` (call ``wait_version`` first).

        Raises (while iterating):
            Aborted: the shard moved past ``version`` during the pull (pull again).
            Unavailable: the shard is shutting down.
        """
        checks.check_dtype(dtype_code, "pull dtype")
        dtype = FLOAT_DTYPES[dtype_code or pb.FLOAT32]
        job, rounds = self.job, self.rounds
        if not rounds.mode.synchronous:
            return self._snapshot(dtype)

        def check() -> None:
            self.check_open()
            if rounds.version != version or rounds.applying or self.job is not job:
                raise Aborted(f"shard moved on from version {version} during the pull; pull again")

        return self._stream(job.table.frames(rounds.params, rounds.buffers, version, dtype, check))

    async def _snapshot(self, dtype) -> AsyncIterator[bytes]:
        """async/ssp: every frame of the newest version, encoded on the compute thread between two applies.

        Pushes are applied back to back, so a pull cannot wait for a moment
        without one; encoding on the compute thread, which runs the applies,
        reads one whole version (memory: one copy of the shard's parameters
        in the wire dtype per pull being sent).
        """
        job, rounds = self.job, self.rounds

        def encode() -> list[bytes]:
            return list(job.table.frames(rounds.params, rounds.buffers, rounds.snapshot_version, dtype, lambda: None))

        frames = await self.run(encode)
        self.check_open()
        async for frame in self._stream(frames):
            yield frame

    async def wait_turn(self, worker_id: str, session: str, round_: int, timeout: float | None) -> None:
        """async/ssp: wait until this member's push of ``round_`` is applied and, in ssp, its clock is allowed.

        Whether the clock is allowed, and the message when it is not in time,
        are ssp's rule (``consistency/ssp.py``); this is only the wait.

        Raises:
            FailedPrecondition: not a member of this session.
            InvalidArgument: the push was refused (its error).
            Aborted: the member left or was dropped meanwhile.
            DeadlineExceeded: not applied, or the slowest worker not close enough, in time
                (the message names the slowest workers).
        """
        member = self.members.get(worker_id, session)
        rounds = self.rounds
        limit = self.config.max_wait_seconds if timeout is None else min(timeout - min(1.0, timeout / 20),
                                                                          self.config.max_wait_seconds)

        def failed() -> bool:
            return member.failed is not None and member.failed[0] == round_

        def ready() -> bool:
            return (self._closing or failed() or self.members.find(worker_id) is not member
                    or (member.applied_round >= round_ and ssp.clock_allowed(rounds.mode, member, self.members)))

        done = await self.notifier.wait_for(ready, limit)
        self.check_open()
        if failed():
            raise member.failed[1]
        if self.members.find(worker_id) is not member:
            raise Aborted(f"worker {shown(worker_id)} stopped being a member of this shard while it waited: join again")
        if not done:
            raise ssp.turn_overdue(self.config.shard_index, rounds.mode, member, self.members, limit,
                                   applied=member.applied_round >= round_)

    async def _stream(self, frames) -> AsyncIterator[bytes]:
        sent = 0
        try:
            for frame in frames:
                sent += len(frame)
                yield frame
        finally:
            self._pull_bytes += sent

    def check_pull(self, request: pb.PullRequest) -> None:
        """A pull names a member of this session, the job's plan fingerprint and a wire dtype.

        Raises:
            InvalidArgument, FailedPrecondition: the first field that is wrong.
        """
        checks.check_worker_id(request.worker_id, self.config)
        checks.check_session(request.session)
        checks.check_dtype(request.dtype, "pull dtype")
        self.require_job(request.plan_fingerprint)
        self.members.get(request.worker_id, request.session)

    # ----------------------------------------------------------------- leave, stats, close
    def leave(self, request: pb.LeaveRequest) -> int:
        """Remove a member (of this session); rounds stop waiting for it. Returns the members left.

        A push it made to the open round is dropped (a push still being
        received is cancelled). When the last member leaves a shard that was
        never initialised, the job is forgotten.

        Raises:
            InvalidArgument: a malformed id or session.
            FailedPrecondition: the id is a member of another session (it stays).
        """
        checks.check_worker_id(request.worker_id, self.config)
        checks.check_session(request.session)
        member = self.members.remove(request.worker_id, request.session)
        if member is None:
            return len(self.members)
        log.info("shard %d: worker %s left (%d members)", self.config.shard_index, shown(member.worker_id),
                 len(self.members))
        self._drop(member)
        return len(self.members)

    def _drop(self, member: Member, apply: bool = True) -> None:
        """``member`` is no longer a member (it left or its lease expired): nothing waits for it any more.

        ``apply=False``: several members go at once; the caller closes the round after the last.
        """
        self._admission.left(member)
        self.rounds.drop(member, apply)
        self.tables.drop(member.worker_id)
        self.notifier.notify_all()

    async def stats(self, request: pb.StatsRequest) -> pb.StatsReply:
        """The shard's counters; with ``request.digest``, also the SHA-256 of its version, parameters and
        optimizer state (``server/stats.py``)."""
        return await self._stats.reply(request)

    def close(self) -> None:
        """Refuse new work and wake every waiting call (they fail with Unavailable)."""
        self._closing = True
        if self._lease_watch is not None:
            self._lease_watch.cancel()
        self.notifier.notify_all()

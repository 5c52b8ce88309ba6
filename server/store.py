"""The shard's state: the job, its parameters, membership, and the calls that wait for versions.

A thin gRPC servicer (``service.py``) adapts this class; it knows nothing of
gRPC. Every method runs on the server's one asyncio event loop, so the
fields below need no lock: a method's checks and the changes they guard
happen with no ``await`` between them. Waiting for a version is an
``await`` on a :class:`_Notifier` and holds no thread; a cancelled call is
woken at once and frees what it held. Work that reads or writes tensors at
length (building a plan, the trial step, applying a round, the Stats
digest) runs on one compute thread (``self._compute``), one piece at a
time, while the loop keeps answering; while a round is applied
(``rounds.applying``) pulls do not read the buffers. The rounds themselves
are ``rounds.py``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor, ThreadPoolExecutor

import torch

from shardps.proto import shardps_pb2 as pb
from shardps.proto.codec import TORCH_DTYPES
from shardps.proto.optim import OptimizerSpecError, check_shardable, parse_hyperparams
from shardps.proto.plan import PartitionPlan
from shardps.server import checks
from shardps.server.checks import shown
from shardps.server.chunks import ChunkTable
from shardps.server.config import ShardConfig
from shardps.server.errors import (
    Aborted, DeadlineExceeded, FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable, stop_call,
)
from shardps.server.job import Job, check_view_for_new_job, new_job_id
from shardps.server.membership import Membership
from shardps.server.optimizer import ShardOptimizer
from shardps.server.rounds import Rounds

log = logging.getLogger(__name__)


class _Notifier:
    """Wake every coroutine waiting for the shard's state to change (no thread is held while waiting)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify_all(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``predicate()`` holds or ``timeout`` seconds pass; returns ``predicate()``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not predicate():
            event = self._event
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except TimeoutError:
                return predicate()
        return True


def _hyperparams_without_lr(spec: pb.OptimizerSpec) -> list[dict]:
    """Each group's checked hyperparameters except ``lr``.

    Raises:
        InvalidArgument: a malformed hyperparameter (see ``parse_hyperparams``).
    """
    try:
        groups = parse_hyperparams(spec)
    except OptimizerSpecError as exc:
        raise InvalidArgument(str(exc)) from None
    for hp in groups:
        hp.pop("lr", None)
    return groups


class ShardStore:
    """Parameters and optimizer state of one shard, its job and members; rounds are :class:`Rounds`.

    Tensors: one flat fp32 buffer per param group (``ChunkTable.group_sizes``
    elements); while a round is open, one staged gradient of the same shape
    per member whose push is being received or was accepted. Memory is
    bounded by ``4 x shard elements x (1 + optimizer-state buffers + members)``
    bytes plus the dry run's fixed scratch, which Join checks against
    ``config.memory_budget_bytes``.

    Args:
        config: the shard's settings and limits.
        compute: where slow work runs (default: one thread of its own).
    """

    def __init__(self, config: ShardConfig, compute: Executor | None = None) -> None:
        self.config = config
        self._compute = compute or ThreadPoolExecutor(1, thread_name_prefix="shard-compute")
        self._notifier = _Notifier()
        self._closing = False
        self._job: Job | None = None
        self._params: dict[int, torch.Tensor] = {}
        self._members = Membership(config.max_workers)
        self.rounds = Rounds(config, self._members, self._notifier.notify_all, self._run)
        self._waiting = 0
        self._first_join = asyncio.Lock()
        self._digest: asyncio.Future | None = None  # the Stats digest being computed, shared by callers
        self._push_bytes = 0
        self._pull_bytes = 0

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

    async def _run(self, fn, *args):
        """Run ``fn(*args)`` on the compute thread; the loop keeps serving meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    # ----------------------------------------------------------------- join
    async def join(self, request: pb.JoinRequest) -> pb.JoinReply:
        """Admit a worker; the first join fixes the plan, the optimizer and (on shard 0) the job id.

        Every check that can refuse the Join runs before anything changes.

        Raises:
            InvalidArgument: a malformed id, session, plan or optimizer, or a limit broken.
            FailedPrecondition: the plan, optimizer or job differs from the shard's.
            AlreadyExists: the id is a live member of another session.
            ResourceExhausted: ``max_workers`` members, or the memory budget.
        """
        cfg = self.config
        checks.check_worker_id(request.worker_id, cfg)
        checks.check_session(request.session)
        self._check_open()
        if len(request.optimizer.group_hyperparams_json) > cfg.max_groups:
            raise InvalidArgument(
                f"the optimizer has {len(request.optimizer.group_hyperparams_json)} param groups; "
                f"this shard accepts at most {cfg.max_groups}"
            )
        hyperparams = _hyperparams_without_lr(request.optimizer)
        if cfg.shard_index > 0 and not request.job.job_id:
            raise InvalidArgument(
                f"joining shard {cfg.shard_index} needs shard 0's job view: join shard 0 first (the worker library does)"
            )
        if self._job is None:
            async with self._first_join:  # Joins that arrive together build the job once
                if self._job is None:
                    await self._new_job(request, hyperparams)
        job = self._job
        job.check_same_job(request, hyperparams)
        if cfg.shard_index > 0:
            job.check_view(request.job, cfg.shard_index, self.version)
        if request.worker_id not in self._members:
            checks.check_memory(job.table.numel, job.state_buffers, len(self._members) + 1, cfg)
        member, is_new = self._members.admit(request.worker_id, request.session)
        # Past every refusal: only now may the Join change the job.
        if cfg.shard_index > 0 and job.adopt_initialiser(request.job):
            self._arm_expiry(job)
        if cfg.shard_index == 0 and job.initialiser is None and not job.initialised:
            job.designate(member.worker_id)
            self._arm_expiry(job)
        initialise = not job.initialised and job.initialiser == member.worker_id
        if is_new:
            log.info("shard %d: worker %s joined (%d members)", cfg.shard_index, shown(member.worker_id),
                     len(self._members))
        return pb.JoinReply(
            initialise=initialise, version=self.version, members=len(self._members),
            shard_index=cfg.shard_index, job=job.view(self.version),
        )

    async def _new_job(self, request: pb.JoinRequest, hyperparams: list[dict]) -> Job:
        """Check a first joiner's plan and optimizer against the limits, build them off the loop, fix the job."""
        cfg = self.config
        try:
            check_shardable(request.optimizer.class_name)
        except OptimizerSpecError as exc:
            raise InvalidArgument(str(exc)) from None
        num_groups = len(request.optimizer.group_hyperparams_json)
        elements = checks.check_plan_spec(request.plan, num_groups, cfg)
        checks.check_memory(elements, 0, 1, cfg)
        try:  # O(keys): a plan that does not match its fingerprint is refused before it is built
            fingerprint = PartitionPlan.fingerprint_of_proto(request.plan)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        if fingerprint != request.plan_fingerprint:
            raise InvalidArgument(
                f"plan fingerprint {shown(request.plan_fingerprint)} does not match the plan sent "
                f"({fingerprint!r}); worker and shard run different shardps versions"
            )
        if cfg.shard_index > 0:
            check_view_for_new_job(request.job, cfg.shard_index)

        def build() -> Job:  # on the compute thread: O(chunks) and one trial step
            try:
                plan = PartitionPlan.from_proto(request.plan)
                state_buffers = ShardOptimizer.trial(request.optimizer)
            except ValueError as exc:  # OptimizerSpecError is a ValueError
                raise InvalidArgument(str(exc)) from None
            return Job(
                table=ChunkTable(plan, cfg.shard_index), plan_bytes=request.plan.SerializeToString(deterministic=True),
                spec=request.optimizer, hyperparams=hyperparams, num_groups=num_groups, state_buffers=state_buffers,
            )

        job = await self._run(build)
        checks.check_memory(job.table.numel, job.state_buffers, 1, cfg)
        self._check_open()
        if cfg.shard_index > 0:
            check_view_for_new_job(request.job, cfg.shard_index)
        job.job_id = new_job_id() if cfg.shard_index == 0 else request.job.job_id
        self._job = job
        log.info("shard %d: job %s, plan %s, %d chunks, %d elements, optimizer %s", cfg.shard_index, job.job_id,
                 job.fingerprint, len(job.table.chunks), job.table.numel, job.spec.class_name)
        return job

    def _arm_expiry(self, job: Job) -> None:
        """(Re)start the timer that frees the initialiser role after ``init_timeout_seconds``.

        Not while the initialiser's Init stream is being received: the timeout
        bounds a worker that never starts (or never finishes) sending, not a
        large model arriving on a slow link.
        """
        if job.expiry is not None:
            job.expiry.cancel()
            job.expiry = None
        if job.initialiser is None or job.initialised or job.init_streaming is not None:
            return
        worker = job.initialiser

        def expire() -> None:
            if self._job is job and job.init_streaming is None and job.lose_initialiser(worker):
                log.warning("shard %d: worker %s did not complete Init within %.0fs; the next Join initialises",
                            self.config.shard_index, shown(worker), self.config.init_timeout_seconds)
                self._notifier.notify_all()

        job.expiry = asyncio.get_running_loop().call_later(self.config.init_timeout_seconds, expire)

    def _check_open(self) -> None:
        if self._closing:
            raise Unavailable(f"shard {self.config.shard_index} is shutting down")

    def _require_job(self, fingerprint: str) -> Job:
        job = self._job
        if job is None:
            raise FailedPrecondition("no worker has joined this shard yet: call Join first")
        if fingerprint != job.fingerprint:
            raise FailedPrecondition(
                f"partition plan fingerprint {shown(fingerprint)} differs from this shard's {job.fingerprint!r}: "
                "every worker must use the same model, parameter names, param groups, number of shards and chunk_bytes"
            )
        return job

    # ----------------------------------------------------------------- init
    async def init(self, header: pb.RoundHeader, frames: AsyncIterator[bytes]) -> int:
        """Receive the initial parameters from the worker that Join named initialiser.

        One Init stream at a time. The check is made before the stream is read
        and again when it ends, so an Init that finishes after another one (or
        after the role passed on) is refused and changes nothing.

        Raises:
            FailedPrecondition: not the initialiser, already initialised, plan mismatch.
            Aborted: another Init stream is being received.
            InvalidArgument: a bad, missing or non-finite chunk (the shard stays uninitialised).
        """
        checks.check_round_header(header, self.config)
        self._check_open()
        job = self._require_job(header.plan_fingerprint)
        member = self._members.get(header.worker_id, header.session)

        def check() -> None:
            self._check_open()
            if self._job is not job or self._members.find(member.worker_id) is not member:
                raise FailedPrecondition("the job or the member changed while this Init was read; join again")
            if job.initialised or job.initialiser != member.worker_id:
                raise FailedPrecondition(
                    f"worker {shown(member.worker_id)} may not initialise this shard (initialised={job.initialised}, "
                    f"initialiser {shown(job.initialiser or job.initialised_by)}); pull the parameters instead"
                )

        check()
        if job.init_streaming is not None:
            raise Aborted("another Init stream of this shard is being received")
        job.init_streaming = asyncio.current_task()
        self._arm_expiry(job)  # paused while the stream is read
        try:
            staged = job.table.allocate()  # all-or-nothing: these become the parameters only if every chunk is good
            rx = job.table.receiver(0, staged, what="init", reject_nonfinite=True)
            async for raw in frames:
                rx.add(raw)
            received = rx.finish()
            try:
                optimizer = await self._run(ShardOptimizer, job.spec, staged)
            except OptimizerSpecError as exc:
                raise InvalidArgument(str(exc)) from None
            check()
        finally:
            job.init_streaming = None
            self._arm_expiry(job)  # re-armed if the stream failed
        self._params = staged
        self.rounds.start(job.table, optimizer)
        job.initialised, job.initialised_by, job.initialiser = True, member.worker_id, None
        self._arm_expiry(job)
        self._push_bytes += received
        log.info("shard %d: initialised by worker %s", self.config.shard_index, shown(member.worker_id))
        self._notifier.notify_all()
        return self.version

    # ----------------------------------------------------------------- push
    async def push(self, header: pb.RoundHeader, frames: AsyncIterator[bytes]) -> int:
        """Accept one worker's gradients for round ``header.round``; apply the round if it is complete.

        Every field of the header is checked before any frame is read.
        Idempotent: a second push of a round already accepted from this worker
        is ignored. Returns the shard version after the push (the last pusher
        of a round waits for the round to be applied).

        Raises:
            FailedPrecondition: not a member (of this session), not initialised, plan
                mismatch, or a round other than the open one.
            InvalidArgument: a bad header or frames, missing chunks, NaN/Inf gradients;
                the shard's state is unchanged.
            Aborted: another push of this worker is in flight, or the round closed without it.
        """
        checks.check_round_header(header, self.config)
        self._check_open()
        job = self._require_job(header.plan_fingerprint)
        member = self._members.get(header.worker_id, header.session)
        if not job.initialised:
            raise FailedPrecondition("this shard has not been initialised yet: pull version 0 first")
        if len(header.lrs) != job.num_groups:
            raise InvalidArgument(f"push carries {len(header.lrs)} learning rates for {job.num_groups} param group(s)")
        self._push_bytes += await self.rounds.push(member, header, frames)
        return self.version

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
        member = self._members.get(worker_id, session)
        limit = self.config.max_wait_seconds if timeout is None else min(timeout, self.config.max_wait_seconds)
        rounds = self.rounds

        def failed() -> bool:
            return member.failed is not None and member.failed[0] == min_version - 1

        def ready() -> bool:
            job = self._job
            return (
                self._closing or failed() or self._members.find(worker_id) is not member
                or (job is not None and not job.initialised and job.initialiser is None)
                or (job is not None and job.initialised and not rounds.applying and rounds.version >= min_version)
            )

        if not ready():
            if self._waiting >= self.config.max_waiting:
                raise ResourceExhausted(
                    f"{self._waiting} calls already wait on this shard (its --max-waiting limit); retry later"
                )
            self._waiting += 1
            try:
                done = await self._notifier.wait_for(ready, limit)
            finally:
                self._waiting -= 1
        else:
            done = True
        self._check_open()
        if failed():
            raise member.failed[1]
        if self._members.find(worker_id) is not member:
            raise Aborted(f"worker {shown(worker_id)} left this shard while it waited")
        job = self._job
        if job is not None and not job.initialised and job.initialiser is None:
            raise Aborted(
                "nobody is initialising this shard (the worker named to do it left or did not complete Init "
                f"within {self.config.init_timeout_seconds:.0f}s): join again and the next worker initialises"
            )
        if not done:
            missing = [shown(w) for w in rounds.waiting_for()]
            raise DeadlineExceeded(
                f"shard {self.config.shard_index} did not reach version {min_version} within {limit:.1f}s "
                f"(version {rounds.version}, initialised={job is not None and job.initialised}, "
                f"{len(self._members)}/{self.config.min_workers} workers joined, "
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
        dtype = TORCH_DTYPES[dtype_code or pb.FLOAT32]
        job, rounds = self._job, self.rounds

        def check() -> None:
            self._check_open()
            if rounds.version != version or rounds.applying or self._job is not job:
                raise Aborted(f"shard moved on from version {version} during the pull; pull again")

        return self._stream(job.table.frames(self._params, version, dtype, check))

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
        self._require_job(request.plan_fingerprint)
        self._members.get(request.worker_id, request.session)

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
        member = self._members.remove(request.worker_id, request.session)
        if member is None:
            return len(self._members)
        log.info("shard %d: worker %s left (%d members)", self.config.shard_index, shown(member.worker_id),
                 len(self._members))
        job = self._job
        if job is not None and job.lose_initialiser(member.worker_id):
            if job.init_streaming is not None:  # its Init stream would only be refused at the end
                stop_call(job.init_streaming, Aborted(f"worker {shown(member.worker_id)} left during its Init"))
            self._arm_expiry(job)
        if job is not None and not job.initialised and not len(self._members):
            if job.expiry is not None:
                job.expiry.cancel()
            self._job = None
            self.rounds.forget()
            log.info("shard %d: the last member left before initialisation; job %s forgotten",
                     self.config.shard_index, job.job_id)
        self.rounds.drop(member)
        self._notifier.notify_all()
        return len(self._members)

    async def _digest_of_current(self) -> str:
        """SHA-256 of the version, parameters and optimizer state; one computation shared by concurrent callers."""
        if self._digest is None:
            async def compute() -> str:
                try:
                    while self.rounds.applying:  # read the buffers between rounds only
                        await self._notifier.wait_for(lambda: not self.rounds.applying, self.config.max_wait_seconds)
                    return await self._run(self.rounds.optimizer.digest, self.version)
                finally:
                    self._digest = None

            self._digest = asyncio.ensure_future(compute())
        return await asyncio.shield(self._digest)

    async def stats(self, request: pb.StatsRequest) -> pb.StatsReply:
        """The shard's counters; with ``request.digest``, also the SHA-256 of version, parameters and state."""
        job = self._job
        digest = ""
        if request.digest and self.rounds.optimizer is not None:
            digest = await self._digest_of_current()
        return pb.StatsReply(
            shard_index=self.config.shard_index,
            num_shards=self.config.num_shards,
            version=self.version,
            members=self._members.ids(),
            min_workers=self.config.min_workers,
            initialised=job is not None and job.initialised,
            plan_fingerprint=job.fingerprint if job else "",
            optimizer=job.spec.class_name if job else "",
            num_chunks=len(job.table.chunks) if job else 0,
            param_bytes=4 * (job.table.numel if job else 0),
            optimizer_state_bytes=self.rounds.state_bytes,
            push_bytes_total=self._push_bytes,
            pull_bytes_total=self._pull_bytes,
            pushed=sorted(self.rounds.pushed),
            job_id=job.job_id if job else "",
            waiting=self._waiting,
            max_workers=self.config.max_workers,
            digest=digest,
        )

    def close(self) -> None:
        """Refuse new work and wake every waiting call (they fail with Unavailable)."""
        self._closing = True
        self._notifier.notify_all()

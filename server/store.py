"""The shard's state: parameters, optimizer state, membership and BSP rounds.

A thin gRPC servicer (``service.py``) adapts this class; it knows nothing of
gRPC. Every method runs on the server's one asyncio event loop, so the
fields below need no lock: a method's checks and the changes they guard
happen with no ``await`` between them. Waiting for a version is an
``await`` on a :class:`_Notifier` and holds no thread; a cancelled call is
woken at once and frees what it held. Work that takes time (building a
plan, the trial step, applying a round, the Stats digest) runs on one
compute thread (``self._compute``) while the loop keeps answering; while a
round is applied (``self._applying``) pulls do not read the buffers.

Bulk synchronous rounds (Valiant, "A bridging model for parallel
computation", CACM 1990): round ``r`` completes once every member has pushed
its gradients for ``r`` and at least ``min_workers`` workers have joined;
the gradients are averaged (summed in worker-id order, so the result does
not depend on arrival order), the optimizer steps once over each flat
buffer, and the version becomes ``r + 1``. A round whose update would not
be finite is refused whole: state unchanged, every pusher of the round gets
the error, and the shard collects the same round again.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass

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
    Aborted, DeadlineExceeded, FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable,
)
from shardps.server.job import Job, check_view_for_new_job, new_job_id
from shardps.server.membership import Member, Membership
from shardps.server.optimizer import RoundRefused, ShardOptimizer

log = logging.getLogger(__name__)

#: Shards of at most this many elements apply a round on the event loop itself
#: (under ~1 ms); larger ones on the compute thread, so the loop keeps serving.
INLINE_ELEMENTS = 1 << 16


@dataclass
class _Counters:
    push_bytes: int = 0
    pull_bytes: int = 0
    rounds: int = 0


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
    """Parameters and optimizer state of one shard, with BSP rounds over its members.

    Tensors: one flat fp32 buffer per param group (``ChunkTable.group_sizes``
    elements); while a round is open, one staged gradient of the same shape
    per member whose push was accepted. Memory is bounded by
    ``4 x shard elements x (1 + optimizer-state buffers + members)`` bytes,
    which Join checks against ``config.memory_budget_bytes``.

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
        self._optimizer: ShardOptimizer | None = None
        self._members = Membership(config.max_workers)
        self._pushed: dict[str, list[float]] = {}  # worker -> lrs, for the open round
        self._applying = False
        self._apply_task: asyncio.Task | None = None
        self._spare: list[dict[int, torch.Tensor]] = []  # staging buffers for reuse
        self._waiting = 0
        self._first_join = asyncio.Lock()
        self._state_bytes = 0  # optimizer state bytes after the last round (read here, not during a step)
        self.version = 0
        self._counters = _Counters()

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
        if cfg.shard_index > 0 and job.follow(request.job, cfg.shard_index):
            self._arm_expiry(job)
        is_new = request.worker_id not in self._members
        if is_new:
            checks.check_memory(job.table.numel, job.state_buffers, len(self._members) + 1, cfg)
        member, is_new = self._members.admit(request.worker_id, request.session)
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

        def build() -> Job:  # on the compute thread: O(chunks) and one trial step
            try:
                plan = PartitionPlan.from_proto(request.plan)
                state_buffers = ShardOptimizer.trial(request.optimizer)
            except ValueError as exc:  # OptimizerSpecError is a ValueError
                raise InvalidArgument(str(exc)) from None
            if plan.fingerprint != request.plan_fingerprint:
                raise InvalidArgument(
                    f"plan fingerprint {shown(request.plan_fingerprint)} does not match the plan sent "
                    f"({plan.fingerprint!r}); worker and shard run different shardps versions"
                )
            return Job(
                table=ChunkTable(plan, cfg.shard_index), plan_bytes=request.plan.SerializeToString(deterministic=True),
                spec=request.optimizer, hyperparams=hyperparams, num_groups=num_groups, state_buffers=state_buffers,
            )

        if cfg.shard_index > 0:
            check_view_for_new_job(request.job, cfg.shard_index)
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
        """(Re)start the timer that frees the initialiser role after ``init_timeout_seconds``."""
        if job.expiry is not None:
            job.expiry.cancel()
            job.expiry = None
        if job.initialiser is None or job.initialised:
            return
        worker = job.initialiser

        def expire() -> None:
            if self._job is job and job.lose_initialiser(worker):
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

        The check is made before the stream is read and again when it ends, so
        an Init that finishes after another one (or after the role passed on)
        is refused and changes nothing.

        Raises:
            FailedPrecondition: not the initialiser, already initialised, plan mismatch.
            InvalidArgument: a bad, missing or non-finite chunk (the shard stays uninitialised).
        """
        checks.check_round_header(header, self.config)

        def check() -> tuple[Job, Member]:
            self._check_open()
            job = self._require_job(header.plan_fingerprint)
            member = self._members.get(header.worker_id, header.session)
            if job.initialised or job.initialiser != member.worker_id:
                raise FailedPrecondition(
                    f"worker {shown(member.worker_id)} may not initialise this shard (initialised={job.initialised}, "
                    f"initialiser {shown(job.initialiser or job.initialised_by)}); pull the parameters instead"
                )
            return job, member

        job, member = check()
        staged = job.table.allocate()  # all-or-nothing: these become the parameters only if every chunk is good
        rx = job.table.receiver(0, staged, what="init", reject_nonfinite=True)
        async for raw in frames:
            rx.add(raw)
        received = rx.finish()
        try:
            optimizer = await self._run(ShardOptimizer, job.spec, staged)
        except OptimizerSpecError as exc:
            raise InvalidArgument(str(exc)) from None
        if check() != (job, member):  # the role passed on while the stream was read
            raise FailedPrecondition("the shard's initialiser changed while this Init was read; pull instead")
        self._params, self._optimizer = staged, optimizer
        self._state_bytes = optimizer.state_bytes()  # Adagrad's state exists from the start
        job.initialised, job.initialised_by, job.initialiser = True, member.worker_id, None
        self._arm_expiry(job)
        self._counters.push_bytes += received
        log.info("shard %d: initialised by worker %s", self.config.shard_index, shown(member.worker_id))
        self._notifier.notify_all()
        return self.version

    # ----------------------------------------------------------------- push
    async def push(self, header: pb.RoundHeader, frames: AsyncIterator[bytes]) -> int:
        """Accept one worker's gradients for round ``header.round``; apply the round if it is complete.

        Every field of the header is checked before any frame is read.
        Idempotent: a second push of a round already accepted from this worker
        is ignored. Returns the shard version after the push.

        Raises:
            FailedPrecondition: not a member (of this session), not initialised, plan
                mismatch, or a round other than the open one.
            InvalidArgument: a bad header or frames, missing chunks, NaN/Inf gradients;
                the shard's state is unchanged.
            Aborted: another push of this worker is in flight, or the round closed without it.
        """
        checks.check_round_header(header, self.config)
        worker, rnd = header.worker_id, header.round
        self._check_open()
        job = self._require_job(header.plan_fingerprint)
        member = self._members.get(worker, header.session)
        if not job.initialised:
            raise FailedPrecondition("this shard has not been initialised yet: pull version 0 first")
        if len(header.lrs) != job.num_groups:
            raise InvalidArgument(f"push carries {len(header.lrs)} learning rates for {job.num_groups} param group(s)")
        if member.last_round == rnd:
            return self.version  # a retry of an accepted push: never double-count
        if self._applying:
            raise Aborted(
                f"round {self.version} is being applied; pull version {self.version + 1}, "
                f"then push round {self.version + 1}"
            )
        if rnd != self.version:
            raise FailedPrecondition(
                f"worker {shown(worker)} pushed round {rnd} but the shard is collecting round {self.version}: "
                f"pull version {self.version} and push round {self.version}"
            )
        if member.pushing:
            raise Aborted(f"another push from worker {shown(worker)} is in progress")
        member.pushing = True
        staging = self._spare.pop() if self._spare else job.table.allocate()
        try:
            rx = job.table.receiver(rnd, staging, what=f"push of round {rnd}",
                                    reject_nonfinite=self.config.reject_nonfinite)
            async for raw in frames:
                rx.add(raw)
            received = rx.finish()
            self._check_open()
            if self._members.find(worker) is not member or self.version != rnd or self._applying:
                raise Aborted(f"round {rnd} closed without worker {shown(worker)}'s push (it left or was removed)")
        except BaseException:
            self._spare.append(staging)
            raise
        finally:
            member.pushing = False
        member.staging, member.last_round, member.failed = staging, rnd, None
        self._pushed[worker] = list(header.lrs)
        self._counters.push_bytes += received
        if self._maybe_apply():
            await asyncio.shield(self._apply_task)  # the last pusher's reply carries the new version
            if member.failed is not None and member.failed[0] == rnd:
                raise member.failed[1]
        return self.version

    def _maybe_apply(self) -> bool:
        """Start applying the open round if every member has pushed it; True if it started."""
        if self._applying or not self._pushed or len(self._members) < self.config.min_workers:
            return False
        if any(w not in self._pushed for w in self._members.ids()):
            return False
        self._applying = True
        self._apply_task = asyncio.get_running_loop().create_task(self._apply())
        return True

    async def _apply(self) -> None:
        """Average and step on the compute thread; then advance the version, or refuse the round."""
        rnd = self.version
        workers = sorted(self._pushed)
        members = [self._members.find(w) for w in workers]
        grads = [m.staging for m in members]
        for m in members:
            m.staging = None  # owned by this task now: a member leaving meanwhile frees nothing
        lrs = self._pushed[workers[0]]
        if any(self._pushed[w] != lrs for w in workers):
            log.warning("round %d: workers pushed different learning rates; using %s's", rnd, shown(workers[0]))
        try:
            apply = functools.partial(self._optimizer.apply, grads, lrs, check=self.config.reject_nonfinite)
            if self._job.table.numel <= INLINE_ELEMENTS:
                apply()  # a small shard's round takes well under a millisecond: no thread hop
            else:
                await self._run(apply)
        except RoundRefused as exc:
            where = f" at {self._job.table.describe(exc.group, exc.start)}" if exc.group >= 0 else ""
            error = InvalidArgument(
                f"round {rnd} was refused: {exc.reason}{where}; the shard's parameters and optimizer state are "
                f"unchanged and it collects round {rnd} again"
            )
            log.warning("shard %d: %s", self.config.shard_index, error)
            for m in members:
                m.failed, m.last_round = (rnd, error), -1
        except BaseException:
            log.exception("shard %d: applying round %d failed", self.config.shard_index, rnd)
            error = Unavailable(f"shard {self.config.shard_index} failed to apply round {rnd}; see its log")
            for m in members:
                m.failed, m.last_round = (rnd, error), -1
            raise
        else:
            self.version += 1
            self._counters.rounds += 1
            self._state_bytes = self._optimizer.state_bytes()
        finally:
            self._spare.extend(grads)
            self._pushed.clear()
            self._applying = False
            self._notifier.notify_all()

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

        def failed() -> bool:
            return member.failed is not None and member.failed[0] == min_version - 1

        def ready() -> bool:
            job = self._job
            return (
                self._closing or failed() or self._members.find(worker_id) is not member
                or (job is not None and not job.initialised and job.initialiser is None)
                or (job is not None and job.initialised and not self._applying and self.version >= min_version)
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
            missing = [shown(w) for w in self._members.ids() if w not in self._pushed]
            raise DeadlineExceeded(
                f"shard {self.config.shard_index} did not reach version {min_version} within {limit:.1f}s "
                f"(version {self.version}, initialised={job is not None and job.initialised}, "
                f"{len(self._members)}/{self.config.min_workers} workers joined, "
                f"round {self.version} still waits for {missing[:20]})"
            )
        return self.version

    def pull(self, version: int, dtype_code: int) -> AsyncIterator[bytes] | None:
        """Frames of every chunk at exactly ``version`` (call ``wait_version`` first).

        Raises (while iterating):
            Aborted: the shard moved past ``version`` during the pull (pull again).
            Unavailable: the shard is shutting down.
        """
        checks.check_dtype(dtype_code, "pull dtype")
        dtype = TORCH_DTYPES[dtype_code or pb.FLOAT32]
        job = self._job

        def check() -> None:
            self._check_open()
            if self.version != version or self._applying or self._job is not job:
                raise Aborted(f"shard moved on from version {version} during the pull; pull again")

        return self._stream(job.table.frames(self._params, version, dtype, check))

    async def _stream(self, frames) -> AsyncIterator[bytes]:
        sent = 0
        try:
            for frame in frames:
                sent += len(frame)
                yield frame
        finally:
            self._counters.pull_bytes += sent

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

        A push it made to the open round is dropped. When the last member
        leaves a shard that was never initialised, the job is forgotten.

        Raises:
            InvalidArgument: a malformed id or session.
            FailedPrecondition: the id is a member of another session (it stays).
        """
        checks.check_worker_id(request.worker_id, self.config)
        checks.check_session(request.session)
        member = self._members.remove(request.worker_id, request.session)
        if member is None:
            return len(self._members)
        self._pushed.pop(member.worker_id, None)
        if member.staging is not None:
            self._spare.append(member.staging)
            member.staging = None
        job = self._job
        if job is not None and job.lose_initialiser(member.worker_id):
            self._arm_expiry(job)
        if job is not None and not job.initialised and not len(self._members):
            if job.expiry is not None:
                job.expiry.cancel()
            self._job, self._spare = None, []
            log.info("shard %d: the last member left before initialisation; job %s forgotten",
                     self.config.shard_index, job.job_id)
        log.info("shard %d: worker %s left (%d members)", self.config.shard_index, shown(member.worker_id),
                 len(self._members))
        self._maybe_apply()
        self._notifier.notify_all()
        return len(self._members)

    async def stats(self, request: pb.StatsRequest) -> pb.StatsReply:
        """The shard's counters; with ``request.digest``, also the SHA-256 of version, parameters and state."""
        job = self._job
        digest = ""
        if request.digest and self._optimizer is not None:
            while self._applying:  # the digest reads the buffers: not while a round changes them
                await self._notifier.wait_for(lambda: not self._applying, self.config.max_wait_seconds)
            digest = await self._run(self._optimizer.digest, self.version)
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
            optimizer_state_bytes=self._state_bytes,
            push_bytes_total=self._counters.push_bytes,
            pull_bytes_total=self._counters.pull_bytes,
            pushed=sorted(self._pushed),
            job_id=job.job_id if job else "",
            waiting=self._waiting,
            max_workers=self.config.max_workers,
            digest=digest,
        )

    def close(self) -> None:
        """Refuse new work and wake every waiting call (they fail with Unavailable)."""
        self._closing = True
        self._notifier.notify_all()

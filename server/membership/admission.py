"""Admitting workers to a shard: the first Join builds the job, the initialiser sends Init, jobs are forgotten.

Runs on the shard's event loop beside ``store.py`` (see there for the
threading rules) and follows the protocol of ``job.py``: the first Join's
plan and optimizer are checked against every limit, then built on the
compute thread; shard 0 names the initialiser and every other shard follows
its view; the initialiser's Init stream becomes the parameters only if it
is complete and the initialiser still holds the role when it ends; a job
whose members all leave before it is initialised is forgotten.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

import torch

from shardps.proto import shardps_pb2 as pb
from shardps.common.optim import OptimizerSpecError, check_shardable, parse_hyperparams
from shardps.common.plan import MASTER_ITEMSIZE, PartitionPlan
from shardps.server import checks
from shardps.server.checks import shown
from shardps.server.dense.chunks import ChunkTable
from shardps.server.config import ShardConfig
from shardps.server.errors import Aborted, FailedPrecondition, InvalidArgument, ResourceExhausted, stop_call
from shardps.server.membership.job import Job, check_view_for_new_job, new_job_id
from shardps.server.membership.members import Member, Membership
from shardps.server.consistency.modes import Mode
from shardps.server.dense.optimizer import SEGMENT, ShardOptimizer
from shardps.server.consistency.rounds import Rounds

log = logging.getLogger(__name__)


#: Resident bytes a member's push and pull hold while they stream (gRPC's buffers within HTTP/2 flow control,
#: and what the allocator keeps of them), at most: a member adds its staged gradient, the smaller of this
#: and half its gradient's bytes, and one chunk (measured: ``benchmarks/join_memory.py``; docs/performance.md;
#: half since the shard reuses freed buffers, ``shardps.common.memory``: 6.4 MiB a member of 1 M elements).
STREAM_BYTES = 20 << 20
#: Resident bytes a job adds besides its arrays: its plan and chunk table, torch's kernels and
#: allocations of a first update (measured as :data:`STREAM_BYTES`).
JOB_BYTES = 16 << 20


def resident_bytes() -> int:
    """This process's resident memory now, bytes (``/proc/self/statm``; where there is none, its peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def member_bytes(elements: int, chunk_bytes: int) -> int:
    """Resident bytes one member adds at a round's peak: ``4 E + min(2 E, STREAM_BYTES) + min(4 E, chunk_bytes)``,
    its staged gradient and its streams in flight (``E`` fp32 elements, chunks of ``chunk_bytes``)."""
    gradient = MASTER_ITEMSIZE * elements
    return gradient + min(gradient // 2, STREAM_BYTES) + min(gradient, chunk_bytes)


def memory_estimate(baseline: int, elements: int, state_buffers: int, members: int, chunk_bytes: int) -> int:
    """Peak resident bytes of a shard once ``members`` workers push one round and pull its result together.

    ``baseline + JOB_BYTES + 4 E (3 + 2 S) + 4 SEGMENT (1 + S) + members x member_bytes(E, chunk_bytes)``:
    the process before any job, the job's fixed part, parameters and optimizer state, the copies of
    both a streamed round keeps to undo what it applied and its average (``shardps.server.consistency.
    streamed``; counted whether or not the workers stream, since they choose per round), the dry run's
    scratch, and each
    member's staged gradient and streams in flight (:func:`member_bytes`).

    Args:
        baseline: the shard's resident bytes before it held a job (:func:`resident_bytes`).
        elements: ``E``, the shard's fp32 elements (parameters, and buffers counted as fp32 elements of the
            same bytes).
        state_buffers: ``S``, the optimizer's state tensors per parameter.
        members: members after the Join.
        chunk_bytes: the plan's ``chunk_bytes``.

    Returns:
        Bytes; within 20% of the measured peak at 1, 64 and 256 members (docs/performance.md).
    """
    gradient = MASTER_ITEMSIZE * elements
    arrays = gradient * (3 + 2 * state_buffers) + MASTER_ITEMSIZE * SEGMENT * (1 + state_buffers)
    return baseline + JOB_BYTES + arrays + members * member_bytes(elements, chunk_bytes)


def check_memory(baseline: int, elements: int, state_buffers: int, members: int, chunk_bytes: int,
                 config: ShardConfig) -> None:
    """Refuse a Join that could make the shard's resident memory exceed ``config.memory_budget_bytes``.

    Raises:
        ResourceExhausted: :func:`memory_estimate` exceeds the budget (the message names the figures and the fix).
    """
    need = memory_estimate(baseline, elements, state_buffers, members, chunk_bytes)
    if need > config.memory_budget_bytes:
        gradient = MASTER_ITEMSIZE * elements
        raise ResourceExhausted(
            f"with {members} member(s) this shard could need {need} bytes of memory ({baseline} bytes of process "
            f"before any job, {gradient} bytes of parameters, {state_buffers} optimizer-state buffer(s), and "
            f"{member_bytes(elements, chunk_bytes)} bytes per member for its staged gradient and streams) but "
            f"its memory budget is {config.memory_budget_bytes} bytes: use more shards, fewer workers, or a larger "
            "--memory-budget-bytes"
        )


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


def _elements(table: ChunkTable) -> int:
    """The shard's fp32 elements, its buffers counted as fp32 elements of the same bytes."""
    return table.numel + -(-table.buffer_bytes // MASTER_ITEMSIZE)


class Admission:
    """The job of one shard and who may join it.

    Attributes:
        job: the job the first Join fixed, or None.

    Args:
        config: the shard's settings and limits.
        members: the shard's membership (shared with the store).
        rounds: the shard's rounds (started when Init completes).
        notify: wakes every waiting call.
        run: runs a function on the compute thread.
        check_open: raises Unavailable once the shard is shutting down.
    """

    def __init__(self, config: ShardConfig, members: Membership, rounds: Rounds, notify: Callable[[], None],
                 run: Callable[..., Awaitable], check_open: Callable[[], None]) -> None:
        self.config, self._members, self.rounds = config, members, rounds
        self._notify, self._run, self._check_open = notify, run, check_open
        self.job: Job | None = None
        self._first_join = asyncio.Lock()
        self._baseline: int | None = None  # resident bytes before the first job (memory_estimate's baseline)

    @property
    def version(self) -> int:
        return self.rounds.version

    def require_job(self, fingerprint: str) -> Job:
        """The job, if ``fingerprint`` is its plan's.

        Raises:
            FailedPrecondition: no job yet, or another plan.
        """
        job = self.job
        if job is None:
            raise FailedPrecondition("no worker has joined this shard yet: call Join first")
        if fingerprint != job.fingerprint:
            raise FailedPrecondition(
                f"partition plan fingerprint {shown(fingerprint)} differs from this shard's {job.fingerprint!r}: "
                "every worker must use the same model, parameter names, param groups, number of shards and chunk_bytes"
            )
        return job

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
        if len(request.static_digest) > 64:
            raise InvalidArgument("static_digest must be a SHA-256 in hex (64 characters)")
        self._check_open()
        if len(request.optimizer.group_hyperparams_json) > cfg.max_groups:
            raise InvalidArgument(
                f"the optimizer has {len(request.optimizer.group_hyperparams_json)} param groups; "
                f"this shard accepts at most {cfg.max_groups}"
            )
        hyperparams = _hyperparams_without_lr(request.optimizer)
        mode = Mode.from_proto(request.mode)
        if cfg.mode and mode.name != cfg.mode:
            raise FailedPrecondition(f"the worker trains in mode {mode.name!r} but this shard was started with "
                                     f"--mode {cfg.mode}: start every worker with mode {cfg.mode!r}")
        if cfg.shard_index > 0 and not request.job.job_id:
            raise InvalidArgument(
                f"joining shard {cfg.shard_index} needs shard 0's job view: join shard 0 first (the worker library does)"
            )
        if self.job is None:
            async with self._first_join:  # Joins that arrive together build the job once
                if self.job is None:
                    await self._new_job(request, hyperparams)
        job = self.job
        job.check_same_job(request, hyperparams)
        if job.mode is not None:
            job.mode.check_same(mode)
        if cfg.shard_index > 0:
            job.check_view(request.job, cfg.shard_index, self.version)
        if request.worker_id not in self._members:
            await self.rounds.streamed.settle(cfg.lease_seconds)  # a part-applied round goes on without it
            if self.job is not job:
                raise Aborted("the shard's job changed while this Join waited for a round; join again")
            check_memory(self._baseline, _elements(job.table), job.state_buffers, len(self._members) + 1,
                         job.table.plan.chunk_bytes, cfg)
        member, is_new = self._members.admit(request.worker_id, request.session)
        # Past every refusal: only now may the Join change the job.
        if job.mode is None:  # the first joiner (or the first one back after a restore) fixes the mode
            job.mode = self.rounds.mode = mode
        if is_new:
            self.rounds.admitted(member)
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
            shard_index=cfg.shard_index, job=job.view(self.version), lease_seconds=cfg.lease_seconds,
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
        if self._baseline is None:  # on the compute thread: after its warm-up, before any job exists
            self._baseline = await self._run(resident_bytes)
        check_memory(self._baseline, elements, 0, 1, request.plan.chunk_bytes, cfg)
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
                static_digest=request.static_digest,
            )

        job = await self._run(build)
        check_memory(self._baseline, _elements(job.table), job.state_buffers, 1, job.table.plan.chunk_bytes, cfg)
        self._check_open()
        if cfg.shard_index > 0:
            check_view_for_new_job(request.job, cfg.shard_index)
        job.job_id = new_job_id() if cfg.shard_index == 0 else request.job.job_id
        self.job = job
        log.info("shard %d: job %s, plan %s, %d chunks, %d elements, optimizer %s, mode %s", cfg.shard_index,
                 job.job_id, job.fingerprint, len(job.table.chunks), job.table.numel, job.spec.class_name,
                 Mode.from_proto(request.mode).describe())
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
            if self.job is job and job.init_streaming is None and job.lose_initialiser(worker):
                log.warning("shard %d: worker %s did not complete Init within %.0fs; the next Join initialises",
                            self.config.shard_index, shown(worker), self.config.init_timeout_seconds)
                self._notify()

        job.expiry = asyncio.get_running_loop().call_later(self.config.init_timeout_seconds, expire)

    # ----------------------------------------------------------------- init
    async def init(self, header: pb.RoundHeader, frames: AsyncIterator[bytes]) -> int:
        """Receive the initial parameters from the worker that Join named initialiser.

        One Init stream at a time. The check is made before the stream is read
        and again when it ends, so an Init that finishes after another one (or
        after the role passed on) is refused and changes nothing.

        Returns:
            Payload bytes received.

        Raises:
            FailedPrecondition: not the initialiser, already initialised, plan mismatch.
            Aborted: another Init stream is being received.
            InvalidArgument: a bad, missing or non-finite chunk (the shard stays uninitialised).
        """
        checks.check_round_header(header, self.config)
        self._check_open()
        job = self.require_job(header.plan_fingerprint)
        member = self._members.get(header.worker_id, header.session)

        def check() -> None:
            self._check_open()
            if self.job is not job or self._members.find(member.worker_id) is not member:
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
            arena = job.table.allocate_buffers()
            rx = job.table.receiver(0, staged, arena, what="init", reject_nonfinite=True)
            async for raw in self._members.renewing(member, frames):  # each chunk renews the initialiser's lease
                if rx.add(raw).header is None:
                    raise InvalidArgument("init: only chunks may follow the round header")
            received = rx.finish()
            try:
                optimizer = await self._run(ShardOptimizer, job.spec, staged, job.table.key_slices, job.table.units())
            except OptimizerSpecError as exc:
                raise InvalidArgument(str(exc)) from None
            check()
        finally:
            job.init_streaming = None
            self._arm_expiry(job)  # re-armed if the stream failed
        self.rounds.start(job.table, optimizer, staged, arena, [set(hp) for hp in job.hyperparams])
        job.initialised, job.initialised_by, job.initialiser = True, member.worker_id, None
        self._arm_expiry(job)
        log.info("shard %d: initialised by worker %s", self.config.shard_index, shown(member.worker_id))
        self._notify()
        return received

    def left(self, member: Member) -> None:
        """``member`` left: its initialiser role passes on (its Init stream ends); a job nobody joined any more
        is forgotten if it was never initialised."""
        job = self.job
        if job is None:
            return
        if job.lose_initialiser(member.worker_id):
            if job.init_streaming is not None:  # its Init stream would only be refused at the end
                stop_call(job.init_streaming, Aborted(f"worker {shown(member.worker_id)} left during its Init"))
            self._arm_expiry(job)
        if not job.initialised and not len(self._members):
            if job.expiry is not None:
                job.expiry.cancel()
            self.job = None
            self.rounds.forget()
            log.info("shard %d: the last member left before initialisation; job %s forgotten",
                     self.config.shard_index, job.job_id)

    def reset(self, job_id: str = "") -> tuple[str, int]:
        """Drop the job of a shard nobody is a member of (the operator's ``shardps reset``).

        Args:
            job_id: when not empty, reset only if the shard holds this job.

        Returns:
            ``(job id dropped, its version)``; ``("", 0)`` if the shard held no job.

        Raises:
            FailedPrecondition: the shard has members (reset idle shards only), or holds another job.
            Aborted: a round or an Init is in progress.
        """
        job = self.job
        if len(self._members):
            raise FailedPrecondition(
                f"shard {self.config.shard_index} has {len(self._members)} member(s) {self._members.ids()[:20]}: "
                "reset only idle shards (stop the job's workers first, or wait for their leases to expire)"
            )
        if job is None:
            return "", 0
        if job_id and job_id != job.job_id:
            raise FailedPrecondition(f"shard {self.config.shard_index} holds job {job.job_id!r}, not {shown(job_id)}")
        if self.rounds.applying or job.init_streaming is not None:
            raise Aborted("a round or an Init is in progress; try again")
        if job.expiry is not None:
            job.expiry.cancel()
        version = self.rounds.version
        self.job = None
        self.rounds.reset()
        log.warning("shard %d: job %s reset at version %d (parameters and optimizer state dropped)",
                    self.config.shard_index, job.job_id, version)
        self._notify()
        return job.job_id, version

    async def restore(self, snap) -> None:
        """Rebuild the job from a checkpoint (``shardps.common.checkpoint.Snapshot``) before the shard serves.

        Raises:
            ValueError: the checkpoint does not fit this shard (another shard count or index, bad optimizer state).
        """
        cfg = self.config
        if self._baseline is None:  # before the job's arrays exist (the checkpoint's file is read already)
            self._baseline = resident_bytes()
        plan_spec, spec = pb.PlanSpec.FromString(snap.plan), pb.OptimizerSpec.FromString(snap.spec)
        if plan_spec.num_shards != cfg.num_shards:
            raise ValueError(f"the checkpoint is of a job with {plan_spec.num_shards} shards, not {cfg.num_shards}")
        hyperparams = _hyperparams_without_lr(spec)

        def build():
            plan = PartitionPlan.from_proto(plan_spec)
            table = ChunkTable(plan, cfg.shard_index)
            params = snap.params()
            if {g: t.numel() for g, t in params.items()} != table.group_sizes:
                raise ValueError("the checkpoint's parameters do not fit this shard's part of its plan")
            optimizer = ShardOptimizer(spec, params, table.key_slices, table.units())
            optimizer.load_state(snap.states())
            optimizer.set_hyperparams([snap.hyperparams.get(g, {}) for g in range(len(hyperparams))])
            job = Job(table=table, plan_bytes=plan_spec.SerializeToString(deterministic=True), spec=spec,
                      hyperparams=hyperparams,
                      num_groups=len(hyperparams), state_buffers=ShardOptimizer.trial(spec),
                      static_digest=snap.static_digest)
            return job, optimizer, params

        job, optimizer, params = await self._run(build)
        if job.fingerprint != snap.fingerprint:
            raise ValueError("the checkpoint's plan does not match its fingerprint")
        buffers = snap.tensors.get("buffers", torch.empty(0, dtype=torch.uint8))
        if buffers.numel() != job.table.buffer_bytes:
            raise ValueError("the checkpoint's buffers do not fit this shard's part of its plan")
        self.rounds.start(job.table, optimizer, params, buffers, [set(hp) for hp in job.hyperparams])
        self.rounds.version = self.rounds.snapshot_version = snap.version
        job.job_id, job.initialised, job.initialised_by, job.restored = snap.job_id, True, snap.initialised_by, True
        self.job = job
        log.warning("shard %d: restored job %s at version %d from a checkpoint", cfg.shard_index, job.job_id,
                    snap.version)

"""The job a shard serves: what its first joiner fixed, and who initialises its parameters.

Initialisation protocol (all shards of a job end up with the parameters of
one worker, or the job fails loudly):

1. A worker joins **shard 0** first. Shard 0 makes the job id and names the
   initialiser: the first joiner, or the next one once the named worker has
   left or has not completed Init within ``init_timeout_seconds``.
2. The worker then joins every other shard with shard 0's :class:`JobView`
   (job id, initialiser, initialised, version). A shard follows shard 0's
   choice of initialiser, and refuses a view that contradicts what it
   holds: a shard that holds nothing while shard 0 is already initialised
   (it lost its partition, e.g. it restarted), a shard of another job, a shard
   initialised by another worker, or a shard whose initialiser is gone while
   shard 0 is initialised (initialisation stopped half-way).
3. Only the named initialiser's Init is accepted, and only once: the check
   is made again when its stream ends, so a slow Init that finishes after
   another one never overwrites parameters.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

from shardps.proto import shardps_pb2 as pb
from shardps.server.checks import shown
from shardps.server.dense.chunks import ChunkTable
from shardps.server.errors import FailedPrecondition, InvalidArgument
from shardps.server.consistency.modes import Mode

_RESET_FIX = ("restart the lost shard on its --checkpoint-dir (it restores its newest checkpoint), or clear every "
              "shard with `shardps reset --servers ...` to begin a new job")


@dataclass(eq=False, kw_only=True)
class Job:
    """What the first Join fixed on this shard, and where its initialisation stands.

    Attributes:
        table: this shard's chunks of the job's partition plan.
        plan_bytes: the plan as sent (deterministic protobuf bytes), to compare later joins.
        spec: the optimizer class and hyperparameters.
        hyperparams: each group's hyperparameters without ``lr`` at the first Join (they may
            change every round; later joiners must have the same names).
        static_digest: SHA-256 of the first joiner's parameters outside the optimizer.
        num_groups: param groups of the optimizer (a push carries one lr each).
        state_buffers: optimizer-state buffers per element (from the trial step).
        job_id: shard 0's id of the job.
        initialiser: worker id told to send Init, or None while the role is free.
        initialiser_lost: the named initialiser left or timed out before initialising.
        initialised: Init completed; ``initialised_by`` names who sent it.
        restored: the job was restored from a checkpoint when this shard started.
        mode: the consistency mode the first joiner fixed (None after a restore until
            the first worker joins again).
        init_streaming: the task receiving the initialiser's Init stream, if one is (the
            timer waits; the initialiser leaving cancels it).
        expiry: timer that frees the initialiser role after ``init_timeout_seconds``.
    """

    table: ChunkTable
    plan_bytes: bytes
    spec: pb.OptimizerSpec
    hyperparams: list[dict]
    num_groups: int
    state_buffers: int
    static_digest: str = ""
    job_id: str = ""
    initialiser: str | None = None
    initialiser_lost: bool = False
    initialised: bool = False
    initialised_by: str = ""
    restored: bool = False
    mode: Mode | None = None
    init_streaming: asyncio.Task | None = None
    expiry: asyncio.TimerHandle | None = field(default=None, repr=False)

    @property
    def fingerprint(self) -> str:
        return self.table.plan.fingerprint

    def view(self, version: int) -> pb.JobView:
        return pb.JobView(
            job_id=self.job_id, initialiser=self.initialiser or self.initialised_by,
            initialised=self.initialised, version=version, restored=self.restored,
        )

    def check_same_job(self, request: pb.JoinRequest, hyperparams: list[dict]) -> None:
        """A later joiner must send the first joiner's plan, optimizer and parameters outside the optimizer.

        Raises:
            FailedPrecondition: another model, chunk size, shard count, optimizer class or
                hyperparameter names, or other parameters outside the optimizer.
            InvalidArgument: the plan sent does not match its own fingerprint.
        """
        if request.plan_fingerprint != self.fingerprint:
            raise FailedPrecondition(
                f"partition plan fingerprint {shown(request.plan_fingerprint)} differs from this shard's "
                f"{self.fingerprint!r}: every worker must use the same model, parameter names, param groups, "
                f"number of shards and chunk_bytes. If job {self.job_id!r} on these shards is over, clear them with "
                "`shardps reset --servers HOST:PORT,...` (once its workers are gone)"
            )
        if request.plan.SerializeToString(deterministic=True) != self.plan_bytes:
            raise InvalidArgument("the plan sent does not match its fingerprint; worker and shard disagree on the plan")
        names = [sorted(hp) for hp in hyperparams]
        if request.optimizer.class_name != self.spec.class_name or names != [sorted(hp) for hp in self.hyperparams]:
            raise FailedPrecondition(
                f"the worker uses optimizer {shown(request.optimizer.class_name)} with groups {names} but this "
                f"shard runs {self.spec.class_name} with groups {[sorted(hp) for hp in self.hyperparams]}; every "
                "worker must build the same optimizer (values may differ: each round carries the lowest worker "
                "id's)"
            )
        if request.static_digest != self.static_digest:
            raise FailedPrecondition(
                "the worker's parameters outside the optimizer differ from the first worker's (SHA-256 "
                f"{shown(request.static_digest)} vs {self.static_digest!r}); they are never sent, so load the same "
                "weights on every worker before building DistributedOptimizer"
            )

    # -------------------------------------------------------------- shard 0
    def designate(self, worker_id: str) -> bool:
        """Shard 0: name ``worker_id`` initialiser if the role is free. True if it (now) holds it."""
        if self.initialised:
            return False
        if self.initialiser is None:
            self.initialiser, self.initialiser_lost = worker_id, False
        return self.initialiser == worker_id

    # ------------------------------------------------------- shards 1..N-1
    def check_view(self, view: pb.JobView, shard_index: int, version: int) -> None:
        """Shard i > 0: refuse shard 0's ``view`` if it contradicts this shard. Changes nothing.

        Args:
            version: this shard's version.

        Shards are at most one round apart, unless one of them restored the job
        from a checkpoint (``restored``): it comes back at the checkpoint's
        version while the others went on, and each shard's partition carries on
        from its own version.

        Raises:
            FailedPrecondition: another job, another initialiser, versions more than
                one round apart without a restore, or an initialisation that
                stopped half-way (the message says which, and the fix).
        """
        if view.job_id != self.job_id:
            raise FailedPrecondition(
                f"shard {shard_index} serves job {self.job_id!r} but shard 0 serves job {shown(view.job_id)}: "
                f"one of them lost its state or they belong to different jobs; {_RESET_FIX}"
            )
        if self.initialised:
            if view.initialiser != self.initialised_by:
                raise FailedPrecondition(
                    f"shard {shard_index} holds the parameters of worker {self.initialised_by!r} but shard 0 names "
                    f"{shown(view.initialiser)} as the job's initialiser: the shards hold parameters from different "
                    f"workers; {_RESET_FIX}"
                )
            synchronous = self.mode is None or self.mode.synchronous  # async shards drift apart freely
            if (view.initialised and synchronous and abs(view.version - version) > 1
                    and not (self.restored or view.restored)):
                raise FailedPrecondition(
                    f"shard {shard_index} is at version {version} but shard 0 at {view.version}: in sync training "
                    "shards are at most one round apart unless one was restored from a checkpoint, so one of them "
                    f"lost or replaced its state; {_RESET_FIX}"
                )
        elif view.initialised and self.initialiser_lost:
            raise FailedPrecondition(
                f"shard 0 is initialised but shard {shard_index} never was (its initialiser left or timed out "
                f"half-way): the job's parameters are incomplete; {_RESET_FIX}"
            )

    def adopt_initialiser(self, view: pb.JobView) -> bool:
        """Shard i > 0, after :meth:`check_view` and admission: follow shard 0's initialiser.

        Returns:
            True if the initialiser changed (the caller restarts its timer).
        """
        if self.initialised or view.initialiser == (self.initialiser or ""):
            return False
        self.initialiser, self.initialiser_lost = view.initialiser or None, False
        return True

    # ----------------------------------------------------------- both
    def lose_initialiser(self, worker_id: str) -> bool:
        """The named initialiser left or timed out; True if it held the role."""
        if self.initialised or self.initialiser != worker_id:
            return False
        self.initialiser, self.initialiser_lost = None, True
        return True


def new_job_id() -> str:
    """A fresh random job id (shard 0 makes one per job)."""
    return uuid.uuid4().hex[:16]


def check_view_for_new_job(view: pb.JobView, shard_index: int) -> None:
    """Shard i > 0 with no job yet: refuse a view of a job that is already under way.

    Raises:
        InvalidArgument: no view (the worker did not join shard 0 first).
        FailedPrecondition: shard 0 is already initialised: this shard lost its partition.
    """
    if not view.job_id:
        raise InvalidArgument(
            f"joining shard {shard_index} needs shard 0's job view: join shard 0 first (the worker library does)"
        )
    if view.initialised or view.version > 0:
        raise FailedPrecondition(
            f"shard {shard_index} holds no state but shard 0 of job {shown(view.job_id)} is initialised at version "
            f"{view.version}: this shard lost its partition (was it restarted?); {_RESET_FIX}"
        )

"""Joining a job: every shard, in the order that keeps the job's parameters from one worker.

The worker joins shard 0 first; shard 0 names the job and the worker that
initialises it. The worker then joins every other shard showing shard 0's
view of the job, so all shards follow one initialiser and a shard whose
state contradicts shard 0's (it restarted empty, it serves another job)
refuses loudly. Only then does the named initialiser send Init to every
shard that told it to; everybody pulls version 0 or later from every
shard. If the initialiser disappears before initialising (the shards say
so with ABORTED), the worker joins again and the next worker initialises.

A Join refused with ALREADY_EXISTS (the id is still held by a process that
crashed and whose lease has not run out yet) is tried again every half
second for up to ``JoinPlan.patience`` seconds: a restarted worker with the
same id is then the same member coming back, while a second live process
using the id keeps being refused (its heartbeats keep the lease).

Rejoining (:func:`rejoin_shard`): when one shard restarts (another
incarnation at the same address) or its connection drops, the worker joins
it again with the same session and pulls its current version into the
model, without restarting. A shard restored from its checkpoint comes back
at the checkpoint's version, and the worker carries on from there on that
shard; a shard that came back empty, or with another job, is refused loudly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass

import grpc

from shardps.proto import shardps_pb2 as pb
from shardps.worker.session.client import ShardClient, ShardRpcError
from shardps.worker.session.retry import retry

log = logging.getLogger(__name__)

#: Joins tried when the named initialiser disappears before initialising.
JOIN_ATTEMPTS = 3


@dataclass(frozen=True, kw_only=True)
class JoinPlan:
    """What a worker sends to join: its identity (worker id and session), the plan and the optimizer."""

    worker_id: str
    session: str
    plan: pb.PlanSpec
    fingerprint: str
    optimizer: pb.OptimizerSpec
    static_digest: str = ""
    patience: float = 30.0
    mode: pb.ModeSpec | None = None


def _join_one(client: ShardClient, request: Callable[[bool], pb.JoinRequest], patience: float) -> pb.JoinReply:
    """Join one shard, waiting up to ``patience`` seconds for an id held by a dead process to be freed.

    ``request(again)`` builds each attempt's request (``again`` from the second
    on, so that it can show shard 0's view of the job as it is now, not as it
    was when the wait began).
    """
    deadline = time.monotonic() + patience
    again = False
    while True:
        try:
            return client.join(request(again))
        except ShardRpcError as exc:
            if exc.code != grpc.StatusCode.ALREADY_EXISTS or time.monotonic() >= deadline:
                raise
            time.sleep(0.5)
            again = True


def _check_replies(replies: Sequence[pb.JoinReply], synchronous: bool = True) -> None:
    """Refuse a job whose shards disagree: one to initialise while another holds trained state.

    Raises:
        RuntimeError: the shards are inconsistent (the message says which and the fix).
    """
    ids = {r.job.job_id for r in replies}
    if len(ids) > 1:
        raise RuntimeError(f"the shards serve different jobs {sorted(ids)}: restart every shard to begin a new job")
    fresh = [i for i, r in enumerate(replies) if r.initialise]
    trained = [(i, r.version) for i, r in enumerate(replies) if r.job.initialised or r.version > 0]
    if fresh and trained:
        i, version = trained[0]
        raise RuntimeError(
            f"shard(s) {fresh} hold no parameters but shard {i} of the same job is initialised at version {version}: "
            "refusing to initialise part of a trained job (a shard lost its state, e.g. it restarted); restore the "
            "shards from a checkpoint, or restart every shard to begin a new job"
        )
    versions = [r.version for r in replies]
    if synchronous and max(versions) - min(versions) > 1 and not any(r.job.restored for r in replies):
        raise RuntimeError(
            f"the shards are at versions {versions}: in sync training shards are at most one round apart unless "
            "one was restored from a checkpoint, so a shard lost or replaced its state; restore the shards from a checkpoint, or restart every shard to "
            "begin a new job"
        )


@dataclass(frozen=True)
class Joined:
    """What joining every shard gave.

    Attributes:
        versions: the version pulled from each shard.
        lease_seconds: the shortest lease the shards grant (heartbeat well within it).
        incarnations: each shard process's random token (another one means it restarted).
        job_id: the job's id (shard 0's).
        initialised: this worker sent the job's initial parameters (to at least one shard).
        member_number: shard 0's member count when it took this worker in (1 for the first worker of
            a job): distinct among workers that joined while nobody left.
    """

    versions: list[int]
    lease_seconds: float
    incarnations: list[str]
    job_id: str
    initialised: bool = False
    member_number: int = 0


def _request(join: JoinPlan, view: pb.JobView | None) -> pb.JoinRequest:
    return pb.JoinRequest(
        worker_id=join.worker_id, session=join.session, plan=join.plan, plan_fingerprint=join.fingerprint,
        optimizer=join.optimizer, job=view, static_digest=join.static_digest, mode=join.mode,
    )


def join_job(
    clients: Sequence[ShardClient],
    pool: ThreadPoolExecutor,
    join: JoinPlan,
    init_frames: Callable[[int], object],
    pull: Callable[[int, list], int],
    on_joined: Callable[[list[pb.JoinReply]], None] | None = None,
) -> Joined:
    """Join every shard, initialise those that name this worker, and pull version 0 or later from each.

    Args:
        clients: one per shard, in shard order.
        pool: threads for the per-shard calls (at least one per shard).
        join: the Join request's contents.
        init_frames: ``init_frames(shard)`` -> the encoded Init stream for that shard.
        pull: ``pull(shard, calls)`` pulls from that shard, appending its gRPC call
            to ``calls`` (so a failing shard can cancel the others), and returns the version.
        on_joined: called with every shard's JoinReply once all of them took this worker, before the Init
            and the first pull (each attempt): where the worker starts its heartbeats.

    Returns:
        :class:`Joined`.

    Raises:
        ShardRpcError: a shard refused (its status and message say why).
        RuntimeError: the shards are inconsistent.
    """

    def request(view: pb.JobView | None) -> pb.JoinRequest:
        return _request(join, view)

    for attempt in range(JOIN_ATTEMPTS):
        first = _join_one(clients[0], lambda again: request(None), join.patience)

        def follow(again: bool) -> pb.JoinRequest:  # shard 0's view now: rounds went on while we waited
            return request(clients[0].join(request(None)).job if again else first.job)

        replies = [first, *pool.map(lambda c: _join_one(c, follow, join.patience), clients[1:])]
        _check_replies(replies, join.mode is None or join.mode.mode in ("", "sync"))
        if on_joined is not None:
            on_joined(replies)
        told = [i for i, r in enumerate(replies) if r.initialise]
        if told:
            log.info("worker %s initialises shard(s) %s of job %s", join.worker_id, told, first.job.job_id)
            list(pool.map(lambda i: clients[i].init(init_frames(i)), told))
        calls: list = []
        futures = [pool.submit(pull, i, calls) for i in range(len(clients))]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)  # blocking wait for every shard's pull
        if any(f.exception() is not None for f in done):
            for call in list(calls):
                call.cancel()
            wait(futures)
        errors = [f.exception() for f in futures if f.exception() is not None]
        if not errors:
            # a shard that holds no dense chunks (fewer parameters than shards) sends none to read a version from
            return Joined([max(f.result(), r.version) for f, r in zip(futures, replies)], min(r.lease_seconds or 10.0 for r in replies),
                          [r.incarnation for r in replies], first.job.job_id, initialised=bool(told),
                          member_number=first.members)
        # the cause, not a pull this function cancelled because of it
        error = next((e for e in errors if getattr(e, "code", None) != grpc.StatusCode.CANCELLED), errors[0])
        initialiser_gone = isinstance(error, ShardRpcError) and error.code == grpc.StatusCode.ABORTED
        if not initialiser_gone or attempt == JOIN_ATTEMPTS - 1:
            raise error
        log.warning("worker %s: %s; joining again", join.worker_id, error.details)
    raise AssertionError("unreachable")


def join_again(clients: Sequence[ShardClient], shard: int, join: JoinPlan, job_id: str) -> pb.JoinReply:
    """Join shard ``shard`` again (same session), without pulling: the shard knows this worker as a member again.

    Each Join is retried while the shard is unreachable (the client's
    ``RetryPolicy``), so a shard that is restarting is waited for, up to that
    policy's total time.

    Returns:
        The shard's Join reply (its ``version`` and ``incarnation`` now).

    Raises:
        ShardRpcError: the shard stayed unreachable, or refused (e.g. it restarted
            without its checkpoint: it holds no state of this trained job).
        RuntimeError: the shard holds another job, or asks to be initialised
            (it lost its state).
    """
    first = clients[0].join(_request(join, None))
    reply = clients[shard].join(_request(join, first.job)) if shard else first
    if reply.job.job_id != job_id or reply.initialise:
        if shard == 0 and reply.job.job_id != job_id:
            try:  # do not leave a half-made new job behind on shard 0
                clients[0].leave(join.worker_id, join.session, timeout=5.0)
            except ShardRpcError:
                pass
        raise RuntimeError(
            f"shard {shard} ({clients[shard].address}) came back without the state of job {job_id!r} (it holds "
            f"job {reply.job.job_id!r}, initialised={reply.job.initialised}): it was restarted without its "
            "checkpoint. Restart it with its --checkpoint-dir, or reset every shard to begin a new job"
        )
    return reply


def rejoin_shard(clients: Sequence[ShardClient], shard: int, join: JoinPlan, job_id: str,
                 pull: Callable[[int, list], int]) -> tuple[int, str]:
    """Join shard ``shard`` again (:func:`join_again`) and pull its current version into the model.

    Returns:
        ``(version, incarnation)`` of the shard now.

    Raises:
        ShardRpcError, RuntimeError: see :func:`join_again`; ShardRpcError also when the pull fails past
            the retry budget.
    """
    reply = join_again(clients, shard, join, job_id)
    client = clients[shard]
    version = retry(lambda: pull(shard, []), client.retry, f"pull from shard {shard} ({client.address})",
                    lambda exc: getattr(exc, "code", None))
    # a shard that holds no dense chunks (fewer parameters than shards) sends none to read a version from
    return max(version, reply.version), reply.incarnation

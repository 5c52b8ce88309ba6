"""Carrying on when a shard restarts or its connection drops, without restarting the worker.

The rule, per shard (each shard decides alone; no worker is ever restarted):

- A round whose PushPull to shard ``i`` fails with UNAVAILABLE (the shard
  died, is restarting, or the connection dropped), or with "not a member" /
  ABORTED from a shard process that is not the one this worker joined (its
  incarnation changed: it restarted), is **not re-sent** to shard ``i``. The
  worker joins shard ``i`` again (same session; retried with backoff while
  the shard is down, up to the client's ``RetryPolicy``) and pulls its
  current version into the model. The other shards' part of that round
  counted as usual.
- A restarted shard restores its newest checkpoint: its partition goes back
  to the checkpoint's version, and the worker's per-shard version for it
  (``DistributedOptimizer.versions[i]``) follows. Every later round
  pushes round ``versions[i]`` to it. What a SIGKILL loses is therefore
  the rounds that shard applied after its newest checkpoint, and only on
  its own partition.
- The same process that only lost its connection still holds this worker
  as a member: its Join is the member retrying and changes nothing; the
  round it was collecting still counts this worker's push if it arrived
  whole, and never twice (the shard's ``(worker_id, round)`` dedup).
- A shard that came back empty, or with another job, is refused loudly
  (``RuntimeError`` naming the fix).
- A shard that stays unreachable past the retry budget makes the step raise
  ``ShardRpcError``; the other shards' part of that round counted (their
  versions are recorded), and every later step tries to rejoin it again at
  its end, raising while it is down, until it is back.

The heartbeat thread (``leases.py``) tells a restarted shard from a lost
membership by the incarnation in the shard's Stats, and records the shard
in :attr:`Recovery.restarted`: the training thread rejoins it between two
steps (never while backward runs). The thread sending sparse table rows,
finding a restarted shard first, only joins it again (:meth:`Recovery.readmit`)
and leaves the pull to the training thread the same way: only the training
thread writes the model's dense parameters and the per-shard versions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import grpc

from shardps.worker.session.client import ShardClient, ShardRpcError
from shardps.worker.session.join import JoinPlan, join_again, rejoin_shard

log = logging.getLogger(__name__)

#: Codes of a failed round that may mean the shard restarted (then checked against its incarnation).
_MAYBE_RESTARTED = frozenset({grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED})
#: Codes of a rejoin that failed because the shard is still down (tried again between the next steps).
_STILL_DOWN = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def divergence(applied: dict[int, int], shard: int, error: object, versions: list[int]) -> str:
    """Why every later step raises: shards ``applied`` (``{shard: new version}``) took a round that ``shard`` failed.

    ``error`` is that failure (not a restart); ``versions`` the worker's per-shard versions now.
    """
    return (f"shard(s) {sorted(applied)} applied round {applied[min(applied)] - 1} but shard {shard} failed it "
            f"({error}): the model's partitions are at different versions {versions}; restore the job from a "
            "checkpoint")


class Recovery:
    """Rejoins shards that restarted or dropped the connection (see the module docstring).

    Args:
        clients: one per shard, in shard order.
        join: this worker's Join request contents.
        job_id: the job joined.
        incarnations: each shard's incarnation at join (updated here).
        pull: ``pull(shard, calls)`` pulls that shard's current parameters into the model, returns the version.

    Attributes:
        restarted: shards the heartbeat thread found restarted, to rejoin between steps.
    """

    def __init__(self, clients: Sequence[ShardClient], join: JoinPlan, job_id: str, incarnations: list[str],
                 pull: Callable[[int, list], int]) -> None:
        self.clients, self.join, self.job_id, self.incarnations = list(clients), join, job_id, list(incarnations)
        self.pull = pull
        self.restarted: set[int] = set()
        self.rejoins = 0  # shards joined again (a stream trainer checks what the shards hold after one)

    def is_restarted(self, shard: int, timeout: float | None = None, retried: bool = True) -> bool:
        """Whether shard ``shard`` is another process than the one joined (its Stats' incarnation differs).

        Raises:
            ShardRpcError: the shard could not be asked (unreachable past the retry budget).
        """
        stats = self.clients[shard].stats(timeout=timeout, retried=retried)
        return bool(stats.incarnation) and stats.incarnation != self.incarnations[shard]

    def rejoin(self, shard: int, why: str) -> int:
        """Join shard ``shard`` again and pull its current version into the model; returns that version.

        Raises:
            ShardRpcError, RuntimeError: see :func:`shardps.worker.session.join.rejoin_shard`.
        """
        version, incarnation = rejoin_shard(self.clients, shard, self.join, self.job_id, self.pull)
        restarted = incarnation != self.incarnations[shard]
        self.incarnations[shard] = incarnation
        self.restarted.discard(shard)
        self.rejoins += 1
        log.warning("worker %s rejoined shard %d (%s) after %s: %s; its partition goes on from version %d",
                    self.join.worker_id, shard, self.clients[shard].address, why,
                    "the shard restarted (rounds since its checkpoint are lost)" if restarted else "same process",
                    version)
        return version

    def readmit(self, shard: int, why: str) -> None:
        """Join shard ``shard`` again without pulling (its sparse tables found this worker gone: it restarted).

        Called from the thread that sends table rows, which must not write the
        model's dense parameters while the training thread runs: the shard is
        queued in :attr:`restarted`, and the training thread pulls its partition
        (:meth:`between_steps`, or :meth:`recover` when a round in flight fails
        on it). The shard's recorded incarnation is left as it was, so that
        round's failure still reads as the restart it is.

        Raises:
            ShardRpcError, RuntimeError: see :func:`shardps.worker.session.join.join_again`.
        """
        join_again(self.clients, shard, self.join, self.job_id)
        self.restarted.add(shard)
        log.warning("worker %s joined shard %d (%s) again after %s; its dense partition is pulled before the next "
                    "step", self.join.worker_id, shard, self.clients[shard].address, why)

    def recover(self, failed: list[tuple[int, BaseException]]) -> tuple[dict[int, int], list, list]:
        """Rejoin the shards whose round failed because they restarted or were unreachable.

        Returns:
            ``({shard: version now}, down, other)``: the shards rejoined; ``down``, the
            ``(shard, error)`` of shards still unreachable past the retry budget (marked
            in :attr:`restarted`: rejoined between the next steps); ``other``, the failures
            that are not a restart (the caller raises them).

        Raises:
            RuntimeError: a shard came back without the job's state (see
                :func:`shardps.worker.session.join.rejoin_shard`).
        """
        rejoined, down, other = {}, [], []
        for shard, error in failed:
            code = error.code if isinstance(error, ShardRpcError) else None
            why = f"{code.name} in a round ({error.details[:200]})" if code else ""
            outcome, value = self.recover_one(shard, code, why)
            if outcome == "rejoined":
                rejoined[shard] = value
            else:
                (down if outcome == "down" else other).append((shard, value or error))
        return rejoined, down, other

    def recover_one(self, shard: int, code: grpc.StatusCode | None, why: str) -> tuple[str, object]:
        """Rejoin shard ``shard`` if its round failed with ``code`` because it restarted or was unreachable.

        Returns:
            ``("rejoined", version now)``; ``("down", ShardRpcError)`` when it stays
            unreachable past the retry budget (then marked in :attr:`restarted`);
            ``("other", None)`` when ``code`` is not a restart, or ``("other", error)``
            when the shard answered the rejoin with an error that is not.

        Raises:
            RuntimeError: the shard came back without the job's state.
        """
        try:
            if not self.rejoinable(shard, code):
                return "other", None
            return "rejoined", self.rejoin(shard, why)
        except ShardRpcError as exc:
            if exc.code in _STILL_DOWN:
                self.restarted.add(shard)
                return "down", exc
            return "other", exc

    def rejoinable(self, shard: int, code: grpc.StatusCode | None) -> bool:
        """Whether a round that failed on shard ``shard`` with ``code`` is a restart or a dropped connection.

        UNAVAILABLE always is; FAILED_PRECONDITION or ABORTED only when the
        shard's incarnation changed (asked with one Stats call).

        Raises:
            ShardRpcError: the shard could not be asked.
        """
        return code == grpc.StatusCode.UNAVAILABLE or (code in _MAYBE_RESTARTED and self.is_restarted(shard))

    def between_steps(self) -> dict[int, int]:
        """Rejoin the shards the heartbeat thread found restarted; ``{shard: version now}``."""
        return {shard: self.rejoin(shard, "a restart seen by the heartbeats") for shard in sorted(self.restarted)}


def rejoin_failed(inner, received: list[int], everyone: list[tuple[int, int, str, str]]
                  ) -> tuple[list[int], list[tuple[int, int, str]], bool]:
    """A node leader's DistributedOptimizer ``inner``, after its node's round failed on some local ranks: rejoin
    the failed shards that restarted or dropped the connection (:meth:`Recovery.recover_one`).

    A shard still unreachable past the retry budget is rejoined between the
    next steps; any other failure on a round that other shards applied
    leaves the partitions at different versions: the job is marked
    diverged (``inner.mark_diverged``), as ``DistributedOptimizer`` does. Never
    raises (every local rank waits for its answer); updates ``inner.versions``.
    Uses only ``inner``'s interface for a node leader (``versions``,
    ``recovery``, ``mark_diverged``).

    Args:
        received: each shard's new version, -1 where it failed.
        everyone: every rank's failures, ``(local rank, shard, status code name or "", message)``.

    Returns:
        ``(versions, left, rejoined)``: each shard's version now, the failures not
        recovered (``(local rank, shard, message)``), and whether any shard was rejoined.
    """
    versions = [v if v >= 0 else old for v, old in zip(received, inner.versions)]
    left, other, rejoined = [], [], False
    for r, s, code, m in everyone:
        try:
            why = f"{code} in a round pushed by local rank {r} ({m[:200]})"
            outcome, value = inner.recovery.recover_one(s, grpc.StatusCode[code] if code else None, why)
        except Exception as exc:  # e.g. the shard came back without the job's state
            outcome, value = "other", exc
        if outcome == "rejoined":
            versions[s], rejoined = value, True
            continue
        if value is not None:
            m = f"{m}; rejoining it failed: {type(value).__name__}: {value}"
        if outcome == "other":
            other.append((s, m))
        left.append((r, s, m))
    inner.versions = versions
    applied = {s: v for s, v in enumerate(received) if v >= 0}
    if other and applied:
        inner.mark_diverged(divergence(applied, other[0][0], other[0][1], versions))
    return versions, left, rejoined

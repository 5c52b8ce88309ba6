"""The job as a worker sees it: where it stood when this worker joined, its members, and waiting for them.

:class:`JobView` is a mixin of :class:`~shardps.worker.optimizer.DistributedOptimizer`
(its ``__init__`` sets every attribute used here). It says, at join, whether
the worker started a job or joined a running one (one INFO line with the
version, the mode and the members), carries optimizer state loaded into the
wrapped optimizer before wrapping to the shards (or refuses it loudly), and
lets a script wait until the whole world has joined (the restart pattern:
docs/guide.md, "Restarts").
"""

from __future__ import annotations

import logging
import time

import torch

from shardps.proto import shardps_pb2 as pb

__all__ = ["JobView", "states_equal"]

log = logging.getLogger(__name__)

#: Seconds between two looks at the membership while waiting for members.
MEMBER_POLL_SECONDS = 0.2


def states_equal(a: dict, b: dict) -> bool:
    """Whether two ``torch.optim`` state dicts hold the same per-parameter state, bit for bit.

    Compares ``a["state"]`` and ``b["state"]``: the same parameter indices, the
    same entries, and tensors (or numbers) equal exactly. Param groups
    (hyperparameters) are not compared: they travel with every round.
    """
    sa, sb = a.get("state", {}), b.get("state", {})
    if set(sa) != set(sb):
        return False
    for index, entries in sa.items():
        other = sb[index]
        if set(entries) != set(other):
            return False
        for name, value in entries.items():
            theirs = other[name]
            if isinstance(value, torch.Tensor) or isinstance(theirs, torch.Tensor):
                if not torch.equal(torch.as_tensor(value, dtype=torch.float64),
                                   torch.as_tensor(theirs, dtype=torch.float64)):
                    return False
            elif value != theirs:
                return False
    return True


class JobView:
    """Where the job stands, its members, waiting for them (see the module docstring)."""

    def stats(self) -> list[pb.StatsReply]:
        """Each shard's Stats reply, in shard order."""
        return [c.stats() for c in self._clients]

    @property
    def stream_process_pids(self) -> list[int | None]:
        """Per shard, the process id of the stream process carrying its PushPull streams
        (``WireOptions(stream_processes=True)``): None before its first round, or without stream processes."""
        return [c.relay.pid if c.relay is not None else None for c in self._clients]

    @property
    def members(self) -> list[str]:
        """The job's member ids (averaging order), as shard 0 reported them at the last heartbeat."""
        return list(self._leases.members) if self._leases else []

    @property
    def membership_epoch(self) -> int:
        """Changes whenever a worker joins, leaves or is dropped (shard 0's count; -1 before the first heartbeat)."""
        return self._leases.epoch if self._leases else -1

    def wait_for_members(self, count: int, timeout: float) -> list[str]:
        """Block until the job has at least ``count`` members (shard 0's view), for at most ``timeout`` seconds.

        Ranks restarted together call it after joining, so that no round runs
        with part of the world (shards gate only the job's first round on
        ``--min-workers``). Polls shard 0's Stats every 0.2 s.

        Returns:
            The member ids.

        Raises:
            ValueError: ``count < 1`` or ``timeout <= 0``.
            TimeoutError: fewer than ``count`` members after ``timeout`` seconds (the message names them).
        """
        if count < 1 or timeout <= 0:
            raise ValueError(f"wait_for_members needs count >= 1 and timeout > 0 seconds, got {count}, {timeout}")
        deadline = time.monotonic() + timeout
        told = False
        while True:
            members = list(self._clients[0].stats().members)
            if len(members) >= count:
                return members
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(f"the job has {len(members)} member(s) {members} after {timeout:g} s; "
                                   f"waited for {count}")
            if not told and now > deadline - timeout + 2.0:
                log.info("waiting for %d member(s) to join (now %s), until %s at the latest", count, members,
                         time.strftime("%H:%M:%S", time.localtime(time.time() + deadline - now)))
                told = True
            time.sleep(min(MEMBER_POLL_SECONDS, deadline - now))  # bounded by the deadline above

    def _announce_join(self, initialised: bool) -> None:
        """One INFO line: a new job started by this worker, or a running job joined at version V."""
        version = min(self.versions)
        mode = self._consistency.mode
        if initialised and version == 0:
            log.info("worker %s started job %s (%s mode, %d shard(s)) at version 0", self.worker_id,
                     self._job_id, mode, len(self._clients))
        else:
            log.info("worker %s joined a running job %s at version %d (%s mode%s): its parameters were pulled "
                     "from the shards, replacing the model's own; in sync mode the version is the job's step "
                     "counter: start the training loop at dist.version", self.worker_id, self._job_id, version,
                     mode, ", resumed" if self.resumed else "")

    def _carry_initial_state(self, saved: dict | None, initialised: bool) -> None:
        """Optimizer state loaded into the wrapped optimizer before wrapping goes to the shards, or is refused.

        - the job is new (version 0) and its shards hold no optimizer state:
          ``saved`` is loaded onto them (every worker of a new job may carry
          the same checkpoint; the last load wins, and each then checks);
        - otherwise the shards' state must equal ``saved``.

        Raises:
            ValueError: the shards' optimizer state differs from ``saved``
                (naming the fix: load it after wrapping with
                ``dist.load_state_dict``, or reset the shards).
        """
        if saved is None:
            return
        shards = self.state_dict()
        if min(self.versions) == 0 and (initialised or not shards.get("state")):
            self.load_state_dict(saved)
            shards = self.state_dict()
        if not states_equal(saved, shards):
            raise ValueError(
                f"the wrapped optimizer held state (load_state_dict before DistributedOptimizer) but the job the "
                f"shards hold is at version {min(self.versions)} with other optimizer state: to replace the job's "
                "state call dist.load_state_dict(saved) after wrapping; to keep it, do not load state into the "
                "optimizer before wrapping; to start over, `shardps reset` the shards")

"""The job as a worker sees it: where it stood when this worker joined, its members, waiting for them, leaving it.

:class:`JobView` is a mixin of :class:`~shardps.worker.optimizer.DistributedOptimizer`
(its ``__init__`` sets every attribute used here). It says, at join, whether
the worker started a job or joined a running one (one INFO line with the
version, the mode and the members, and a WARNING when the job is past
version 0: a script run again against the same shards continues the old
job; ``resume="refuse"`` refuses that instead, with :class:`RunningJobError`),
carries optimizer state loaded into the wrapped optimizer before wrapping to
the shards (or refuses it loudly), lets a script wait until the whole world
has joined (the restart pattern: docs/guide.md, "Restarts"), and leaves the
shards: on ``close()``, when construction fails, and at interpreter exit for
a script that never called ``close()`` (``shardps.worker.session.exit``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import wait
from typing import Self

import torch

from shardps.proto import shardps_pb2 as pb
from shardps.common.addresses import parse_servers
from shardps.common.security import ChannelSecurity
from shardps.worker import optimizer_state as optimizer_state
from shardps.worker.session.client import ShardClient, ShardRpcError
from shardps.worker.session.exit import forget

__all__ = ["JobView", "RESUME_CHOICES", "RunningJobError", "check_resume", "continuation_line", "refuse_running_job",
           "states_equal"]

log = logging.getLogger(__name__)

#: Seconds between two looks at the membership while waiting for members.
MEMBER_POLL_SECONDS = 0.2
#: ``DistributedOptimizer(resume=...)``: continue a job the shards hold past version 0 (with a WARNING), or refuse to.
RESUME_CHOICES = ("allow", "refuse")
#: Seconds a worker closed at interpreter exit waits for its last step's parameters before it cancels the pull.
EXIT_PULL_SECONDS = 3.0


def continuation_line(job_id: str, version: int) -> str:
    """The line a worker logs (WARNING) when it joins a job past version 0, and ``shardps train`` shows:
    ``continuing job J at version V; `shardps reset` starts over``."""
    return f"continuing job {job_id} at version {version}; `shardps reset` starts over"


class RunningJobError(RuntimeError):
    """``resume="refuse"`` and the shards already hold a job past version 0; the worker did not stay a member.

    Attributes:
        job_id: the job the shards hold.
        version: its version (the furthest shard's).
        servers: the shards' addresses, in shard order.
    """

    def __init__(self, job_id: str, version: int, servers: Sequence[str]) -> None:
        self.job_id, self.version, self.servers = job_id, version, list(servers)
        super().__init__(
            f"refusing to continue job {job_id} at version {version} (resume=\"refuse\"): the shards already "
            f"trained it. To start over, stop its workers and run `shardps reset --servers {','.join(self.servers)}`;"
            " to continue it, pass resume=\"allow\" (the default)")


def check_resume(resume: object) -> None:
    """Raise ``ValueError`` unless ``resume`` is one of :data:`RESUME_CHOICES`."""
    if not isinstance(resume, str) or resume not in RESUME_CHOICES:
        raise ValueError(f"resume must be \"allow\" (continue a running job, with a WARNING) or \"refuse\" (raise "
                         f"RunningJobError instead), got {resume!r}")


def refuse_running_job(servers: Sequence[str] | str, *, security: ChannelSecurity | None = None,
                       timeout: float = 30.0) -> None:
    """Raise :class:`RunningJobError` if the shards at ``servers`` hold a job past version 0; join nothing.

    For a launcher that starts every worker of one fresh run itself (``shardps
    train``): it checks once, before any worker starts, and starts the workers
    with ``resume="allow"``, since a worker of the same run may join after the
    first rounds. Asks each shard's Stats (retried as Stats always is).

    Raises:
        RunningJobError: a shard is past version 0 (the message names the job, the version and ``shardps reset``).
        ValueError: bad addresses.
        ConnectionError: a shard did not answer within ``timeout`` seconds.
        ShardRpcError: a shard refused Stats (a wrong token, say).
    """
    addresses = parse_servers(servers)
    clients: list[ShardClient] = []
    try:
        for i, address in enumerate(addresses):
            clients.append(ShardClient(address, index=i, rpc_timeout=timeout, connect_timeout=timeout,
                                       security=security))
        replies = [client.stats() for client in clients]
    finally:
        for client in clients:
            client.close()
    furthest = max(replies, key=lambda r: r.version)
    if furthest.version > 0:
        raise RunningJobError(furthest.job_id, furthest.version, addresses)


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

    @property
    def job_id(self) -> str:
        """The job's id, as shard 0 named it when this worker joined ("" before joining)."""
        return self._job_id

    def _announce_join(self, initialised: bool, resume: str = "allow") -> None:
        """One INFO line: a new job started by this worker, or a running job joined at version V; plus a WARNING
        when that job is past version 0 (this worker continues it), or :class:`RunningJobError` with ``resume``
        ``"refuse"`` (the caller then leaves the shards: ``_close_refused``)."""
        version = min(self.versions)
        furthest = max(self.versions)  # a shard past version 0 trained the job, whatever the others say
        mode = self._consistency.mode
        if furthest > 0:
            if resume == "refuse":
                raise RunningJobError(self._job_id, furthest, [c.address for c in self._clients])
            log.warning("%s (worker %s takes the shards' parameters, not its model's own; to start over run "
                        "`shardps reset --servers %s` while no worker is a member; resume=\"refuse\" refuses a "
                        "running job instead)", continuation_line(self._job_id, furthest), self.worker_id,
                        ",".join(c.address for c in self._clients))
        if initialised and version == 0:
            log.info("worker %s started job %s (%s mode, %d shard(s)) at version 0", self.worker_id,
                     self._job_id, mode, len(self._clients))
        else:
            log.info("worker %s joined a running job %s at version %d (%s mode%s): its parameters were pulled "
                     "from the shards, replacing the model's own; in sync mode the version is the job's step "
                     "counter: start the training loop at dist.version", self.worker_id, self._job_id, version,
                     mode, ", resumed" if self.resumed else "")

    # ------------------------------------------------------------ leaving the job
    def close(self) -> None:
        """Leave every shard (rounds stop waiting for this worker), remove hooks, close channels.

        A worker never closed is closed when the interpreter exits (see
        :meth:`_close_at_exit`). Calling it again does nothing more. A failing
        last pull or Leave is logged, not raised.
        """
        forget(self._exit_key)
        if self._leases is not None:
            self._leases.stop()
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._waits is not None:
            self._waits.remove()
        if self._tables is not None:
            self._tables.close()
        try:
            self._finish_pull(rejoin=False)
        except (ShardRpcError, RuntimeError) as exc:
            log.warning("the last pull failed while closing: %s", exc)
        with self._lock:
            rnd, self._round = self._round, None
        if rnd is not None:
            for q in rnd.queues:
                q.put(None)
            for call in rnd.calls:
                call.cancel()
        for client in self._clients:
            try:
                client.leave(self.worker_id, self.session, timeout=5.0)
            except ShardRpcError as exc:
                log.warning("leaving shard %d failed: %s", client.index, exc)
            client.close()
        self._clients = []
        self._pool.shutdown(wait=False)
        if self._routed is not None:
            optimizer_state.restore(self._optimizer, self._routed)
            self._routed = None
        self.metrics.close()

    def _close_refused(self, saved: dict | None) -> None:
        """Construction failed: leave, and give the wrapped optimizer back the state it came with."""
        self.close()
        if saved is not None:
            self._optimizer.load_state_dict(saved)

    def _close_at_exit(self) -> None:
        """The interpreter exits and this worker was never closed (the script raised, returned or called
        ``sys.exit`` without ``close()``): leave the shards without waiting on the training loop.

        The gradients of a step that ``step()`` never closed are dropped (its
        calls cancelled: ``close()``). The last step's parameters, when still
        landing, get up to :data:`EXIT_PULL_SECONDS`: its pushes are complete,
        and a round that closes keeps this worker's gradient in it; after that
        its calls are cancelled. Nothing is rejoined or recovered.
        """
        log.info("worker %s was not closed: it leaves the shards at exit", self.worker_id)
        rnd, self._pulling = self._pulling, None
        if rnd is not None:
            wait(rnd.futures, timeout=EXIT_PULL_SECONDS)  # blocking, bounded: the last step's pull
            for call in rnd.calls:
                call.cancel()  # (a call that ended already is left as it is)
        self.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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

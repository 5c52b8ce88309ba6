"""The worker's leases: a background thread renews them on every shard and watches the membership.

A shard drops a member that made no call for ``lease_seconds`` (its
``--lease-seconds``), as if it had left, so that one crashed, hung or
partitioned worker never stalls the others for longer than the lease. The
thread sends a Heartbeat to every shard at once every third of the lease
(the first at once), each waiting at most that third; the training loop
never waits on it. Heartbeats travel on each shard's lease channel, a TCP
connection of their own (``ShardClient.heartbeat_future``), so they never
queue behind the megabytes of a push on a slow link, and one shard that
does not answer delays no other shard's heartbeat. A shard that answers
"not a member" has dropped this worker (it was silent too long, e.g.
stopped with SIGSTOP): the loss is recorded and the next ``step()`` raises
with it, because this worker's gradients no longer count, unless the shard
is another process than the one joined (it restarted: its Stats'
incarnation changed); then the shard is handed to
:class:`~shardps.worker.session.recovery.Recovery`, and the training thread
joins it again between two steps. Network errors are only
logged: the lease itself bounds how long they may last.

Shard 0's replies carry the membership (member ids and an epoch that
changes with every join, leave and expiry): :class:`Leases` keeps the
latest and calls ``on_change(members)`` when it changes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import grpc

from shardps.worker.session.client import ShardClient, ShardRpcError
from shardps.worker.session.recovery import Recovery

log = logging.getLogger(__name__)


class Leases:
    """Heartbeats to every shard from a daemon thread.

    Args:
        clients: one per shard, in shard order.
        worker_id, session: this worker's identity.
        lease_seconds: the shards' lease; heartbeats go every third of it.
        on_change: called from the heartbeat thread with the member ids when
            shard 0's membership changes (keep it short; exceptions are logged).
        recovery: where a restarted shard is reported (None: a dropped membership is always lost).
        joining: started while the worker joins (its Init and first pull can outlast a lease on a slow
            link): refused heartbeats are ignored until :meth:`joined`.

    Attributes:
        members: member ids in averaging order, as shard 0 last reported them.
        epoch: shard 0's membership epoch (changes with every join, leave and expiry).
        lost: why this worker is no longer a member of some shard, or "".
    """

    def __init__(self, clients: Sequence[ShardClient], worker_id: str, session: str, lease_seconds: float,
                 on_change: Callable[[list[str]], None] | None = None, recovery: Recovery | None = None,
                 joining: bool = False) -> None:
        self.clients, self.worker_id, self.session = list(clients), worker_id, session
        self.recovery = recovery
        self.joining = joining  # started during the join: a refused heartbeat is the join's to report
        self.interval = lease_seconds / 3
        self.on_change = on_change
        self.members: list[str] = []
        self.epoch = -1
        self.lost = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"shardps-heartbeat-{worker_id[:32]}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        due = time.monotonic()
        while not self._stop.wait(max(0.0, due - time.monotonic())):  # blocking wait: the heartbeat period
            due = max(due + self.interval, time.monotonic())  # a fixed cadence, however long a beat took
            self._beat()

    def _beat(self) -> None:
        """One Heartbeat to every shard, all sent before any reply is awaited (each waits at most an interval)."""
        calls = []
        for client in self.clients:
            try:
                calls.append((client, client.heartbeat_future(self.worker_id, self.session, timeout=self.interval)))
            except ShardRpcError as exc:  # the client is closed: the optimizer is closing
                calls.append((client, exc))
        for client, call in calls:
            if self._stop.is_set():
                return
            try:
                if isinstance(call, ShardRpcError):
                    raise call
                try:
                    reply = call.result()
                except grpc.RpcError as exc:
                    raise client.error("heartbeat", exc) from None
            except ShardRpcError as exc:
                if self.joining:  # the Join (retried by join_job) decides whether this worker is a member
                    log.debug("heartbeat to shard %d during the join failed: %s", client.index, exc)
                    continue
                if exc.code == grpc.StatusCode.FAILED_PRECONDITION and self._restarted(client.index):
                    continue
                if exc.code == grpc.StatusCode.FAILED_PRECONDITION and not self.lost:
                    self.lost = (f"shard {client.index} ({client.address}) dropped worker {self.worker_id}: "
                                 f"{exc.details}. Its gradients no longer count; close this "
                                 "DistributedOptimizer and create a new one to join again")
                    log.error("%s", self.lost)
                elif exc.code != grpc.StatusCode.FAILED_PRECONDITION:
                    log.warning("heartbeat to shard %d failed: %s", client.index, exc)
                continue
            if client.index == 0 and reply.membership_epoch != self.epoch:
                self.epoch, self.members = reply.membership_epoch, list(reply.members)
                if self.on_change is not None:
                    try:
                        self.on_change(list(self.members))
                    except Exception:  # a user callback must not stop the heartbeats
                        log.exception("on_membership_change raised")

    def joined(self, recovery: Recovery | None) -> None:
        """The join is done: from now on a shard that forgot this worker is reported to ``recovery`` (or lost)."""
        self.recovery, self.joining = recovery, False

    def _restarted(self, shard: int) -> bool:
        """Whether ``shard`` restarted (then it is queued for rejoining), or cannot be asked now (the next
        heartbeat decides); False: the same process dropped this worker."""
        if self.recovery is None:
            return False
        if shard in self.recovery.restarted:
            return True
        try:
            restarted = self.recovery.is_restarted(shard, timeout=self.interval, retried=False)
        except ShardRpcError:
            return True
        if restarted:
            log.warning("shard %d (%s) restarted; worker %s joins it again before its next step", shard,
                        self.clients[shard].address, self.worker_id)
            self.recovery.restarted.add(shard)
        return restarted

    def stop(self) -> None:
        """Stop the heartbeats (returns at once; the thread ends within one call's timeout)."""
        self._stop.set()

"""Waits that speak: one INFO line when a step waits longer than ``after`` seconds, naming what for.

A worker's step blocks inside gRPC calls while the shards wait for something
the worker cannot see: members that have not pushed the round (one of them
may have died: the shards drop it when its lease runs out), fewer members
than ``--min-workers``, or, in ssp, the slowest live worker. After ``after``
seconds (2 by default) the watcher asks one shard's ``Stats`` (a short,
unretried call from its own thread, never from the waiting one) and logs one
line saying what the round waits for and until when at the latest, e.g.::

    round 12 waits for worker w1 (it has not pushed round 12; if it died, its lease of 10 s runs out by 14:03:07)

The same text goes to ``on_wait`` (``shardps train``'s progress bar shows
it). Each wait is told once; a wait that ends is not told at all.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from shardps.worker.session.client import ShardClient, ShardRpcError

__all__ = ["WAIT_NOTICE_SECONDS", "WaitWatcher", "explain", "tell"]

log = logging.getLogger(__name__)

#: Seconds a step may wait before the worker says what it waits for.
WAIT_NOTICE_SECONDS = 2.0
#: Deadline of the Stats call that finds out, seconds.
STATS_TIMEOUT_SECONDS = 2.0


def explain(round_: int, stats, mode: str, staleness: int, lease_seconds: float, now_wall: float) -> str:
    """The sentence for a round that waits, from one shard's ``StatsReply``.

    Args:
        round_: the round (version) this worker pushed.
        stats: the shard's ``pb.StatsReply`` (members, pushed, min_workers, version).
        mode, staleness: the job's consistency mode and ssp bound (clocks).
        lease_seconds: the shards' lease, seconds.
        now_wall: ``time.time()`` when asked (Unix seconds), for the "by HH:MM:SS" bound.
    """
    by = time.strftime("%H:%M:%S", time.localtime(now_wall + lease_seconds))
    members = list(stats.members)
    if len(members) < stats.min_workers:
        return (f"round {round_} waits for {stats.min_workers - len(members)} more worker(s) to join "
                f"(the shards start with --min-workers {stats.min_workers}; {len(members)} joined)")
    if mode == "ssp":
        return (f"round {round_} waits for the slowest worker (ssp lets no worker run more than {staleness} clocks "
                f"ahead; members {', '.join(members)}); a member that died is dropped when its lease of "
                f"{lease_seconds:g} s runs out, by {by}")
    missing = [m for m in members if m not in set(stats.pushed)]
    if mode == "sync" and missing and stats.version == round_:
        who = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        return (f"round {round_} waits for worker(s) {who} (not pushed yet; if one died, its lease of "
                f"{lease_seconds:g} s runs out by {by} and the round goes on without it)")
    return f"round {round_} waits for shard {stats.shard_index} to apply it (version {stats.version})"


class WaitWatcher:
    """Tells, once per wait, what a step has waited for longer than ``after`` seconds (module docstring).

    Args:
        clients: the worker's shard connections (only ``stats`` is called, from this watcher's thread).
        mode, staleness: the job's consistency mode and ssp bound.
        lease_seconds: the shards' lease, seconds.
        after: seconds before a wait is told (default :data:`WAIT_NOTICE_SECONDS`).
        on_wait: also called with the sentence (from the watcher's thread).
    """

    def __init__(self, clients: Sequence[ShardClient], *, mode: str, staleness: int, lease_seconds: float,
                 after: float = WAIT_NOTICE_SECONDS, on_wait: Callable[[str], None] | None = None) -> None:
        self._clients = list(clients)
        self._mode, self._staleness, self._lease = mode, staleness, lease_seconds
        self._after, self._on_wait = after, on_wait
        self._cond = threading.Condition()  # guards _round, _since, _told, _closed
        self._round: int | None = None
        self._since = 0.0
        self._told = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="shardps-waits", daemon=True)
        self._thread.start()

    def begin(self, round_: int) -> None:
        """A step starts waiting for round ``round_`` (the version it pushed)."""
        with self._cond:
            self._round, self._since, self._told = round_, time.monotonic(), False
            self._cond.notify()

    def end(self) -> None:
        """The wait is over."""
        with self._cond:
            self._round = None

    def close(self) -> None:
        """Stop the thread (joins it for at most the Stats deadline)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=STATS_TIMEOUT_SECONDS + 1.0)

    def _run(self) -> None:
        while True:
            with self._cond:
                # blocking wait: until a wait begins, its notice is due, or close()
                while not self._closed and (self._round is None or self._told
                                            or time.monotonic() - self._since < self._after):
                    due = None if self._round is None or self._told else self._since + self._after - time.monotonic()
                    self._cond.wait(timeout=due)
                if self._closed:
                    return
                round_, self._told = self._round, True
            sentence = self._ask(round_)
            with self._cond:
                if self._round != round_ or self._closed:
                    continue  # the wait ended while the shard was asked: nothing to tell
            log.info("%s", sentence)
            if self._on_wait is not None:
                self._on_wait(sentence)

    def _ask(self, round_: int) -> str:
        replies: list = []
        for client in self._clients:
            try:
                replies.append(client.stats(timeout=STATS_TIMEOUT_SECONDS, retried=False))
            except (ShardRpcError, ConnectionError):
                replies.append(None)
        return tell(round_, replies, self._mode, self._staleness, self._lease, time.time())


def tell(round_: int, replies: Sequence, mode: str, staleness: int, lease_seconds: float, now_wall: float) -> str:
    """The sentence for a round that waits, from every shard's ``StatsReply`` (``None``: it did not answer).

    The shards of one round apply it independently: a member that died after
    sending its push to some shards leaves only the others waiting. The
    sentence is therefore built (:func:`explain`) from the answering shard
    with the lowest version; shards that did not answer are named instead
    only when every answering shard has already applied ``round_``.
    """
    behind = min((r for r in replies if r is not None), key=lambda r: r.version, default=None)
    silent = [str(shard) for shard, r in enumerate(replies) if r is None]
    if behind is not None and (behind.version <= round_ or not silent):
        return explain(round_, behind, mode, staleness, lease_seconds, now_wall)
    return (f"round {round_} waits for shard(s) {', '.join(silent)}, which do not answer (restarting or "
            f"unreachable; the worker retries for its retry_seconds)")

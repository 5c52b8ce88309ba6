"""The report/commit exchange of a sync round that clips or scales (a mixin of ``Rounds``).

Clipping by total norm and skipping a step on Inf/NaN under a GradScaler
need one decision from the whole model, which no shard holds: each shard
sends every member its part (``pb.RoundReport``), every worker combines all
shards' parts into the same ``pb.RoundCommit`` and sends it to every shard,
and a shard applies the round once the commits of all its members still
here agree (``rounds.py`` sends the reports and waits here).
"""

from __future__ import annotations

import asyncio
import math

from shardps.proto import shardps_pb2 as pb
from shardps.server.checks import shown
from shardps.server.dense.optimizer import RoundRefused
from shardps.server.errors import FailedPrecondition, InvalidArgument
from shardps.server.membership.members import Member


class CommitExchange:
    """Waiting for, checking and recording the members' commits of the closed round (uses ``Rounds``'s
    ``closed``, ``config`` and membership)."""

    async def _commits(self, closed) -> pb.RoundCommit:
        """Wait for the commit of every member of the closed round still here; they must agree."""
        self._check_committed(closed)
        try:
            await asyncio.wait_for(closed.committed.wait(), self.config.max_wait_seconds)
        except TimeoutError:
            missing = [shown(m.worker_id) for m in closed.members if m.worker_id not in closed.commits]
            raise RoundRefused(f"workers {missing[:20]} did not commit round {closed.number} within "
                               f"{self.config.max_wait_seconds:.0f}s") from None
        commits = list(closed.commits.values())
        if not commits:
            raise RoundRefused("every member of the round left before committing it")
        first = commits[0]
        if any((c.skip, c.clip_coef) != (first.skip, first.clip_coef) for c in commits):
            raise RoundRefused("the workers' commits disagree (skip or clip coefficient): they must see the same "
                               "reports")
        return first

    def _check_committed(self, closed) -> None:
        here = [m for m in closed.members if self._members.find(m.worker_id) is m]
        if all(m.worker_id in closed.commits for m in here):
            closed.committed.set()

    def commit(self, member: Member, commit: pb.RoundCommit) -> None:
        """Record ``member``'s commit of the closed round.

        Raises:
            FailedPrecondition: no such round is waiting for commits, or the member is not in it.
            InvalidArgument: a clip coefficient that is not a number in (0, 1].
        """
        closed = self.closed
        if closed is None or closed.number != commit.round or closed.report is None:
            raise FailedPrecondition(f"round {commit.round} is not waiting for commits")
        if member not in closed.members:
            raise FailedPrecondition(f"worker {shown(member.worker_id)} is not in round {commit.round}")
        if not commit.skip and not (math.isfinite(commit.clip_coef) and 0 < commit.clip_coef <= 1):
            raise InvalidArgument(f"clip_coef {commit.clip_coef} must be in (0, 1]")
        closed.commits.setdefault(member.worker_id, commit)
        self._check_committed(closed)

"""Calls served between rounds: a shard's optimizer state and its parameters (export).

``GetState``/``SetState`` carry the optimizer state of the shard's keys
(``dense/optimizer_state.py`` encodes it; workers use them for
``state_dict()`` and ``load_state_dict()``); ``Export`` streams the
parameters to operators (a checkpoint now is ``snapshots/checkpoints.py``'s
``Checkpoints.reply``). Each waits for a round being applied to
finish, never for rounds to come. They run on the shard's event loop like
:class:`~shardps.server.store.ShardStore`, and use only its public names.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from shardps.proto import shardps_pb2 as pb
from shardps.server import checks
from shardps.server.errors import Aborted, DeadlineExceeded, FailedPrecondition, InvalidArgument
from shardps.server.dense.optimizer import StateError
from shardps.server.dense.optimizer_state import decode_state, encode_state

if TYPE_CHECKING:
    from shardps.server.store import ShardStore


class BetweenRounds:
    """GetState, SetState, Export and Checkpoint of one shard's :class:`ShardStore` (``store.between_rounds``)."""

    def __init__(self, store: "ShardStore") -> None:
        self._store = store

    async def get_state(self, request: pb.StateRequest) -> list[bytes]:
        """The optimizer state of this shard's keys, as frames (``server/dense/optimizer_state.py``), read between rounds.

        Raises:
            InvalidArgument, FailedPrecondition: not a member of this session, plan mismatch, not initialised.
        """
        self._check_member_call(request.worker_id, request.session, request.plan_fingerprint)
        await self._store.notifier.wait_for(lambda: not self._store.rounds.applying, self._store.config.max_wait_seconds)
        return await self._store.run(encode_state, self._store.job.table, self._store.rounds.optimizer, self._store.version)

    async def set_state(self, header: pb.RoundHeader, frames: AsyncIterator[bytes]) -> int:
        """Replace the optimizer state of this shard's keys, all or nothing; returns the version.

        The state changes only between rounds (no push of the open round
        accepted yet); a state equal to the current one is accepted any time,
        so every worker of a job may load the same checkpoint. With
        ``header.check_only`` the state is checked (and whether it may be
        loaded now) and nothing changes: the worker checks every shard first.

        Raises:
            InvalidArgument: malformed or incomplete frames, entries the optimizer does not keep.
            FailedPrecondition: not a member, plan mismatch, not initialised.
            Aborted: a round is in progress and the state differs.
        """
        checks.check_round_header(header, self._store.config)
        self._check_member_call(header.worker_id, header.session, header.plan_fingerprint)
        decoded = []
        async for raw in frames:
            frame = checks.decode(raw, "set_state")
            if frame.header is None:
                raise InvalidArgument("set_state: only state chunks may follow the round header")
            decoded.append(frame)
        table, optimizer = self._store.job.table, self._store.rounds.optimizer
        try:
            states = await self._store.run(decode_state, table, optimizer, decoded)
            if self._store.rounds.applying or self._store.rounds.in_progress or header.check_only:
                changed = await self._store.run(optimizer.load_state, states, True)  # checks and compares only
                if changed and (self._store.rounds.applying or self._store.rounds.in_progress):
                    raise Aborted("a round is in progress: load optimizer state between rounds (before pushing)")
                return self._store.version
            await self._store.run(optimizer.load_state, states)
        except StateError as exc:
            raise InvalidArgument(str(exc)) from None
        self._store.rounds.state_bytes = optimizer.state_bytes()
        return self._store.version

    def _check_member_call(self, worker_id: str, session: str, fingerprint: str) -> None:
        checks.check_worker_id(worker_id, self._store.config)
        checks.check_session(session)
        self._store.check_open()
        job = self._store.require_job(fingerprint)
        self._store.members.get(worker_id, session)
        if not job.initialised:
            raise FailedPrecondition("this shard has not been initialised yet")

    async def export(self, request: pb.ExportRequest, timeout: float | None) -> AsyncIterator[bytes]:
        """The fp32 parameters and buffers at the shard's version, which must be ``>= request.min_version``.

        Read-only and open to non-members (operators export a live job). Waits
        only for a round being applied to finish, never for rounds to come.

        Raises:
            FailedPrecondition: the shard holds no initialised job, or is below ``min_version``.
            DeadlineExceeded: a round was still being applied after ``timeout`` seconds.
        """
        self._store.check_open()
        job = self._store.job
        if job is None or not job.initialised:
            raise FailedPrecondition(f"shard {self._store.config.shard_index} holds no initialised job to export")
        limit = self._store.config.max_wait_seconds if timeout is None else min(timeout, self._store.config.max_wait_seconds)
        if not await self._store.notifier.wait_for(lambda: self._store.closing or not self._store.rounds.applying, limit):
            raise DeadlineExceeded(f"shard {self._store.config.shard_index} was still applying a round after {limit:.1f}s")
        self._store.check_open()
        if self._store.job is not job:
            raise Aborted(f"shard {self._store.config.shard_index}'s job was reset during the export")
        if self._store.version < request.min_version:
            raise FailedPrecondition(f"shard {self._store.config.shard_index} is at version {self._store.version}, below "
                                     f"{request.min_version}; export again later")
        return self._store.pull(self._store.version, pb.FLOAT32)

"""When a shard checkpoints, and restoring at start (the file format is ``common/checkpoint.py``).

A checkpoint is written every ``--checkpoint-every-rounds`` rounds and/or
``--checkpoint-every-seconds`` seconds (when the version moved), and on
SIGTERM after the last round in flight was applied, so a clean stop loses
nothing. The snapshot is copied on the event loop between rounds (no round
is applied while it is taken: a copy of parameters, buffers and optimizer
state, about the shard's memory once more for a moment); the file is
written on a thread of its own while rounds go on. A SIGKILL loses the
rounds applied since the newest checkpoint.

A shard started on a directory holding checkpoints restores the newest
intact one before it serves (job, plan, optimizer and its state, buffers,
hyperparameters, version), so workers that join again resume the job.
Newer damaged checkpoints are skipped (the log names each with the reason,
and the one loaded) and moved to ``shard-<index>/damaged/``. The shard
refuses to start (exit 1, naming expected and found) on a checkpoint
another shard index, or a job with another shard count, wrote; and when
checkpoints are there but none is intact it refuses to start empty (which
would let the next worker begin a new job over them), naming the directory
and every damaged file, unless ``--start-empty-over-damaged-checkpoints``
(then a WARNING, and the damaged files are moved aside).
The checkpoint records the job's members: the restored shard's rounds wait
up to one lease for them to join again (``Rounds.await_rejoin``), so the
first worker back does not make a round alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from shardps.common import checkpoint
from shardps.server.dense.optimizer import StateError

log = logging.getLogger(__name__)


class Checkpoints:
    """The checkpoints of one shard (a part of :class:`shardps.server.store.ShardStore`).

    Args:
        store: the shard's store (its public names only: config, rounds, job, notifier, compute thread).

    Attributes:
        latest: ``(version, Unix seconds)`` of the newest checkpoint written or restored; ``(0, 0.0)``: none.
        restored: the version restored at start (0: none).
    """

    def __init__(self, store) -> None:
        self.store = store
        cfg = store.config
        self.directory = Path(cfg.checkpoint_dir) / f"shard-{cfg.shard_index}" if cfg.checkpoint_dir else None
        self.latest = (0, 0.0)
        self.restored = 0
        self._sparse_round = 0  # the sparse round of the newest checkpoint
        self._clock = time.monotonic()
        self._lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="shard-checkpoint")

    async def restore(self) -> None:
        """Restore the newest intact checkpoint (before serving), then checkpoint on schedule.

        Raises:
            RuntimeError: a checkpoint that is intact but does not fit this shard or was written by
                another one; or checkpoints there but none intact (see :meth:`_find`).
        """
        store, cfg = self.store, self.store.config
        if self.directory is None:
            return
        snap = await store.run(self._find)
        if snap is not None:
            try:
                await store.restore_job(snap)
                store.tables.restore(snap.tensors, snap.sparse)
                self._sparse_round = store.tables.round
            except (ValueError, KeyError, StateError) as exc:
                raise RuntimeError(f"checkpoint of version {snap.version} in {self.directory}: {exc}") from None
            self.latest = (snap.version, time.time())
            self.restored = snap.version
            if snap.members:
                store.rounds.await_rejoin(snap.members, cfg.lease_seconds)
        if cfg.checkpoint_every_rounds or cfg.checkpoint_every_seconds:
            self._task = asyncio.get_running_loop().create_task(self._on_schedule())

    def _find(self) -> checkpoint.Snapshot | None:
        """The checkpoint to restore (on the compute thread), skipped ones logged and moved aside.

        Raises:
            RuntimeError: a checkpoint of another shard; none intact of ``--restore-version``;
                checkpoints there but none intact, without ``--start-empty-over-damaged-checkpoints``;
                damaged files that could not be moved aside.
        """
        try:
            return self._choose()
        except OSError as exc:
            raise RuntimeError(f"shard {self.store.config.shard_index}: moving damaged checkpoints aside in "
                               f"{self.directory} failed: {exc}") from None

    def _choose(self) -> checkpoint.Snapshot | None:
        cfg, directory = self.store.config, self.directory
        try:
            found = checkpoint.find(directory, shard_index=cfg.shard_index, num_shards=cfg.num_shards,
                                    at_most=cfg.restore_version)
        except checkpoint.ForeignCheckpoint as exc:
            raise RuntimeError(f"shard {cfg.shard_index}: {exc}") from None
        for path, reason in found.skipped:
            log.warning("shard %d: skipping checkpoint %s: %s", cfg.shard_index, path, reason)
        damaged = "; ".join(f"{path.name}: {reason}" for path, reason in found.skipped)
        if found.snapshot is None and cfg.restore_version:
            raise RuntimeError(f"no intact checkpoint of version <= {cfg.restore_version} in {directory}"
                               + (f" (damaged: {damaged})" if damaged else ""))
        if found.snapshot is None and found.present:
            if not cfg.start_empty_over_damaged_checkpoints:
                raise RuntimeError(
                    f"shard {cfg.shard_index}: {directory} holds checkpoints but none is intact ({damaged}). The "
                    "shard does not start empty over them (the next worker would begin a new job in their "
                    "place): put intact files back, or start over on purpose with "
                    "--start-empty-over-damaged-checkpoints")
            aside = checkpoint.set_aside(directory, [p for p, _ in found.skipped])
            log.warning("shard %d: starting EMPTY although %s holds checkpoints, none of them intact, as "
                        "--start-empty-over-damaged-checkpoints asks: the job they held is not restored; the "
                        "damaged files were moved to %s", cfg.shard_index, directory, aside)
            return None
        if found.snapshot is not None:
            if found.skipped:
                aside = checkpoint.set_aside(directory, [p for p, _ in found.skipped])
                log.warning("shard %d: loaded checkpoint %s (version %d), the newest intact one; skipped %s "
                            "(moved to %s)", cfg.shard_index, found.path, found.snapshot.version,
                            ", ".join(p.name for p, _ in found.skipped), aside)
            else:
                log.info("shard %d: loaded checkpoint %s (version %d)", cfg.shard_index, found.path,
                         found.snapshot.version)
        return found.snapshot

    def _due(self) -> bool:
        store, cfg = self.store, self.store.config
        job = store.job
        if store.closing or job is None or not job.initialised or store.rounds.applying:
            return False
        version = self.latest[0]
        by_rounds = cfg.checkpoint_every_rounds and store.version >= version + cfg.checkpoint_every_rounds
        by_time = cfg.checkpoint_every_seconds and store.version > version and \
            time.monotonic() - self._clock >= cfg.checkpoint_every_seconds
        return bool(by_rounds or by_time)

    async def _on_schedule(self) -> None:
        store = self.store
        while not store.closing:
            await store.notifier.wait_for(lambda: self._due() or store.closing, 1.0)
            if self._due():
                try:
                    await self.write()
                except OSError as exc:
                    log.error("shard %d: writing a checkpoint failed: %s", store.config.shard_index, exc)

    async def write(self) -> int:
        """Write a checkpoint of the current version, between rounds; returns its version (0: nothing to write).

        Also what the Checkpoint RPC (``shardps checkpoint``) runs.

        Raises:
            OSError: the disk refused (the older checkpoints are untouched).
        """
        store = self.store
        async with self._lock:
            while store.rounds.applying or not store.tables.settled():  # the sparse snapshot reads on this thread
                await store.notifier.wait_for(lambda: not store.rounds.applying and store.tables.settled(),
                                              store.config.max_wait_seconds)
            job, rounds = store.job, store.rounds
            if self.directory is None or job is None or not job.initialised:
                return 0
            if self.latest[0] == store.version and store.version and self._sparse_round == store.tables.round:
                return store.version  # nothing changed since
            tensors = {f"param/{g}": t.clone() for g, t in rounds.params.items()}
            tensors["buffers"] = rounds.buffers.clone()
            for key, entries in rounds.optimizer.get_state().items():
                for name, value in entries.items():
                    tensors[f"state/{key}/{name}"] = value
            sparse_tensors, sparse = store.tables.snapshot()
            tensors.update(sparse_tensors)
            snap = checkpoint.Snapshot(
                version=store.version, job_id=job.job_id, fingerprint=job.fingerprint,
                initialised_by=job.initialised_by, plan=job.plan_bytes, spec=job.spec.SerializeToString(),
                static_digest=job.static_digest, hyperparams=rounds.optimizer.hyperparams(), tensors=tensors,
                shard_index=store.config.shard_index, num_shards=store.config.num_shards,
                members=self.store.members.ids(), sparse=sparse,
            )
            started = time.monotonic()
            await asyncio.get_running_loop().run_in_executor(
                self._writer, checkpoint.write, self.directory, snap, store.config.keep_checkpoints)
            self.latest, self._clock = (snap.version, time.time()), time.monotonic()
            self._sparse_round = sparse.get("round", 0)
            store.metrics.checkpoint_seconds.observe(time.monotonic() - started)
            log.info("shard %d: checkpoint of version %d written in %.2fs", store.config.shard_index, snap.version,
                     time.monotonic() - started)
            return snap.version

    async def final(self) -> None:
        """On shutdown (after the store closed): checkpoint every round applied so far; errors are logged."""
        if self._task is not None:
            self._task.cancel()
        try:
            await self.write()
        except OSError as exc:
            log.error("shard %d: the final checkpoint failed: %s", self.store.config.shard_index, exc)

"""When a shard checkpoints, and restoring at start (the file format is ``common/checkpoint.py``).

A checkpoint is written every ``--checkpoint-every-rounds`` rounds (dense
rounds, or sparse rounds, whichever moved that far since the newest
checkpoint) and/or every ``--checkpoint-every-seconds`` seconds (when either
moved), on request (the Checkpoint call, ``shardps checkpoint``), and on
SIGTERM after the last round in flight was applied, so a clean stop loses
nothing. A SIGKILL loses the rounds applied since the newest checkpoint.

Each checkpoint gets a name no checkpoint of the directory had
(``checkpoint-<sequence>-v<version>-r<sparse round>``): sparse rounds at an
unchanged dense version make new checkpoints beside the earlier ones, and
``--keep-checkpoints N`` keeps the N newest. A checkpoint asked for when
nothing changed since the newest one (same job, dense version, sparse round,
tables, hyperparameters, and dense parameters, buffers and optimizer state,
compared byte for byte with its file) writes nothing: that one is named
instead (``Saved.written`` False).

The tensor file is streamed from the live tensors by one piece of work on
the compute thread, queued between rounds (``writing.py``: consistent, and
the shard's memory grows by a block of rows, the largest table's sorted ids
and the dense optimizer state, not by a copy of the tables); its SHA-256,
fsync and rename, and the manifest, follow on a thread of their own while
rounds go on.

A shard started on a directory holding checkpoints restores the newest
intact one before it serves (job, plan, optimizer and its state, buffers,
hyperparameters, version, sparse tables), so workers that join again resume
the job. Temporary files of writes a crash cut short are removed first.
Newer damaged or incomplete checkpoints are skipped (the log names each with
the reason, and the one loaded) and moved to ``shard-<index>/damaged/``.
The shard refuses to start (exit 1, naming expected and found) on a
checkpoint another shard index, or a job with another shard count, wrote;
and when checkpoints are there but none is intact it refuses to start empty
(which would let the next worker begin a new job over them), naming the
directory and every damaged file, unless ``--start-empty-over-damaged-checkpoints``
(then a WARNING, and the damaged files are moved aside).
The checkpoint records the job's members: the restored shard's rounds wait
up to one lease for them to join again (``Rounds.await_rejoin``), so the
first worker back does not make a round alone.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from shardps.proto import shardps_pb2 as pb
from shardps.common import checkpoint
from shardps.server.dense.optimizer import StateError
from shardps.server.errors import FailedPrecondition, Unavailable
from shardps.server.snapshots import writing

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Saved:
    """A checkpoint that holds the shard's state.

    Attributes:
        name: its name (``name.manifest`` is its manifest's file name in the shard's directory).
        path: its manifest's path.
        sparse_round: the sparse rounds it holds (``name.version``: the dense version).
        written: True if this call wrote it; False: the state had not changed since it was written.
    """

    name: checkpoint.Name
    path: Path
    sparse_round: int
    written: bool


def _numbers_key(snap: checkpoint.Snapshot) -> str:
    """SHA-256 of what identifies a state besides its tensors (job, versions, tables, hyperparameters; not the
    members: workers leaving before a SIGTERM do not make a new checkpoint)."""
    numbers = {"job": [snap.job_id, snap.fingerprint, snap.initialised_by, snap.static_digest],
               "version": snap.version, "sparse": snap.sparse,
               "hyperparams": {str(g): hp for g, hp in snap.hyperparams.items()}}
    return hashlib.sha256(json.dumps(numbers, sort_keys=True, default=str).encode()).hexdigest()


class Checkpoints:
    """The checkpoints of one shard (a part of :class:`shardps.server.store.ShardStore`).

    Args:
        store: the shard's store (its public names only: config, rounds, tables, job, notifier, run, metrics).

    Attributes:
        latest: ``(dense version, Unix seconds)`` of the newest checkpoint written or restored; ``(0, 0.0)``:
            none (``latest_name`` tells "none" from a checkpoint of version 0).
        latest_name, latest_round: that checkpoint's manifest file name (``""``: none) and sparse round.
        restored: the dense version restored at start (0: none, or version 0: see ``restored_name``).
        restored_name, restored_round: the manifest file name restored at start (``""``: none) and its sparse
            round.
    """

    def __init__(self, store) -> None:
        self.store = store
        cfg = store.config
        self.directory = Path(cfg.checkpoint_dir) / f"shard-{cfg.shard_index}" if cfg.checkpoint_dir else None
        self.latest = (0, 0.0)
        self.latest_name, self.latest_round = "", 0
        self.restored = 0
        self.restored_name, self.restored_round = "", 0
        self._last: tuple[str, str, Saved] | None = None  # (job id, numbers key, the checkpoint) of the newest
        self._sequence = 0  # the highest sequence number written or seen
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
                store.rounds.positions.load(snap.sparse.get("stream", {}))  # the stream offsets its state holds
            except (ValueError, KeyError, StateError) as exc:
                raise RuntimeError(f"checkpoint {snap.name.manifest} (version {snap.version}) in {self.directory}: "
                                   f"{exc}") from None
            name, members = snap.name, snap.members
            del snap  # the rows are in the tables now
            saved = Saved(name, self.directory / name.manifest, store.tables.round, False)
            self._remember(saved, self._numbers())
            self.restored, self.restored_name, self.restored_round = name.version, name.manifest, saved.sparse_round
            if members:
                store.rounds.await_rejoin(members, cfg.lease_seconds)
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
            if removed := checkpoint.remove_temporary(self.directory):
                log.warning("shard %d: removed the temporary files of checkpoint writes that did not finish: %s",
                            self.store.config.shard_index, ", ".join(removed))
            self._sequence = checkpoint.next_sequence(self.directory) - 1
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
            snap = found.snapshot
            if found.skipped:
                aside = checkpoint.set_aside(directory, [p for p, _ in found.skipped])
                log.warning("shard %d: loaded checkpoint %s (version %d, sparse round %d), the newest intact one; "
                            "skipped %s (moved to %s)", cfg.shard_index, found.path, snap.version,
                            snap.sparse_round, ", ".join(p.name for p, _ in found.skipped), aside)
            else:
                log.info("shard %d: loaded checkpoint %s (version %d, sparse round %d)", cfg.shard_index,
                         found.path, snap.version, snap.sparse_round)
        return found.snapshot

    # ------------------------------------------------------------------ writing
    def _snapshot(self) -> tuple[checkpoint.Snapshot, list, object]:
        """The state's numbers now (event loop, between rounds), and the tables' layout and writer."""
        store, job, rounds = self.store, self.store.job, self.store.rounds
        layout, entry, write_rows = store.tables.snapshot()
        snap = checkpoint.Snapshot(
            version=store.version, job_id=job.job_id, fingerprint=job.fingerprint,
            initialised_by=job.initialised_by, plan=job.plan_bytes, spec=job.spec.SerializeToString(),
            static_digest=job.static_digest, hyperparams=rounds.optimizer.hyperparams(), tensors={},
            shard_index=store.config.shard_index, num_shards=store.config.num_shards,
            members=store.members.ids(), sparse={**entry, "stream": rounds.positions.state()})
        return snap, layout, write_rows

    def _numbers(self) -> tuple[str, str]:
        """``(job id, numbers key)`` of the state now."""
        snap, _, _ = self._snapshot()
        return snap.job_id, _numbers_key(snap)

    def _remember(self, saved: Saved, numbers: tuple[str, str]) -> None:
        self._last = (*numbers, saved)
        self._sequence = max(self._sequence, saved.name.sequence)
        self.latest, self._clock = (saved.name.version, time.time()), time.monotonic()
        self.latest_name, self.latest_round = saved.name.manifest, saved.sparse_round

    def _due(self) -> bool:
        store, cfg = self.store, self.store.config
        job = store.job
        if store.closing or job is None or not job.initialised or store.rounds.applying:
            return False
        version, sparse_round = (self.latest[0], self.latest_round) if self._last and self._last[0] == job.job_id \
            else (0, 0)
        progress = max(store.version - version, store.tables.round - sparse_round)
        by_rounds = cfg.checkpoint_every_rounds and progress >= cfg.checkpoint_every_rounds
        by_time = cfg.checkpoint_every_seconds and progress > 0 and \
            time.monotonic() - self._clock >= cfg.checkpoint_every_seconds
        return bool(by_rounds or by_time)

    async def _on_schedule(self) -> None:
        store = self.store
        while not store.closing:
            await store.notifier.wait_for(lambda: self._due() or store.closing, 1.0)
            if self._due():
                try:
                    await self.save()
                except Exception as exc:  # the disk refused, or a bug: logged, training goes on
                    log.error("shard %d: writing a checkpoint failed: %s", store.config.shard_index, exc)

    async def save(self) -> Saved | None:
        """Make sure a checkpoint holds the state of now, between rounds: write one, or name the newest when
        nothing changed since it. None: nothing to checkpoint (no ``--checkpoint-dir``, or no initialised job).

        The work goes on to its end if the caller is cancelled (the next caller waits for it).

        Raises:
            OSError: the disk refused (the older checkpoints are untouched).
            ValueError: a tensor safetensors files here cannot hold (RuntimeError: a table changed meanwhile,
                a bug).
        """
        task = asyncio.ensure_future(self._save())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved, even with nobody waiting
        return await asyncio.shield(task)

    async def _save(self) -> Saved | None:
        store = self.store
        async with self._lock:
            while store.rounds.applying or not store.tables.settled():  # the tensors change on the compute thread
                await store.notifier.wait_for(lambda: not store.rounds.applying and store.tables.settled(),
                                              store.config.max_wait_seconds)
            job, rounds, directory = store.job, store.rounds, self.directory
            if directory is None or job is None or not job.initialised:
                return None
            # From here to the piece of work queued below nothing awaits: it sees the state these numbers describe.
            snap, layout, write_rows = self._snapshot()
            numbers = (snap.job_id, _numbers_key(snap))
            last = self._last[2] if self._last is not None and self._last[:2] == numbers else None
            previous = directory / last.name.tensors if last is not None and last.path.exists() else None
            name = checkpoint.Name(max(self._sequence + 1, checkpoint.next_sequence(directory)), snap.version,
                                   snap.sparse_round)
            started = time.monotonic()
            writer = await store.run(writing.stream, directory, name, dict(rounds.params), rounds.buffers,
                                     rounds.optimizer, layout, write_rows, previous)
            del write_rows
            if writer is None:
                log.info("shard %d: nothing changed since checkpoint %s: nothing written", store.config.shard_index,
                         last.path)
                return replace(last, written=False)
            paused = time.monotonic() - started
            path = await asyncio.get_running_loop().run_in_executor(
                self._writer, checkpoint.finish, directory, writer, name, snap, store.config.keep_checkpoints)
            saved = Saved(name, path, snap.sparse_round, True)
            self._remember(saved, numbers)
            store.metrics.checkpoint_seconds.observe(time.monotonic() - started)
            log.info("shard %d: checkpoint %s (version %d, sparse round %d, %d bytes) written in %.2fs (rounds "
                     "paused %.2fs of it)", store.config.shard_index, path.name, snap.version, snap.sparse_round,
                     writer.size, time.monotonic() - started, paused)
            return saved

    async def write(self) -> int:
        """:meth:`save`, for callers that want the dense version only: the checkpoint's version, 0 when there was
        nothing to checkpoint (which a checkpoint of version 0 also returns: prefer :meth:`save`).

        Raises:
            OSError: as :meth:`save`.
        """
        saved = await self.save()
        return saved.name.version if saved is not None else 0

    async def reply(self) -> pb.CheckpointReply:
        """The Checkpoint call (``shardps checkpoint``): :meth:`save`, and what holds the state now.

        Raises:
            Unavailable: the shard is shutting down, or the disk refused (the message says why; older
                checkpoints are kept).
            FailedPrecondition: no ``--checkpoint-dir``.
        """
        store = self.store
        store.check_open()
        if self.directory is None:
            raise FailedPrecondition(f"shard {store.config.shard_index} was started without --checkpoint-dir")
        try:
            saved = await self.save()
        except OSError as exc:
            raise Unavailable(f"shard {store.config.shard_index}: writing the checkpoint failed: {exc}") from None
        if saved is None:
            return pb.CheckpointReply(path=str(self.directory), no_job=True)
        return pb.CheckpointReply(version=saved.name.version, path=str(self.directory), name=saved.name.manifest,
                                  sparse_round=saved.sparse_round, written=saved.written)

    async def final(self) -> None:
        """On shutdown (after the store closed): checkpoint every round applied so far; errors are logged."""
        if self._task is not None:
            self._task.cancel()
        try:
            await self.save()
        except Exception as exc:  # the disk refused, or a bug: logged, the shard still stops
            log.error("shard %d: the final checkpoint failed: %s", self.store.config.shard_index, exc)

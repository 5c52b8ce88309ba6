"""Streamed sync rounds: each chunk is applied as soon as every member pushed it, and sent back at once.

A plain sync round moves the model twice over every link, one way after
the other: the workers push the whole gradient, the shard applies the
round, the workers pull the whole model. Each link sends during the push
and receives during the pull, never both, so a step costs ``2 M / R`` (M
model bytes, R link rate). BytePS pipelines per partition instead (Jiang
et al., "A Unified Architecture for Accelerating Distributed DNN Training
in Heterogeneous GPU/CPU Clusters", OSDI 2020): a partition is summed and
updated as soon as every worker pushed it and streams back while later
partitions are still arriving. A streamed round does the same per chunk,
on one PushPull call per member and shard (``RoundHeader.streamed``).

Exactness: the shard's optimizers are element-wise and step one unit per
chunk (``ShardOptimizer`` units), a chunk's average is summed in
worker-id order as a whole round's is, and the learning rates and
hyperparameters come with the header (``RoundHeader.options``), so every
element gets the value a plain round gives it, bit for bit.

All or nothing: before a chunk's first apply its parameters and optimizer
state are copied (``ShardOptimizer.save_units``), and the average of
several members' pushes goes to a buffer of the round's own, so the pushes
stay as they arrived (float32 chunks are read from the frames they arrived
in, never copied: ``Receiver.kept``; one member's push is stepped from
there, as nothing applies it again); a round that must be refused after
some chunks were applied (an update that would not be finite) is undone
from those copies, its hyperparameters put back, and every member's call
ends with the error: the shard is as before the round and collects it
again. Members whose headers carry different learning rates or
hyperparameters are refused before any chunk is applied. Workers hold the
frames of a streamed round until the shard's call ends without error and
only then copy them into the model, so a failed round changes nothing
there either.

Membership: until a round's first chunk is applied it waits for whoever is
a member, as a plain round does; from then on the round's members are
fixed ("frozen"), and a worker that joins meanwhile waits for the next
round (its first pull waits while the round is applied). A member whose
push ends early (it leaves or is dropped at lease expiry, its stream
breaks, it sends a non-finite or malformed chunk) loses only its push, as
in a plain round: what the round applied is undone, the others' calls get
a ``REWIND`` frame (their workers drop the frames received so far), and
the round is applied again, chunk by chunk, with whoever is still in it
(a member still in the job must push again; one that left is not waited
for). Only a refused update (not finite) ends every member's call with
the error. Rounds that clip or scale need every shard's report before any
chunk can be applied: they are never streamed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import torch

from shardps.proto import shardps_pb2 as pb
from shardps.common.codec import FLOAT_DTYPES, encode_chunk, encode_round
from shardps.server import checks
from shardps.server.checks import shown
from shardps.server.dense.bounds import average_bound
from shardps.server.dense.chunks import Receiver
from shardps.server.dense.optimizer import RoundRefused
from shardps.server.errors import Aborted, FailedPrecondition, InvalidArgument, ShardError, Unavailable
from shardps.server.membership.members import Member

log = logging.getLogger(__name__)

#: Sent when the round starts over without a member's push: the worker drops the round's frames received so far.
REWIND = encode_round(pb.RoundHeader())


class StreamedRound:
    """One streamed round of one shard: who pushed which chunk, what was applied, what each member gets back."""

    def __init__(self, number: int, chunks: int) -> None:
        self.number = number
        self.frozen: list[Member] | None = None  # sorted by worker id, once the first chunk was applied
        self.headers: dict[str, pb.RoundHeader] = {}
        self.receivers: dict[str, Receiver] = {}
        self.staging: dict[str, tuple[dict[int, torch.Tensor], torch.Tensor | None]] = {}
        self.readers: dict[str, asyncio.Task] = {}
        self.outboxes: dict[str, asyncio.Queue] = {}
        self.pushed: list[set[str]] = [set() for _ in range(chunks)]  # pushed, or absent per the member's trailer
        self.absent: list[set[str]] = [set() for _ in range(chunks)]
        self.trailers: dict[str, pb.RoundTrailer] = {}
        self.hyperparams: dict[str, list[dict] | None] = {}
        self.finished, self.applied, self.saved = False, bytearray(chunks), []
        self.hyperparams_before: dict | None = None
        self.error: ShardError | None = None
        self.wake, self.lock = asyncio.Event(), asyncio.Lock()
        self.closed = asyncio.Event()  # set when the round is finished or failed
        self.failing: asyncio.Task | None = None
        self.rewinding: asyncio.Task | None = None
        self.rewinds = 0  # times the round started over without a member's push
        self.average: dict[int, torch.Tensor] | None = None  # the average of the chunks applied
        self.task: asyncio.Task | None = None
        self.update_seconds = 0.0


class StreamedRounds:
    """Streamed rounds of one shard, beside :class:`~shardps.server.consistency.rounds.Rounds` (whose state it
    shares: version, parameters, optimizer, membership, staging buffers).

    Args:
        rounds: the shard's rounds.
        members: the shard's membership.
        notify: wakes every waiting call.
        run: runs a function on the compute thread.
    """

    def __init__(self, rounds, members, notify: Callable[[], None], run: Callable[..., Awaitable]) -> None:
        self.rounds, self.members, self.notify, self.run = rounds, members, notify, run
        self.current: StreamedRound | None = None
        #: payload bytes of the streamed pushes accepted so far
        self.received_bytes = 0

    # ------------------------------------------------------------------ a member's call
    async def push_pull(self, member: Member, header: pb.RoundHeader,
                        frames: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """Receive ``member``'s streamed push of round ``header.round`` and yield the new version's frames.

        Raises (while iterating):
            FailedPrecondition: not sync mode, another round, or the round's other pushes are not streamed.
            InvalidArgument: bad options, frames or trailer (before any chunk was applied: this push
                only; after: the round, undone).
            Aborted: the round is being applied without this member, another push of it is in
                flight, or the round was undone because a member left.
        """
        rounds, rnd_no, w = self.rounds, header.round, member.worker_id
        what = f"streamed push of round {rnd_no}"
        if not rounds.mode.synchronous:
            raise FailedPrecondition(f"{what}: streamed rounds exist in sync mode only; this job runs "
                                     f"{rounds.mode.name}")
        if header.scaled:
            raise InvalidArgument(f"{what}: a loss-scaled round needs every shard's report first: push it "
                                  "unstreamed")
        current = self.current
        if rounds.applying and (current is None or current.frozen is None or member not in current.frozen):
            raise Aborted(f"round {rounds.version} is being applied; pull version {rounds.version + 1}, then push "
                          f"round {rounds.version + 1}")
        if rnd_no != rounds.version:
            raise FailedPrecondition(f"worker {shown(w)} pushed round {rnd_no} but the shard is collecting round "
                                     f"{rounds.version}: pull version {rounds.version} and push round {rounds.version}")
        if rounds.pushed:
            raise FailedPrecondition(f"{what}: other members pushed round {rnd_no} unstreamed: every worker of a job "
                                     "must use the same WireOptions(streamed=...)")
        if current is not None and w in current.headers:
            # this member's earlier stream of the round is dead (a worker has one push of a round in flight:
            # it cancelled that call, or lost it): what it pushed no longer counts, and a round it took part in
            # is undone first
            old = current.readers.get(w)
            if old is not None and not old.done():
                old.cancel()
            await self._member_failed(current, member, Aborted(f"worker {shown(w)} pushed round {rnd_no} again"))
            current = self.current
        options = header.options
        hyperparams = checks.check_trailer(options, len(rounds.hyperparam_names), rounds.hyperparam_names)
        if options.inv_scale or options.max_grad_norm or options.absent_keys or options.HasField("span"):
            raise InvalidArgument(f"{what}: the header's options carry learning rates and hyperparameters only")
        if current is None:
            current = self.current = StreamedRound(rnd_no, len(rounds.table.chunks))
            current.task = asyncio.get_running_loop().create_task(self._apply_loop(current))
        rnd = current
        staging, arena = rounds.take_staging()
        rnd.headers[w], rnd.staging[w] = header, (staging, arena)
        # fp32 chunks stay in the frames they arrived in (Receiver.kept): _apply reads them there
        rnd.receivers[w] = rounds.table.receiver(rnd_no, staging, arena, what=what, keep=True,
                                                 reject_nonfinite=rounds.config.reject_nonfinite)
        outbox = rnd.outboxes[w] = asyncio.Queue()
        rnd.hyperparams[w] = hyperparams
        reader = rnd.readers[w] = asyncio.get_running_loop().create_task(self._read(member, rnd, frames, what))
        member.pushing = reader  # a Leave ends it
        try:
            while (item := await outbox.get()) is not None:  # blocking wait for applied chunks
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not reader.done():
                reader.cancel()

    async def _read(self, member: Member, rnd: StreamedRound, frames: AsyncIterator[bytes], what: str) -> None:
        """Read ``member``'s push into its staging; each chunk counts as soon as it arrived whole."""
        w, rx = member.worker_id, rnd.receivers[member.worker_id]
        try:
            def counted(is_buffer: bool, index: int) -> None:
                if not is_buffer:
                    rnd.pushed[index].add(w)
                    rnd.wake.set()

            trailer = await rx.read_push(frames, counted)
            options = rnd.headers[w].options
            if list(trailer.lrs) != list(options.lrs) or trailer.group_hyperparams_json:
                raise InvalidArgument(f"{what}: the learning rates or hyperparameters changed after the round's "
                                      "first gradient was pushed: set them before backward(), or push unstreamed")
            if trailer.inv_scale or trailer.max_grad_norm or trailer.HasField("span"):
                raise InvalidArgument(f"{what}: a round that clips, scales or trains a stream batch cannot be streamed")
            rx.finish(trailer.absent_keys)
            for i in rx.absent_chunks(trailer.absent_keys):
                rnd.pushed[i].add(w)
                rnd.absent[i].add(w)
            rnd.trailers[w] = trailer
            self.received_bytes += rx.received
            member.last_round, member.failed = rnd.number, None
            self.rounds.pushes_accepted += 1
            rnd.wake.set()
        except asyncio.CancelledError:
            if rnd.error is None and not rnd.finished and rnd.readers.get(w) is asyncio.current_task():
                await self._member_failed(rnd, member, Aborted(f"worker {shown(w)}'s streamed push of round "
                                                               f"{rnd.number} ended early"))
            raise
        except Exception as exc:
            if rnd.readers.get(w) is asyncio.current_task():  # (not superseded by a newer push of this member)
                error = exc if isinstance(exc, ShardError) else Unavailable(
                    f"worker {shown(w)}'s push stream failed: {exc}")  # a broken stream
                await self._member_failed(rnd, member, error)
        finally:
            if member.pushing is rnd.readers.get(w):
                member.pushing = None

    async def _member_failed(self, rnd: StreamedRound, member: Member, error: ShardError) -> None:
        """A member's push failed (a bad frame, a broken stream, it left): only its push is dropped, as in a plain
        round; if the round had applied chunks with it, they are undone first and the round starts over."""
        if rnd.frozen is not None and member in rnd.frozen and rnd.error is None:
            task = rnd.rewinding = asyncio.get_running_loop().create_task(self._rewind(rnd, member, error))
            await asyncio.shield(task)  # a cancelled caller cannot stop the undo half-way
            return
        self._forget(rnd, member.worker_id, error)
        rnd.wake.set()

    async def _rewind(self, rnd: StreamedRound, member: Member, error: ShardError) -> None:
        """Undo what ``rnd`` applied, drop ``member``'s push, tell the others' calls to drop what they received
        (a ``REWIND`` frame), and let the round be applied again with whoever is still in it."""
        async with rnd.lock:  # an apply in progress finishes first
            if rnd.error is not None or rnd.finished or rnd.frozen is None or member not in rnd.frozen:
                self._forget(rnd, member.worker_id, error)
                rnd.wake.set()
                return
            await self._undo_applied(rnd)
            rnd.frozen = None
            rnd.applied = bytearray(len(rnd.applied))
            self.rounds.applying = False
            self._forget(rnd, member.worker_id, error)
            rnd.rewinds += 1
            log.info("shard %d: streamed round %d starts over without worker %s's push (%s)",
                     self.rounds.config.shard_index, rnd.number, shown(member.worker_id), error)
            for outbox in rnd.outboxes.values():
                outbox.put_nowait(REWIND)
            self.notify()
            rnd.wake.set()

    async def _undo_applied(self, rnd: StreamedRound) -> None:
        """Put back the parameters, optimizer state and hyperparameters ``rnd`` changed (caller holds ``rnd.lock``)."""
        optimizer = self.rounds.optimizer
        saved, before = rnd.saved, rnd.hyperparams_before
        rnd.saved, rnd.hyperparams_before = [], None

        def undo() -> None:
            optimizer.restore_units(saved)
            if before is not None:
                optimizer.set_hyperparams(before)

        if saved or before is not None:
            await self.run(undo)

    def _forget(self, rnd: StreamedRound, w: str, error: BaseException | None) -> None:
        if rnd.trailers.pop(w, None) is not None:
            self.rounds.pushes_dropped += 1  # an accepted push that will not count
        rnd.headers.pop(w, None)
        rnd.readers.pop(w, None)
        rx = rnd.receivers.pop(w, None)
        if rx is not None:
            rx.kept.clear()  # the frames go now, even where a traceback still holds the receiver
        staging = rnd.staging.pop(w, None)
        if staging is not None:
            self.rounds.give_back(*staging)
        for pushed in rnd.pushed:
            pushed.discard(w)
        for absent in rnd.absent:
            absent.discard(w)
        outbox = rnd.outboxes.pop(w, None)
        if outbox is not None and error is not None:
            outbox.put_nowait(error)

    def reset(self) -> None:
        """The job was reset (no members): a round still open is dropped unapplied (its pushes came from members
        that are gone, and its chunks follow the old job's plan), so the next job's rounds start afresh."""
        rnd, self.current = self.current, None
        if rnd is None:
            return
        rnd.error = rnd.error or Aborted(f"round {rnd.number} was dropped with its job (reset)")
        for task in (rnd.task, *rnd.readers.values()):
            if task is not None and not task.done():
                task.cancel()
        for outbox in rnd.outboxes.values():
            outbox.put_nowait(rnd.error)
        rnd.staging.clear()  # the job's buffers go with it
        rnd.average = None
        rnd.closed.set()

    # ------------------------------------------------------------------ membership
    def dropped(self, member: Member) -> None:
        """``member`` left or its lease ran out: the round goes on without its push (undone and applied again
        without it if it had started)."""
        rnd = self.current
        if rnd is None or member.worker_id not in rnd.headers:
            if rnd is not None:
                rnd.wake.set()
            return
        asyncio.get_running_loop().create_task(self._member_failed(
            rnd, member, Aborted(f"worker {shown(member.worker_id)} left during its push of round {rnd.number}")))

    def wake(self) -> None:
        """Something the open round waits for may have changed (a member left, the rejoin wait ended)."""
        if self.current is not None:
            self.current.wake.set()

    async def settle(self, timeout: float) -> None:
        """Wait (up to ``timeout`` seconds) until no streamed round is part-applied.

        A Join waits here, so that its reply names the version the joiner starts from: a round whose
        members are already fixed does not wait for the joiner, and the shard would otherwise answer with the
        version before that round while other shards answer with the one after it.
        """
        rnd = self.current
        if rnd is not None and rnd.frozen is not None:
            try:
                await asyncio.wait_for(asyncio.shield(rnd.closed.wait()), timeout)
            except TimeoutError:
                pass

    def in_progress(self) -> bool:
        """A streamed round is open and some member's push of it has begun."""
        return self.current is not None and bool(self.current.headers)

    def accepted(self) -> set[str]:
        """Members whose streamed push of the open round arrived whole (trailer checked)."""
        return set(self.current.trailers) if self.current is not None else set()

    def waiting_for(self) -> list[str] | None:
        """Members whose trailer of the streamed round has not arrived; None without a streamed round."""
        rnd = self.current
        if rnd is None:
            return None
        ids = [m.worker_id for m in rnd.frozen] if rnd.frozen is not None else self.members.ids()
        return [w for w in ids if w not in rnd.trailers]

    def _needed(self, rnd: StreamedRound) -> list[str] | None:
        """The members whose chunks a chunk waits for; None while the round may not start yet."""
        if rnd.frozen is not None:
            return [m.worker_id for m in rnd.frozen]
        rounds = self.rounds
        if rounds.still_rejoining() or (rounds.version == 0 and len(self.members) < rounds.config.min_workers):
            return None
        ids = self.members.ids()
        return ids if ids and all(w in rnd.headers for w in ids) else None

    # ------------------------------------------------------------------ applying
    async def _apply_loop(self, rnd: StreamedRound) -> None:
        """Apply chunks as they complete; finish the round once every chunk is applied and every trailer is in."""
        try:
            while rnd.error is None:
                await rnd.wake.wait()  # a chunk, trailer, leave or failure
                rnd.wake.clear()
                if rnd.error is not None:
                    return
                needed = self._needed(rnd)
                if needed is None:
                    continue
                ready = [i for i, pushed in enumerate(rnd.pushed)
                         if not rnd.applied[i] and all(w in pushed for w in needed)]
                async with rnd.lock:
                    if rnd.error is not None:
                        return
                    if ready and all(w in rnd.headers for w in needed):  # (nobody was dropped meanwhile)
                        if rnd.frozen is None:
                            self._freeze(rnd, needed)
                        await self._apply(rnd, ready)
                    elif not rnd.applied and rnd.frozen is None and all(w in rnd.trailers for w in needed):
                        self._freeze(rnd, needed)  # a shard that holds no chunk: the round is its trailers
                    if all(rnd.applied) and rnd.frozen is not None and all(
                            m.worker_id in rnd.trailers for m in rnd.frozen):
                        await self._finish(rnd)
                        return
        except RoundRefused as exc:
            table = self.rounds.table
            where = f" at {table.describe(exc.key)}" if exc.key >= 0 else ""
            await self.fail(rnd, InvalidArgument(
                f"round {rnd.number} was refused: {exc.reason}{where}; the shard's parameters and optimizer state "
                f"are unchanged and it collects round {rnd.number} again"))
        except asyncio.CancelledError:
            raise
        except BaseException:
            log.exception("shard %d: applying streamed round %d failed", self.rounds.config.shard_index, rnd.number)
            await self.fail(rnd, Unavailable(f"shard {self.rounds.config.shard_index} failed to apply round "
                                             f"{rnd.number}; see its log"))

    def _freeze(self, rnd: StreamedRound, needed: list[str]) -> None:
        """The first chunk is complete: the round's members are fixed and pulls wait until it is applied. Raises
        ``RoundRefused`` where their headers carry different lrs or hyperparameters (``checks.disagreement``)."""
        why = checks.disagreement(needed, [list(rnd.headers[w].options.lrs) for w in needed],
                                  [rnd.hyperparams.get(w) for w in needed], self.rounds.optimizer.hyperparams())
        if why is not None:
            raise RoundRefused(why)
        rnd.frozen = [self.members.find(w) for w in sorted(needed)]
        self.rounds.applying = True

    async def _apply(self, rnd: StreamedRound, ready: list[int]) -> None:
        """Average, step and encode the chunks in ``ready`` on the compute thread, then send them to every member."""
        rounds, table, optimizer = self.rounds, self.rounds.table, self.rounds.optimizer
        members = [m.worker_id for m in rnd.frozen]
        lead = members[0]
        grads = [rnd.staging[w][0] for w in members]
        # Each member's chunk is read where it arrived (its receiver kept the frame: Receiver.kept) or was
        # staged (another wire type, an absent key's zeros). One member: its push is the average, stepped
        # from there, and the frame is let go once applied (a round of one member is never applied again
        # with that push). Several: the average goes to a buffer of the round's own, so that a round
        # applied again without one of them (REWIND) finds the others' pushes as they came.
        kept = [rnd.receivers[w].kept for w in members]
        unit_grads = {i: kept[0].pop(i) for i in ready if i in kept[0]} if len(grads) == 1 else None

        def pushed(j: int, i: int) -> torch.Tensor:
            view = kept[j].get(i)
            return table.view(grads[j], table.chunks[i]) if view is None else view

        if len(grads) > 1 and rnd.average is None:
            rnd.average = rounds.take_staging()[0]
        average = rnd.average if len(grads) > 1 else grads[0]
        stepped = [i for i in ready if len(rnd.absent[i]) < len(members)]
        present = {table.chunks[i].key_index for i in stepped}
        lrs = list(rnd.headers[lead].options.lrs)
        check = rounds.config.reject_nonfinite
        bound = None
        if check:
            bound = max((average_bound([rnd.receivers[w].chunk_bounds[i] for w in members]) for i in stepped),
                        default=0.0)
        dtypes = sorted({rnd.headers[w].pull_dtype or pb.FLOAT32 for w in members})
        version = rnd.number + 1
        first = rnd.hyperparams_before is None
        lead_hyperparams = rnd.hyperparams.get(lead) if first else None

        def step() -> dict[int, list[bytes]]:
            if first:
                rnd.hyperparams_before = optimizer.saved_hyperparams()
                if lead_hyperparams is not None:
                    optimizer.set_hyperparams(lead_hyperparams)
            if len(grads) > 1:
                for i in ready:  # optimizer.average_'s order: the same float32 sums, bit for bit
                    # the pushes stay as they came: the first sum goes straight into the round's own buffer
                    dst = torch.add(pushed(0, i), pushed(1, i), out=table.view(average, table.chunks[i]))
                    for j in range(2, len(grads)):
                        dst.add_(pushed(j, i))
                    dst.mul_(1.0 / len(grads))
            rnd.saved.extend(optimizer.save_units(stepped))
            optimizer.apply(average, present, lrs, 1.0, check, grad_bound=bound, units=set(stepped),
                            unit_grads=unit_grads)
            frames = {}
            for code in dtypes:
                dtype = FLOAT_DTYPES[code]
                frames[code] = [encode_chunk(table.chunks[i].key, table.chunks[i].offset,
                                             table.view(rounds.params, table.chunks[i]).to(dtype), version)
                                for i in ready]
            return frames

        started = time.perf_counter()
        frames = await self.run(step)
        rnd.update_seconds += time.perf_counter() - started
        for i in ready:
            rnd.applied[i] = 1
        for w in members:
            outbox = rnd.outboxes.get(w)
            if outbox is not None:
                for f in frames[rnd.headers[w].pull_dtype or pb.FLOAT32]:
                    outbox.put_nowait(f)

    async def _finish(self, rnd: StreamedRound) -> None:
        """Every chunk applied and every trailer in: take the lead's buffers, advance the version, end the calls."""
        rounds, table = self.rounds, self.rounds.table
        lead = rnd.frozen[0].worker_id
        arena = rnd.staging[lead][1]
        version = rnd.number + 1

        def finish() -> list[bytes]:
            if arena is not None:
                rounds.buffers.copy_(arena)  # the lowest worker id's buffers, as DDP broadcasts rank 0's
            rounds.snapshot_version = version
            return [encode_chunk(c.key, c.offset, table.buffer_view(rounds.buffers, c), version)
                    for c in table.buffer_chunks]

        buffer_frames = await self.run(finish)
        rnd.finished = True
        rounds.round_completed(rnd.number, rnd.frozen, 0, rnd.update_seconds)
        for w in [m.worker_id for m in rnd.frozen]:
            outbox = rnd.outboxes.get(w)
            if outbox is not None:
                for f in buffer_frames:
                    outbox.put_nowait(f)
                outbox.put_nowait(None)
        self._close(rnd)

    async def fail(self, rnd: StreamedRound, error: ShardError) -> None:
        """Undo what ``rnd`` applied (parameters, state, hyperparameters) and end every member's call with ``error``.

        The undo runs as its own task: a caller cancelled meanwhile (its call ended) cannot stop it half-way,
        and every caller waits for the same undo (the first error is the round's).
        """
        await asyncio.shield(self.start_failing(rnd, error))

    def start_failing(self, rnd: StreamedRound, error: ShardError) -> asyncio.Task:
        """Make ``error`` the round's (if it has none yet) and start its undo; the undo's task."""
        if rnd.failing is None:
            rnd.error = error
            rnd.wake.set()
            rnd.failing = asyncio.get_running_loop().create_task(self._undo(rnd, error))
        return rnd.failing

    async def _undo(self, rnd: StreamedRound, error: ShardError) -> None:
        log.warning("shard %d: %s", self.rounds.config.shard_index, error)
        async with rnd.lock:  # an apply in progress finishes first
            await self._undo_applied(rnd)
        readers = list(rnd.readers.values())
        for w in list(rnd.headers):
            m = self.members.find(w)
            if m is not None:
                m.failed, m.last_round = (rnd.number, error), -1
            self._forget(rnd, w, error)
        for task in readers:
            if not task.done():
                task.cancel()
        self._close(rnd)

    def _close(self, rnd: StreamedRound) -> None:
        for staging in rnd.staging.values():
            self.rounds.give_back(*staging)
        rnd.staging.clear()
        for rx in rnd.receivers.values():
            rx.kept.clear()
        rnd.receivers.clear()
        if rnd.average is not None:
            self.rounds.give_back(rnd.average, None)
            rnd.average = None
        rnd.saved = []
        if self.current is rnd:
            self.current = None
        self.rounds.applying = False
        rnd.closed.set()
        self.notify()

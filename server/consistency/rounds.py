"""Bulk synchronous rounds of one shard: staged pushes, the commit exchange, the apply, refusals.

Bulk synchronous parallel (Valiant, "A bridging model for parallel
computation", CACM 1990): round ``r`` completes once every member has pushed
it; the first round also waits until ``min_workers`` workers have joined
(later rounds go on with whoever is a member: workers leave, are dropped at
lease expiry, or finish early). A push is a worker's
gradient chunks (none for keys whose gradient is None), its buffers, and a
trailer with the round's learning rates, changed hyperparameters, absent
keys, loss scale and clipping. The gradients are averaged over all members
(a member without a gradient for a key counts as zero, as DDP averages),
summed in worker-id order so the result does not depend on arrival order;
keys nobody had a gradient for are not stepped at all. The lowest worker
id's trailer and buffers are the round's (every worker's should agree; the
rule makes the result deterministic when they do not).

Sync rounds that clip or scale need one number from every shard: the shard
averages and unscales, sends each member a :class:`pb.RoundReport` (its part
of the norm, whether it found Inf/NaN), and waits for every member's
:class:`pb.RoundCommit` (skip, clip coefficient), which all must agree. So
every shard clips by the same coefficient and skips the same rounds.

A round whose update would not be finite is refused whole: parameters and
optimizer state unchanged, every pusher of the round gets the error, and
the shard collects the same round again. A skipped round (GradScaler
overflow) completes with both unchanged.

Runs on the shard's event loop beside ``store.py`` and shares its
membership and notifier. Everything a round needs is captured in one
synchronous step when it closes (:meth:`Rounds.maybe_apply`), so a Leave or
a push arriving while the apply starts cannot change it.

In async and ssp modes (``modes.py``) the same machinery closes a "round"
of one push as soon as it is accepted, in arrival order: no averaging, the
push's own learning rates (optionally divided by its staleness), one
optimizer step per push; pushes that arrive meanwhile queue in ``pushed``.

Staging memory: each member's push is received into a gradient buffer the
size of the shard's parameters (and a byte arena the size of its buffers),
taken when the push starts and given back when the round is applied, the
push fails, or the member leaves (its push is then ended). Spare buffers
are kept for reuse, never more than one per member.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import torch

from shardps.proto import shardps_pb2 as pb
from shardps.server import checks
from shardps.server.checks import shown
from shardps.server.dense.chunks import ChunkTable
from shardps.server.config import ShardConfig
from shardps.server.errors import Aborted, FailedPrecondition, InvalidArgument, Unavailable, stop_call
from shardps.server.membership.members import Member, Membership
from shardps.server.metrics import ShardMetrics
from shardps.server.consistency.modes import Mode, StalenessHistogram
from shardps.server.dense.bounds import average_bound
from shardps.server.dense.optimizer import RoundRefused, ShardOptimizer, average_
from shardps.server.consistency.commits import CommitExchange
from shardps.server.consistency.streamed import StreamedRounds
from shardps.server.stream_positions import StreamPositions, check_span, span_of

log = logging.getLogger(__name__)


def _needs_commit(trailer: pb.RoundTrailer) -> bool:
    """A round that clips or scales needs every shard's report and every member's commit."""
    return bool(trailer.inv_scale or trailer.max_grad_norm)


@dataclass
class _Pushed:
    """One member's accepted push of the open round (its gradients are in ``member.staging``, and its float32
    chunks in the frames they arrived in, ``kept``: ``Receiver.kept``)."""

    trailer: pb.RoundTrailer
    scaled: bool
    hyperparams: list[dict] | None
    grad_bound: float | None = None  # |g| bound over its chunks, measured as they arrived (None: not measured)
    kept: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass(eq=False)
class Closed:
    """What a round captured when it closed: applied from this, whatever happens meanwhile."""

    number: int
    members: list[Member]
    grads: list[dict[int, torch.Tensor]]
    arenas: list[torch.Tensor | None]
    lead: _Pushed
    present: set[int]
    report: pb.RoundReport | None = None
    commits: dict[str, pb.RoundCommit] = field(default_factory=dict)
    committed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def needs_commit(self) -> bool:
        return _needs_commit(self.lead.trailer)


class Rounds(CommitExchange):
    """The open round of one shard, its parameters, buffers and optimizer.

    Attributes:
        version: rounds applied so far (skipped ones included).
        applying: a closed round is being applied (pulls do not read the buffers meanwhile).
        closed: the round being applied, while it is.
        pushed: ``{worker_id: push}`` of the members whose push of the open round was accepted.
        params: ``{group: flat fp32}``; buffers: the buffer arena (uint8).
        applied, skipped: rounds applied, and of those skipped (loss-scale overflow).
        pushes_accepted, contributions_applied, pushes_dropped: accepted pushes (a
            retry of one is not counted), those a round averaged, and those that
            never counted (the member left, or the round was refused); accepted =
            applied + dropped + those of the open round.
        rejoining: after a restore, members of the checkpoint that rounds still
            wait for (for one lease at most: see :meth:`await_rejoin`).
        last_contributors: members whose gradients the last applied round averaged.
        state_bytes: optimizer-state bytes after the last round.
        mode: the job's consistency mode (``modes.py``).
        staleness: counts of applied gradients by staleness.
        snapshot_version: the version the parameters hold, as seen from the compute
            thread (async pulls snapshot parameters there).

    Args:
        config: the shard's settings.
        members: the shard's membership (shared with the store).
        notify: wakes every waiting call (the store's notifier).
        run: runs a function on the compute thread (``await run(fn, *args)``).
        metrics: where applied rounds, their update seconds and staleness are recorded.
    """

    def __init__(self, config: ShardConfig, members: Membership, notify: Callable[[], None],
                 run: Callable[..., Awaitable], metrics: ShardMetrics) -> None:
        self.config, self._members, self._notify, self._run = config, members, notify, run
        self.metrics = metrics
        self.version = 0
        self.applying = False
        self.closed: Closed | None = None
        self.pushed: dict[str, _Pushed] = {}
        self.applied = self.skipped = self.last_contributors = 0
        self.pushes_accepted = self.contributions_applied = self.pushes_dropped = 0
        self.rejoining: set[str] = set()
        self.state_bytes = 0
        self.mode = Mode()
        self.staleness = StalenessHistogram()
        self.positions = StreamPositions()  # the stream offsets held (the store shares it with its tables)
        self.snapshot_version = 0
        self.table: ChunkTable | None = None
        self.optimizer: ShardOptimizer | None = None
        self.params: dict[int, torch.Tensor] = {}
        self.buffers = torch.empty(0, dtype=torch.uint8)
        self._hyperparam_names: list[set[str]] = []
        self._spare: list[dict[int, torch.Tensor]] = []
        self._spare_arenas: list[torch.Tensor] = []
        self._task: asyncio.Task | None = None
        #: streamed sync rounds (``streamed.py``), applied a chunk at a time
        self.streamed = StreamedRounds(self, members, notify, run)

    def start(self, table: ChunkTable, optimizer: ShardOptimizer, params: dict[int, torch.Tensor],
              buffers: torch.Tensor, hyperparam_names: list[set[str]]) -> None:
        """The shard was initialised: rounds may begin."""
        self.table, self.optimizer, self.params, self.buffers = table, optimizer, params, buffers
        self._hyperparam_names = hyperparam_names
        self.state_bytes = optimizer.state_bytes()  # Adagrad's state exists from the start

    def forget(self) -> None:
        """The job was forgotten before initialisation: drop its buffers."""
        self.table, self.optimizer, self.params, self._spare, self._spare_arenas = None, None, {}, [], []
        self.mode = Mode()

    def reset(self) -> None:
        """The job was reset (no members, nothing applying): drop everything, back to version 0."""
        self.streamed.reset()
        self.forget()
        self.buffers = torch.empty(0, dtype=torch.uint8)
        self.pushed.clear()
        self.version = self.applied = self.skipped = self.last_contributors = self.state_bytes = 0
        self.pushes_accepted = self.contributions_applied = self.pushes_dropped = self.snapshot_version = 0
        self.rejoining = set()
        self.staleness.reset()
        self.positions.reset()

    def waiting_for(self) -> list[str]:
        """Members whose push of the open round has not been accepted, then checkpoint members not back yet."""
        streamed = self.streamed.waiting_for()
        waiting = streamed if streamed is not None else [w for w in self._members.ids() if w not in self.pushed]
        return waiting + sorted(self.rejoining - set(self._members.ids()))

    def await_rejoin(self, worker_ids: list[str], seconds: float) -> None:
        """After a restore: rounds wait up to ``seconds`` for the checkpoint's members to join again.

        Without this, the first member to come back would make a round alone
        (nobody else is a member yet); with it, the restored shard averages the
        same workers as the shards that never stopped, and a member that died
        meanwhile stops being waited for once its lease would have run out.
        """
        self.rejoining = set(worker_ids)

        def give_up() -> None:
            self.streamed.wake()
            if self.rejoining:
                log.warning("shard %d: %s did not join again within %.0fs of the restore; rounds go on without "
                            "them", self.config.shard_index, sorted(self.rejoining - set(self._members.ids())),
                            seconds)
            self.rejoining = set()
            self.maybe_apply()
            self._notify()

        asyncio.get_running_loop().call_later(seconds, give_up)

    @property
    def in_progress(self) -> bool:
        """Some member's push of the open round was accepted (plain) or has begun (streamed)."""
        return bool(self.pushed) or self.streamed.in_progress()

    def open_pushers(self) -> list[str]:
        """Members whose push of the open round was accepted (plain or streamed), sorted."""
        return sorted(set(self.pushed) | self.streamed.accepted())

    @property
    def hyperparam_names(self) -> list[set[str]]:
        """Each group's hyperparameter names (without ``lr``) the job fixed."""
        return self._hyperparam_names

    def take_staging(self) -> tuple[dict[int, torch.Tensor], torch.Tensor | None]:
        """A gradient buffer (and a buffer arena if the plan has buffers) for one push; :meth:`give_back` it."""
        staging = self._spare.pop() if self._spare else self.table.allocate()
        arena = None
        if self.table.buffer_chunks:
            arena = self._spare_arenas.pop() if self._spare_arenas else self.table.allocate_buffers()
        return staging, arena

    def give_back(self, staging: dict[int, torch.Tensor] | None, arena: torch.Tensor | None) -> None:
        """Return a push's buffers for reuse (at most one spare per member is kept)."""
        self._give_back(staging, arena)

    def still_rejoining(self) -> bool:
        """After a restore: rounds still wait for members of the checkpoint (see :meth:`await_rejoin`)."""
        return self._still_rejoining()

    def round_completed(self, number: int, members: list[Member], staleness: int, update_seconds: float,
                        skip: bool = False) -> None:
        """Bookkeeping of an applied round: version, counters, metrics, the members' clocks."""
        self.version += 1
        self.applied += 1
        self.last_contributors = len(members)
        self.contributions_applied += len(members)
        self.skipped += skip
        self.state_bytes = self.optimizer.state_bytes()
        self.staleness.record(staleness, len(members))
        self.metrics.round_applied(self.mode.name, update_seconds, staleness, len(members))
        for m in members:
            m.clock += 1
            m.applied_round = number

    def _still_rejoining(self) -> bool:
        if self.rejoining and self.rejoining <= set(self._members.ids()):
            self.rejoining = set()  # all back (else the timer of await_rejoin ends the wait)
        return bool(self.rejoining)

    # ------------------------------------------------------------------ push
    async def push(self, member: Member, header: pb.RoundHeader, frames: AsyncIterator[bytes], *,
                   can_commit: bool) -> tuple[int, bool]:
        """Receive ``member``'s push of round ``header.round``; close the round if it completes.

        The caller has checked the header and the member. Idempotent: a push of a
        round already accepted from this member is ignored, unread.

        Args:
            can_commit: the call can carry the report/commit exchange (PushPull);
                a Push that asks to clip or scale is refused.

        Returns:
            ``(bytes, needs_commit)``: payload bytes received (0 for an ignored
            retry), and whether this push asked to clip or scale (the caller then
            sends the round's report and waits for the member's commit).

        Raises:
            FailedPrecondition: a round other than the open one.
            InvalidArgument: bad frames or trailer, missing chunks, NaN/Inf gradients
                (nothing changed); or the round this push completed was refused.
                An async/ssp push that asks the shards to clip or scale (workers do that).
            Aborted: another push of this member is in flight, the round is being
                applied, or it closed without this push (the member left).
        """
        rnd = header.round
        if member.last_round == rnd:  # a retry of an accepted push: never double-count
            earlier = self.pushed.get(member.worker_id)
            return 0, earlier is not None and _needs_commit(earlier.trailer)
        if self.mode.synchronous:
            if self.streamed.current is not None:
                raise FailedPrecondition(f"worker {shown(member.worker_id)} pushed round {rnd} unstreamed but other "
                                         "members stream it: every worker of a job must use the same "
                                         "WireOptions(streamed=...)")
            if self.applying:
                raise Aborted(
                    f"round {self.version} is being applied; pull version {self.version + 1}, "
                    f"then push round {self.version + 1}"
                )
            if rnd != self.version:
                raise FailedPrecondition(
                    f"worker {shown(member.worker_id)} pushed round {rnd} but the shard is collecting round "
                    f"{self.version}: pull version {self.version} and push round {self.version}"
                )
        elif rnd > self.version or member.worker_id in self.pushed:
            raise FailedPrecondition(
                f"worker {shown(member.worker_id)} pushed a gradient of version {rnd} but the shard is at version "
                f"{self.version}{' and still holds its previous push' if rnd <= self.version else ''}: push the "
                "gradient of the version last pulled, once the previous push came back"
            )
        if member.pushing is not None:
            raise Aborted(f"another push from worker {shown(member.worker_id)} is in progress")
        member.pushing = asyncio.current_task()  # a Leave ends it (and frees its staging)
        staging, arena = self.take_staging()
        what = f"push of round {rnd}"
        rx = None
        try:
            # float32 chunks stay in their frames where the push will likely be stepped alone (see _apply): an
            # async/ssp push, or a sync job of one member; a round that averages would copy them to staging
            # anyway, while holding every member's frames
            alone = not header.scaled and (not self.mode.synchronous or len(self._members) == 1)
            rx = self.table.receiver(rnd, staging, arena, what=what, keep=alone,
                                     reject_nonfinite=self.config.reject_nonfinite and not header.scaled)
            trailer = await rx.read_push(frames)
            hyperparams = checks.check_trailer(trailer, len(self._hyperparam_names), self._hyperparam_names)
            if trailer.HasField("span"):
                check_span(trailer.span, what)
            if (trailer.inv_scale or trailer.max_grad_norm) and not can_commit:
                raise InvalidArgument(f"{what}: a round that clips or scales needs PushPull (it exchanges a report "
                                      "and a commit)")
            self.mode.check_commit(what, bool(trailer.inv_scale or trailer.max_grad_norm))
            if trailer.inv_scale and not header.scaled:
                raise InvalidArgument(f"{what}: inv_scale is set but the round header does not say 'scaled'")
            received = rx.finish(trailer.absent_keys)
            if self._members.find(member.worker_id) is not member or (
                    self.mode.synchronous and (self.version != rnd or self.applying)):
                raise Aborted(f"round {rnd} closed without worker {shown(member.worker_id)}'s push (it left)")
        except BaseException:
            self._give_back(staging, arena)
            if rx is not None:
                rx.kept.clear()  # now: the traceback may keep the receiver alive until a garbage collection
            raise
        finally:
            member.pushing = None
        member.staging, member.arena, member.last_round, member.failed = staging, arena, rnd, None
        self.pushes_accepted += 1
        self.pushed[member.worker_id] = _Pushed(trailer, header.scaled, hyperparams,
                                                rx.grad_bound if rx.reject_nonfinite else None, rx.kept)
        needs_commit = _needs_commit(trailer)
        task = self.maybe_apply()
        if task is not None and not needs_commit and self.mode.synchronous:
            await asyncio.shield(task)  # the last pusher's reply carries the new version
            if member.failed is not None and member.failed[0] == rnd:
                raise member.failed[1]
        return received, needs_commit

    def admitted(self, member: Member) -> None:
        """A new member: in async/ssp it starts at the slowest live member's clock (or 0)."""
        member.clock = min((m.clock for m in self._members.members() if m is not member), default=0)
        if not self.mode.synchronous and self.table is not None:
            self.maybe_apply()  # pushes queued while the job waited for --min-workers

    def _give_back(self, staging: dict[int, torch.Tensor] | None, arena: torch.Tensor | None) -> None:
        limit = max(1, len(self._members))
        if self.table is None:
            return
        if staging is not None and len(self._spare) < limit:
            self._spare.append(staging)
        if arena is not None and len(self._spare_arenas) < limit:
            self._spare_arenas.append(arena)

    # ------------------------------------------------------------------ close and apply
    def maybe_apply(self) -> asyncio.Task | None:
        """Close the open round and start applying it if every member has pushed it."""
        if self.applying or not self.pushed or (self.version == 0 and len(self._members) < self.config.min_workers):
            return None
        if self.mode.synchronous:
            if self._still_rejoining() or self.waiting_for():
                return None
            workers = sorted(self.pushed)
        else:
            workers = [next(iter(self.pushed))]  # one push at a time, in arrival order
        members = [self._members.find(w) for w in workers]
        pushes = [self.pushed[w] for w in workers]
        lead = pushes[0]
        present = set(range(len(self.table.plan.keys)))
        present -= set.intersection(*(set(p.trailer.absent_keys) for p in pushes))
        number = self.version if self.mode.synchronous else members[0].last_round
        closed = Closed(number, members, [m.staging for m in members], [m.arena for m in members], lead, present)
        for m in members:
            m.staging = m.arena = None  # the apply owns the buffers now: a member leaving meanwhile frees nothing
        self.applying, self.closed = True, closed
        self._task = asyncio.get_running_loop().create_task(self._apply(closed, pushes, workers))
        return self._task

    async def _apply(self, closed: Closed, pushes: list[_Pushed], workers: list[str]) -> None:
        """Average, exchange report and commits if needed, step; then advance the version or refuse."""
        skip = False
        staleness = self.version - closed.number
        try:
            self._check_agreement(closed, pushes, workers)
            spans = [span_of(p.trailer) for p in pushes]
            try:  # a stream batch this shard holds already, or that leaves a gap, is skipped (stream_positions.py)
                due = self.positions.verdict("dense", spans, f"round {closed.number}", self.config.shard_index)
            except InvalidArgument as exc:
                raise RoundRefused(str(exc)) from None
            lead = closed.lead.trailer
            lrs = list(lead.lrs)
            if self.mode.scale_lr and staleness > 1:
                lrs = [lr / staleness for lr in lrs]
            norm_type = lead.norm_type or 2.0
            # One push that neither clips nor scales is stepped from the frames its chunks arrived in; averaging,
            # unscaling and clipping write the gradient, so those rounds copy the frames to staging first.
            alone = len(pushes) == 1 and not closed.needs_commit

            def average_and_report() -> None:
                for grads, push in zip(closed.grads, pushes if not alone else ()):
                    for i, frame in push.kept.items():
                        self.table.view(grads, self.table.chunks[i]).copy_(frame)
                average_(closed.grads)
                if closed.needs_commit:
                    part, found = self.optimizer.report(closed.grads[0], closed.present, lead.inv_scale, norm_type)
                    closed.report = pb.RoundReport(round=closed.number, norm_part=part, found_inf=found)

            await self._run(average_and_report)
            clip_coef = 1.0
            if closed.needs_commit:
                self._notify()  # the members' PushPull calls send the report
                commit = await self._commits(closed)
                skip, clip_coef = commit.skip, commit.clip_coef or 1.0
            skip = skip or not due

            def step() -> None:
                before = None
                if closed.lead.hyperparams is not None:
                    before = self.optimizer.saved_hyperparams()
                    self.optimizer.set_hyperparams(closed.lead.hyperparams)
                try:
                    if not skip:
                        bounds = [p.grad_bound for p in pushes]
                        bound = None if None in bounds else average_bound(bounds, lead.inv_scale)
                        self.optimizer.apply(closed.grads[0], closed.present, lrs, clip_coef,
                                             self.config.reject_nonfinite, grad_bound=bound,
                                             unit_grads=pushes[0].kept if alone else None)
                except BaseException:
                    if before is not None:  # a refused round changes nothing: its hyperparameters neither
                        self.optimizer.set_hyperparams(before)
                    raise
                if closed.arenas[0] is not None and due:  # (a stream batch the shard holds changes no buffer)
                    self.buffers.copy_(closed.arenas[0])  # the lowest worker id's buffers, as DDP broadcasts rank 0's
                self.snapshot_version = self.version + 1  # read by snapshots on this (compute) thread

            started = time.perf_counter()
            await self._run(step)
            update_seconds = time.perf_counter() - started
        except RoundRefused as exc:
            where = f" at {self.table.describe(exc.key)}" if exc.key >= 0 else ""
            self._refuse(closed, InvalidArgument(
                f"round {closed.number} was refused: {exc.reason}{where}; the shard's parameters and optimizer "
                f"state are unchanged and it collects round {closed.number} again"
            ))
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                log.exception("shard %d: applying round %d failed", self.config.shard_index, closed.number)
            self._refuse(closed, Unavailable(
                f"shard {self.config.shard_index} failed to apply round {closed.number}; see its log"
            ))
            raise
        else:
            if due:
                self.positions.advance("dense", spans)
            self.round_completed(closed.number, closed.members, staleness, update_seconds, skip)
        finally:
            for grads, arena in zip(closed.grads, closed.arenas):
                self._give_back(grads, arena)
            for w in workers:
                self.pushed.pop(w, None)
            self.applying, self.closed = False, None
            self._notify()
            if not self.mode.synchronous:  # the next queued push, after the calls waiting for a gap between applies
                asyncio.get_running_loop().call_soon(self.maybe_apply)

    def _check_agreement(self, closed: Closed, pushes: list[_Pushed], workers: list[str]) -> None:
        """Every member must scale and clip alike (else some would not take part in the commit exchange), and step
        with the same learning rates and hyperparameters (``checks.disagreement``).

        Raises:
            RoundRefused: naming the members and what differs; nothing of the round is applied.
        """
        lead = closed.lead
        def options(p: _Pushed) -> tuple:
            t = p.trailer
            return p.scaled, t.inv_scale, t.max_grad_norm, (t.norm_type or 2.0) if t.max_grad_norm else None

        for w, p in zip(workers, pushes):
            t, lt = p.trailer, lead.trailer
            if options(p) != options(lead):
                raise RoundRefused(
                    f"workers {shown(workers[0])} and {shown(w)} push with different loss scales or clipping "
                    f"(inv_scale {lt.inv_scale} vs {t.inv_scale}, max_grad_norm {lt.max_grad_norm} vs "
                    f"{t.max_grad_norm}, norm_type {lt.norm_type} vs {t.norm_type}): every worker must use the same "
                    "GradScaler state, max_grad_norm and norm_type"
                )
        why = checks.disagreement(workers, [list(p.trailer.lrs) for p in pushes], [p.hyperparams for p in pushes],
                                  self.optimizer.hyperparams())
        if why is not None:
            raise RoundRefused(why)

    def _refuse(self, closed: Closed, error: Exception) -> None:
        log.warning("shard %d: %s", self.config.shard_index, error)
        self.pushes_dropped += len(closed.members)
        for m in closed.members:
            m.failed, m.last_round = (closed.number, error), -1

    # ------------------------------------------------------------------ leave
    def drop(self, member: Member, apply: bool = True) -> None:
        """``member`` left: its push of the open round no longer counts, its staging is freed.

        Args:
            apply: close the round now if everybody left has pushed; False when the
                caller drops several members at once (then it calls :meth:`maybe_apply`).
        """
        applying_it = self.closed is not None and member in self.closed.members
        if not applying_it and self.pushed.pop(member.worker_id, None) is not None:
            self.pushes_dropped += 1  # (a closed round being applied still counts it: it stays in ``pushed``)
        self.streamed.dropped(member)
        if member.pushing is not None:  # its stream's staging comes back when the task unwinds
            stop_call(member.pushing, Aborted(f"worker {shown(member.worker_id)} left during its push"))
        self._give_back(member.staging, member.arena)
        member.staging = member.arena = None
        del self._spare[max(1, len(self._members)):]
        del self._spare_arenas[max(1, len(self._members)):]
        if self.closed is not None:
            self._check_committed(self.closed)  # the round no longer waits for its commit
        if apply:
            self.maybe_apply()

"""The shard's state: parameters, optimizer state, membership and BSP rounds.

A thin gRPC servicer (``service.py``) adapts this class; it knows nothing of
gRPC. One ``threading.Condition`` (``self._cond``) guards every field below
it; the only blocking waits are ``wait_version`` (on that condition) and the
reads of incoming frames in ``init``/``push``, which happen without the
lock, into buffers no other thread touches.

Bulk synchronous rounds (Valiant, "A bridging model for parallel
computation", CACM 1990): round ``r`` completes once every member has pushed
its gradients for ``r`` and at least ``min_workers`` workers have joined;
the gradients are averaged (summed in worker-id order, so the result does
not depend on arrival order), the optimizer steps once over each flat
buffer, and the version becomes ``r + 1``.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from shardps.proto import shardps_pb2 as pb
from shardps.proto.codec import TORCH_DTYPES
from shardps.proto.optim import OptimizerSpecError, check_shardable
from shardps.proto.plan import PartitionPlan
from shardps.server.chunks import ChunkTable
from shardps.server.config import ShardConfig
from shardps.server.errors import Aborted, DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable
from shardps.server.optimizer import ShardOptimizer

log = logging.getLogger(__name__)


@dataclass
class _Member:
    worker_id: str
    staging: dict[int, torch.Tensor] | None = None  # this worker's gradients of the open round
    pushing: bool = False
    last_round: int = -1  # last round whose push was accepted


@dataclass(frozen=True)
class JoinResult:
    initialise: bool
    version: int
    members: int


@dataclass
class _Counters:
    push_bytes: int = 0
    pull_bytes: int = 0
    rounds: int = 0


def _hyperparams_without_lr(spec: pb.OptimizerSpec) -> list[dict]:
    """Each group's hyperparameters except ``lr`` (schedulers change it between joins).

    Raises:
        InvalidArgument: a group's hyperparameters are not a JSON object.
    """
    out = []
    for g, text in enumerate(spec.group_hyperparams_json):
        try:
            hp = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"hyperparameters of param group {g} are not valid JSON: {exc}") from exc
        if not isinstance(hp, dict):
            raise InvalidArgument(f"hyperparameters of param group {g} must be a JSON object")
        hp.pop("lr", None)
        out.append(hp)
    return out


class ShardStore:
    """Parameters and optimizer state of one shard, with BSP rounds over its members.

    Tensors: one flat fp32 buffer per param group (``ChunkTable.group_sizes``
    elements); a staging buffer of the same shape per member while it pushes.
    """

    def __init__(self, config: ShardConfig) -> None:
        self.config = config
        self._cond = threading.Condition()
        self._closing = False
        self._table: ChunkTable | None = None
        self._spec: pb.OptimizerSpec | None = None
        self._params: dict[int, torch.Tensor] = {}
        self._optimizer: ShardOptimizer | None = None
        self._initialiser: str | None = None
        self._initialised = False
        self._members: dict[str, _Member] = {}
        self._pushed: dict[str, list[float]] = {}  # worker -> lrs, for the open round
        self.version = 0
        self._counters = _Counters()

    # ----------------------------------------------------------------- join
    def join(self, worker_id: str, plan_spec: pb.PlanSpec, fingerprint: str, spec: pb.OptimizerSpec) -> JoinResult:
        """Admit ``worker_id``; the first join fixes the plan and the optimizer.

        Raises:
            InvalidArgument: empty worker id, a malformed plan or optimizer, chunks too big.
            FailedPrecondition: the plan or optimizer differs from the shard's.
        """
        if not worker_id:
            raise InvalidArgument("worker_id must be a non-empty string")
        try:
            plan = PartitionPlan.from_proto(plan_spec)
            check_shardable(spec.class_name)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc
        if plan.fingerprint != fingerprint:
            raise InvalidArgument(
                f"plan fingerprint {fingerprint!r} does not match the plan sent ({plan.fingerprint!r}); "
                "worker and shard run different shardps versions"
            )
        cfg = self.config
        if plan.num_shards != cfg.num_shards:
            raise FailedPrecondition(
                f"the worker's plan has {plan.num_shards} shard(s) but this is shard {cfg.shard_index} "
                f"of {cfg.num_shards}: pass the addresses of all {cfg.num_shards} shards, in shard order"
            )
        if plan.chunk_bytes > cfg.max_chunk_bytes:
            raise InvalidArgument(
                f"chunk_bytes {plan.chunk_bytes} exceeds the {cfg.max_chunk_bytes} this shard accepts; "
                "use smaller chunks or start the shard with a larger --max-message-bytes"
            )
        with self._cond:
            self._check_open()
            if self._table is None:
                table = ChunkTable(plan, cfg.shard_index)
                params = table.allocate()
                try:
                    optimizer = ShardOptimizer(spec, params)
                except OptimizerSpecError as exc:
                    raise InvalidArgument(str(exc)) from exc
                self._table, self._spec, self._params, self._optimizer = table, spec, params, optimizer
                log.info(
                    "shard %d: plan %s, %d chunks, %d elements, optimizer %s",
                    cfg.shard_index, plan.fingerprint, len(table.chunks), table.numel, spec.class_name,
                )
            else:
                self._check_plan(fingerprint)
                if spec.class_name != self._spec.class_name or _hyperparams_without_lr(spec) != _hyperparams_without_lr(
                    self._spec
                ):
                    raise FailedPrecondition(
                        f"worker {worker_id!r} uses optimizer {spec.class_name} {list(spec.group_hyperparams_json)} "
                        f"but this shard runs {self._spec.class_name} {list(self._spec.group_hyperparams_json)}; "
                        "every worker must build the same optimizer"
                    )
            initialise = not self._initialised and self._initialiser in (None, worker_id)
            if initialise:
                self._initialiser = worker_id
            self._members.setdefault(worker_id, _Member(worker_id))
            log.info("shard %d: worker %s joined (%d members)", cfg.shard_index, worker_id, len(self._members))
            return JoinResult(initialise, self.version, len(self._members))

    def _check_open(self) -> None:
        if self._closing:
            raise Unavailable(f"shard {self.config.shard_index} is shutting down")

    def _check_plan(self, fingerprint: str) -> None:
        if self._table is None:
            raise FailedPrecondition("no worker has joined this shard yet: call Join first")
        if fingerprint != self._table.plan.fingerprint:
            raise FailedPrecondition(
                f"partition plan fingerprint {fingerprint!r} differs from this shard's "
                f"{self._table.plan.fingerprint!r}: every worker must use the same model, "
                "parameter names, param groups, number of shards and chunk_bytes"
            )

    def _member(self, worker_id: str) -> _Member:
        member = self._members.get(worker_id)
        if member is None:
            raise FailedPrecondition(f"worker {worker_id!r} is not a member of this shard: call Join first")
        return member

    # ----------------------------------------------------------------- init
    def init(self, header: pb.RoundHeader, raw_frames: Iterable[bytes]) -> int:
        """Receive the initial parameters from the worker that Join told to initialise.

        Raises:
            FailedPrecondition: not that worker, already initialised, plan mismatch.
            InvalidArgument: a bad or missing chunk (the shard stays uninitialised).
        """
        with self._cond:
            self._check_open()
            self._check_plan(header.plan_fingerprint)
            if self._initialised or self._initialiser != header.worker_id:
                raise FailedPrecondition(
                    f"worker {header.worker_id!r} may not initialise this shard "
                    f"(initialised={self._initialised}); pull the parameters instead"
                )
            table = self._table
        staged = table.allocate()  # all-or-nothing: params change only if every chunk is good
        received = table.receive(raw_frames, 0, staged, what="init")
        with self._cond:
            for g, p in self._params.items():
                p.copy_(staged[g])
            self._initialised = True
            self._counters.push_bytes += received
            self._cond.notify_all()
            return self.version

    # ----------------------------------------------------------------- push
    def push(self, header: pb.RoundHeader, raw_frames: Iterable[bytes]) -> int:
        """Accept one worker's gradients for round ``header.round``; apply the round if it is complete.

        Idempotent: a second push of a round already accepted from this
        worker is ignored. Returns the shard version after the push.

        Raises:
            FailedPrecondition: not joined, not initialised, plan mismatch, or a round
                other than the open one.
            InvalidArgument: bad frames, missing chunks, wrong number of lrs, NaN/Inf
                gradients; the shard's state is unchanged.
            Aborted: another push of this worker is in flight, or the round closed without it.
        """
        worker, rnd = header.worker_id, header.round
        with self._cond:
            self._check_open()
            self._check_plan(header.plan_fingerprint)
            member = self._member(worker)
            if not self._initialised:
                raise FailedPrecondition("this shard has not been initialised yet: pull version 0 first")
            if member.last_round == rnd or worker in self._pushed:
                return self.version  # a retry of an accepted push: never double-count
            if rnd != self.version:
                raise FailedPrecondition(
                    f"worker {worker!r} pushed round {rnd} but the shard is collecting round {self.version}: "
                    f"pull version {self.version} and push round {self.version}"
                )
            if len(header.lrs) != self._table.plan.num_groups:
                raise InvalidArgument(
                    f"push carries {len(header.lrs)} learning rates for {self._table.plan.num_groups} param group(s)"
                )
            if member.pushing:
                raise Aborted(f"another push from worker {worker!r} is in progress")
            member.pushing = True
            if member.staging is None:
                member.staging = self._table.allocate()
            table, staging = self._table, member.staging
        try:  # without the lock: only this call writes this member's staging buffers
            received = table.receive(
                raw_frames, rnd, staging, what=f"push of round {rnd}", reject_nonfinite=self.config.reject_nonfinite
            )
        finally:
            with self._cond:
                member.pushing = False
        with self._cond:
            self._check_open()
            if self._members.get(worker) is not member or self.version != rnd:
                raise Aborted(f"round {rnd} closed without worker {worker!r}'s push (it left or was removed)")
            self._pushed[worker] = list(header.lrs)
            member.last_round = rnd
            self._counters.push_bytes += received
            self._maybe_apply()
            return self.version

    def _maybe_apply(self) -> None:
        """Apply the open round if every member has pushed. Caller holds ``self._cond``."""
        if not self._pushed or len(self._members) < self.config.min_workers:
            return
        if any(w not in self._pushed for w in self._members):
            return
        workers = sorted(self._pushed)
        lrs = self._pushed[workers[0]]
        if any(self._pushed[w] != lrs for w in workers):
            log.warning("round %d: workers pushed different learning rates; using %s's", self.version, workers[0])
        # Average in place in the first worker's staging buffers (rewritten by its next push).
        grads = self._members[workers[0]].staging
        if len(workers) > 1:
            for g, grad in grads.items():
                for w in workers[1:]:
                    grad.add_(self._members[w].staging[g])
                grad.mul_(1.0 / len(workers))
        self._optimizer.step(grads, lrs)
        self._pushed.clear()
        self.version += 1
        self._counters.rounds += 1
        self._cond.notify_all()

    # ----------------------------------------------------------------- pull
    def wait_version(self, min_version: int, timeout: float | None) -> int:
        """Block until the shard is initialised and at ``min_version`` or later.

        Args:
            timeout: seconds; capped at ``config.max_wait_seconds``.

        Raises:
            DeadlineExceeded: not reached in time (the message names who has not pushed).
            Unavailable: the shard is shutting down.
        """
        limit = self.config.max_wait_seconds if timeout is None else min(timeout, self.config.max_wait_seconds)
        with self._cond:  # blocking wait on the condition
            done = self._cond.wait_for(
                lambda: self._closing or (self._initialised and self.version >= min_version), timeout=limit
            )
            self._check_open()
            if not done:
                missing = sorted(w for w in self._members if w not in self._pushed)
                raise DeadlineExceeded(
                    f"shard {self.config.shard_index} did not reach version {min_version} within {limit:.1f}s "
                    f"(version {self.version}, initialised={self._initialised}, "
                    f"{len(self._members)}/{self.config.min_workers} workers joined, "
                    f"round {self.version} still waits for {missing})"
                )
            return self.version

    def pull(self, version: int, dtype_code: int, fingerprint: str) -> Iterator[bytes]:
        """Frames of every chunk at exactly ``version`` (call ``wait_version`` first).

        Raises:
            FailedPrecondition: plan mismatch.
            InvalidArgument: unsupported wire dtype.
            Aborted: the shard moved past ``version`` during the pull (pull again).
        """
        dtype = TORCH_DTYPES.get(dtype_code or pb.FLOAT32)
        if dtype is None:
            raise InvalidArgument(f"unsupported pull dtype {dtype_code}")
        with self._cond:
            if fingerprint:
                self._check_plan(fingerprint)
            table = self._table

        def check() -> None:
            self._check_open()
            if self.version != version:
                raise Aborted(f"shard moved from version {version} to {self.version} during the pull; pull again")

        sent = 0
        for frame in table.frames(self._params, version, dtype, self._cond, check):
            sent += len(frame)
            yield frame
        with self._cond:
            self._counters.pull_bytes += sent

    # ----------------------------------------------------------------- leave, stats, close
    def leave(self, worker_id: str) -> int:
        """Remove ``worker_id``; rounds stop waiting for it. Returns the members left."""
        with self._cond:
            member = self._members.pop(worker_id, None)
            if member is not None:
                self._pushed.pop(worker_id, None)
                if self._initialiser == worker_id and not self._initialised:
                    self._initialiser = None
                log.info("shard %d: worker %s left (%d members)", self.config.shard_index, worker_id, len(self._members))
                self._maybe_apply()
                self._cond.notify_all()
            return len(self._members)

    def stats(self) -> pb.StatsReply:
        with self._cond:
            state_bytes = self._optimizer.state_bytes() if self._optimizer else 0
            return pb.StatsReply(
                shard_index=self.config.shard_index,
                num_shards=self.config.num_shards,
                version=self.version,
                members=sorted(self._members),
                min_workers=self.config.min_workers,
                initialised=self._initialised,
                plan_fingerprint=self._table.plan.fingerprint if self._table else "",
                optimizer=self._spec.class_name if self._spec else "",
                num_chunks=len(self._table.chunks) if self._table else 0,
                param_bytes=4 * (self._table.numel if self._table else 0),
                optimizer_state_bytes=state_bytes,
                push_bytes_total=self._counters.push_bytes,
                pull_bytes_total=self._counters.pull_bytes,
                pushed=sorted(self._pushed),
            )

    def close(self) -> None:
        """Refuse new work and wake every waiting pull (they fail with Unavailable)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()

"""``DistributedOptimizer``: wraps a plain ``torch.optim`` optimizer so that the shards run it.

The wrapper follows the Horovod/BytePS optimizer wrappers (Sergeev & Del
Balso, "Horovod", 2018; Jiang et al., "BytePS", OSDI 2020): gradient hooks
start the communication while backward still runs, ``synchronize()`` waits
for it, and ``step()`` leaves the parameters updated in place. Unlike them,
the update itself runs on the shards, which hold the optimizer state (the
local optimizer never allocates any), and everything the user can change
between ``backward()`` and ``step()`` is part of the round: clipping and
loss scaling act on the averaged gradient through the wrapper, learning
rates and every other hyperparameter are read at ``step()``, and a gradient
edited after its push started is an error instead of a race.

Each step opens one PushPull stream per shard (``shardps.worker.pipeline.streams``);
joining and initialising the shards follows ``shardps.worker.session.join``.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import uuid
from collections.abc import Iterable

import torch

from shardps.proto import shardps_pb2 as pb
from shardps.common.codec import FLOAT_DTYPES, wire_dtype
from shardps.common.optim import optimizer_spec
from shardps.common.memory import retain_freed_memory
from shardps.common.addresses import parse_servers
from shardps.common.plan import Chunk, PartitionPlan, keys_from_named_parameters
from shardps.worker import optimizer_state as optimizer_state
from shardps.worker.job import JobView, check_resume
from shardps.worker.config import ConsistencyOptions, ObservabilityOptions, WireOptions, moved_keywords_error
from shardps.worker.session.client import ShardClient
from shardps.worker.pipeline.commit import RoundOptions, await_decision, record_found_inf
from shardps.worker.pipeline.own import OwnGradient
from shardps.worker.session.join import JoinPlan, join_job
from shardps.worker.session.recovery import Recovery
from shardps.worker.session.retry import RetryPolicy
from shardps.worker.pipeline.overlap import ForwardWaits
from shardps.worker.session.leases import Leases
from shardps.worker.session.exit import DaemonPool, close_at_exit
from shardps.worker.session.waits import WaitWatcher
from shardps.worker.metrics import WorkerMetrics
from shardps.worker.pipeline.streams import GradientEditedError, ParameterSink, Round
from shardps.worker.pipeline.marks import StreamMarks
from shardps.worker.pipeline.steps import RoundSteps
from shardps.worker.embedding.modules import is_table_handle
from shardps.worker.embedding.specs import check_sparse_options
from shardps.worker.embedding.tables import SparseTables
from shardps.worker.pipeline.tensors import HyperparamChanges, buffer_infos, static_digest

__all__ = ["DistributedOptimizer", "GradientEditedError", "default_worker_id"]

log = logging.getLogger(__name__)


def default_worker_id() -> str:
    """A worker id unique to this process: ``host-pid-random``."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class DistributedOptimizer(StreamMarks, RoundSteps, JobView):
    """Run ``optimizer``'s updates on the shards (sync, async or ssp), with torch.optim's semantics.

    The common case is one line::

        dist = DistributedOptimizer(opt, model.named_parameters(), servers="host:port,host:port")

    Args:
        optimizer: a ``torch.optim`` optimizer (SGD, Adam, AdamW, Adagrad or
            RMSprop). Its class and param groups go to the shards; every
            hyperparameter is read at each ``step()`` (LR schedulers, OneCycleLR's
            momentum, edits by hand all work); its own ``step`` is never called and
            it never allocates state. Its ``state_dict``/``load_state_dict`` are
            this wrapper's (the state lives on the shards).
        named_parameters: ``model.named_parameters()``; the names are the keys.
            Parameters not in ``optimizer`` are never sent nor touched; every worker
            must hold the same values for them (the shards compare a digest).
        servers: shard addresses ``host:port``, in shard-index order: a list, or one
            comma-separated string (``shardps.common.addresses.parse_servers``).
        worker_id: stable id of this worker (default: host-pid-random), 1 to 256
            printable characters. Two live processes may not share one: the
            second is refused with ALREADY_EXISTS. The process is told apart by
            ``session``, a random token made here and sent with every call.
        model: the module that owns the parameters. When given, its buffers are
            synchronised (see ``broadcast_buffers``) and ``step()`` returns as
            soon as the gradients are handed to the network: the new parameters
            stream in while the next forward runs, each submodule waiting for
            its own. Read parameters outside ``model``'s forward only after
            ``synchronize()``.
        named_buffers: the buffers to synchronise when ``model`` is not given
            (``model.named_buffers()``).
        broadcast_buffers: before every forward, every worker holds the lowest
            worker id's buffers of the previous step, as DDP's
            ``broadcast_buffers=True`` (default) gives every rank rank 0's.
        backward_passes_per_step: backward calls accumulated before gradients are pushed.
        max_grad_norm: clip the averaged gradient to this total norm over the
            whole model before the update, exactly as ``clip_grad_norm_`` after
            DDP's averaging (do not call ``clip_grad_norm_`` yourself). The norm of
            each step is ``last_grad_norm``. In async and ssp modes each push is
            applied alone, so this worker clips its own gradient before pushing it
            (``shardps.worker.pipeline.own``; pushed at ``step()``, not from hooks).
        norm_type: the norm's order for ``max_grad_norm`` (2.0; ``inf`` allowed).
        grad_scaler: the ``torch.amp.GradScaler`` whose scaled loss you backward.
            The shards unscale the averaged gradient, skip the update on every
            shard if it is not finite, and ``scaler.update()`` sees the same
            verdict on every worker. Call ``dist.step()``, not ``scaler.step``. In
            async and ssp modes this worker unscales and checks its own gradient
            and on Inf/NaN skips its step alone (an empty push:
            ``shardps.worker.pipeline.own``). ``scaler.unscale_``/``scaler.step`` on
            this wrapper or the optimizer it wraps raise, naming this argument.
        push_during_backward: push each gradient from its hook while backward
            runs (default). With False, everything is pushed at ``step()``, so
            gradients may be edited freely in between (no overlap).
        consistency: sync (default), async or ssp rounds
            (:class:`~shardps.worker.config.ConsistencyOptions`: ``mode``,
            ``staleness``, ``scale_lr_by_staleness``). The first worker fixes the
            job's mode; a worker with another one is refused.
        wire: chunk size, wire types, checksums, message limit, timeouts, retries
            and TLS (:class:`~shardps.worker.config.WireOptions`: ``chunk_bytes``,
            ``push_dtype``, ``pull_dtype``, ``checksum``, ``max_message_bytes``,
            ``rpc_timeout``, ``connect_timeout``, ``retry_seconds``, ``security``).
        sparse_optimizer: the optimizer of the model's sharded embedding tables
            (``shardps.worker.ShardedEmbedding``/``ShardedEmbeddingBag``): ``torch.optim.SGD``,
            ``Adagrad``, ``SparseAdam`` or ``shardps.worker.RowWiseAdagrad`` over their ``handle``
            placeholders; the rows and their optimizer state stay on the shards
            (``shardps.worker.embedding``). Sync mode only; not with ``max_grad_norm`` or ``grad_scaler``.
        observability: Prometheus metrics and the membership callback
            (:class:`~shardps.worker.config.ObservabilityOptions`: ``metrics_port``,
            ``metrics_host``, ``metrics_registry``, ``on_membership_change``).
            ``self.metrics`` records the metrics whether or not they are served;
            ``self.metrics_port`` is the port bound (None: not served).
        resume: what to do when the shards already hold this job past version 0 (a
            script run again against the same shards, a worker restarted or joining
            late): ``"allow"`` (default) continues it, from the shards' parameters,
            and logs a WARNING ``continuing job J at version V; `shardps reset`
            starts over``; ``"refuse"`` raises ``RunningJobError`` instead and
            leaves the shards. A job at version 0 (a worker of the same run started
            it moments ago) is joined either way. ``"refuse"`` is for scripts that
            must start from scratch: with it, every worker of a run must join before
            the first round (shards started with ``--min-workers`` = the workers).

    A keyword that moved into a group (``mode=``, ``chunk_bytes=``, ``metrics_port=``...)
    raises a ``TypeError`` naming the group to put it in. An optimizer never
    closed is closed at interpreter exit (``shardps.worker.session.exit``).

    ``last_timeline`` is the timeline of the last round whose pull landed,
    in seconds from the step's first push (its first gradient hook):
    ``step_called`` (``step()`` closed the pushes), ``push_end`` (the last
    shard's push sent), ``first_pull`` and ``last_pull`` (the first and last
    frame received from any shard); None before the first round. In a
    streamed round ``first_pull`` comes before ``push_end``. ``last_shard_timeline``: the same
    per shard, with ``push_start`` (None: nothing sent or received); async/ssp workers push
    their shards one after another (``shardps.worker.pipeline.streams.staggered_order``).

    Parameters must be contiguous tensors of a floating dtype; they may live
    on CPU or CUDA (chunks cross the wire from CPU memory).

    Raises:
        TypeError: a keyword this class does not take (a moved one names its group),
            or an option group of the wrong type.
        ValueError: bad arguments (the message names the fix).
        shardps.worker.job.RunningJobError: ``resume="refuse"`` and the job is past version 0.
        shardps.common.optim.OptimizerSpecError: an optimizer the shards cannot run.
        ConnectionError: a shard did not answer.
        ShardRpcError: a shard refused to join (e.g. a plan mismatch).
        RuntimeError: the metrics port could not be bound.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.Tensor]],
        *,
        servers: list[str] | str,
        worker_id: str | None = None,
        model: torch.nn.Module | None = None,
        named_buffers: Iterable[tuple[str, torch.Tensor]] | None = None,
        broadcast_buffers: bool = True,
        backward_passes_per_step: int = 1,
        max_grad_norm: float | None = None,
        norm_type: float = 2.0,
        grad_scaler: torch.amp.GradScaler | None = None,
        push_during_backward: bool = True,
        consistency: ConsistencyOptions = ConsistencyOptions(),
        wire: WireOptions = WireOptions(),
        observability: ObservabilityOptions = ObservabilityOptions(),
        sparse_optimizer: torch.optim.Optimizer | None = None,
        resume: str = "allow",
        **legacy,
    ) -> None:
        if legacy:
            raise moved_keywords_error(legacy)
        check_resume(resume)
        for name, value, cls in (("consistency", consistency, ConsistencyOptions), ("wire", wire, WireOptions),
                                 ("observability", observability, ObservabilityOptions)):
            if not isinstance(value, cls):
                raise TypeError(f"{name}= takes a shardps.worker.config.{cls.__name__}(...), "
                                f"got {type(value).__name__}")
        servers = parse_servers(servers)
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        self._consistency, self._wire, self._observability = consistency, wire, observability
        self.mode = consistency.to_proto()
        self._options = RoundOptions(max_grad_norm=max_grad_norm, norm_type=norm_type, grad_scaler=grad_scaler)
        # async/ssp apply each push alone: this worker clips and unscales its own gradient (pipeline/own.py)
        self._own = OwnGradient(self._options) if consistency.mode != "sync" and self._options.needs_commit else None
        self._pushed_options = RoundOptions() if self._own is not None else self._options
        named = [(n, p) for n, p in named_parameters if not is_table_handle(p)]  # tables: sparse_optimizer
        check_sparse_options(optimizer, sparse_optimizer, model, consistency.mode, self._options)
        for name, p in named:
            if not p.is_floating_point() or not p.is_contiguous():
                raise ValueError(f"parameter {name!r} must be a contiguous floating-point tensor")
        self._optimizer = optimizer
        self._spec = optimizer_spec(optimizer)
        keys, outside = keys_from_named_parameters(named, optimizer.param_groups)
        if broadcast_buffers and named_buffers is None and model is not None:
            named_buffers = model.named_buffers()
        buffers, self._buffers = buffer_infos(named_buffers if broadcast_buffers and named_buffers is not None else ())
        self.plan = PartitionPlan.build(keys, num_shards=len(servers), chunk_bytes=wire.chunk_bytes, buffers=buffers)
        self.worker_id, self.session = worker_id or default_worker_id(), uuid.uuid4().hex
        self._push_dtype, self._pull_code = FLOAT_DTYPES[wire_dtype(wire.push_dtype)], wire_dtype(wire.pull_dtype)
        self._passes, self._checksum = backward_passes_per_step, wire.checksum
        if wire.retain_freed_memory:  # chunk-sized buffers reused, not faulted in afresh each round
            retain_freed_memory()
        self._streamed = wire.streamed and consistency.mode == "sync"
        named_map = dict(named)
        self._params = {k.key: named_map[k.key] for k in keys}
        self._index = {k.key: i for i, k in enumerate(keys)}
        self._key_of = {id(p): name for name, p in self._params.items()}
        self._chunks_of: dict[str, list[Chunk]] = {}
        for c in (*self.plan.chunks, *self.plan.buffer_chunks):
            self._chunks_of.setdefault(c.key, []).append(c)
        self._sink = ParameterSink(self.plan, self._params, self._buffers)
        self._counts = dict.fromkeys(self._params, 0)
        self._chunk_counts = {key: len(chunks) for key, chunks in self._chunks_of.items()}
        self._hyperparams = HyperparamChanges(optimizer)
        self._round: Round | None = None  # the round being pushed
        self._pulling: Round | None = None  # the round whose parameters are still arriving
        self._rpc_timeout = wire.rpc_timeout
        self._diverged = ""  # set when a round was applied by some shards and failed by others
        self._lock = threading.Lock()  # guards self._round between hooks and step()
        self._pool = DaemonPool(len(servers), thread_name_prefix="shardps-pull")  # never holds the exit
        self._clients: list[ShardClient] = []
        self._hooks = []
        self._waits: ForwardWaits | None = None
        self._routed: dict | None = None  # the wrapped optimizer's methods while they are routed here
        self._leases: Leases | None = None
        self._recovery: Recovery | None = None
        self.metrics = WorkerMetrics(observability.metrics_registry)
        self.metrics_port: int | None = None
        policy = RetryPolicy(total_seconds=wire.retry_seconds, on_retry=self.metrics.retried)
        self.versions: list[int] = [0] * len(servers)
        self.last_grad_norm = math.nan
        self.last_step_skipped = False
        self.last_timeline = self.last_shard_timeline = None  # dict[str, float]; list of dict[str, float | None]
        self.resumed = False  # the shards already held this job, past version 0, when this worker joined
        self._watcher: WaitWatcher | None = None
        self._job_id = ""
        self._tables: SparseTables | None = None
        # state loaded into the wrapped optimizer before wrapping: carried to the shards after joining
        # (JobView._carry_initial_state); the local optimizer itself never holds state
        saved = optimizer.state_dict() if optimizer.state else None
        optimizer.state.clear()
        self._exit_key = close_at_exit(self._close_at_exit)  # a script that never calls close() leaves at exit
        try:
            if observability.metrics_port is not None:
                self.metrics_port = self.metrics.serve(observability.metrics_host, observability.metrics_port)
            self._clients = list(self._pool.map(
                lambda ia: ShardClient(ia[1], index=ia[0], rpc_timeout=wire.rpc_timeout,
                                       connect_timeout=wire.connect_timeout, max_message_bytes=wire.max_message_bytes,
                                       retry=policy, security=wire.security, stream_process=wire.stream_processes),
                enumerate(servers)))
            join = JoinPlan(worker_id=self.worker_id, session=self.session, plan=self.plan.to_proto(),
                            fingerprint=self.plan.fingerprint, optimizer=self._spec,
                            static_digest=static_digest(named_map, outside), patience=wire.connect_timeout,
                            mode=self.mode)
            def start_leases(replies: list) -> None:  # heartbeats from the first Join: the Init and the
                if self._leases is None:  # first pull may take longer than a lease on a slow link
                    self._leases = Leases(self._clients, self.worker_id, self.session,
                                          min(r.lease_seconds or 10.0 for r in replies),
                                          observability.on_membership_change, joining=True)

            joined = join_job(self._clients, self._pool, join, self._init_frames, self._initial_pull,
                              on_joined=start_leases)
            self.versions = joined.versions
            self._recovery = Recovery(self._clients, join, joined.job_id, joined.incarnations, self._initial_pull)
            self._leases.joined(self._recovery)
            self.resumed = min(self.versions) > 0
            self._job_id = joined.job_id
            self._member_number = joined.member_number  # where its async/ssp pushes start (staggered_order)
            self._announce_join(joined.initialised, resume)
            self._tables = SparseTables(self._clients, self.worker_id, self.session, sparse_optimizer, model,
                                        self._rejoin_shard, wire.max_message_bytes,
                                        consistency.tables) if sparse_optimizer else None
            self._watcher = WaitWatcher(self._clients, mode=consistency.mode, staleness=consistency.staleness or 0,
                                        lease_seconds=joined.lease_seconds, on_wait=observability.on_wait)
        except BaseException:
            self._close_refused(saved)
            raise
        if push_during_backward and self._own is None:  # (own gradients are pushed whole, at step())
            for p in self._params.values():
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
        if model is not None:
            tensors = {id(t): k for k, t in (*self._params.items(), *self._buffers.items())}
            self._waits = ForwardWaits(model, tensors, lambda: self._pulling, self._finish_pull, wire.rpc_timeout)
        self._routed = optimizer_state.redirect(optimizer, self.state_dict, self.load_state_dict)
        try:
            self._carry_initial_state(saved, joined.initialised)
        except BaseException:
            self._close_refused(saved)
            raise

    def _rejoin_shard(self, shard: int) -> None:
        """Join shard ``shard`` again now (its sparse tables found this worker gone: it restarted); the training
        thread pulls its dense partition before the next step (``Recovery.readmit``)."""
        self._recovery.readmit(shard, "its sparse tables no longer knew this worker")

    # ------------------------------------------------------------ public API
    @property
    def param_groups(self) -> list[dict]:
        """The wrapped optimizer's param groups (attach LR schedulers to the wrapped optimizer)."""
        return self._optimizer.param_groups

    @property
    def version(self) -> int:
        """The parameter version the model holds once pending pulls land (the lowest over shards)."""
        self._finish_pull()
        return min(self.versions)

    def synchronize(self) -> None:
        """Wait until the parameters of every ``step()`` so far are in the model.

        Starts no round: gradients are pushed only by ``step()``. Waits for
        the last step's pull when ``model`` was given, and until every shard
        took the last step's table rows (``sparse_optimizer``). Blocks on the
        network.

        Raises:
            ShardRpcError: a shard refused the push or the pull (its message says why).
            RuntimeError: a shard answered outside the protocol.
        """
        self._finish_pull()
        if self._tables is not None:
            self._tables.wait_sent()

    def step(self, closure=None):
        """Finish this round: push the gradients, pull the updated parameters (and buffers) into the model.

        Parameters whose ``grad`` is None are not sent, and the shards leave
        them and their optimizer state alone (unless another worker had a
        gradient for them: then it is averaged with this worker's zeros, as DDP
        does). Without ``model`` this blocks until the parameters are in
        place; with ``model`` it returns once the gradients are handed off.
        Sharded tables' rows are handed off too: the next lookup, export or
        ``synchronize()`` waits until every shard took them and raises a
        refusal of that push.

        Returns:
            ``closure()``'s loss, if a closure is given.

        Raises:
            GradientEditedError: a gradient changed after its push started.
            ShardRpcError: a shard refused the push or the pull (its message says why); a shard refused the
                previous step's table rows.
            RuntimeError: a shard answered outside the protocol, or a round was
                skipped for overflow without a GradScaler.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # the tables' push is checked before anything is sent, and sent after the dense round is closed, so
        # the shards apply the (small) dense round while the rows are on their way
        rows = self._tables.prepare() if self._tables is not None else None
        own = self._own
        self._start_pull(None if own is None else own.prepare({k: p.grad for k, p in self._params.items()}))
        if rows is not None:
            self._tables.send(rows)  # on its way: the next forward's rows wait until every shard took it
        rnd = self._pulling
        if rnd.decide is not None:
            self.last_step_skipped = await_decision(rnd, self._options, self._optimizer, self._finish_pull)
        if own is not None:  # async/ssp with clipping or a GradScaler: this worker decided alone
            self.last_grad_norm, self.last_step_skipped = own.norm, own.skipped
            if self._options.scaled:
                record_found_inf(self._options.grad_scaler, self._optimizer, own.skipped)
            elif own.skipped:
                self._finish_pull()
                raise RuntimeError(f"this worker's gradient is not finite (total norm {own.norm}): its step was "
                                   "skipped (an empty push); lower the learning rate or the loss, or train with a "
                                   "GradScaler")
        if self._waits is None:
            self._finish_pull()
        self.metrics.step_finished()
        # Tell LR schedulers attached to the wrapped optimizer that a step happened.
        self._optimizer._opt_called = True
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients, like ``torch.optim.Optimizer.zero_grad``.

        Raises:
            RuntimeError: gradients of this step are still being pushed (call step() first).
        """
        if self._round is not None:
            raise RuntimeError("zero_grad() while gradients are being pushed: call step() first")
        rnd = self._pulling
        if rnd is not None and not set_to_none:  # zeroing in place: wait until the pushes copied the gradients
            for event in rnd.sent:
                while not event.wait(0.05):
                    if rnd.failed() is not None:
                        self._finish_pull()
        self._optimizer.zero_grad(set_to_none=set_to_none)
        if self._tables is not None:
            self._tables.zero_grad()

    def state_dict(self) -> dict:
        """The optimizer state from the shards, in ``torch.optim``'s format (loads into a plain optimizer).

        Raises:
            ShardRpcError: a shard refused or failed.
        """
        self._finish_pull()
        if not self._clients:
            raise RuntimeError("this DistributedOptimizer is closed: its optimizer state lives on the shards, read it "
                               "before close()")
        request = pb.StateRequest(worker_id=self.worker_id, session=self.session,
                                  plan_fingerprint=self.plan.fingerprint)
        return optimizer_state.gather(self._clients, self._pool, request, self.plan, self._optimizer, self._params)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a ``torch.optim`` state dict (from a plain optimizer or :meth:`state_dict`) onto the shards.

        Call it between rounds (before the first ``step()``, typically); every
        worker may call it with the same checkpoint. Hyperparameters in it
        apply from the next round, as ``torch.optim`` does.

        Raises:
            ValueError: it does not fit this optimizer (groups, parameters, shapes).
            ShardRpcError: a shard refused it (a round in progress, unknown entries).
        """
        self._finish_pull()
        if not self._clients:
            raise RuntimeError("this DistributedOptimizer is closed")
        optimizer_state.load(self._clients, self._pool, self._header(), self.plan, self._optimizer, self._params,
                             state_dict)

    @property
    def tables(self) -> SparseTables | None:
        """The sharded embedding tables of ``sparse_optimizer`` (``export(name)`` reads one back), or None."""
        return self._tables

    @property
    def consistency(self) -> ConsistencyOptions:
        """The consistency options this optimizer joined with (``shardps.worker.config``)."""
        return self._consistency

    @property
    def wire(self) -> WireOptions:
        """The wire options in use: chunk size, wire types, checksum, timeouts, TLS (``shardps.worker.config``)."""
        return self._wire

    @property
    def observability(self) -> ObservabilityOptions:
        """The metrics and membership-callback options given (``shardps.worker.config``)."""
        return self._observability

    # ------------------------------------------------------------ for a node leader
    # ``shardps.worker.node.optimizer.NodeOptimizer`` runs its rounds itself (its local ranks push the shards they
    # own) and uses its leader's DistributedOptimizer for joining, heartbeats, recovery and the round's trailer,
    # through these members only. They are stable, but meant for code that runs rounds of its own.

    @property
    def clients(self) -> tuple[ShardClient, ...]:
        """The channel to each shard, in shard order (empty once closed).

        For code that runs rounds itself (the node leader pushes its own shards
        through them); they belong to this optimizer, which closes them in
        :meth:`close`: do not close them yourself.
        """
        return tuple(self._clients)

    @property
    def recovery(self) -> Recovery | None:
        """The rejoining of restarted shards (``shardps.worker.session.recovery.Recovery``); None once construction
        failed. ``recovery.restarted`` holds the shards the heartbeats found restarted, rejoined by the next
        :meth:`synchronize`; ``recovery.recover_one`` rejoins a shard whose round failed."""
        return self._recovery

    def check_healthy(self) -> None:
        """Raise if no round may start: the model's partitions diverged, or this worker lost its membership.

        Every ``step()`` checks this first; a node leader checks it before each of its rounds.

        Raises:
            RuntimeError: a round was applied by some shards and failed by others (see
                :meth:`mark_diverged`), or the shards dropped this worker at lease expiry
                (the message says what to do).
        """
        lost = self._leases.lost if self._leases is not None else ""
        if self._diverged or lost:
            raise RuntimeError(self._diverged or lost)

    def mark_diverged(self, reason: str) -> None:
        """Record that a round was applied by some shards and failed by others: every later round raises ``reason``
        (:meth:`check_healthy`). For a node leader whose local ranks ran the round
        (``shardps.worker.session.recovery.divergence`` words ``reason``)."""
        if not reason:
            raise ValueError("mark_diverged needs the reason every later step raises")
        self._diverged = reason

    def round_trailer(self, absent: list[int]) -> pb.RoundTrailer:
        """The trailer that closes a round pushed by other code than :meth:`step` (a node's local ranks).

        It holds each param group's learning rate read now (LR schedulers work),
        the hyperparameters changed since the last trailer (so call it once per
        round), ``absent`` (indices into ``self.plan.keys`` of parameters without a
        gradient on every contributor) and the clipping / loss-scale fields.

        Raises:
            ValueError: a learning rate is not finite or is negative.
        """
        return self._trailer(self._round_lrs(), absent)

"""Reduction within a node first: the local ranks of one node act as one contributor to the shards.

BytePS's layout (Jiang et al., "A Unified Architecture for Accelerating
Distributed DNN Training in Heterogeneous GPU/CPU Clusters", OSDI 2020):
processes on one node first combine their gradients over the fast local
interconnect with ``torch.distributed`` (NCCL when the tensors are on CUDA,
Gloo on CPU: one code path that differs only in backend and device), and
only then does the node talk to the shards, so the shards see one push per
node instead of one per process and the bytes sent to them per step divide
by the number of local ranks.

How a step runs (:meth:`NodeOptimizer.step`), by chunk ownership (the default):

1. every local rank flattens its gradients into one fp32 vector in plan order
   (plus a presence mask, all-reduced: a parameter whose gradient is None on
   every local rank is left out, as torch.optim does);
2. reduce-scatter along the partition plan: shard ``s`` holds one contiguous
   range of that vector (plan format 4) and is owned by local rank
   ``s % L``; every rank sends the ranges it does not own to their owners
   (point to point, ``shares.reduce_scatter``), and each owner sums its
   range in local-rank order and divides by ``L``: the node's average
   gradient, each range on one rank;
3. the leader broadcasts the round (each shard's version and the trailer:
   learning rates, hyperparameters, absent keys), and its buffers so that
   every owner pushes the leader's, as a lone leader would;
4. every local rank pushes its shards' ranges to them and pulls them back
   (``shardps.worker.node.shares``), all ranks at once, with the node's one
   member id and session: the shards see one contributor per node;
5. all-gather: one ``dist.broadcast`` per shard range from its owner, and
   the buffers' chunks likewise, so every rank holds the whole new model.

The leader (local rank 0) alone joins the shards, heartbeats, and rejoins a
shard its heartbeats found restarted (between steps; it then broadcasts its
whole state).
A shard that restarted or dropped the connection during a round is
rejoined by the leader inside that step (its partition pulled and broadcast;
the round is not sent to it again), as ``DistributedOptimizer`` does, and the
step succeeds. Any other failure, or a shard still down past the retry
budget, raises on every rank, naming the rank, the shard and its error.

With ``max_grad_norm`` the round's clipping needs every shard's report
before any shard applies it, so ownership would have to exchange reports
across ranks in the middle of a round: the node then runs the leader path
instead (``split=False``): ``dist.reduce`` of the whole vector to the
leader, which pushes and pulls every shard as a ``DistributedOptimizer``,
then ``dist.broadcast`` of the parameters and buffers.

In sync mode with equal local batches both paths are exactly single-process
training on the whole global batch (the average of node averages is the
average). The node's contributor id is the leader's ``worker_id``: give it
from the node's index (``torchrun``'s ``GROUP_RANK``), so a restarted node
rejoins as the same member.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist

from shardps.proto import shardps_pb2 as pb
from shardps.common.addresses import parse_servers
from shardps.common.codec import FLOAT_DTYPES, wire_dtype
from shardps.common.plan import PartitionPlan
from shardps.worker.session.client import ShardClient
from shardps.worker import optimizer_state as optimizer_state
from shardps.worker.config import WireOptions, moved_keywords_error, node_refusal
from shardps.worker.job import check_resume
from shardps.worker.optimizer import DistributedOptimizer
from shardps.worker.session.recovery import rejoin_failed
from shardps.worker.session.retry import RetryPolicy
from shardps.worker.node.shares import (NodeSession, ShardShare, all_gather, owner, param_pieces, reduce_scatter,
                                   shard_segments)

log = logging.getLogger(__name__)

#: The keywords a NodeOptimizer passes on to its leader's DistributedOptimizer.
FORWARDED_KEYWORDS = frozenset({"broadcast_buffers", "backward_passes_per_step", "max_grad_norm", "norm_type",
                                "consistency", "wire", "observability", "resume"})


class NodeOptimizer:
    """Wrap ``optimizer`` so that the local ranks of ``group`` push and pull as one contributor.

    Call it on every local rank of the node, with the same model replica
    (same parameter shapes and order) and the same arguments; all calls are
    collective over ``group``.

    Args:
        optimizer: the ``torch.optim`` optimizer of this rank's replica; only the
            leader's hyperparameters (and LR schedulers) reach the shards.
        named_parameters: ``model.named_parameters()``; floating-point tensors, all
            on one device (CUDA with the NCCL backend, CPU with Gloo).
        servers: shard addresses ``host:port`` in shard order.
        node_id: the node's contributor id on the shards (the leader's ``worker_id``);
            stable across restarts of the node (e.g. ``f"{job}-node{GROUP_RANK}"``).
        group: the node's process group (default: the whole default group), already
            initialised by the caller (``torch.distributed.init_process_group`` or
            ``new_subgroups``). Its rank 0 is the leader.
        named_buffers: buffers to keep equal on every rank and on the shards
            (``model.named_buffers()``): the leader's are pushed, and every rank
            holds the pulled ones after each step.
        split: push and pull by chunk ownership, every local rank its own shards
            (default: True unless ``max_grad_norm`` is given, which needs the
            leader path; see the module docstring). False: the leader alone.
        **kwargs: passed to the leader's :class:`DistributedOptimizer`: ``consistency``
            (:class:`~shardps.worker.config.ConsistencyOptions`), ``wire``
            (:class:`~shardps.worker.config.WireOptions`: every local rank opens its
            channels with its timeouts, retries, message limit and TLS), ``observability``
            (the leader's metrics), ``max_grad_norm``, ``norm_type``,
            ``backward_passes_per_step``, ``broadcast_buffers``, ``resume`` (the leader
            alone joins: with ``"refuse"`` and a job past version 0 it raises
            ``RunningJobError`` and the other ranks a ``RuntimeError``). ``model`` (overlapped
            pulls), ``grad_scaler`` and ``push_during_backward`` are not supported here:
            the node pushes at ``step()``.

    Raises:
        ValueError: unsupported arguments, parameters on several devices,
            ``split=True`` with ``max_grad_norm``, bad shard addresses.
        TypeError: a keyword neither this class nor ``DistributedOptimizer`` takes (one
            that moved into an option group, such as ``mode=``, names the group).
            Every ValueError and TypeError above is raised on every rank, before any
            collective.
        RuntimeError: the leader failed to join the shards, or a rank could not reach
            its shards (raised on every rank).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, torch.Tensor]], *,
                 servers: list[str] | str, node_id: str, group: dist.ProcessGroup | None = None,
                 named_buffers: Iterable[tuple[str, torch.Tensor]] = (), split: bool | None = None,
                 **kwargs) -> None:
        for name in ("model", "grad_scaler", "push_during_backward"):
            if name in kwargs:
                raise ValueError(node_refusal(name))
        if "worker_id" in kwargs:
            raise TypeError("NodeOptimizer takes node_id= (the node's contributor id), not worker_id=")
        unknown = [name for name in kwargs if name not in FORWARDED_KEYWORDS]
        if unknown:
            raise moved_keywords_error(unknown, where="NodeOptimizer")
        servers = parse_servers(servers)
        check_resume(kwargs.get("resume", "allow"))  # on every rank, before any collective
        wire = kwargs.get("wire", WireOptions())
        if not isinstance(wire, WireOptions):
            raise TypeError(f"wire= takes a shardps.worker.config.WireOptions(...), got {type(wire).__name__}")
        if not dist.is_initialized():
            raise ValueError("NodeOptimizer needs torch.distributed initialised (the node's process group)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._leader = dist.get_global_rank(group, 0) if group is not None else 0
        named, named_buffers = list(named_parameters), list(named_buffers)
        in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
        self._params = [p for _, p in named if id(p) in in_optimizer]
        self._buffers = [b for _, b in named_buffers]
        self._names = [name for name, p in named if id(p) in in_optimizer]
        self._starts = [0, *itertools.accumulate(p.numel() for p in self._params)]
        self._numel = self._starts.pop()
        self._grad_buffer: torch.Tensor | None = None  # reused by every split step (_flat_grads)
        self._param_buffer: torch.Tensor | None = None  # reused by every split step (_gather_shares)
        self._scratch: torch.Tensor | None = None  # reused by every split step (reduce_scatter)
        devices = {t.device for t in (*self._params, *self._buffers)}
        if len(devices) != 1:
            raise ValueError(f"parameters and buffers must be on one device, found {sorted(map(str, devices))}")
        self.device = devices.pop()
        self._optimizer = optimizer
        clipping = kwargs.get("max_grad_norm") is not None
        if split and clipping:
            raise ValueError("split=True cannot clip (max_grad_norm needs every shard's report before any shard "
                             "applies the round): leave split unset, or pass split=False")
        self.split = not clipping if split is None else split
        self._share: ShardShare | None = None
        self._routed: dict | None = None  # a non-leader's optimizer methods while its step is refused
        self._failure: BaseException | None = None
        self.inner: DistributedOptimizer | None = None
        error = ""
        if self.rank == 0:
            try:
                self.inner = DistributedOptimizer(optimizer, named, servers=servers, worker_id=node_id,
                                                  named_buffers=named_buffers,
                                                  push_during_backward=False, **kwargs)
            except Exception as exc:  # told to every rank below, then raised here
                error = f"{type(exc).__name__}: {exc}"
                self._status(error)
                raise
        self.version = 0
        self._status(error)
        self._resumed = self.version > 0
        self._broadcast_state()
        if self.split:
            self._setup_share(named_buffers, servers, wire)
        # no rank's optimizer may step on its own. The leader's DistributedOptimizer routed its methods (and
        # restores them at close): only the advice changes. The other ranks keep their own state_dict (empty:
        # they never step)
        if self.rank == 0:
            optimizer.step = optimizer_state.refusing_step("NodeOptimizer")
        else:
            self._routed = optimizer_state.redirect(optimizer, optimizer.state_dict, optimizer.load_state_dict,
                                                    wrapper="NodeOptimizer")

    def _setup_share(self, named_buffers: list, servers: list[str], wire: WireOptions) -> None:
        """The leader hands out the node's session; each rank connects to the shards it owns."""
        box = [None]
        if self.rank == 0:
            inner = self.inner
            box[0] = NodeSession(inner.worker_id, inner.session, inner.plan.to_proto().SerializeToString(),
                                 wire_dtype(inner.wire.pull_dtype), FLOAT_DTYPES[wire_dtype(inner.wire.push_dtype)],
                                 inner.wire.checksum)
        dist.broadcast_object_list(box, src=self._leader, group=self.group)
        node: NodeSession = box[0]
        plan = PartitionPlan.from_proto(pb.PlanSpec.FromString(node.plan))
        self._segments = shard_segments(plan)
        self._buffer_chunks = list(plan.buffer_chunks)
        self._owned = [s for s in range(plan.num_shards) if owner(s, self.size) == self.rank]
        self._pieces = {s: param_pieces(self._segments[s], self._params, self._starts)
                        for s in range(plan.num_shards)}
        self._buffer_map = dict(named_buffers)
        error, failure, clients = "", None, {}
        try:
            if self.rank == 0:
                leader_clients = self.inner.clients
                clients = {s: leader_clients[s] for s in self._owned}
            else:
                retry = RetryPolicy(total_seconds=wire.retry_seconds)
                for s in self._owned:
                    clients[s] = ShardClient(servers[s], index=s, rpc_timeout=wire.rpc_timeout,
                                             connect_timeout=wire.connect_timeout, retry=retry,
                                             security=wire.security, max_message_bytes=wire.max_message_bytes,
                                             stream_process=wire.stream_processes)
            self._share = ShardShare(node, plan, clients, dict(zip(self._names, self._params)), self._buffer_map,
                                     wire.rpc_timeout)
        except Exception as exc:  # told to every rank below
            error, failure = f"{type(exc).__name__}: {exc}", exc
            if self.rank != 0:  # the channels this rank opened before the failure (the leader's belong to inner)
                for client in clients.values():
                    client.close()
        errors = self._agree(error)
        if errors:
            self.close()
            if failure is not None:
                raise failure
            raise RuntimeError(f"a local rank could not reach its shards: {'; '.join(errors)}")

    def _agree(self, error: str) -> list[str]:
        """Every rank's error (``""``: none), on every rank: one all-reduce, the messages only after a failure."""
        flag = torch.tensor([1 if error else 0], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if not flag.item():
            return []
        errors: list = [None] * self.size
        dist.all_gather_object(errors, error, group=self.group)
        return [f"local rank {r}: {e}" for r, e in enumerate(errors) if e]

    def _status(self, error: str) -> None:
        """Leader -> every rank: 0 (ok) or 1 (failed), then the version; raises on the others if failed."""
        word = torch.tensor([1 if error else 0, self.inner.version if self.inner and not error else 0],
                            dtype=torch.int64, device=self.device)
        dist.broadcast(word, src=self._leader, group=self.group)
        if word[0].item() and self.rank != 0:
            raise RuntimeError("the node leader (local rank 0) failed; see its log")
        self.version = int(word[1].item())

    def _broadcast_state(self) -> None:
        """Leader's parameters and buffers -> every local rank."""
        with torch.no_grad():
            if self._params:
                flat = torch.cat([p.detach().reshape(-1).float() for p in self._params])
                dist.broadcast(flat, src=self._leader, group=self.group)
                if self.rank != 0:
                    self._unflatten(flat, self._params)
            for b in self._buffers:
                dist.broadcast(b, src=self._leader, group=self.group)

    @staticmethod
    def _unflatten(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        at = 0
        for t in tensors:
            t.copy_(flat[at : at + t.numel()].view_as(t))
            at += t.numel()

    def step(self) -> None:
        """Average the gradients over the local ranks, push and pull the shards, give every rank the result.

        Collective over the node's group; blocks until every rank holds the new
        parameters. By chunk ownership (``split``) every rank pushes and pulls
        its own shards; else the leader pushes and pulls them all. A shard that
        restarted or dropped the connection is rejoined within the step, which
        then succeeds (module docstring).

        Raises:
            ShardRpcError, RuntimeError: a push or pull failed and was not recovered,
                raised on every rank: the rank that talked to the shard raises the
                shard's error, the others a RuntimeError naming it.
        """
        self._optimizer._opt_called = True  # tells LR schedulers attached to it that a step happened
        if self.split:
            self._step_split()
            return
        with torch.no_grad():
            flat, present = self._flat_grads()
            dist.reduce(flat, dst=self._leader, op=dist.ReduceOp.SUM, group=self.group)
            dist.reduce(present, dst=self._leader, op=dist.ReduceOp.MAX, group=self.group)
            error = ""
            if self.rank == 0:
                flat /= self.size
                at = 0
                for p, has in zip(self._params, present.tolist()):
                    n = p.numel()
                    p.grad = flat[at : at + n].view_as(p).to(p.dtype) if has else None
                    at += n
                try:
                    self.inner.step()
                except Exception as exc:
                    error = f"{type(exc).__name__}: {exc}"
                    self._status(error)
                    raise
        self._status(error)
        self._broadcast_state()

    def _flat_grads(self, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's gradients as one fp32 vector in plan order (zeros where None), and 1.0 where present.

        ``out``: a float32 buffer of the total numel to write into (reused every step: a fresh
        one per step costs a page fault per 4 KiB).
        """
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]
        flat = torch.cat([g.detach().reshape(-1).float() for g in grads], out=out)
        present = torch.tensor([p.grad is not None for p in self._params], dtype=torch.float32, device=self.device)
        return flat, present

    def _begin_round(self, absent: list[int]) -> tuple[str, list[int], bytes, bool]:
        """Leader: rejoin restarted shards, then the round every rank pushes.

        Returns:
            ``(error, versions, trailer, resync)``: ``""`` or what failed (the exception
            is kept in ``self._failure``), each shard's version, the serialised
            ``RoundTrailer``, and whether a rejoined shard's partition must be broadcast.
        """
        inner = self.inner
        try:
            resync = bool(inner.recovery.restarted)
            inner.synchronize()  # rejoins the shards the heartbeats found restarted (pulls them into the model)
            inner.check_healthy()
            trailer = inner.round_trailer(absent)
            return "", list(inner.versions), trailer.SerializeToString(), resync
        except Exception as exc:
            self._failure = exc
            return f"{type(exc).__name__}: {exc}", [], b"", False

    def _step_split(self) -> None:
        """:meth:`step` by chunk ownership (module docstring, steps 1-5)."""
        with torch.no_grad():
            if self._grad_buffer is None:
                self._grad_buffer = torch.empty(self._numel, dtype=torch.float32, device=self.device)
            flat, present = self._flat_grads(out=self._grad_buffer)
            dist.all_reduce(present, op=dist.ReduceOp.MAX, group=self.group)
            began = time.perf_counter()
            self._scratch = reduce_scatter(flat, self._segments, self.rank, self.size, self.group, self._scratch)
            self._phase("reduce_scatter", began)
            absent_index = [i for i, has in enumerate(present.tolist()) if not has]
            box = [self._begin_round(absent_index) if self.rank == 0 else None]
            dist.broadcast_object_list(box, src=self._leader, group=self.group)
            error, versions, trailer, resync = box[0]
            if error:
                if self.rank == 0:
                    raise self._failure
                raise RuntimeError(f"the node leader (local rank 0) failed: {error}")
            if resync:  # the leader rejoined a restarted shard and pulled its partition
                self._broadcast_state()
            for b in self._buffers:
                dist.broadcast(b, src=self._leader, group=self.group)
            absent = {self._names[i] for i in absent_index}
            began = time.perf_counter()
            applied, failed = self._share.push_pull(versions, pb.RoundTrailer.FromString(trailer), flat, absent)
            self._phase("push_pull", began)
            outcome = torch.zeros(len(self._segments), dtype=torch.int64, device=self.device)
            for shard, version in applied.items():
                outcome[shard] = version
            for shard, _ in failed:
                outcome[shard] = -1
            dist.all_reduce(outcome, op=dist.ReduceOp.SUM, group=self.group)
            received = outcome.tolist()
            if min(received) < 0:
                received = self._round_failed(received, failed)
            else:
                began = time.perf_counter()
                self._gather_shares()
                self._phase("all_gather", began)
            if self.inner is not None:
                self.inner.versions = received
                self.inner.metrics.step_finished()
            self.version = min(received)

    def _phase(self, phase: str, began: float) -> None:
        """On the leader: observe ``shardps_worker_node_phase_seconds{phase}``, from ``began`` (perf_counter) to now."""
        if self.inner is not None:
            self.inner.metrics.node_phase(phase, time.perf_counter() - began)

    def _round_failed(self, received: list[int], failed: list[tuple[int, BaseException]]) -> list[int]:
        """After a push failed on some rank: rejoin the shards that restarted, or raise on every rank.

        Every rank first takes the shards that did apply the round from their
        owners, as after a good step. The leader then rejoins each failed shard
        whose error is a restart or a dropped connection and pulls its current
        version (``recovery.rejoin_failed``), as a ``DistributedOptimizer`` does
        inside its step: the round is not sent to it again. If it rejoined any,
        it broadcasts the whole model (so every rank holds what it pulled), and
        if every failed shard was rejoined the step succeeds on every rank.

        Args:
            received: each shard's new version, -1 where its push or pull failed.
            failed: this rank's failures, ``(shard, error)``.

        Returns:
            Each shard's version now (every failed shard rejoined).

        Raises:
            ShardRpcError, RuntimeError: on every rank, when a failed shard could not be
                rejoined: the rank that pushed to it raises the shard's error, the others
                a RuntimeError naming the local rank, the shard and the error.
        """
        mine = [(s, getattr(e, "code", None), f"{type(e).__name__}: {e}") for s, e in failed]
        gathered: list = [None] * self.size
        dist.all_gather_object(gathered, [(s, c.name if c else "", m) for s, c, m in mine], group=self.group)
        everyone = [(r, s, code, m) for r, lst in enumerate(gathered) for s, code, m in lst]
        self._gather_shares()
        box = [rejoin_failed(self.inner, received, everyone) if self.inner is not None else None]
        dist.broadcast_object_list(box, src=self._leader, group=self.group)
        versions, left, rejoined = box[0]
        if rejoined:
            self._broadcast_state()  # the rejoined shards' partitions, pulled by the leader
        if not left:
            return versions
        own = [e for s, e in failed if s in {shard for _, shard, _ in left}]
        if own:
            raise own[0]
        raise RuntimeError("the node's round failed on " + "; ".join(
            f"local rank {r}, shard {s}: {m}" for r, s, m in left))

    def _gather_shares(self) -> None:
        """All-gather: every shard's range of the parameters, and its buffer chunks, from the rank that pulled them."""
        if self._params and self._param_buffer is None:
            self._param_buffer = torch.empty(self._numel, dtype=torch.float32, device=self.device)
        all_gather(self._param_buffer if self._params else None, self._pieces, self._segments, self.rank, self.size,
                   self.group, [(self._buffer_map[c.key], c) for c in self._buffer_chunks])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear this rank's gradients (``torch.optim.Optimizer.zero_grad``)."""
        self._optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict]:
        return self._optimizer.param_groups

    def state_dict(self) -> dict:
        """The node's optimizer state from the shards, in ``torch.optim``'s format; on the leader only.

        The shards hold one optimizer state per node, which the leader reads
        (see ``DistributedOptimizer.state_dict``); no collective, so the usual
        ``if rank == 0: torch.save(opt.state_dict(), ...)`` works.

        Raises:
            RuntimeError: called on a local rank other than 0, or after ``close()``.
            ShardRpcError: a shard refused or failed.
        """
        if self.rank != 0:
            raise RuntimeError(f"the node's optimizer state is read by its leader: call state_dict() on local rank 0 "
                               f"(this is local rank {self.rank})")
        if self.inner is None:
            raise RuntimeError("this NodeOptimizer is closed: its optimizer state lives on the shards, read it before "
                               "close()")
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a ``torch.optim`` state dict onto the shards: the leader does, the other local ranks do nothing.

        Every rank may call it with the same checkpoint (the usual resume code);
        no collective. Call it between steps (see ``DistributedOptimizer.load_state_dict``).

        Raises:
            RuntimeError: the leader's optimizer is closed.
            ValueError: it does not fit this optimizer (groups, parameters, shapes).
            ShardRpcError: a shard refused it.
        """
        if self.rank != 0:
            return
        if self.inner is None:
            raise RuntimeError("this NodeOptimizer is closed")
        self.inner.load_state_dict(state_dict)

    @property
    def last_pushed_bytes(self) -> dict[int, int]:
        """``{shard: bytes}`` this rank pushed in its last step (by ownership: its own shards; leader path: {})."""
        return dict(self._share.last_pushed_bytes) if self._share is not None else {}

    @property
    def resumed(self) -> bool:
        """The job was past version 0 when the leader joined (the shards held it already)."""
        return self._resumed

    @property
    def metrics(self):
        """The leader's ``WorkerMetrics`` (``shardps.worker.metrics``); None on the other local ranks."""
        return self.inner.metrics if self.inner is not None else None

    @property
    def metrics_port(self) -> int | None:
        """The port of the leader's metrics endpoint; None on the other ranks or when not served."""
        return self.inner.metrics_port if self.inner is not None else None

    @property
    def members(self) -> list[str]:
        """The job's member ids as the leader last saw them (empty on the other ranks)."""
        return self.inner.members if self.inner is not None else []

    def stats(self) -> list:
        """Each shard's Stats reply (the leader asks the shards; the other ranks get an empty list)."""
        return self.inner.stats() if self.inner is not None else []

    def close(self) -> None:
        """The leader leaves the shards (rounds stop waiting for this node); no collective."""
        if self._share is not None:
            self._share.close(own_clients=self.rank != 0)
            self._share = None
        if self.inner is not None:
            self.inner.close()
            self.inner = None
        if self._routed is not None:
            optimizer_state.restore(self._optimizer, self._routed)
            self._routed = None

    def __enter__(self) -> "NodeOptimizer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

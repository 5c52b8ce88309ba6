"""Reduction within a node first: the local ranks of one node act as one contributor to the shards.

BytePS's layout (Jiang et al., "A Unified Architecture for Accelerating
Distributed DNN Training in Heterogeneous GPU/CPU Clusters", OSDI 2020):
processes on one node first combine their gradients over the fast local
interconnect with ``torch.distributed`` (NCCL when the tensors are on CUDA,
Gloo on CPU: one code path that differs only in backend and device), and
only then does the node talk to the shards, so the shards see one push per
node instead of one per process and the bytes sent to them per step divide
by the number of local ranks.

How a step runs (:meth:`NodeOptimizer.step`):

1. every local rank flattens its gradients into one fp32 vector (plus a
   presence mask: a parameter whose gradient is None on every local rank is
   left out, as torch.optim does);
2. ``dist.reduce`` sums them on the node leader (local rank 0), which
   divides by the number of local ranks: the node's average gradient;
3. the leader, a member of the job like any worker, pushes it and pulls the
   new parameters (``DistributedOptimizer``, any mode);
4. ``dist.broadcast`` sends the parameters and buffers from the leader to
   every local rank, with a status word first so that a failure on the
   leader raises on every rank instead of leaving them waiting.

In sync mode with equal local batches the result is exactly single-process
training on the whole global batch (the average of node averages is the
average). The node's contributor id is the leader's ``worker_id``: give it
from the node's index (``torchrun``'s ``GROUP_RANK``), so a restarted node
rejoins as the same member.

The leader alone talks to the shards here. Splitting the push by chunk
ownership over the local ranks (reduce-scatter, then an all-gather) would
also spread the node's network traffic over its ranks; it is not built
yet. Since plan format 4 each shard owns one contiguous range of the flat
fp32 parameter vector used here, so the reduce-scatter is one
``dist.reduce`` per shard range to the rank that owns the shard and the
all-gather one ``dist.broadcast`` per range back; what is missing is a
``DistributedOptimizer`` that joins, pushes to and pulls from a subset of
the shards (with clipping, its commit needs every shard's report).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.distributed as dist

from shardps.worker.optimizer import DistributedOptimizer

log = logging.getLogger(__name__)


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
            (``model.named_buffers()``), broadcast from the leader after each step.
        **kwargs: passed to the leader's :class:`DistributedOptimizer` (``mode``,
            ``staleness``, ``chunk_bytes``, wire dtypes, ``max_grad_norm``, timeouts...).
            ``model`` (overlapped pulls), ``grad_scaler`` and ``push_during_backward``
            are not supported here: the node pushes at ``step()``.

    Raises:
        ValueError: unsupported arguments, parameters on several devices.
        RuntimeError: the leader failed to join the shards (raised on every rank).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, torch.Tensor]], *,
                 servers: list[str] | str, node_id: str, group: dist.ProcessGroup | None = None,
                 named_buffers: Iterable[tuple[str, torch.Tensor]] = (), **kwargs) -> None:
        for name in ("model", "grad_scaler", "push_during_backward"):
            if name in kwargs:
                raise ValueError(f"NodeOptimizer does not take {name}=: the node pushes at step() (see its docstring)")
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
        devices = {t.device for t in (*self._params, *self._buffers)}
        if len(devices) != 1:
            raise ValueError(f"parameters and buffers must be on one device, found {sorted(map(str, devices))}")
        self.device = devices.pop()
        self._optimizer = optimizer
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
        """Average the gradients over the local ranks, push and pull on the leader, broadcast the result.

        Collective over the node's group; blocks until every rank holds the new parameters.

        Raises:
            RuntimeError: the leader's push or pull failed (raised on every rank; the
                leader raises the shard's error itself).
        """
        with torch.no_grad():
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]
            flat = torch.cat([g.detach().reshape(-1).float() for g in grads])
            present = torch.tensor([p.grad is not None for p in self._params], dtype=torch.float32,
                                   device=self.device)
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

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear this rank's gradients (``torch.optim.Optimizer.zero_grad``)."""
        self._optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict]:
        return self._optimizer.param_groups

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
        if self.inner is not None:
            self.inner.close()
            self.inner = None

    def __enter__(self) -> "NodeOptimizer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

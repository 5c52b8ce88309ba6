"""``DistributedOptimizer``: wraps a plain ``torch.optim`` optimizer so that the shards run it.

The wrapper follows the Horovod/BytePS optimizer wrappers (Sergeev & Del
Balso, "Horovod", 2018; Jiang et al., "BytePS", OSDI 2020): gradient hooks
start the communication while backward still runs, ``synchronize()`` waits
for it, and ``step()`` leaves the parameters updated in place. Unlike them,
the update itself runs on the shards, which hold the optimizer state (the
local optimizer never allocates any).

Each step opens one PushPull stream per shard (``shardps.worker.rounds``);
joining and initialising the shards follows ``shardps.worker.join``.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from shardps.proto import shardps_pb2 as pb
from shardps.proto.codec import TORCH_DTYPES, wire_dtype
from shardps.proto.optim import current_lrs, optimizer_spec
from shardps.proto.plan import Chunk, PartitionPlan, keys_from_named_parameters
from shardps.proto.transport import DEFAULT_MAX_MESSAGE_BYTES
from shardps.worker.client import ShardClient, ShardRpcError
from shardps.worker.join import JoinPlan, join_job
from shardps.worker.rounds import ParameterSink, Round, init_requests, push_requests

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 1 << 20


def default_worker_id() -> str:
    """A worker id unique to this process: ``host-pid-random``."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class DistributedOptimizer:
    """Run ``optimizer``'s updates on the shards, synchronously (BSP).

    Args:
        optimizer: a ``torch.optim`` optimizer (SGD, Adam, AdamW, Adagrad or
            RMSprop) built over the model's parameters. Its class, param-group
            hyperparameters and current ``lr`` (so LR schedulers attached to it
            work unchanged) are sent to the shards; its own ``step`` is never
            called and it never allocates state.
        named_parameters: ``model.named_parameters()``; the names are the keys.
        servers: shard addresses ``host:port``, in shard-index order.
        worker_id: stable id of this worker (default: host-pid-random), 1 to 256
            printable characters. Two live processes may not share one: the
            second is refused with ALREADY_EXISTS. The process is told apart by
            ``session``, a random token made here and sent with every call.
        chunk_bytes: largest chunk in bytes of fp32 (default 1 MiB); every worker
            of a job must use the same value.
        push_dtype, pull_dtype: wire types of gradients and parameters
            (``"fp32"``, ``"bf16"`` or ``"fp16"``); shards keep fp32 master weights.
        backward_passes_per_step: backward calls accumulated before gradients are pushed.
        model: the module that owns the parameters. When given, ``step()``
            returns as soon as the gradients are handed to the network, the new
            parameters stream in while the next forward runs, and a forward
            pre-hook on each submodule waits for that submodule's own
            parameters (BytePS-style priority: shards send chunks in
            ``named_parameters`` order, first layers first). Read parameters
            outside ``model``'s forward only after ``synchronize()``.
        checksum: send a CRC-32 with every gradient chunk.
        rpc_timeout: deadline of every call in seconds.
        connect_timeout: how long to wait for each shard to answer, seconds.

    Parameters must be contiguous tensors of a floating dtype; they may live
    on CPU or CUDA (chunks cross the wire from CPU memory).

    Raises:
        ValueError: bad arguments (the message names the fix).
        shardps.proto.optim.OptimizerSpecError: an optimizer the shards cannot run.
        ConnectionError: a shard did not answer.
        ShardRpcError: a shard refused to join (e.g. a plan mismatch).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.Tensor]],
        *,
        servers: list[str] | str,
        worker_id: str | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        push_dtype: str = "fp32",
        pull_dtype: str = "fp32",
        backward_passes_per_step: int = 1,
        model: torch.nn.Module | None = None,
        checksum: bool = False,
        rpc_timeout: float = 120.0,
        connect_timeout: float = 30.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        if isinstance(servers, str):
            servers = [s for s in servers.split(",") if s]
        if not servers:
            raise ValueError("servers must list at least one shard address host:port")
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        if chunk_bytes + (64 << 10) > max_message_bytes:
            raise ValueError(f"chunk_bytes {chunk_bytes} does not fit in max_message_bytes {max_message_bytes}")
        named = list(named_parameters)
        for name, p in named:
            if not p.is_floating_point() or not p.is_contiguous():
                raise ValueError(f"parameter {name!r} must be a contiguous floating-point tensor")
        self._optimizer = optimizer
        self._spec = optimizer_spec(optimizer)
        self.plan = PartitionPlan.build(
            keys_from_named_parameters(named, optimizer.param_groups), num_shards=len(servers), chunk_bytes=chunk_bytes
        )
        self.worker_id = worker_id or default_worker_id()
        self.session = uuid.uuid4().hex
        self._push_dtype = TORCH_DTYPES[wire_dtype(push_dtype)]
        self._pull_code = wire_dtype(pull_dtype)
        self._passes = backward_passes_per_step
        self._checksum = checksum
        self._params = dict(named)
        self._key_of = {id(p): name for name, p in named}
        self._chunks_of: dict[str, list[Chunk]] = {}
        for c in self.plan.chunks:
            self._chunks_of.setdefault(c.key, []).append(c)
        self._sink = ParameterSink(self.plan, self._params)
        self._counts = dict.fromkeys(self._params, 0)
        self._chunk_counts = {key: len(chunks) for key, chunks in self._chunks_of.items()}
        self._round: Round | None = None  # the round being pushed
        self._pulling: Round | None = None  # the round whose parameters are still arriving
        self._rpc_timeout = rpc_timeout
        self._diverged = ""  # set when a round was applied by some shards and failed by others
        self._lock = threading.Lock()  # guards self._round between hooks and step()
        self._pool = ThreadPoolExecutor(max_workers=len(servers), thread_name_prefix="shardps-pull")
        self._clients: list[ShardClient] = []
        self._hooks = []
        self.versions: list[int] = [0] * len(servers)
        try:
            self._clients = list(
                self._pool.map(
                    lambda ia: ShardClient(
                        ia[1], index=ia[0], rpc_timeout=rpc_timeout, connect_timeout=connect_timeout,
                        max_message_bytes=max_message_bytes,
                    ),
                    enumerate(servers),
                )
            )
            join = JoinPlan(worker_id=self.worker_id, session=self.session, plan=self.plan.to_proto(),
                            fingerprint=self.plan.fingerprint, optimizer=self._spec)
            self.versions = join_job(self._clients, self._pool, join, self._init_frames, self._initial_pull)
        except BaseException:
            self.close()
            raise
        for p in self._params.values():
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
        self._overlap = model is not None
        if model is not None:
            self._register_forward_waits(model)

    # ------------------------------------------------------------ joining
    def _init_frames(self, shard: int):
        header = pb.RoundHeader(worker_id=self.worker_id, session=self.session, plan_fingerprint=self.plan.fingerprint)
        return init_requests(header, self.plan, shard, self._params)

    def _initial_pull(self, shard: int, calls: list) -> int:
        client = self._clients[shard]
        call = client.pull(pb.PullRequest(
            min_version=0, plan_fingerprint=self.plan.fingerprint, dtype=self._pull_code,
            worker_id=self.worker_id, session=self.session,
        ))
        calls.append(call)
        return self._sink.receive(client, call, 0, "pull")

    def _register_forward_waits(self, model: torch.nn.Module) -> None:
        """Pre-hook every submodule of ``model``; see :meth:`_learn_wait_keys`."""
        self._model_root = model
        self._called: set[int] = set()
        self._wait_keys: dict[int, list[str]] | None = None
        for module in model.modules():
            self._hooks.append(module.register_forward_pre_hook(self._forward_wait))

    def _learn_wait_keys(self) -> None:
        """Give each parameter to the nearest module around it whose forward ran in the first step.

        Some modules read a child's parameters without calling the child
        (``nn.MultiheadAttention`` uses ``out_proj.weight`` directly), so a
        parameter is waited for by its own module only if that module's
        forward runs; otherwise by the nearest ancestor whose forward does.
        The first forward, before anything is learned, waits for the whole pull.
        """
        ours = {id(p): key for key, p in self._params.items()}
        keys: dict[int, list[str]] = {}

        def assign(module: torch.nn.Module, owner: torch.nn.Module) -> None:
            if id(module) in self._called:
                owner = module
            for p in module.parameters(recurse=False):
                if id(p) in ours:
                    keys.setdefault(id(owner), []).append(ours[id(p)])
            for child in module.children():
                assign(child, owner)

        assign(self._model_root, self._model_root)
        self._wait_keys = keys

    def _forward_wait(self, module: torch.nn.Module, args) -> None:
        if self._wait_keys is None:
            self._called.add(id(module))
        rnd = self._pulling
        if rnd is None:
            return
        if self._wait_keys is None:
            self._finish_pull()  # nothing learned yet: wait for every parameter
            return
        deadline = time.monotonic() + self._rpc_timeout
        for key in self._wait_keys.get(id(module), ()):
            event = rnd.ready.get(key)  # None for an empty parameter: nothing to wait for
            while event is not None and not event.wait(0.05):  # blocking wait for this module's chunks
                if rnd.failed() is not None or time.monotonic() > deadline:
                    self._finish_pull()  # raises the pull's error
                    raise TimeoutError(f"parameters of {key!r} did not arrive within {self._rpc_timeout:.0f}s")

    # ------------------------------------------------------------ pushing
    def _open_round(self) -> Round:
        """Start one PushPull stream per shard (first gradient hook of a step). Caller holds ``_lock``."""
        if self._round is None:
            self._finish_pull()  # blocking wait, normally a no-op: the forward already waited
            if self._diverged:
                raise RuntimeError(self._diverged)
            lrs = current_lrs(self._optimizer)
            bad = [(g, lr) for g, lr in enumerate(lrs) if not (math.isfinite(lr) and lr >= 0)]
            if bad:
                raise ValueError(f"learning rate of param group {bad[0][0]} is {bad[0][1]}; it must be finite and >= 0")
            rnd = Round(len(self._clients), self._chunk_counts)
            for shard, client in enumerate(self._clients):
                header = pb.RoundHeader(
                    worker_id=self.worker_id, session=self.session, round=self.versions[shard], lrs=lrs,
                    plan_fingerprint=self.plan.fingerprint, pull_dtype=self._pull_code,
                )
                requests = push_requests(header, rnd.queues[shard], rnd.sent[shard], self._push_dtype, self._checksum)
                rnd.calls.append(client.push_pull(requests))
            self._round = rnd
        return self._round

    def _enqueue(self, rnd: Round, key: str, grad: torch.Tensor | None) -> None:
        if grad is None:
            grad = torch.zeros_like(self._params[key])
        flat = grad.detach().reshape(-1)
        for c in self._chunks_of.get(key, ()):
            rnd.queues[c.shard].put((c, flat[c.offset : c.offset + c.numel]))
        rnd.pushed.add(key)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        key = self._key_of[id(param)]
        self._counts[key] += 1
        if self._counts[key] < self._passes:
            return
        with self._lock:
            rnd = self._open_round()
            if key in rnd.pushed:
                raise RuntimeError(
                    f"gradient of {key!r} is ready again before step(): call step() after every "
                    f"{self._passes} backward pass(es), or raise backward_passes_per_step"
                )
            self._enqueue(rnd, key, param.grad)

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

        Starts no round: gradients are pushed only by ``step()``. A no-op
        unless ``model`` was given (then the last step's pull may still be
        landing). Blocks on the network.

        Raises:
            ShardRpcError: a shard refused the push or the pull (its message says why).
            RuntimeError: a shard answered outside the protocol.
        """
        self._finish_pull()

    def _start_pull(self) -> None:
        """Close this round's pushes and start reading every shard's parameters in the background."""
        with self._lock:
            rnd = self._open_round()
            for key, p in self._params.items():
                if key not in rnd.pushed:
                    self._enqueue(rnd, key, p.grad)
            for q in rnd.queues:
                q.put(None)
            self._round = None
            self._counts = dict.fromkeys(self._counts, 0)
        if self._overlap and self._wait_keys is None and self._called:
            self._learn_wait_keys()
        expected = [v + 1 for v in self.versions]
        rnd.futures = [
            self._pool.submit(self._sink.receive, self._clients[s], call, expected[s], "push_pull", rnd)
            for s, call in enumerate(rnd.calls)
        ]
        self._pulling = rnd

    def _finish_pull(self) -> None:
        """Wait for the pending pulls (if any) and record the versions received.

        Every shard's outcome is awaited (each is bounded by the call's
        deadline), not only the first failure: if some shards applied the
        round and others failed it, the model's partitions are now at
        different versions and every later step raises (sync training cannot
        go on from a half-applied round).
        """
        rnd = self._pulling
        if rnd is None:
            return
        self._pulling = None
        wait(rnd.futures)  # blocking wait for every shard
        failed = [s for s, f in enumerate(rnd.futures) if f.exception() is not None]
        applied = [s for s, f in enumerate(rnd.futures) if f.exception() is None]
        for s in applied:
            self.versions[s] = rnd.futures[s].result()
        if not failed:
            return
        error = rnd.futures[failed[0]].exception()
        if applied:
            self._diverged = (
                f"shard(s) {applied} applied round {self.versions[applied[0]] - 1} but shard {failed[0]} failed it "
                f"({error}): the model's partitions are at different versions {self.versions}; restore the job "
                "from a checkpoint"
            )
        raise error

    def step(self, closure=None):
        """Finish this round: push the gradients, pull the updated parameters into the model.

        Parameters without a gradient push zeros. Without ``model`` this blocks
        until the parameters are in place. With ``model`` it returns once the gradients are
        handed off; the parameters land while the next forward runs, each
        submodule waiting for its own.

        Returns:
            ``closure()``'s loss, if a closure is given.

        Raises:
            ShardRpcError: a shard refused the push or the pull (its message says why).
            RuntimeError: a shard answered outside the protocol.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._start_pull()
        if not self._overlap:
            self._finish_pull()
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

    def stats(self) -> list[pb.StatsReply]:
        """Each shard's Stats reply, in shard order."""
        return [c.stats() for c in self._clients]

    def close(self) -> None:
        """Leave every shard (rounds stop waiting for this worker), remove hooks, close channels."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        try:
            self._finish_pull()
        except (ShardRpcError, RuntimeError) as exc:
            log.warning("the last pull failed while closing: %s", exc)
        with self._lock:
            rnd, self._round = self._round, None
        if rnd is not None:
            for q in rnd.queues:
                q.put(None)
            for call in rnd.calls:
                call.cancel()
        for client in self._clients:
            try:
                client.leave(self.worker_id, self.session, timeout=5.0)
            except ShardRpcError as exc:
                log.warning("leaving shard %d failed: %s", client.index, exc)
            client.close()
        self._clients = []
        self._pool.shutdown(wait=False)

    def __enter__(self) -> "DistributedOptimizer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""The option groups of :class:`~shardps.worker.optimizer.DistributedOptimizer`.

``DistributedOptimizer`` takes what every training script sets (the
optimizer, the parameters, the shards, the model, clipping) as keywords of
its own, and the rest in three groups, each a frozen dataclass checked when
it is built (``ValueError`` naming the fix):

- :class:`ConsistencyOptions`: sync, async or ssp rounds;
- :class:`WireOptions`: chunking, wire types, message size, timeouts, retries, TLS;
- :class:`ObservabilityOptions`: Prometheus metrics and the membership callback.

A keyword from before the groups (``mode=``, ``chunk_bytes=``, ``metrics_port=``...)
is refused with a ``TypeError`` naming its group (:func:`moved_keywords_error`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from shardps.proto import shardps_pb2 as pb
from shardps.common.codec import wire_dtype
from shardps.common.modes import mode_problem
from shardps.common.plan import MASTER_ITEMSIZE, MIN_CHUNK_BYTES
from shardps.common.security import ChannelSecurity
from shardps.common.transport import DEFAULT_MAX_MESSAGE_BYTES

__all__ = ["ConsistencyOptions", "DEFAULT_CHUNK_BYTES", "MESSAGE_HEADROOM_BYTES", "MOVED_KEYWORDS",
           "ObservabilityOptions", "WireOptions", "moved_keywords_error"]

#: ``WireOptions.chunk_bytes``'s default: 1 MiB.
DEFAULT_CHUNK_BYTES = 1 << 20
#: Room a gRPC message needs beyond its chunk's bytes (frame header, key, offsets): 64 KiB.
MESSAGE_HEADROOM_BYTES = 64 << 10


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_seconds(name: str, value: object, zero: bool = False) -> None:
    """Raise ValueError unless ``value`` is a finite number of seconds > 0 (>= 0 with ``zero``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and (
        value >= 0 if zero else value > 0)
    if not ok:
        bound = ">= 0" if zero else "> 0"
        raise ValueError(f"{name} is in seconds and must be a finite number {bound}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ConsistencyOptions:
    """How the shards apply the workers' pushes: sync, async or ssp rounds.

    The first worker fixes the job's mode; a worker with another one is
    refused when it joins.

    Attributes:
        mode: ``"sync"`` (default: bulk synchronous rounds, the exact equivalent of
            single-process training on the whole batch), ``"async"`` (each push
            applied on arrival with its own learning rates; ``step()`` gets the
            newest parameters without waiting for other workers) or ``"ssp"``
            (as async, but a worker never runs more than ``staleness`` steps ahead
            of the slowest live worker; Ho et al., NIPS 2013).
        staleness: ssp's bound ``s``, in clocks (steps) a worker may run ahead of
            the slowest live worker: required with ``mode="ssp"`` (an int >= 0),
            None with the other modes.
        scale_lr_by_staleness: async/ssp: the shards divide each push's learning
            rates by ``max(1, staleness)`` (Zhang et al., IJCAI 2016). Off by default.
        tables: how the shards apply the sparse tables' pushes (``sparse_optimizer=``):
            ``"sync"`` (default: one round per step of every worker, their gradients
            averaged, exactly one process's training) or ``"async"`` (**hybrid**,
            with ``mode="sync"``: each worker's rows applied on their own as they
            arrive, its gradient whole, while the dense parameters stay sync; Persia,
            Lian et al. 2021). Tables with ``mode="async"``/``"ssp"`` are refused.

    Raises:
        ValueError: an unknown mode, ssp without an int bound >= 0, a bound or lr
            scaling with a mode that has none (``shardps.common.modes.mode_problem``).
    """

    mode: str = "sync"
    staleness: int | None = None
    scale_lr_by_staleness: bool = False
    tables: str = "sync"

    def __post_init__(self) -> None:
        problem = mode_problem(self.mode, self.staleness, self.scale_lr_by_staleness)
        if problem is not None:
            raise ValueError(problem)
        if self.tables not in ("sync", "async"):
            raise ValueError(f"tables must be 'sync' or 'async', got {self.tables!r}")

    def to_proto(self) -> pb.ModeSpec:
        """The mode as sent in a Join (``staleness`` 0 when None)."""
        return pb.ModeSpec(mode=self.mode, staleness=self.staleness or 0,
                           scale_lr_by_staleness=self.scale_lr_by_staleness)


@dataclass(frozen=True, kw_only=True)
class WireOptions:
    """How a worker talks to the shards: chunking, wire types, message size, deadlines, retries, TLS.

    Attributes:
        chunk_bytes: largest chunk in bytes (default 1 MiB), a multiple of 4 and
            >= 16; the same on every worker (it is part of the partition plan).
            Where links are the bottleneck, streamed rounds do better with
            smaller chunks: a shard sends a chunk back once every worker
            pushed it, and the slowest worker's stream sets that pace (4 x 4
            hosts at 100 Mbit/s: 53.0 samples/s with 256 KiB, 50.0 with
            1 MiB; docs/performance.md, Cluster in one box).
        push_dtype: wire type of gradients (``"fp32"``, ``"bf16"`` or ``"fp16"``).
        pull_dtype: wire type of parameters (same choices); the shards keep fp32
            master weights either way.
        checksum: send a CRC-32 with every gradient chunk.
        max_message_bytes: gRPC message limit in bytes (default 8 MiB; must match
            the shards'). A chunk plus 64 KiB of headroom must fit in it.
        rpc_timeout: deadline of every call, in seconds.
        connect_timeout: how long to wait for each shard to answer, in seconds;
            also how long a Join waits for this ``worker_id`` to be freed by a
            crashed process whose lease has not expired yet.
        retry_seconds: how long repeatable calls (Join, Pull, Stats, ...) are
            retried after UNAVAILABLE or DEADLINE_EXCEEDED, in seconds, with capped
            exponential backoff and jitter, before ``ShardRpcError``; also how
            long a restarting shard is waited for (``shardps.worker.session.recovery``).
            0: no retries.
        security: TLS, mutual TLS and the bearer token of every channel
            (``shardps.common.security.ChannelSecurity``); None (default):
            plaintext, no token.
        streamed: sync mode: stream each round (default; ``RoundHeader.streamed``):
            a shard applies each chunk as soon as every worker pushed it and sends
            it back while later chunks are still being pushed, so every link sends
            and receives at once (BytePS-style pipelining; results bit for bit as
            with False). The round's learning rates and hyperparameters are read at
            its first gradient: set them before ``backward()`` (a change between
            ``backward()`` and ``step()`` makes ``step()`` raise ``ValueError``).
            Rounds that clip or scale are not streamed. The same on every worker
            of a job. False: push the whole round, then pull it.
        push_credit_bytes: streamed rounds: a push stream sends its next gradient
            chunk only while at most this many bytes of its chunks to that shard
            are unanswered (counted in whole chunks of ``chunk_bytes`` in the push
            wire type, at least one; 0, the default: no limit). A shard answers
            a chunk once every worker pushed it, so a credit keeps each worker's
            stream within that much of the slowest one's and leaves the link to
            what the shards can use now (ByteScheduler's credit). Where links
            bind it helps (docs/performance.md, Cluster in one box, measures
            1 MiB). A stream that gets no answer for a second sends the rest of
            its round without credit.
        retain_freed_memory: let this process's malloc keep freed chunk-sized
            buffers for reuse (glibc ``mallopt``, once per process; default
            True; ``shardps.common.memory``). Every chunk is a fresh buffer of
            up to a few MiB; without this, glibc hands a round's freed chunks
            back to the kernel and the next round faults their pages in again,
            which costs several times the copy itself. Up to 1 GiB of freed
            memory stays with the process, and every thread allocates from one
            malloc arena. Skipped where the C library is not glibc or one of
            ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``,
            ``MALLOC_ARENA_MAX``, ``GLIBC_TUNABLES`` is set; False: malloc is
            left as it is.
        stream_processes: carry each shard's push/pull streams (the PushPull
            call of every round) through a helper process of its own
            (``shardps.worker.session.relay``): gRPC's copies and its
            per-message work leave this process's GIL, and this process
            moves each frame with one kernel copy. For a host with cores to
            spare beside the training loop (a GPU host); where every core is
            busy it costs more CPU in all. Default False. The frames, checks,
            errors and results are the same either way.

    Raises:
        ValueError: a chunk that does not fit in a message, an unknown wire type,
            a timeout that is not a positive number of seconds.
    """

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    push_dtype: str = "fp32"
    pull_dtype: str = "fp32"
    checksum: bool = False
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    rpc_timeout: float = 120.0
    connect_timeout: float = 30.0
    retry_seconds: float = 60.0
    security: ChannelSecurity | None = None
    streamed: bool = True
    push_credit_bytes: int = 0
    retain_freed_memory: bool = True
    stream_processes: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.chunk_bytes) or self.chunk_bytes < MIN_CHUNK_BYTES or self.chunk_bytes % MASTER_ITEMSIZE:
            raise ValueError(f"chunk_bytes must be an int, a multiple of {MASTER_ITEMSIZE} and >= {MIN_CHUNK_BYTES} "
                             f"(bytes), got {self.chunk_bytes!r}")
        if not _is_int(self.max_message_bytes) or self.max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be a positive int (bytes), got {self.max_message_bytes!r}")
        if self.chunk_bytes + MESSAGE_HEADROOM_BYTES > self.max_message_bytes:
            raise ValueError(f"chunk_bytes {self.chunk_bytes} does not fit in max_message_bytes "
                             f"{self.max_message_bytes} (a chunk needs 64 KiB of headroom): lower chunk_bytes to at "
                             f"most {self.max_message_bytes - MESSAGE_HEADROOM_BYTES} or raise max_message_bytes "
                             "(on the shards too)")
        for name in ("push_dtype", "pull_dtype"):
            try:
                wire_dtype(getattr(self, name))
            except (ValueError, TypeError) as exc:  # TypeError: an unhashable value
                raise ValueError(f"{name}: {exc}") from None
        for name in ("checksum", "streamed", "retain_freed_memory", "stream_processes"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not _is_int(self.push_credit_bytes) or self.push_credit_bytes < 0:
            raise ValueError(f"push_credit_bytes must be an int >= 0 (bytes; 0: no limit), got "
                             f"{self.push_credit_bytes!r}")
        _positive_seconds("rpc_timeout", self.rpc_timeout)
        _positive_seconds("connect_timeout", self.connect_timeout)
        _positive_seconds("retry_seconds", self.retry_seconds, zero=True)
        if self.security is not None and not isinstance(self.security, ChannelSecurity):
            raise ValueError("security must be a shardps.common.security.ChannelSecurity (or None: plaintext), got "
                             f"{type(self.security).__name__}")


def push_credit_chunks(wire: WireOptions, push_itemsize: int) -> int:
    """``wire.push_credit_bytes`` as whole gradient chunks of ``wire.chunk_bytes`` (fp32 master bytes) sent in a
    wire type of ``push_itemsize`` bytes per element: at least 1, or 0 when there is no credit."""
    if not wire.push_credit_bytes:
        return 0
    return max(1, wire.push_credit_bytes // (wire.chunk_bytes // MASTER_ITEMSIZE * push_itemsize))


@dataclass(frozen=True, kw_only=True)
class ObservabilityOptions:
    """What a worker tells the outside: Prometheus metrics and membership changes.

    Attributes:
        metrics_port: serve this worker's Prometheus metrics (``shardps.worker.metrics``)
            over HTTP on ``metrics_host:metrics_port`` (0: a free one, then read the
            optimizer's ``metrics_port`` after construction); None (default): not
            served. The optimizer's ``metrics`` records them either way.
        metrics_host: the interface the metrics endpoint binds (default ``"0.0.0.0"``: all).
        metrics_registry: the ``prometheus_client.CollectorRegistry`` the metrics go
            to (default: a fresh one per optimizer).
        on_membership_change: called with the member ids (from a background
            thread) when workers join, leave or are dropped at lease expiry.
        on_wait: called with one sentence (from a background thread) when a
            step has waited over 2 s, saying what for: members that have not
            pushed and when their lease runs out, ``--min-workers``, ssp's
            slowest worker, a shard that does not answer. The same sentence is
            logged at INFO either way (``shardps.worker.session.waits``).

    Raises:
        ValueError: a port outside [0, 65535], an empty host, a registry or
            callback of the wrong type.
    """

    metrics_port: int | None = None
    metrics_host: str = "0.0.0.0"
    metrics_registry: CollectorRegistry | None = None
    on_membership_change: Callable[[list[str]], None] | None = None
    on_wait: Callable[[str], None] | None = None

    def __post_init__(self) -> None:
        if self.metrics_port is not None and not (_is_int(self.metrics_port) and 0 <= self.metrics_port <= 65535):
            raise ValueError(f"metrics_port must be an int in [0, 65535] (0: a free port) or None (not served), "
                             f"got {self.metrics_port!r}")
        if not isinstance(self.metrics_host, str) or not self.metrics_host:
            raise ValueError(f"metrics_host must be a non-empty host name or address, got {self.metrics_host!r}")
        if self.metrics_registry is not None and not isinstance(self.metrics_registry, CollectorRegistry):
            raise ValueError("metrics_registry must be a prometheus_client.CollectorRegistry or None, got "
                             f"{type(self.metrics_registry).__name__}")
        if self.on_membership_change is not None and not callable(self.on_membership_change):
            raise ValueError("on_membership_change must be callable (it is called with the member ids) or None, got "
                             f"{type(self.on_membership_change).__name__}")
        if self.on_wait is not None and not callable(self.on_wait):
            raise ValueError(f"on_wait must be callable (it is called with a sentence) or None, got "
                             f"{type(self.on_wait).__name__}")


#: The keywords ``DistributedOptimizer`` took before the option groups -> the group that holds them now.
MOVED_KEYWORDS: dict[str, str] = {
    **dict.fromkeys(("mode", "staleness", "scale_lr_by_staleness"), "consistency"),
    **dict.fromkeys(("chunk_bytes", "push_dtype", "pull_dtype", "checksum", "max_message_bytes", "rpc_timeout",
                     "connect_timeout", "retry_seconds", "security", "streamed"), "wire"),
    **dict.fromkeys(("metrics_port", "metrics_host", "metrics_registry", "on_membership_change"), "observability"),
}
_GROUP_CLASSES = {"consistency": "ConsistencyOptions", "wire": "WireOptions", "observability": "ObservabilityOptions"}


def moved_keywords_error(names: Iterable[str], where: str = "DistributedOptimizer") -> TypeError:
    """The error for keywords ``where()`` does not take: those that moved into a group name the group to use.

    Returns the ``TypeError`` (the caller raises it), e.g. ``DistributedOptimizer() takes these keywords in
    option groups now: mode=, staleness= moved to consistency=ConsistencyOptions(mode=..., staleness=...)``.
    """
    names = list(names)
    moved: dict[str, list[str]] = {}
    for name in names:
        if name in MOVED_KEYWORDS:
            moved.setdefault(MOVED_KEYWORDS[name], []).append(name)
    unknown = [name for name in names if name not in MOVED_KEYWORDS]
    parts = []
    if moved:
        parts.append(f"{where}() takes these keywords in option groups now (shardps.worker.config): " + "; ".join(
            f"{', '.join(n + '=' for n in group_names)} moved to "
            f"{group}={_GROUP_CLASSES[group]}({', '.join(n + '=...' for n in group_names)})"
            for group, group_names in moved.items()))
    if unknown:
        parts.append(f"{where}() got unexpected keyword argument(s) {', '.join(repr(n) for n in unknown)}")
    return TypeError("; ".join(parts))


def node_refusal(name: str) -> str:
    """Why ``NodeOptimizer`` refuses the keyword ``name`` (``model``, ``grad_scaler``, ``push_during_backward``), and
    what to use instead (the ``ValueError`` message, raised on every local rank before any collective)."""
    if name == "grad_scaler":
        return ("NodeOptimizer does not take grad_scaler= (AMP loss scaling with reduction within a node: the node's "
                "ranks would each have to learn one found-inf verdict): use DistributedOptimizer(grad_scaler=) per rank, "
                "or bf16 autocast (which needs no GradScaler)")
    return f"NodeOptimizer does not take {name}=: the node pushes at step() (see its docstring)"

"""Typed configuration of one shard process, with every limit a client's request is checked against."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from shardps.common.cores import usable_cores
from shardps.common.security import token_over_plaintext_problem
from shardps.common.transport import DEFAULT_MAX_MESSAGE_BYTES

#: Room a frame needs beyond its payload (header, key, tags); bounded by the key length check.
FRAME_OVERHEAD_BYTES = 64 << 10


def default_memory_budget_bytes() -> int:
    """80% of the memory this process may use: the cgroup v2 limit if one is set, else physical memory.

    Read once at the edge (CLI, ``ShardConfig`` default). Bytes.
    """
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:  # a Kubernetes pod's memory limit
        text = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        limit = int(text) if text.isdigit() else physical
    except OSError:
        limit = physical
    return int(0.8 * min(physical, limit))


@dataclass(frozen=True, kw_only=True)
class ShardConfig:
    """Settings of one ``shardps-server`` process.

    Attributes:
        shard_index: this shard's index ``i`` in ``[0, num_shards)``.
        num_shards: how many shards the job has.
        host: interface to bind.
        port: TCP port; 0 picks a free one (printed at start). A port already
            in use is an error (``SO_REUSEPORT`` is off).
        min_workers: rounds start once this many workers have joined.
        max_message_bytes: gRPC send/receive message limit in bytes on this
            server; a worker's ``chunk_bytes`` must fit under it.
        max_wait_seconds: longest a pull waits for a version, whatever the
            caller's deadline, in seconds.
        reject_nonfinite: reject pushes whose gradients hold NaN or Inf.
        grace_seconds: how long SIGTERM lets in-flight calls finish.
        max_workers: members at once; a Join beyond it gets RESOURCE_EXHAUSTED.
        max_waiting: Pull/PushPull calls that may wait for a version at once;
            one more gets RESOURCE_EXHAUSTED. A waiting call holds no thread.
        max_streams: ``shardps.v1.Shard`` calls open at once, from every client
            together; one more gets RESOURCE_EXHAUSTED (health calls are never counted).
        max_streams_per_peer: calls open at once from one client host (its IP
            address); one more gets RESOURCE_EXHAUSTED. Also the HTTP/2 streams
            one connection may carry.
        max_connections: connections the main port holds at once (one more is
            closed when accepted): with the health port's 64, what bounds the
            shard's open files (``shardps.server.streams``).
        stream_idle_seconds: a call whose client sends no frame of its request
            stream for this long, while the shard waits for one, ends with
            DEADLINE_EXCEEDED; waits for a round or a version do not count.
        connection_idle_seconds: a connection with no call for this long is
            closed (the client reconnects when it calls again).
        max_id_chars: longest ``worker_id`` (printable characters only).
        max_keys, max_groups, max_chunks, max_dims: limits on the partition
            plan a first joiner may ask for, checked arithmetically before the
            plan is built (building is O(chunks)).
        memory_budget_bytes: the shard's resident bytes a Join may lead to. A
            Join is refused when admission's estimate of the peak (the process
            before any job, parameters, optimizer state, and per member its
            staged gradient and streams: ``membership.admission.memory_estimate``)
            would exceed it.
        table_max_bytes: memory limit of one sparse table on this shard (rows, optimizer state and
            index, bytes; 4 GiB) unless the table declares its own ``max_bytes``: a round that would
            pass it is refused with RESOURCE_EXHAUSTED, never an OOM kill.
        init_timeout_seconds: how long the worker told to initialise has to
            start its Init (the clock stops while the stream is received);
            after it, the next Join takes the role over and waiting pulls are
            told to join again.
        checkpoint_dir: where checkpoints go (``<dir>/shard-<index>``); empty: none.
            A shard started on a directory holding checkpoints restores the newest intact one.
        checkpoint_every_rounds, checkpoint_every_seconds: write a checkpoint
            when this many rounds or seconds passed since the last (0: never);
            and always on SIGTERM.
        keep_checkpoints: how many checkpoints to keep.
        restore_version: restore the newest checkpoint of at most this version
            (0: the newest), e.g. the version every shard of the job still has.
        start_empty_over_damaged_checkpoints: start with no job (a WARNING) when the
            checkpoint directory holds checkpoints but none is intact; False (default):
            refuse to start (exit 1) naming the directory and the damaged files.
        lease_seconds: a member that makes no call (workers send a Heartbeat
            every third of it) for this long is dropped, as if it had left:
            the open round stops waiting for it.
        mode: when set (``sync``, ``async`` or ``ssp``), workers that train in another
            mode are refused; empty: the job's first joiner fixes it.
        metrics_port: port of the Prometheus HTTP endpoint (0: a free one); -1: no endpoint.
        metrics_host: interface of the metrics endpoint; empty: ``host``.
        health_port: port of a plaintext gRPC server holding only the health service,
            for Kubernetes probes when the main port is TLS (0: a free one); -1: none.
        tls_cert, tls_key: PEM files of this shard's certificate and key; both set: the port serves TLS.
        tls_ca: PEM file of the CA that signs client certificates; set: mutual TLS (clients must
            present a certificate it signed).
        auth_token_file: file holding the bearer token every ``shardps.v1.Shard`` call must carry.
        allow_token_over_plaintext: with ``auth_token_file`` and no TLS, serve on a ``host`` that is not
            loopback anyway (the token then travels in clear text; a WARNING is logged at start).
            False: that configuration is refused (``ValueError`` naming the fix).
        log_level: the process's log level (DEBUG, INFO, WARNING or ERROR).
        threads: torch threads of the optimizer step (``torch.set_num_threads``
            at start); 0 (or left out): :func:`usable_cores`, the cores the
            process may use (affinity and cgroup CPU quota).
    """

    shard_index: int
    num_shards: int
    host: str = "127.0.0.1"
    port: int = 0
    min_workers: int = 1
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_wait_seconds: float = 600.0
    reject_nonfinite: bool = True
    grace_seconds: float = 5.0
    max_workers: int = 1024
    max_waiting: int = 4096
    max_streams: int = 4096
    max_streams_per_peer: int = 1024
    max_connections: int = 4096
    stream_idle_seconds: float = 120.0
    connection_idle_seconds: float = 300.0
    max_id_chars: int = 256
    max_keys: int = 1 << 17
    max_groups: int = 4096
    max_chunks: int = 1 << 18
    max_dims: int = 32
    memory_budget_bytes: int = field(default_factory=default_memory_budget_bytes)
    table_max_bytes: int = 1 << 32
    init_timeout_seconds: float = 60.0
    lease_seconds: float = 10.0
    checkpoint_dir: str = ""
    checkpoint_every_rounds: int = 0
    checkpoint_every_seconds: float = 0.0
    keep_checkpoints: int = 3
    restore_version: int = 0
    start_empty_over_damaged_checkpoints: bool = False
    mode: str = ""
    metrics_port: int = -1
    metrics_host: str = ""
    health_port: int = -1
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    auth_token_file: str = ""
    allow_token_over_plaintext: bool = False
    log_level: str = "INFO"
    threads: int = field(default_factory=usable_cores)

    def __post_init__(self) -> None:
        if self.threads == 0:
            object.__setattr__(self, "threads", usable_cores())
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(f"shard_index must be in [0, {self.num_shards}), got {self.shard_index}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("metrics_port", "health_port"):
            if not -1 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be in [0, 65535] (or -1: off), got {getattr(self, name)}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together: give both or neither")
        if self.tls_ca and not self.tls_cert:
            raise ValueError("--tls-ca (mutual TLS) needs --tls-cert and --tls-key: the shard must serve TLS")
        for name in ("tls_cert", "tls_key", "tls_ca", "auth_token_file"):
            path = getattr(self, name)
            if path and not os.access(path, os.R_OK):
                raise ValueError(f"--{name.replace('_', '-')} {path}: no such readable file")
        if self.auth_token_file and not self.tls_cert and not self.allow_token_over_plaintext and \
                (problem := token_over_plaintext_problem(self.host, "shardps-server --host")):
            raise ValueError(problem)
        if self.min_workers < 1:
            raise ValueError(f"min_workers must be >= 1, got {self.min_workers}")
        if self.max_message_bytes < 2 * FRAME_OVERHEAD_BYTES:
            raise ValueError(f"max_message_bytes must be >= {2 * FRAME_OVERHEAD_BYTES}, got {self.max_message_bytes}")
        if self.max_wait_seconds <= 0 or self.grace_seconds < 0 or self.init_timeout_seconds <= 0:
            raise ValueError("max_wait_seconds and init_timeout_seconds must be > 0 and grace_seconds >= 0")
        if min(self.checkpoint_every_rounds, self.checkpoint_every_seconds, self.restore_version) < 0 or \
                self.keep_checkpoints < 1:
            raise ValueError("checkpoint_every_rounds, checkpoint_every_seconds and restore_version must be >= 0, "
                             "keep_checkpoints >= 1")
        if self.log_level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(f"log_level must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}")
        if self.mode not in ("", "sync", "async", "ssp"):
            raise ValueError(f"mode must be sync, async or ssp, got {self.mode!r}")
        if not 0.5 <= self.lease_seconds <= 3600:
            raise ValueError(f"lease_seconds must be in [0.5, 3600], got {self.lease_seconds}")
        if self.max_workers < self.min_workers:
            raise ValueError(f"max_workers ({self.max_workers}) must be >= min_workers ({self.min_workers})")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1 (or 0: the usable cores), got {self.threads}")
        if self.stream_idle_seconds <= 0 or self.connection_idle_seconds <= 0:
            raise ValueError("stream_idle_seconds and connection_idle_seconds must be > 0")
        for name in ("max_streams", "max_streams_per_peer", "max_connections", "max_waiting", "max_id_chars",
                     "max_keys", "max_groups", "max_chunks", "max_dims",
                     "memory_budget_bytes", "table_max_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def max_chunk_bytes(self) -> int:
        """Largest ``chunk_bytes`` a worker may use with this shard."""
        return self.max_message_bytes - FRAME_OVERHEAD_BYTES

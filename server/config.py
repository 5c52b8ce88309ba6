"""Typed configuration of one shard process."""

from __future__ import annotations

from dataclasses import dataclass

from shardps.proto.transport import DEFAULT_MAX_MESSAGE_BYTES

#: Room a frame needs beyond its payload (header, key, tags); bounded by the key length check.
FRAME_OVERHEAD_BYTES = 64 << 10


@dataclass(frozen=True, kw_only=True)
class ShardConfig:
    """Settings of one ``shardps-server`` process.

    Attributes:
        shard_index: this shard's index ``i`` in ``[0, num_shards)``.
        num_shards: how many shards the job has.
        host: interface to bind.
        port: TCP port; 0 picks a free one (printed at start).
        min_workers: rounds start once this many workers have joined.
        max_message_bytes: gRPC send/receive message limit in bytes on this
            server; a worker's ``chunk_bytes`` must fit under it.
        max_wait_seconds: longest a pull waits for a version, whatever the
            caller's deadline, in seconds.
        grpc_threads: gRPC handler threads; each blocked pull holds one.
        reject_nonfinite: reject pushes whose gradients hold NaN or Inf.
        grace_seconds: how long SIGTERM lets in-flight calls finish.
    """

    shard_index: int
    num_shards: int
    host: str = "127.0.0.1"
    port: int = 0
    min_workers: int = 1
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_wait_seconds: float = 600.0
    grpc_threads: int = 64
    reject_nonfinite: bool = True
    grace_seconds: float = 5.0

    def __post_init__(self) -> None:
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(f"shard_index must be in [0, {self.num_shards}), got {self.shard_index}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.min_workers < 1:
            raise ValueError(f"min_workers must be >= 1, got {self.min_workers}")
        if self.max_message_bytes < 2 * FRAME_OVERHEAD_BYTES:
            raise ValueError(f"max_message_bytes must be >= {2 * FRAME_OVERHEAD_BYTES}, got {self.max_message_bytes}")
        if self.max_wait_seconds <= 0 or self.grace_seconds < 0:
            raise ValueError("max_wait_seconds must be > 0 and grace_seconds >= 0")
        if self.grpc_threads < 4:
            raise ValueError(f"grpc_threads must be >= 4, got {self.grpc_threads}")

    @property
    def max_chunk_bytes(self) -> int:
        """Largest ``chunk_bytes`` a worker may use with this shard."""
        return self.max_message_bytes - FRAME_OVERHEAD_BYTES

"""gRPC channel and server options shared by both ends of the wire."""

from __future__ import annotations

#: Default gRPC message limit on both ends, bytes: a 4 MiB chunk plus headroom.
DEFAULT_MAX_MESSAGE_BYTES = 8 << 20

#: Keep-alive ping period of both ends, milliseconds.
KEEPALIVE_MS = 30_000
#: The shortest ping interval a server accepts without data, milliseconds (well under ``KEEPALIVE_MS``).
MIN_PING_INTERVAL_MS = 10_000


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Options for ``grpc.server`` and ``grpc.insecure_channel``.

    Message sizes are bounded explicitly (never unlimited), in bytes. Keep-alive
    pings let either side notice a dead peer on an idle connection: clients
    ping every ``KEEPALIVE_MS`` and servers accept pings as often as every
    ``MIN_PING_INTERVAL_MS`` (a third of it), so a server never answers a
    client's pings with GOAWAY ``too_many_pings``.

    Raises:
        ValueError: ``max_message_bytes`` is not positive or exceeds 1 GiB.
    """
    if not 0 < max_message_bytes <= 1 << 30:
        raise ValueError(f"max_message_bytes must be in (0, 1 GiB], got {max_message_bytes}")
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # servers accept the clients' pings above (the default would GOAWAY them)
        ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
        # a shard that restarts is reconnected to within about a second (gRPC's
        # default backoff grows to 120 s); the worker's own retries are bounded
        # by their RetryPolicy
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 1_000),
        # Bulk transfer: read the socket in MiB pieces, not 8 KiB ones, and let
        # HTTP/2 carry whole chunks per frame with a large fixed window. On
        # loopback this takes a raw-bytes stream from ~1.1 to ~1.8 GB/s
        # (benchmarks/wire.py measures the ceiling with these same options).
        ("grpc.experimental.tcp_read_chunk_size", 4 << 20),
        ("grpc.experimental.tcp_min_read_chunk_size", 1 << 20),
        ("grpc.experimental.tcp_max_read_chunk_size", 8 << 20),
        ("grpc.http2.lookahead_bytes", 16 << 20),
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.max_frame_size", (16 << 20) - 1),
    ]

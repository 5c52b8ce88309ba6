"""gRPC options: keep-alive pings that a shard never answers with GOAWAY ``too_many_pings``; bounded reconnects."""

from shardps.common import transport
from shardps.worker.session.retry import RetryPolicy


def test_clients_never_ping_faster_than_shards_accept() -> None:
    options = dict(transport.channel_options())
    # gRPC core counts a "ping strike" when a ping arrives sooner than the server's minimum interval and
    # sends GOAWAY too_many_pings after two strikes: the client's period must stay well above that minimum.
    assert options["grpc.keepalive_time_ms"] >= 2 * options["grpc.http2.min_recv_ping_interval_without_data_ms"]
    assert options["grpc.keepalive_permit_without_calls"] == 1  # ...so the shard must accept pings on idle channels
    assert options["grpc.http2.max_pings_without_data"] == 0
    assert options["grpc.max_reconnect_backoff_ms"] <= 1_000  # a restarted shard is reconnected to within ~1 s


def test_backoff_is_capped_exponential_with_full_jitter() -> None:
    import random

    policy = RetryPolicy(total_seconds=10, initial_delay=0.05, max_delay=2.0)
    rng = random.Random(0)
    for attempt in range(12):
        cap = min(2.0, 0.05 * 2 ** attempt)
        delays = [policy.delay(attempt, rng) for _ in range(200)]
        assert all(0 <= d <= cap for d in delays)
        assert max(delays) > 0.8 * cap and min(delays) < 0.2 * cap  # spread over [0, cap]: full jitter

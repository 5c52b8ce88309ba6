"""``shardps-server``: run one shard until SIGTERM/SIGINT.

Prints ``shardps-server shard I/N listening on HOST:PORT`` on stdout once it
serves (``--port 0`` picks a free port). On SIGTERM it reports NOT_SERVING
through the gRPC health service, fails waiting pulls with UNAVAILABLE, lets
in-flight calls finish for ``--grace-seconds`` and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

import torch
from grpc_health.v1 import health

from shardps.server.config import ShardConfig
from shardps.server.service import create_server
from shardps.server.store import ShardStore

log = logging.getLogger("shardps.server")


def parse_args(argv: list[str] | None = None) -> ShardConfig:
    p = argparse.ArgumentParser(prog="shardps-server", description="Run one shardps shard.")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1; 0.0.0.0 in pods)")
    p.add_argument("--port", type=int, default=0, help="TCP port, 0 for a free one (default 0)")
    p.add_argument("--shard-index", type=int, required=True, help="this shard's index in [0, num-shards)")
    p.add_argument("--num-shards", type=int, required=True, help="number of shards in the job")
    p.add_argument("--min-workers", type=int, default=1, help="rounds start once this many workers joined (default 1)")
    p.add_argument("--max-message-bytes", type=int, default=ShardConfig.max_message_bytes,
                   help="gRPC message limit in bytes (default 8 MiB)")
    p.add_argument("--max-wait-seconds", type=float, default=ShardConfig.max_wait_seconds,
                   help="longest a pull waits for a round (default 600)")
    p.add_argument("--grace-seconds", type=float, default=ShardConfig.grace_seconds,
                   help="SIGTERM grace for in-flight calls (default 5)")
    p.add_argument("--threads", type=int, default=ShardConfig.grpc_threads, help="gRPC handler threads (default 64)")
    p.add_argument("--allow-nonfinite", action="store_true", help="accept NaN/Inf gradients instead of rejecting them")
    a = p.parse_args(argv)
    try:
        return ShardConfig(
            shard_index=a.shard_index, num_shards=a.num_shards, host=a.host, port=a.port,
            min_workers=a.min_workers, max_message_bytes=a.max_message_bytes,
            max_wait_seconds=a.max_wait_seconds, grace_seconds=a.grace_seconds,
            grpc_threads=a.threads, reject_nonfinite=not a.allow_nonfinite,
        )
    except ValueError as exc:
        p.error(str(exc))


def serve(config: ShardConfig, stop: threading.Event) -> None:
    """Serve one shard until ``stop`` is set, then shut down gracefully.

    Raises:
        RuntimeError: the address could not be bound.
    """
    torch.set_num_threads(1)  # one optimizer thread per shard; shards share the node's cores
    store = ShardStore(config)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    server, port = create_server(config, store, health_servicer)
    server.start()
    print(f"shardps-server shard {config.shard_index}/{config.num_shards} listening on {config.host}:{port}",
          flush=True)
    stop.wait()  # blocking wait for SIGTERM/SIGINT
    log.info("shard %d: stopping (version %d)", config.shard_index, store.version)
    health_servicer.enter_graceful_shutdown()
    store.close()
    server.stop(config.grace_seconds).wait()
    log.info("shard %d: stopped", config.shard_index)


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve(config, stop)
    except RuntimeError as exc:
        print(f"shardps-server: {exc}", file=sys.stderr)
        return 1
    return 0

"""``shardps-server``: run one shard until SIGTERM/SIGINT.

Prints ``shardps-server shard I/N listening on HOST:PORT`` on stdout once it
serves (``--port 0`` picks a free port), after ``... metrics on HOST:PORT``
and ``... health on HOST:PORT`` lines when ``--metrics-port`` and
``--health-port`` are given. On SIGTERM it reports NOT_SERVING
through the gRPC health service, fails waiting pulls with UNAVAILABLE, lets
in-flight calls finish for ``--grace-seconds`` and exits 0. A port already
in use is an error (exit 1).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

import torch
from grpc_health.v1 import health

from shardps.common.memory import retain_freed_memory
from shardps.common.security import warn_token_over_plaintext
from shardps.common.version import shardps_version
from shardps.server.config import ShardConfig
from shardps.server.metrics import MetricsInterceptor
from shardps.server.service import create_server
from shardps.server.store import ShardStore

log = logging.getLogger("shardps.server")


def build_parser() -> argparse.ArgumentParser:
    """The ``shardps-server`` argument parser (docs/configuration.md lists every flag; a test checks it)."""
    d = ShardConfig
    p = argparse.ArgumentParser(prog="shardps-server", description="Run one shardps shard.")
    p.add_argument("--version", action="version", version=f"shardps-server {shardps_version()}")
    p.add_argument("--log-level", choices=("DEBUG", "INFO", "WARNING", "ERROR"), default="INFO",
                   help="log level of the shard's log on stderr (default INFO)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1; 0.0.0.0 in pods)")
    p.add_argument("--port", type=int, default=0, help="TCP port, 0 for a free one (default 0); a port in use is an error")
    p.add_argument("--shard-index", type=int, required=True, help="this shard's index in [0, num-shards)")
    p.add_argument("--num-shards", type=int, required=True, help="number of shards in the job")
    p.add_argument("--min-workers", type=int, default=1, help="rounds start once this many workers joined (default 1)")
    p.add_argument("--max-workers", type=int, default=d.max_workers,
                   help=f"members at once; more Joins are refused (default {d.max_workers})")
    p.add_argument("--max-waiting", type=int, default=d.max_waiting,
                   help=f"calls waiting for a version at once (default {d.max_waiting})")
    p.add_argument("--max-streams", type=int, default=d.max_streams,
                   help=f"calls open at once from every client together; more get RESOURCE_EXHAUSTED "
                        f"(default {d.max_streams}; health calls are never counted)")
    p.add_argument("--max-streams-per-peer", type=int, default=d.max_streams_per_peer,
                   help=f"calls open at once from one client host (IP address); more get RESOURCE_EXHAUSTED "
                        f"(default {d.max_streams_per_peer})")
    p.add_argument("--max-connections", type=int, default=d.max_connections,
                   help=f"connections the port holds at once; more are closed when accepted. Bounds the shard's "
                        f"open files (default {d.max_connections})")
    p.add_argument("--stream-idle-seconds", type=float, default=d.stream_idle_seconds,
                   help=f"end a call whose client sends no frame of its request stream for this long while the "
                        f"shard waits for one (default {d.stream_idle_seconds:.0f}; waits for a round do not count)")
    p.add_argument("--connection-idle-seconds", type=float, default=d.connection_idle_seconds,
                   help=f"close connections with no call for this long (default {d.connection_idle_seconds:.0f})")
    p.add_argument("--memory-budget-bytes", type=int, default=None,
                   help="the shard's resident bytes a Join may lead to; Joins whose estimate (the process, "
                        "parameters, optimizer state, per member its staged gradient and streams) exceeds it are "
                        "refused (default: 80%% of the memory limit of this machine or cgroup)")
    p.add_argument("--max-chunks", type=int, default=d.max_chunks,
                   help=f"most chunks a job's plan may have (default {d.max_chunks})")
    p.add_argument("--init-timeout", type=float, default=d.init_timeout_seconds,
                   help=f"seconds the initialising worker has to send Init (default {d.init_timeout_seconds:.0f})")
    p.add_argument("--lease-seconds", type=float, default=d.lease_seconds,
                   help=f"a worker silent this long (no heartbeat, no call) is dropped (default {d.lease_seconds:.0f})")
    p.add_argument("--checkpoint-dir", default="",
                   help="write checkpoints to DIR/shard-INDEX and restore the newest intact one at start")
    p.add_argument("--checkpoint-every-rounds", type=int, default=0, help="checkpoint every N rounds (0: off)")
    p.add_argument("--checkpoint-every-seconds", type=float, default=0.0, help="checkpoint every T seconds (0: off)")
    p.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints,
                   help=f"checkpoints kept (default {d.keep_checkpoints})")
    p.add_argument("--restore-version", type=int, default=0,
                   help="restore the newest checkpoint of at most this version (default: the newest)")
    p.add_argument("--start-empty-over-damaged-checkpoints", action="store_true",
                   help="start with no job (logged as a WARNING) when --checkpoint-dir holds checkpoints but none "
                        "is intact; default: refuse to start, naming the damaged files")
    p.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes,
                   help="gRPC message limit in bytes (default 8 MiB)")
    p.add_argument("--table-max-bytes", type=int, default=d.table_max_bytes,
                   help="memory limit of one sparse table on this shard, bytes, unless the table sets its own "
                        "(default 4 GiB): a round past it is refused with RESOURCE_EXHAUSTED")
    p.add_argument("--max-wait-seconds", type=float, default=d.max_wait_seconds,
                   help="longest a pull waits for a round (default 600)")
    p.add_argument("--grace-seconds", type=float, default=d.grace_seconds,
                   help="SIGTERM grace for in-flight calls (default 5)")
    p.add_argument("--mode", choices=("sync", "async", "ssp"), default="",
                   help="refuse workers that train in another consistency mode (default: the first worker's)")
    p.add_argument("--allow-nonfinite", action="store_true", help="accept NaN/Inf gradients instead of rejecting them")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads of the optimizer step (default 0: the cores this process may use, from its "
                        "CPU affinity and cgroup CPU quota)")
    o = p.add_argument_group("operations")
    o.add_argument("--metrics-port", type=int, default=-1,
                   help="serve Prometheus metrics over HTTP on this port (0: a free one; default: off)")
    o.add_argument("--metrics-host", default="", help="interface of the metrics endpoint (default: --host)")
    o.add_argument("--health-port", type=int, default=-1,
                   help="also serve the gRPC health service alone, in plaintext, on this port, for probes that "
                        "cannot do TLS (0: a free one; default: off; health is always on --port too)")
    o.add_argument("--tls-cert", default="", help="PEM certificate of this shard: serve TLS (with --tls-key)")
    o.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    o.add_argument("--tls-ca", default="",
                   help="PEM CA certificate: require client certificates signed by it (mutual TLS)")
    o.add_argument("--auth-token-file", default="",
                   help="file holding a bearer token every shardps call must carry (health is not checked)")
    o.add_argument("--allow-token-over-plaintext", action="store_true",
                   help="with --auth-token-file and no --tls-cert, serve on a --host that is not loopback anyway "
                        "(the token travels in clear text; logs a WARNING); default: refuse to start")
    return p


def parse_args(argv: list[str] | None = None) -> ShardConfig:
    """``shardps-server``'s flags as a checked :class:`ShardConfig`.

    Raises:
        SystemExit: a flag is missing or malformed (argparse prints the usage), or
            the values do not make a valid ``ShardConfig`` (the message names the fix).
    """
    parser = build_parser()
    a = parser.parse_args(argv)
    budget = {} if a.memory_budget_bytes is None else {"memory_budget_bytes": a.memory_budget_bytes}
    try:
        return ShardConfig(
            shard_index=a.shard_index, num_shards=a.num_shards, host=a.host, port=a.port,
            min_workers=a.min_workers, max_workers=a.max_workers, max_waiting=a.max_waiting,
            max_streams=a.max_streams, max_streams_per_peer=a.max_streams_per_peer,
            max_connections=a.max_connections, stream_idle_seconds=a.stream_idle_seconds,
            connection_idle_seconds=a.connection_idle_seconds,
            max_chunks=a.max_chunks, table_max_bytes=a.table_max_bytes, init_timeout_seconds=a.init_timeout,
            lease_seconds=a.lease_seconds,
            checkpoint_dir=a.checkpoint_dir, checkpoint_every_rounds=a.checkpoint_every_rounds,
            checkpoint_every_seconds=a.checkpoint_every_seconds, keep_checkpoints=a.keep_checkpoints,
            restore_version=a.restore_version,
            start_empty_over_damaged_checkpoints=a.start_empty_over_damaged_checkpoints, mode=a.mode,
            metrics_port=a.metrics_port,
            metrics_host=a.metrics_host, health_port=a.health_port, tls_cert=a.tls_cert, tls_key=a.tls_key,
            tls_ca=a.tls_ca, auth_token_file=a.auth_token_file,
            allow_token_over_plaintext=a.allow_token_over_plaintext, log_level=a.log_level,
            max_message_bytes=a.max_message_bytes, max_wait_seconds=a.max_wait_seconds,
            grace_seconds=a.grace_seconds, reject_nonfinite=not a.allow_nonfinite, threads=a.threads, **budget,
        )
    except ValueError as exc:
        parser.error(str(exc))


async def serve(config: ShardConfig, stop: asyncio.Event) -> None:
    """Serve one shard until ``stop`` is set, then shut down gracefully.

    Raises:
        RuntimeError: the address could not be bound.
    """
    torch.set_num_threads(config.threads)  # --threads: by default the cores this process may use
    log.info("shard %d: malloc %s", config.shard_index, retain_freed_memory())  # chunk buffers reused, not refaulted
    if config.auth_token_file and not config.tls_cert:  # allowed over plaintext: loopback, or the operator said so
        warn_token_over_plaintext(config.host, f"shardps-server shard {config.shard_index}")
    store = ShardStore(config)
    health_servicer = health.aio.HealthServicer()
    await store.checkpoints.restore()  # the newest intact checkpoint of --checkpoint-dir, if any
    servers = await create_server(config, store, health_servicer,
                                  interceptors=(MetricsInterceptor(store.metrics),))
    name = f"shardps-server shard {config.shard_index}/{config.num_shards}"
    if config.metrics_port >= 0:
        host = config.metrics_host or config.host
        print(f"{name} metrics on {host}:{store.metrics.serve(host, config.metrics_port)}", flush=True)
    if servers.health_port >= 0:
        print(f"{name} health on {config.host}:{servers.health_port}", flush=True)
    await servers.start()
    store.warm_up()
    print(f"{name} listening on {config.host}:{servers.port}", flush=True)
    await stop.wait()  # until SIGTERM/SIGINT
    log.info("shard %d: stopping (version %d)", config.shard_index, store.version)
    await health_servicer.enter_graceful_shutdown()
    store.close()
    await store.checkpoints.final()  # every round applied so far
    await servers.stop(config.grace_seconds)
    log.info("shard %d: stopped", config.shard_index)


async def _main(config: ShardConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve(config, stop)


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(_main(config))
    except RuntimeError as exc:
        print(f"shardps-server: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``shardps serve``: a serving replica of a training job's tables, refreshed by touched-row deltas.

    shardps serve --servers HOST:PORT,... --tables user,item,user_bias,item_bias [--port 0] [--period 0.5]
                  [--dense-every 5] [--metrics-port -1]

Prints ``serving on HOST:PORT`` once listening (and ``metrics on HOST:PORT`` with ``--metrics-port``); the gRPC
health service says NOT_SERVING until the first state is read (the shards may not be up yet: it keeps trying
every period), SERVING after. SIGTERM or Ctrl-C: NOT_SERVING, the calls in flight get 5 s, exit 0.
"""

from __future__ import annotations

import argparse
import signal
import threading
import time

__all__ = ["add_command"]


def add_command(sub, servers_type) -> None:
    """Register ``serve`` on the CLI's subparsers (its ``run`` default runs it)."""
    s = sub.add_parser("serve", help="serve a job's tables read-only, refreshed from the training shards")
    s.add_argument("--servers", type=servers_type, required=True, help="training shards host:port,... in order")
    s.add_argument("--tables", required=True, help="comma-separated names of the tables to serve")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=0, help="port of the Serving and health services (default 0: free)")
    s.add_argument("--period", type=float, default=0.5, help="seconds between two refreshes (default 0.5, >= 0.05)")
    s.add_argument("--dense-every", type=float, default=5.0,
                   help="seconds between two reads of the dense parameters (default 5; < 0: never)")
    s.add_argument("--metrics-port", type=int, default=-1, help="Prometheus metrics port (0: free; default: off)")
    s.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run the replica until SIGTERM or Ctrl-C; returns the exit status (0)."""
    from prometheus_client import start_http_server
    from grpc_health.v1 import health_pb2

    from shardps.worker.serving.replica import Replica
    from shardps.worker.serving.service import serve

    tables = [t for t in args.tables.split(",") if t]
    replica = Replica(args.servers, tables, period=args.period, dense_every=None if args.dense_every < 0 else
                      args.dense_every)
    server, port, metrics, checks = serve(replica, args.host, args.port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        print(f"serving on {args.host}:{port}", flush=True)
        if args.metrics_port >= 0:
            http, _ = start_http_server(args.metrics_port, addr=args.host, registry=metrics.registry)
            print(f"metrics on {args.host}:{http.server_port}", flush=True)
        while not stop.is_set() and replica.state is None:  # the first state: the shards may still be starting
            try:
                replica.refresh()
            except Exception as exc:  # noqa: BLE001 - said, and tried again
                print(f"waiting for the shards: {exc}", flush=True)
                stop.wait(max(args.period, 1.0))
        if replica.state is not None:
            checks.set("", health_pb2.HealthCheckResponse.SERVING)
            replica.start()
            print(f"serving tables {', '.join(tables)} (state 1 read)", flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        checks.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        server.stop(5).wait(10)
        replica.close()
    return 0


def wait_for(lines, prefix: str, timeout: float = 60.0) -> str:
    """The first of ``lines`` (an iterator of text lines) starting with ``prefix``, within ``timeout`` seconds
    (for launchers and tests reading ``serving on HOST:PORT``).

    Raises:
        TimeoutError: none came in time.
    """
    deadline = time.monotonic() + timeout
    for line in lines:
        if line.startswith(prefix):
            return line[len(prefix):].strip()
        if time.monotonic() > deadline:
            break
    raise TimeoutError(f"no {prefix!r} line within {timeout:g} s")

"""``shardps serve``: a serving replica of a training job's tables, refreshed by touched-row deltas.

    shardps serve --servers HOST:PORT,... --tables user,item,user_bias,item_bias [--port 0] [--period 0.5]
                  [--dense-every 5] [--metrics-port -1] [--threads 1] [--nice 0 | --realtime 0]
                  [--model MODULE:CALLABLE]
                  [--freshness-redis URL]
                  [--tls-cert FILE --tls-key FILE [--tls-ca FILE]] [--auth-token-file FILE] [--health-port -1]
                  [--shards-tls-ca FILE [--shards-tls-cert FILE --shards-tls-key FILE]]
                  [--shards-auth-token-file FILE]

Prints ``serving on HOST:PORT`` once listening (after ``health on HOST:PORT`` with ``--health-port``, and
``metrics on HOST:PORT`` with ``--metrics-port``); the gRPC health service says NOT_SERVING until the first
state is read (the shards may not be up yet: it keeps trying every period), SERVING after. SIGTERM or Ctrl-C:
NOT_SERVING, the calls in flight get 5 s, exit 0.

Security, as the shards': ``--tls-cert``/``--tls-key`` serve the Serving port with TLS, ``--tls-ca`` also
requires client certificates signed by that CA (mutual TLS), ``--auth-token-file`` ends every Serving call
without ``authorization: Bearer <token>`` with UNAUTHENTICATED (the shards' check,
``shardps.server.auth.BearerTokenInterceptor``; health calls pass), and a token over plaintext on a ``--host``
that is not loopback is refused unless ``--allow-token-over-plaintext`` (a WARNING). ``--health-port`` serves
health alone in plaintext for probes that cannot do TLS. The replica reaches the training shards with the
``--shards-*`` flags, the client flags of the other commands (``--tls-ca``, ...) under another name, since its
own port takes those.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading

import grpc

from shardps.common.security import INSECURE_FLAG
from shardps.server.auth import HANDLER_KINDS, HEALTH_PREFIX, BearerTokenInterceptor

__all__ = ["TokenCheck", "add_command", "own_security", "run", "shards_security"]

log = logging.getLogger("shardps.serve")

#: Prefix of the flags of the replica's own calls to the training shards (``--shards-tls-ca``, ...).
SHARDS = "--shards-"


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
    s.add_argument("--threads", type=int, default=1,
                   help="torch threads for lookups, scores and refreshes (default 1: a query's work is small, and "
                        "more threads contend for the cores training shares)")
    s.add_argument("--nice", type=int, default=0,
                   help="the replica's scheduling priority, -20 (first) to 19 (last), as nice(1) (default 0: "
                        "unchanged). On a host shared with training, a negative value lets queries run before "
                        "training's work (a lower value needs CAP_SYS_NICE: root, or the container's "
                        "capabilities.add: [SYS_NICE])")
    s.add_argument("--realtime", type=int, default=0, metavar="PRIORITY",
                   help="run the replica under the real-time policy SCHED_FIFO at this priority, 1 to 99 (default 0: "
                        "off). On a host whose cores training keeps busy, a query's threads then take a core at "
                        "once instead of waiting their turn; needs CAP_SYS_NICE, --threads 1 and no --nice")
    s.add_argument("--model", default="", metavar="MODULE:CALLABLE",
                   help="a zero-argument callable returning the job's model (with its sharded tables), e.g. "
                        "shardps.apps.movielens:serving_model: Predict runs it, made local from each state "
                        "(default: Predict is refused)")
    s.add_argument("--freshness-redis", default="", metavar="URL",
                   help="the Redis broker (redis://host:port/db) whose streams the job trains: each event a new "
                        "state makes visible is read from its stream and observed in the Prometheus histogram "
                        "shardps_serving_event_freshness_seconds (event time to visible here; default: off)")
    o = s.add_argument_group("security of the Serving port (as the shards' flags)")
    o.add_argument("--tls-cert", default="", metavar="FILE",
                   help="PEM certificate of this replica: serve TLS (with --tls-key)")
    o.add_argument("--tls-key", default="", metavar="FILE", help="PEM private key of --tls-cert")
    o.add_argument("--tls-ca", default="", metavar="FILE",
                   help="PEM CA certificate: require client certificates signed by it (mutual TLS)")
    o.add_argument("--auth-token-file", default="", metavar="FILE",
                   help="file holding a bearer token every Serving call must carry (health is not checked)")
    o.add_argument(INSECURE_FLAG, action="store_true",
                   help="with --auth-token-file and no --tls-cert, serve on a --host that is not loopback anyway "
                        "(the token travels in clear text; logs a WARNING); default: refuse to start")
    o.add_argument("--health-port", type=int, default=-1,
                   help="also serve the gRPC health service alone, in plaintext, on this port, for probes that "
                        "cannot do TLS (0: a free one; default: off; health is always on --port too)")
    c = s.add_argument_group("security of the calls to the training shards (the other commands' --tls-ca, ...)")
    c.add_argument(SHARDS + "tls-ca", default="", metavar="FILE",
                   help="PEM CA certificate that signed the shards' certificates; given: connect with TLS")
    c.add_argument(SHARDS + "tls-cert", default="", metavar="FILE",
                   help="PEM client certificate, for shards that require client certificates (with "
                        "--shards-tls-key)")
    c.add_argument(SHARDS + "tls-key", default="", metavar="FILE", help="PEM private key of --shards-tls-cert")
    c.add_argument(SHARDS + "auth-token-file", default="", metavar="FILE",
                   help="file holding the bearer token the shards require (sent as 'authorization: Bearer ...')")
    c.add_argument(SHARDS + INSECURE_FLAG.removeprefix("--"), action="store_true",
                   help="send --shards-auth-token-file without --shards-tls-ca to shards that are not on a loopback "
                        "address (refused otherwise); logs a WARNING")
    s.set_defaults(run=run)


class TokenCheck(grpc.ServerInterceptor):
    """The shards' bearer-token check (``shardps.server.auth.BearerTokenInterceptor``: its ``problem`` decides) on
    the replica's threaded gRPC server: a call without the token ends with UNAUTHENTICATED before its handler runs;
    ``grpc.health.v1.Health`` calls always pass.

    Raises:
        ValueError: the token is empty or malformed.
    """

    def __init__(self, token: str) -> None:
        self.check = BearerTokenInterceptor(token)

    def __repr__(self) -> str:
        return f"TokenCheck(<hidden>, refused={self.check.refused})"

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(HEALTH_PREFIX):
            return continuation(handler_call_details)
        problem = self.check.problem(handler_call_details.invocation_metadata)
        if problem is None:
            return continuation(handler_call_details)
        check = self.check
        check.refused += 1
        if check.refused % check.LOG_EVERY == 1:
            log.warning("refused %s: %s (%d unauthenticated calls refused so far)", method, problem, check.refused)
        message = (f"{method}: {problem}; calls to this replica need the metadata 'authorization: Bearer <token>' "
                   "with the token of its --auth-token-file")

        def refuse(request_or_iterator, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        handler = continuation(handler_call_details)
        kind = (False, False) if handler is None else (bool(handler.request_streaming),
                                                        bool(handler.response_streaming))
        return HANDLER_KINDS[kind](refuse)  # no deserializer: the request is never parsed


def own_security(args: argparse.Namespace) -> tuple[grpc.ServerCredentials | None, list[grpc.ServerInterceptor]]:
    """The Serving port's TLS credentials (None: plaintext) and token check (or none), as ``shardps-server``'s
    flags ask for them, checked before anything starts.

    Raises:
        ValueError: ``--tls-cert`` without ``--tls-key`` or the other way round, ``--tls-ca`` without them, a file
            missing, unreadable or not PEM, a malformed token file (the message names the flag), or a token over
            plaintext on a ``--host`` that is not loopback without ``--allow-token-over-plaintext``.
        RuntimeError: gRPC cannot use the certificate or key.
    """
    from shardps.common.security import read_token_file, server_credentials, token_over_plaintext_problem
    from shardps.worker.serving.service import check_credentials

    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together: give both or neither")
    if args.tls_ca and not args.tls_cert:
        raise ValueError("--tls-ca (mutual TLS) needs --tls-cert and --tls-key: the replica must serve TLS")
    credentials = server_credentials(args.tls_cert, args.tls_key, args.tls_ca) if args.tls_cert else None
    interceptors = [TokenCheck(read_token_file(args.auth_token_file))] if args.auth_token_file else []
    if args.auth_token_file and not args.tls_cert and not args.allow_token_over_plaintext and \
            (problem := token_over_plaintext_problem(args.host, "shardps serve --host")):
        raise ValueError(f"{problem} (shardps serve: --tls-cert/--tls-key serve its own port with TLS)")
    if credentials is not None:
        check_credentials(credentials)
    return credentials, interceptors


def shards_security(args: argparse.Namespace):
    """The ``ChannelSecurity`` of the replica's calls to the training shards (the ``--shards-*`` flags); None:
    plaintext, no token.

    Raises:
        ValueError: ``--shards-tls-cert`` without ``--shards-tls-key`` or the other way round, a client certificate
            without ``--shards-tls-ca``, a file missing, unreadable or not PEM, a malformed token (the message names
            the flag).
    """
    from shardps.common.security import ChannelSecurity, read_pem, read_token_file

    ca, cert, key, token = (args.shards_tls_ca, args.shards_tls_cert, args.shards_tls_key,
                            args.shards_auth_token_file)
    if bool(cert) != bool(key):
        raise ValueError("--shards-tls-cert and --shards-tls-key go together: give both or neither")
    if cert and not ca:
        raise ValueError("a client certificate (--shards-tls-cert/--shards-tls-key) needs --shards-tls-ca too: the "
                         "replica must verify the shards' certificates")
    if not (ca or token):
        return None
    return ChannelSecurity(ca=read_pem(ca, SHARDS + "tls-ca") if ca else None,
                           cert=read_pem(cert, SHARDS + "tls-cert") if cert else None,
                           key=read_pem(key, SHARDS + "tls-key", key=True) if key else None,
                           token=read_token_file(token, SHARDS + "auth-token-file") if token else None,
                           allow_token_over_plaintext=args.shards_allow_token_over_plaintext)


def _predictor(args: argparse.Namespace, tables: list[str]):
    """The Predictor of ``--model`` (None without it), checked against ``--tables`` and ``--dense-every``.

    Raises:
        ValueError: the callable cannot be imported or called, its model has a table not served, or dense
            parameters the replica never reads (``--dense-every`` < 0).
    """
    if not args.model:
        return None
    from shardps.worker.serving.predict import Predictor, build_model, load_factory

    predictor = Predictor(build_model(load_factory(args.model)))
    predictor.check_tables(tables)
    if predictor.dense_keys and args.dense_every < 0:
        raise ValueError(f"--model: the model has dense parameters ({predictor.dense_keys[0]!r}, ...) and "
                         "--dense-every < 0 never reads them: give --dense-every >= 0")
    return predictor


def set_scheduling(args: argparse.Namespace) -> None:
    """The replica's priority: ``--nice`` or ``--realtime`` (``shardps.worker.serving.priority``), before any
    thread but this one starts, so that every later thread inherits it.

    Raises:
        ValueError: both given; ``--realtime`` with ``--threads`` > 1 (torch's worker threads spin while they
            wait, which at a real-time priority takes a core from training); a value out of range or refused.
    """
    from shardps.worker.serving.priority import set_nice, set_realtime

    if args.realtime and args.nice:
        raise ValueError("--realtime and --nice: give one (a nice value does not weigh real-time threads)")
    if args.realtime and args.threads > 1:
        raise ValueError(f"--realtime with --threads {args.threads}: torch's worker threads spin while they wait, "
                         "which at a real-time priority takes a core from training; use --threads 1")
    if args.realtime:
        set_realtime(args.realtime)
    elif args.nice:
        set_nice(args.nice)


def run(args: argparse.Namespace) -> int:
    """Run the replica until SIGTERM or Ctrl-C; returns the exit status (0).

    Raises:
        ValueError, RuntimeError: a flag's setting is refused before anything starts (the message names the flag:
            ``shardps: error: ...``, exit 1), or a port could not be bound.
    """
    from prometheus_client import start_http_server
    from grpc_health.v1 import health_pb2

    from shardps.common.security import warn_token_over_plaintext
    from shardps.worker.serving.replica import Replica
    from shardps.worker.serving.service import serve, serve_health

    import torch

    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    set_scheduling(args)
    torch.set_num_threads(args.threads)  # a 2,000-id lookup takes 0.1 ms; a second thread only adds its wake-ups
    tables = [t for t in args.tables.split(",") if t]
    credentials, interceptors = own_security(args)
    security = shards_security(args)
    predictor = _predictor(args, tables)
    if interceptors and credentials is None:  # allowed over plaintext: loopback, or the operator said so
        warn_token_over_plaintext(args.host, "shardps serve")
    try:
        replica = Replica(args.servers, tables, period=args.period, security=security,
                          dense_every=None if args.dense_every < 0 else args.dense_every)
    except ValueError as exc:  # a token refused over plaintext to the shards: name serve's flags for them
        raise ValueError(f"{exc} (shardps serve reaches the shards with --shards-tls-ca, --shards-tls-cert, "
                         f"--shards-tls-key, --shards-auth-token-file and {SHARDS}{INSECURE_FLAG[2:]})") from None
    started, freshness = [], None
    try:
        server, port, metrics, checks = serve(replica, args.host, args.port, credentials=credentials,
                                              interceptors=interceptors, predictor=predictor)
        started.append(server)
        if args.freshness_redis:
            freshness = event_freshness(args.freshness_redis, metrics.registry)
            replica.watchers.append(freshness.note)
            if args.metrics_port < 0:
                log.warning("--freshness-redis without --metrics-port: the freshness histogram is measured but "
                            "not served; add --metrics-port")
        log.info("shardps serve: %s, %s", "plaintext" if credentials is None else
                 "mutual TLS" if args.tls_ca else "TLS", "bearer token required" if interceptors else "no token")
        if args.health_port >= 0:
            health_server, health_port = serve_health(checks, args.host, args.health_port)
            started.append(health_server)
            print(f"health on {args.host}:{health_port}", flush=True)
    except BaseException:
        for s in started:
            s.stop(None)
        replica.close()
        if freshness is not None:
            freshness.close()
        raise
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
                hint = " (the replica's TLS settings for the shards are the --shards-* flags)" \
                    if "--tls" in str(exc) else ""
                print(f"waiting for the shards: {exc}{hint}", flush=True)
                stop.wait(max(args.period, 1.0))
        if replica.state is not None:
            checks.set("", health_pb2.HealthCheckResponse.SERVING)
            replica.start()
            print(f"serving tables {', '.join(tables)} (state 1 read)", flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        checks.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        for s in started:
            s.stop(5).wait(10)
        replica.close()
        if freshness is not None:
            freshness.close()
    return 0


def event_freshness(url: str, registry):
    """``--freshness-redis``'s ``EventFreshness`` on ``registry``.

    Raises:
        ValueError: ``url`` is not a Redis URL, or redis-py is not installed (the message names the flag).
    """
    from shardps.worker.serving.event_freshness import EventFreshness

    try:
        return EventFreshness(url, registry)
    except (ValueError, ImportError) as exc:
        raise ValueError(f"--freshness-redis {url!r}: {exc}") from None

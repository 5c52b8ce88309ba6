"""``shardps.v1.Serving`` over a :class:`~shardps.worker.serving.replica.Replica`: rows and scores, health, metrics.

Every call reads the replica's state once (``replica.state``), so an answer is of one whole state, never of a
half-applied delta. ``Lookup`` answers rows of any served table; ``States`` the recent states, what each made
visible (stream offsets) and when, and the refreshes' wire and payload bytes; ``Score`` scores one user against candidate
items with the MovieLens matrix factorisation (``shardps.apps.movielens.MF``: ``p_u . q_i + b_u + b_i + mu``,
tables ``user``, ``item``, ``user_bias``, ``item_bias`` and the dense ``global_bias``). The gRPC health service
says NOT_SERVING until the first state is read, SERVING after. Prometheus metrics (``shardps_serving_*``): calls
by method and code, their latency, the state's age and number, refresh failures and the delta bytes received.
``Predict`` runs the job's own model (``shardps serve --model``), made local from each state
(``shardps.worker.serving.predict``). ``Query`` takes any of the three on one stream and answers them in order, a
refused query in its own answer (code and message) while the stream goes on: a caller sending queries one
after another costs the replica about a quarter less CPU per query than with a call each (gRPC's Python server
does less per message than per call; docs/serving.md). The port serves TLS, mutual TLS and a bearer-token check
as the shards' do (``serve(credentials=, interceptors=)``); health needs no token, and :func:`serve_health`
serves it alone in plaintext for probes that cannot do TLS.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from shardps.common.rows import ids_from
from shardps.proto import shardps_pb2 as pb
from shardps.proto import shardps_pb2_grpc as pb_grpc
from shardps.worker.serving.predict import Refused, decode_features

__all__ = ["MAX_IDS", "ServingMetrics", "check_credentials", "serve", "serve_health"]

#: Ids (or items) one call may ask for.
MAX_IDS = 1 << 20
SCORE_TABLES = ("user", "item", "user_bias", "item_bias")


class ServingMetrics:
    """The replica's Prometheus metrics, in their own registry (``start_http_server(port, registry=...)``)."""

    def __init__(self, replica) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.calls = Counter("shardps_serving_calls", "Serving calls answered, by method and status code.",
                             ("method", "code"), registry=r)
        self.seconds = Histogram("shardps_serving_call_seconds", "Seconds a Serving call took, by method.",
                                 ("method",), registry=r,
                                 buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0))
        age = Gauge("shardps_serving_state_age_seconds", "Seconds since the state served was swapped in.", registry=r)
        age.set_function(lambda: time.time() - replica.state.made_at if replica.state is not None else float("nan"))
        number = Gauge("shardps_serving_state", "The number of the state served (1: the first snapshot).", registry=r)
        number.set_function(lambda: replica.state.number if replica.state is not None else 0)
        for name, text, read in (
                ("shardps_serving_refresh_failures", "Refreshes that failed (the last state kept serving).",
                 lambda: replica.failures),
                ("shardps_serving_delta_bytes", "Row and id bytes the refreshes received.", lambda: replica.delta_bytes),
                ("shardps_serving_delta_wire_bytes", "Serialized reply bytes the refreshes received (ExportRows).",
                 lambda: replica.wire_bytes),
                ("shardps_serving_delta_payload_bytes", "The least bytes the refreshes needed: distinct rows and ids.",
                 lambda: replica.payload_bytes),
                ("shardps_serving_snapshots", "Tables read whole (first read, or a delta that could not apply).",
                 lambda: replica.snapshots)):
            gauge = Gauge(name + "_total", text, registry=r)  # read from the replica's own counters when scraped
            gauge.set_function(read)
        r.register(_Positions(replica))


class _Positions:
    """``shardps_serving_stream_offset{partition}``: the stream offset up to which every event is in the state
    served (``ReplicaState.positions``). For a Redis stream (offsets ``ms << 20 | seq``) the newest visible event
    entered the broker at ``offset / 2**20 / 1000`` seconds since the epoch: ``time() - that`` is its age."""

    def __init__(self, replica) -> None:
        self.replica = replica

    def describe(self):
        return [GaugeMetricFamily("shardps_serving_stream_offset", "", labels=["partition"])]

    def collect(self):
        family = GaugeMetricFamily("shardps_serving_stream_offset", "The stream offset up to which every event is "
                                   "in the state served, by partition.", labels=["partition"])
        state = self.replica.state
        for partition, offset in (state.positions if state is not None else {}).items():
            family.add_metric([partition], float(offset))
        yield family


def _ids(data: bytes, what: str) -> torch.Tensor:
    if len(data) % 8 or len(data) // 8 > MAX_IDS:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"{what} must be int64 little-endian, at most {MAX_IDS} of them ({len(data)} bytes given)")
    return ids_from(data)


class _Servicer(pb_grpc.ServingServicer):
    def __init__(self, replica, metrics: ServingMetrics, predictor=None, streams: int = 4) -> None:
        self.replica, self.metrics, self.predictor = replica, metrics, predictor
        self.streams, self.open_streams, self.lock = streams, 0, threading.Lock()
        self.kinds = {"lookup": ("Lookup", self._lookup), "score": ("Score", self._score),
                      "predict": ("Predict", self._predict)}

    def _state(self):
        state = self.replica.state
        if state is None:
            raise Refused(grpc.StatusCode.UNAVAILABLE, "the replica has not read the tables yet")
        return state

    def _timed(self, method: str, fn, request):
        """``fn(request)``, counted and timed by method and code (a refusal raises :class:`Refused`)."""
        started = time.perf_counter()
        code = "OK"
        try:
            return fn(request)
        except Refused as exc:
            code = exc.code.name
            raise
        except Exception:
            code = "UNKNOWN"
            raise
        finally:
            self.metrics.calls.labels(method, code).inc()
            self.metrics.seconds.labels(method).observe(time.perf_counter() - started)

    def _unary(self, method: str, fn, request, context):
        try:
            return self._timed(method, fn, request)
        except Refused as exc:
            context.abort(exc.code, str(exc))

    def _lookup(self, request) -> pb.LookupReply:
        state = self._state()
        if request.table not in state.tables:
            raise Refused(grpc.StatusCode.NOT_FOUND,
                          f"this replica serves tables {sorted(state.tables)}, not {request.table[:200]!r}")
        rows = state.lookup(request.table, _ids(request.ids, "ids"))
        return pb.LookupReply(rows=rows.numpy().tobytes(), dim=rows.shape[-1], state=state.number,
                              state_age_seconds=time.time() - state.made_at, rounds=state.rounds[request.table])

    def _score(self, request) -> pb.ScoreReply:
        state = self._state()
        missing = [t for t in SCORE_TABLES if t not in state.tables] + \
            ([] if "global_bias" in state.dense else ["global_bias (dense; the replica reads dense parameters)"])
        if missing:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "Score needs the matrix factorisation's tables "
                                                               f"and global bias; this replica lacks {missing}")
        items = _ids(request.items, "items")
        user = torch.tensor([request.user])
        p, b_u = state.lookup("user", user)[0], state.lookup("user_bias", user)[0, 0]
        q, b_i = state.lookup("item", items), state.lookup("item_bias", items)[:, 0]
        scores = q @ p + b_i + b_u + state.dense["global_bias"].reshape(())
        return pb.ScoreReply(scores=scores.numpy().tobytes(), state=state.number)

    def _predict(self, request) -> pb.PredictReply:
        if self.predictor is None:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          "this replica serves no model: start shardps serve with --model MODULE:CALLABLE "
                          "(a zero-argument callable returning the job's model) to answer Predict")
        features = decode_features(request.features, MAX_IDS)
        state = self._state()
        scores = self.predictor.predict(state, features)
        return pb.PredictReply(scores=scores.numpy().tobytes(), shape=list(scores.shape), state=state.number)

    def Lookup(self, request, context):
        return self._unary("Lookup", self._lookup, request, context)

    def Score(self, request, context):
        return self._unary("Score", self._score, request, context)

    def Predict(self, request, context):
        return self._unary("Predict", self._predict, request, context)

    def Query(self, request_iterator, context):
        with self.lock:
            refused = self.open_streams >= self.streams
            if not refused:
                self.open_streams += 1
        if refused:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"this replica already answers {self.streams} Query streams, its most (each holds one of "
                          "its threads): send Lookup, Score or Predict calls, or close a stream")
        try:
            for query in request_iterator:
                yield self._answer(query)
        finally:
            with self.lock:
                self.open_streams -= 1

    def _answer(self, query: pb.ServingQuery) -> pb.ServingAnswer:
        kind = query.WhichOneof("query")
        if kind is None:
            return pb.ServingAnswer(tag=query.tag, code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                    error="a ServingQuery holds one of lookup, score or predict; this one holds none")
        method, fn = self.kinds[kind]
        try:
            return pb.ServingAnswer(tag=query.tag, **{kind: self._timed(method, fn, getattr(query, kind))})
        except Refused as exc:
            return pb.ServingAnswer(tag=query.tag, code=exc.code.value[0], error=str(exc))

    def States(self, request, context):
        def run(request):
            replica = self.replica
            return pb.StatesReply(states=[
                pb.VisibleState(state=number, made_at_unix_seconds=made_at, versions=versions,
                                positions=[pb.StreamPosition(partition=k, rows=v) for k, v in positions.items()],
                                dense_read_unix_seconds=dense_at)
                for number, made_at, positions, versions, dense_at in list(replica.history)],
                delta_wire_bytes=replica.wire_bytes, delta_payload_bytes=replica.payload_bytes)
        return self._unary("States", run, request, context)


def check_credentials(credentials: grpc.ServerCredentials) -> None:
    """Make gRPC load ``credentials`` now, on a scratch server on a free loopback port (gRPC reads PEM contents
    only when a port is bound, and would report a bad certificate like a port in use).

    Raises:
        RuntimeError: gRPC cannot use the certificate, key or CA (the message names the flags).
    """
    probe = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    try:
        if not probe.add_secure_port("127.0.0.1:0", credentials):
            raise RuntimeError("bind")
    except RuntimeError:
        raise RuntimeError("--tls-cert/--tls-key/--tls-ca: gRPC cannot use them: a file is not a valid PEM "
                           "certificate or key, or --tls-key is not the key of --tls-cert") from None
    finally:
        probe.stop(None)


def _bind(server: grpc.Server, host: str, port: int, credentials: grpc.ServerCredentials | None, flag: str) -> int:
    address = f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address) if credentials is None else \
            server.add_secure_port(address, credentials)
    except RuntimeError:
        bound = 0
    if not bound:
        raise RuntimeError(f"could not bind {address} ({flag})")
    return bound


def serve(replica, host: str = "127.0.0.1", port: int = 0, threads: int = 8, *,
          credentials: grpc.ServerCredentials | None = None, interceptors=(), predictor=None, streams: int = 0,
          ) -> tuple[grpc.Server, int, ServingMetrics, health.HealthServicer]:
    """Start the Serving and health services for ``replica`` on ``host:port`` (0: a free port).

    Args:
        threads: the gRPC server's threads: a call takes one while its handler runs, an open ``Query`` stream
            one for its whole life.
        streams: the most ``Query`` streams open at once (a further one ends with RESOURCE_EXHAUSTED);
            0: half of ``threads``, so that calls and health checks always find a thread.
        credentials: TLS of the port (``shardps.common.security.server_credentials``: mutual TLS when it holds the
            clients' CA); None: plaintext. Check them first with :func:`check_credentials`.
        interceptors: ``grpc.ServerInterceptor`` objects run on every call, in order (the bearer-token check of
            ``shardps serve --auth-token-file``; it lets health calls through).
        predictor: a :class:`~shardps.worker.serving.predict.Predictor` answering ``Predict``; None: Predict is
            refused with FAILED_PRECONDITION naming ``--model``.

    Returns:
        ``(server, bound port, metrics, health servicer)``; the caller stops the server. Health says NOT_SERVING
        until the caller sets it.

    Raises:
        RuntimeError: the port could not be bound.
        ValueError: ``streams`` is not below ``threads`` (an open stream holds a thread for its life).
    """
    if not 0 <= streams < threads:
        raise ValueError(f"streams must be in [0, threads - 1] (threads {threads}), got {streams}")
    metrics = ServingMetrics(replica)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="shardps-serving"),
                         interceptors=list(interceptors))
    servicer = _Servicer(replica, metrics, predictor, streams or max(1, threads // 2))
    pb_grpc.add_ServingServicer_to_server(servicer, server)
    Gauge("shardps_serving_query_streams", f"Query streams open (at most {servicer.streams}; each holds a thread).",
          registry=metrics.registry).set_function(lambda: servicer.open_streams)
    checks = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    bound = _bind(server, host, port, credentials, "--port")
    checks.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    server.start()
    return server, bound, metrics, checks


def serve_health(checks: health.HealthServicer, host: str, port: int) -> tuple[grpc.Server, int]:
    """Serve ``checks`` (the Serving port's health servicer: one status for both) alone, in plaintext, without a
    token check, on ``host:port`` (0: a free port), for probes that cannot do TLS (Kubernetes' gRPC probe).

    Returns:
        ``(server, bound port)``, started; the caller stops it.

    Raises:
        RuntimeError: the port could not be bound.
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="shardps-serving-health"))
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    bound = _bind(server, host, port, None, "--health-port")
    server.start()
    return server, bound

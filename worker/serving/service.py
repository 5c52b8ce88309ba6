"""``shardps.v1.Serving`` over a :class:`~shardps.worker.serving.replica.Replica`: rows and scores, health, metrics.

Every call reads the replica's state once (``replica.state``), so an answer is of one whole state, never of a
half-applied delta. ``Lookup`` answers rows of any served table; ``Score`` scores one user against candidate
items with the MovieLens matrix factorisation (``shardps.apps.movielens.MF``: ``p_u . q_i + b_u + b_i + mu``,
tables ``user``, ``item``, ``user_bias``, ``item_bias`` and the dense ``global_bias``). The gRPC health service
says NOT_SERVING until the first state is read, SERVING after. Prometheus metrics (``shardps_serving_*``): calls
by method and code, their latency, the state's age and number, refresh failures and the delta bytes received.
"""

from __future__ import annotations

import time
from concurrent import futures

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shardps.common.rows import ids_from
from shardps.proto import shardps_pb2 as pb
from shardps.proto import shardps_pb2_grpc as pb_grpc

__all__ = ["MAX_IDS", "ServingMetrics", "serve"]

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
                ("shardps_serving_snapshots", "Tables read whole (first read, or a delta that could not apply).",
                 lambda: replica.snapshots)):
            gauge = Gauge(name + "_total", text, registry=r)  # read from the replica's own counters when scraped
            gauge.set_function(read)


def _ids(data: bytes, what: str, context) -> torch.Tensor:
    if len(data) % 8 or len(data) // 8 > MAX_IDS:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"{what} must be int64 little-endian, at most {MAX_IDS} of them ({len(data)} bytes given)")
    return ids_from(data)


class _Servicer(pb_grpc.ServingServicer):
    def __init__(self, replica, metrics: ServingMetrics) -> None:
        self.replica, self.metrics = replica, metrics

    def _state(self, context):
        state = self.replica.state
        if state is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the replica has not read the tables yet")
        return state

    def _timed(self, method: str, fn, request, context):
        started = time.perf_counter()
        code = "OK"
        try:
            return fn(request, context)
        except Exception:
            code = context.code().name if context.code() is not None else "UNKNOWN"
            raise
        finally:
            self.metrics.calls.labels(method, code).inc()
            self.metrics.seconds.labels(method).observe(time.perf_counter() - started)

    def Lookup(self, request, context):
        def run(request, context):
            state = self._state(context)
            if request.table not in state.tables:
                context.abort(grpc.StatusCode.NOT_FOUND, f"this replica serves tables {sorted(state.tables)}, "
                                                         f"not {request.table[:200]!r}")
            rows = state.lookup(request.table, _ids(request.ids, "ids", context))
            return pb.LookupReply(rows=rows.numpy().tobytes(), dim=rows.shape[-1], state=state.number,
                                  state_age_seconds=time.time() - state.made_at, rounds=state.rounds[request.table])
        return self._timed("Lookup", run, request, context)

    def Score(self, request, context):
        def run(request, context):
            state = self._state(context)
            missing = [t for t in SCORE_TABLES if t not in state.tables] + \
                ([] if "global_bias" in state.dense else ["global_bias (dense; the replica reads dense parameters)"])
            if missing:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "Score needs the matrix factorisation's tables "
                                                                    f"and global bias; this replica lacks {missing}")
            items = _ids(request.items, "items", context)
            user = torch.tensor([request.user])
            p, b_u = state.lookup("user", user)[0], state.lookup("user_bias", user)[0, 0]
            q, b_i = state.lookup("item", items), state.lookup("item_bias", items)[:, 0]
            scores = q @ p + b_i + b_u + state.dense["global_bias"].reshape(())
            return pb.ScoreReply(scores=scores.numpy().tobytes(), state=state.number)
        return self._timed("Score", run, request, context)


def serve(replica, host: str = "127.0.0.1", port: int = 0, threads: int = 8) -> tuple[grpc.Server, int, ServingMetrics,
                                                                                      health.HealthServicer]:
    """Start the Serving and health services for ``replica`` on ``host:port`` (0: a free port), plaintext.

    Returns:
        ``(server, bound port, metrics, health servicer)``; the caller stops the server.

    Raises:
        RuntimeError: the port could not be bound.
    """
    metrics = ServingMetrics(replica)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="shardps-serving"))
    pb_grpc.add_ServingServicer_to_server(_Servicer(replica, metrics), server)
    checks = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise RuntimeError(f"could not bind {host}:{port}")
    checks.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    server.start()
    return server, bound, metrics, checks

"""Prometheus metrics of one shard (prometheus-client), and the gRPC interceptor that counts its calls.

Every series carries ``shard="<index>"``; the other labels are bounded:
``method`` (a ``shardps.v1.Shard`` RPC name), ``code`` (a gRPC status name),
``mode`` (sync, async, ssp) and ``reason`` (per_peer, total, idle). Parameter names never become labels.

==============================================  =========  ==================================================
name                                            type       what
==============================================  =========  ==================================================
shardps_shard_rpcs_total{method,code}           counter    finished calls (every method x code starts at 0)
shardps_shard_rpc_seconds{method}               histogram  call duration, waiting included
shardps_shard_received_bytes_total              counter    Frame bytes received (Init, pushes, SetState)
shardps_shard_sent_bytes_total                  counter    Frame bytes of parameters sent (pulls)
shardps_shard_rounds_total{mode}                counter    rounds applied (async/ssp: one per applied push)
shardps_shard_version                           gauge      the shard's version
shardps_shard_live_workers                      gauge      members holding a lease
shardps_shard_min_workers                       gauge      the ``--min-workers`` setting
shardps_shard_joins_total                       counter    workers admitted (a new member)
shardps_shard_leaves_total                      counter    workers that left (Leave)
shardps_shard_lease_expiries_total              counter    workers dropped because their lease ran out
shardps_shard_update_seconds                    histogram  optimizer update of one applied round
shardps_shard_staleness_versions                histogram  staleness of each applied contribution
shardps_shard_checkpoint_seconds                histogram  writing one checkpoint
shardps_shard_last_checkpoint_timestamp_seconds gauge      Unix time of the newest checkpoint (0: none)
shardps_shard_info{version}                     gauge      1; the software version
shardps_shard_streams_refused_total{reason}     counter    calls refused or ended by ``streams.py``: reason
                                                           ``per_peer``, ``total`` (a cap) or ``idle``
shardps_shard_open_streams                      gauge      ``shardps.v1.Shard`` calls open now
==============================================  =========  ==================================================
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from shardps.proto import shardps_pb2 as pb
from shardps.common.version import shardps_version
from shardps.server.auth import HANDLER_KINDS
from shardps.server.consistency.modes import MODES

SERVICE = pb.DESCRIPTOR.services_by_name["Shard"]
METHODS = tuple(m.name for m in SERVICE.methods)
_PREFIX = f"/{SERVICE.full_name}/"
#: Call durations, seconds: a fast Stats (~1 ms) to a pull that waits for a slow round.
RPC_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: Staleness, versions. The shard's own histogram (``Stats.staleness_histogram``) is exact up to 30.
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 30)

#: Why ``streams.py`` refused or ended a call: a cap per peer, the total cap, or a stream idle too long.
STREAM_REFUSALS = ("per_peer", "total", "idle")
#: Counters the store keeps itself, read when scraped: name (without ``shardps_shard_`` and ``_total``) -> help.
READ_COUNTERS = {
    "received_bytes": "Frame bytes received (Init, pushes).",
    "sent_bytes": "Frame bytes of parameters sent.",
    "joins": "Workers admitted as new members.",
    "leaves": "Workers that left (Leave).",
    "lease_expiries": "Workers dropped because their lease ran out.",
    "stream_batches_held": "Pushes (dense or rows) of skipped rounds whose stream batch the shard holds already.",
    "stream_batches_owed": "Pushes (dense or rows) of skipped rounds whose stream batch leaves a gap after what "
                           "the shard holds (a replay from its held offset follows).",
}
#: Gauges read when scraped: name (without ``shardps_shard_``) -> help.
READ_GAUGES = {
    "version": "The shard's version.",
    "live_workers": "Members holding a lease.",
    "min_workers": "Workers a job needs before its first round (--min-workers).",
    "last_checkpoint_timestamp_seconds": "Unix time of the newest checkpoint written or restored; 0: none.",
}


class _StoreCollector(Collector):
    """The store's own numbers as Prometheus families, read at scrape time (no copy kept in sync)."""

    def __init__(self, shard: str, read: Callable[[], dict[str, float]]) -> None:
        self.shard, self.read = shard, read

    def collect(self):
        values = self.read()
        for name, text in READ_COUNTERS.items():
            family = CounterMetricFamily(f"shardps_shard_{name}", text, labels=["shard"])
            family.add_metric([self.shard], values[name])
            yield family
        for name, text in READ_GAUGES.items():
            family = GaugeMetricFamily(f"shardps_shard_{name}", text, labels=["shard"])
            family.add_metric([self.shard], values[name])
            yield family


#: Per sparse table, read when scraped (label ``table``: at most ``sparse.tables.MAX_TABLES`` per job).
TABLE_GAUGES = {
    "rows": "Rows of the sparse table held by this shard.",
    "bytes": "Bytes the sparse table holds on this shard (rows, optimizer state, index, admission counts).",
}
TABLE_COUNTERS = {
    "admitted": "Ids that became trained rows (admission passed, or at once with min_count <= 1).",
    "evicted_ttl": "Rows evicted because they were not pushed for ttl_rounds rounds.",
    "evicted_capacity": "Rows evicted, least recently pushed first, because the table passed its capacity.",
    "rows_pulled": "Rows read by pulls.",
    "rows_pushed": "Unique rows of applied rounds (after averaging over workers).",
    "dropped_unadmitted": "Row gradients dropped because the id had not reached min_count sightings.",
}


class _TableCollector(Collector):
    """Sparse tables' numbers as Prometheus families, read at scrape time."""

    def __init__(self, shard: str, read: Callable[[], tuple[int, dict[str, dict[str, float]]]]) -> None:
        self.shard, self.read = shard, read

    def collect(self):
        rounds, tables = self.read()
        family = CounterMetricFamily("shardps_shard_sparse_rounds", "Sparse-table rounds applied.", labels=["shard"])
        family.add_metric([self.shard], rounds)
        yield family
        for name, text in TABLE_GAUGES.items():
            family = GaugeMetricFamily(f"shardps_shard_table_{name}", text, labels=["shard", "table"])
            for table, values in tables.items():
                family.add_metric([self.shard, table], values[name])
            yield family
        for name, text in TABLE_COUNTERS.items():
            family = CounterMetricFamily(f"shardps_shard_table_{name}", text, labels=["shard", "table"])
            for table, values in tables.items():
                family.add_metric([self.shard, table], values[name])
            yield family


class ShardMetrics:
    """The metrics of shard ``shard`` in ``registry`` (a fresh ``CollectorRegistry`` when None).

    Rounds and checkpoints call the recording methods, the interceptor counts
    calls; the store's own counters and gauges are read when scraped (:meth:`watch`).
    """

    def __init__(self, shard: int, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.shard = str(shard)
        r, s = self.registry, ("shard",)
        self._rpcs = Counter("shardps_shard_rpcs", "Finished shardps.v1.Shard calls by method and status code.",
                             ("shard", "method", "code"), registry=r)
        self._rpc_seconds = Histogram("shardps_shard_rpc_seconds", "Duration of shardps.v1.Shard calls (seconds).",
                                      ("shard", "method"), buckets=RPC_BUCKETS, registry=r)
        self._rounds = Counter("shardps_shard_rounds", "Rounds applied (async/ssp: one per applied push).",
                               ("shard", "mode"), registry=r)
        self.update_seconds = Histogram("shardps_shard_update_seconds", "Optimizer update of one round (seconds).", s,
                                        registry=r).labels(self.shard)
        self.staleness = Histogram("shardps_shard_staleness_versions",
                                   "Staleness of each applied contribution (shard version at apply minus the "
                                   "version it was computed from).", s, buckets=STALENESS_BUCKETS,
                                   registry=r).labels(self.shard)
        self.checkpoint_seconds = Histogram("shardps_shard_checkpoint_seconds", "Writing one checkpoint (seconds).",
                                            s, registry=r).labels(self.shard)
        Gauge("shardps_shard_info", "The shardps software version (always 1).", ("shard", "version"),
              registry=r).labels(self.shard, shardps_version()).set(1)
        for method in METHODS:  # every series exists from the start, so rate() and ratios always have data
            self._rpc_seconds.labels(self.shard, method)
            for code in grpc.StatusCode:
                self._rpcs.labels(self.shard, method, code.name)
        for mode in MODES:
            self._rounds.labels(self.shard, mode)
        self._streams_refused = Counter("shardps_shard_streams_refused",
                                        "Calls refused (a cap per peer or in total) or ended (idle) by reason.",
                                        ("shard", "reason"), registry=r)
        for reason in STREAM_REFUSALS:
            self._streams_refused.labels(self.shard, reason)
        self._open_streams = Gauge("shardps_shard_open_streams", "shardps.v1.Shard calls open now.", s,
                                   registry=r).labels(self.shard)

    def watch(self, read: Callable[[], dict[str, float]]) -> None:
        """Read the store's counters and gauges when scraped: ``read()`` returns a number for each name of
        :data:`READ_COUNTERS` and :data:`READ_GAUGES`. Call once.

        Raises:
            ValueError: called twice.
        """
        self.registry.register(_StoreCollector(self.shard, read))

    def watch_tables(self, read: Callable[[], tuple[int, dict[str, dict[str, float]]]]) -> None:
        """Read the sparse tables' numbers when scraped: ``read()`` returns ``(sparse rounds applied,
        {table: {name: value}})`` with every name of :data:`TABLE_GAUGES` and :data:`TABLE_COUNTERS`. Call once."""
        self.registry.register(_TableCollector(self.shard, read))

    def rpc(self, method: str, code: str, seconds: float) -> None:
        """Count one finished call of ``method`` with status ``code`` (a ``grpc.StatusCode`` name), ``seconds`` long."""
        self._rpcs.labels(self.shard, method, code).inc()
        self._rpc_seconds.labels(self.shard, method).observe(seconds)

    def stream_refused(self, reason: str) -> None:
        """Count one call refused or ended for ``reason`` (one of :data:`STREAM_REFUSALS`)."""
        self._streams_refused.labels(self.shard, reason).inc()

    def streams_open(self, count: int) -> None:
        """``count`` calls are open now."""
        self._open_streams.set(count)

    def round_applied(self, mode: str, seconds: float, staleness: int, contributions: int) -> None:
        """Count one applied round of ``mode``: its optimizer ``seconds`` and each contribution's ``staleness``."""
        self._rounds.labels(self.shard, mode).inc()
        self.update_seconds.observe(seconds)
        for _ in range(contributions):
            self.staleness.observe(staleness)

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP endpoint (``/metrics``) on ``host:port`` in a daemon thread; returns the bound port.

        Raises:
            RuntimeError: the address could not be bound.
        """
        try:
            server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise RuntimeError(f"could not bind the metrics endpoint {host}:{port}: {exc}") from None
        return server.server_port


_CODE_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}


def _code_name(context) -> str:
    code = context.code()
    if code is None:
        return "UNKNOWN"
    if isinstance(code, grpc.StatusCode):
        return code.name
    return _CODE_NAMES.get(int(code), "UNKNOWN")


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts every ``shardps.v1.Shard`` call by method and final status and times it; other services pass."""

    def __init__(self, metrics: ShardMetrics) -> None:
        self.metrics = metrics

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(_PREFIX):
            return handler
        method, record = details.method[len(_PREFIX):], self.metrics.rpc

        def finished(context, started: float, error: BaseException | None) -> None:
            if error is None:
                code = "OK"
            elif isinstance(error, (asyncio.CancelledError, GeneratorExit)):  # the client went away
                code = "CANCELLED"
            else:
                code = _code_name(context)
            record(method, code, time.perf_counter() - started)

        if handler.response_streaming:
            behavior = handler.unary_stream or handler.stream_stream

            async def streaming(request, context):
                started, error = time.perf_counter(), None
                try:
                    async for item in behavior(request, context):
                        yield item
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    finished(context, started, error)

            return HANDLER_KINDS[(bool(handler.request_streaming), True)](streaming, request_deserializer=handler.request_deserializer,
                        response_serializer=handler.response_serializer)
        behavior = handler.unary_unary or handler.stream_unary

        async def unary(request, context):
            started, error = time.perf_counter(), None
            try:
                return await behavior(request, context)
            except BaseException as exc:
                error = exc
                raise
            finally:
                finished(context, started, error)

        return HANDLER_KINDS[(bool(handler.request_streaming), False)](unary, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)

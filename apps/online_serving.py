"""A serving replica beside a training job: ``shardps serve`` started, queried at a steady rate, and measured.

Used by ``shardps train movielens --online --serve`` and by ``benchmarks/serving.py``:

- :func:`start_serve`: a ``shardps serve`` process subscribed to the training shards, once it has read its
  first state;
- :class:`QueryLoad`: a client process sending ``Lookup`` (2,000 user ids) and ``Score`` (one user against 100
  items) queries alternately at a steady rate, each timed from send to answer, every failure counted;
- :func:`freshness_report`: each streamed event's event-to-visible seconds (``FreshnessProbe``), their
  quantiles and histogram, and the deltas' wire bytes against the least bytes they needed;
- :func:`equals_export`: whether the replica's tables and dense parameters equal the shards' export exactly.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time

import grpc
import torch

from shardps.common.rows import ids_bytes
from shardps.proto import shardps_pb2 as pb
from shardps.proto import shardps_pb2_grpc as pb_grpc
from shardps.worker.serving.event_freshness import BUCKETS  # event-to-visible upper bounds, the last +inf

__all__ = ["BUCKETS", "QueryLoad", "Served", "equals_export", "freshness_report", "replica_histogram",
           "start_serve"]

MF_TABLES = ("user", "item", "user_bias", "item_bias")
REQUESTS = 512  # distinct requests of each kind a QueryLoad cycles through


def start_serve(servers: str, tables=MF_TABLES, *, period: float = 0.5, dense_every: float = 5.0,
                timeout: float = 120.0, nice: int = 0, realtime: int = 0, freshness_redis: str = "",
                extra: tuple = ()) -> tuple[subprocess.Popen, str, str]:
    """Start ``shardps serve`` against ``servers`` and wait for its first state (``nice``, ``realtime``: its
    ``--nice``, ``--realtime``;
    ``freshness_redis``: its ``--freshness-redis``, with its metrics on a free port).

    Returns:
        ``(process, "host:port", metrics "host:port" or "")``; the caller terminates the process (SIGTERM: it
        exits 0 within 5 s).

    Raises:
        TimeoutError: it did not read its first state within ``timeout`` seconds (the process is killed).
    """
    from shardps.apps.processes import wait_for

    flags = ("--freshness-redis", freshness_redis, "--metrics-port", "0") if freshness_redis else ()
    process = subprocess.Popen([sys.executable, "-m", "shardps.cli.main", "serve", "--servers", servers, "--tables",
                                ",".join(tables), "--period", str(period), "--dense-every", str(dense_every),
                                *(("--nice", str(nice)) if nice else ()),
                                *(("--realtime", str(realtime)) if realtime else ()), *flags, *extra],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = iter(process.stdout.readline, "")
        address = wait_for(lines, "serving on ", timeout)
        metrics = wait_for(lines, "metrics on ", timeout) if freshness_redis else ""
        wait_for(lines, "serving tables ", timeout)
    except BaseException:
        process.kill()
        process.wait(30)
        raise
    threading.Thread(target=lambda: [None for _ in lines], name="shardps-serve-output", daemon=True).start()
    return process, address, metrics


def _query_loop(address: str, qps: float, users: int, items: int, seed: int, stop, conn, nice: int = 0,
                realtime: int = 0, api: str = "unary") -> None:
    """The client process of :class:`QueryLoad`: queries until ``stop`` is set, then sends its results."""
    from shardps.worker.serving.priority import set_nice, set_realtime

    # before gRPC starts its threads, which inherit it; a refusal ends the process unready (start() says so)
    if realtime:
        set_realtime(realtime, "the query client's real-time priority")
    elif nice:
        set_nice(nice, "the query client's nice value")
    g = torch.Generator().manual_seed(seed)
    # The requests are built before the clock starts and sent in turn, as a load generator does: the client's
    # own CPU, which shares the machine with what it measures, stays small.
    lookups = [pb.LookupRequest(table="user", ids=ids_bytes(torch.randint(1, users + 1, (2000,), generator=g)))
               for _ in range(REQUESTS)]
    scores = [pb.ScoreRequest(user=int(torch.randint(1, users + 1, (1,), generator=g)),
                              items=ids_bytes(torch.randint(1, items + 1, (100,), generator=g)))
              for _ in range(REQUESTS)]
    got = {"latencies": {"lookup": [], "score": []}, "failed": {"lookup": 0, "score": 0}, "codes": [],
           "answered_at": []}
    conn.send("ready")
    try:
        if api == "stream":
            import asyncio

            queries = [(pb.ServingQuery(tag=i, lookup=lookups[i]), pb.ServingQuery(tag=i, score=scores[i]))
                       for i in range(REQUESTS)]
            asyncio.run(_stream_queries(address, qps, queries, stop, got))
        else:
            _unary_queries(address, qps, lookups, scores, stop, got)
    finally:
        conn.send(got)
        conn.close()


def _answered(got: dict, kind: str, sent: float) -> None:
    got["latencies"][kind].append(1e3 * (time.perf_counter() - sent))
    got["answered_at"].append(time.time())


def _failed(got: dict, kind: str, code: str) -> None:
    got["failed"][kind] += 1
    got["codes"].append(code)


def _unary_queries(address: str, qps: float, lookups: list, scores: list, stop, got: dict) -> None:
    """A ``Lookup`` or ``Score`` call per query, alternately, at ``qps``, until ``stop`` is set."""
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.ServingStub(channel)
    started, k = time.monotonic(), 0
    try:
        while not stop.is_set():
            due = started + k / qps
            if due > time.monotonic():
                stop.wait(due - time.monotonic())
                continue
            kind = "lookup" if k % 2 == 0 else "score"
            request, call = (lookups, stub.Lookup) if kind == "lookup" else (scores, stub.Score)
            sent = time.perf_counter()
            try:
                call(request[(k // 2) % REQUESTS], timeout=5)
                _answered(got, kind, sent)
            except grpc.RpcError as exc:
                _failed(got, kind, exc.code().name)
            k += 1
    finally:
        channel.close()


async def _stream_queries(address: str, qps: float, queries: list, stop, got: dict) -> None:
    """The same queries on one ``Query`` stream (grpc.aio: one thread), each answer awaited at most 5 s; a
    refused query counts as failed under its code, an answer of another query's tag as ``WRONG_TAG``; a broken
    stream fails its query and is opened again."""
    import asyncio

    names = {code.value[0]: code.name for code in grpc.StatusCode}
    async with grpc.aio.insecure_channel(address) as channel:
        stub, call = pb_grpc.ServingStub(channel), None
        started, k = time.monotonic(), 0
        while not stop.is_set():
            wait = started + k / qps - time.monotonic()
            if wait > 0:
                await asyncio.sleep(min(wait, 0.1))
                continue
            kind = "lookup" if k % 2 == 0 else "score"
            sent = time.perf_counter()
            try:
                call = call or stub.Query()
                await call.write(queries[(k // 2) % REQUESTS][k % 2])
                answer = await asyncio.wait_for(call.read(), 5)
                if answer is grpc.aio.EOF:
                    raise ConnectionError("the replica ended the stream")
                if answer.tag != (k // 2) % REQUESTS:  # answers come in the queries' order: another is a bug
                    _failed(got, kind, "WRONG_TAG")
                elif answer.code:
                    _failed(got, kind, names.get(answer.code, str(answer.code)))
                else:
                    _answered(got, kind, sent)
            except (grpc.RpcError, asyncio.TimeoutError, ConnectionError) as exc:
                _failed(got, kind, exc.code().name if isinstance(exc, grpc.RpcError) else type(exc).__name__)
                if call is not None:
                    call.cancel()
                call = None
            k += 1
        if call is not None:
            call.cancel()


class QueryLoad:
    """Queries a replica at ``qps`` from a client process of its own (so that the caller's threads, a trainer's
    among them, do not delay the client and inflate what it measures) until :meth:`stop`: a ``Lookup`` of 2,000
    ids of ``user`` (in [1, users]) and a ``Score`` of a user against 100 items (in [1, items]) alternately, each
    timed from send to answer with a 5 s deadline. ``nice``: the client's nice value (as ``nice(1)``; 0:
    unchanged); ``realtime``: its ``SCHED_FIFO`` priority instead (1-99; 0: none;
    ``shardps.worker.serving.priority``). ``api``: ``"unary"``, a ``Lookup`` or ``Score`` call per query;
    ``"stream"``, every query on one ``Query`` stream (the replica spends about a quarter less CPU per query).
    On a host whose cores training saturates, the client's own wait for a core is part of what it measures; at
    a real-time priority it is not, as for callers on other hosts (2 cores and the online job: a 2,000-id
    lookup's p99 6.4 ms measured by a client at nice 0, 4.6 ms by a real-time one; docs/serving.md).

    Attributes (filled by :meth:`stop`):
        latencies: ``{"lookup": [ms], "score": [ms]}`` of the answered queries; failed: failures by kind;
        codes: the status codes of the failures; answered_at: ``time.time()`` of every answer.

    Raises:
        RuntimeError: from :meth:`stop`, when the client process died without reporting.
    """

    def __init__(self, address: str, qps: float, *, users: int = 943, items: int = 1682, seed: int = 1,
                 nice: int = 0, realtime: int = 0, api: str = "unary") -> None:
        import multiprocessing as mp

        if api not in ("unary", "stream"):
            raise ValueError(f"api must be 'unary' or 'stream', got {api!r}")
        self.address, self.qps, self.users, self.items = address, qps, users, items
        self.latencies = {"lookup": [], "score": []}
        self.failed = {"lookup": 0, "score": 0}
        self.codes: list[str] = []
        self.answered_at: list[float] = []
        ctx = mp.get_context("spawn")  # no fork of a process with gRPC threads
        self._stop = ctx.Event()
        self._results, child = ctx.Pipe(duplex=False)
        self._process = ctx.Process(target=_query_loop, name="shardps-queries", daemon=True,
                                    args=(address, qps, users, items, seed, self._stop, child, nice, realtime, api))
        self._child, self._report = child, None

    def start(self, timeout: float = 120.0) -> "QueryLoad":
        """Start the client process and return once it sends its first query.

        Raises:
            RuntimeError: it was not ready within ``timeout`` seconds (it is killed).
        """
        self._process.start()
        self._child.close()
        try:
            ready = self._results.poll(timeout) and self._results.recv() == "ready"
        except EOFError:
            ready = False
        if not ready:
            self._process.kill()
            self._process.join(10)
            raise RuntimeError(f"the query client was not ready within {timeout:g} s (exit {self._process.exitcode})")
        return self

    def stop(self) -> dict:
        """Stop the client (once; later calls return the same report) and return ``{kind: {"answered",
        "failed", "p50_ms", "p99_ms"}}``."""
        if self._report is not None:
            return self._report
        self._stop.set()
        try:
            got = self._results.recv() if self._results.poll(60) else None
        except EOFError:
            got = None
        self._process.join(30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(10)
        if got is None:
            raise RuntimeError(f"the query client exited {self._process.exitcode} without reporting its results")
        self.latencies, self.failed = got["latencies"], got["failed"]
        self.codes, self.answered_at = got["codes"], got["answered_at"]
        out = {}
        for kind, values in self.latencies.items():
            q = statistics.quantiles(values, n=100) if len(values) >= 2 else [float("nan")] * 99
            out[kind] = {"answered": len(values), "failed": self.failed[kind], "p50_ms": q[49], "p99_ms": q[98]}
        self._report = out
        return out


def freshness_report(probe, event_seconds: dict[int, float]) -> dict:
    """Event-to-visible seconds of every event (``{offset: event time in seconds}``) from ``probe``'s states.

    Returns:
        ``{"events", "not_visible", "p50_s", "p99_s", "max_s", "histogram": [[upper bound, count], ...],
        "delta_wire_bytes", "delta_payload_bytes", "delta_overhead"}`` (``delta_overhead``: wire bytes over
        the least bytes the rows applied need).
    """
    from shardps.worker.serving.freshness import quantile

    offsets = sorted(event_seconds)
    seconds = [v - event_seconds[o] for o, v in zip(offsets, probe.visible_at(offsets)) if v is not None]
    counts = [0] * len(BUCKETS)
    for s in seconds:
        counts[next(k for k, bound in enumerate(BUCKETS) if s <= bound)] += 1
    return {"events": len(offsets), "not_visible": len(offsets) - len(seconds), "p50_s": quantile(seconds, 0.5),
            "p99_s": quantile(seconds, 0.99), "max_s": max(seconds, default=float("nan")),
            "histogram": [[b, c] for b, c in zip(BUCKETS, counts)], "delta_wire_bytes": probe.wire_bytes,
            "delta_payload_bytes": probe.payload_bytes,
            "delta_overhead": probe.wire_bytes / probe.payload_bytes if probe.payload_bytes else float("nan")}


def replica_histogram(metrics: str, partition: str) -> dict:
    """A replica's ``shardps_serving_event_freshness_seconds{partition}`` as its metrics port (``host:port``)
    serves it: ``{"events", "histogram": [[upper bound, count in that bucket alone], ...], "truncated",
    "failures"}``.

    Raises:
        OSError: the port did not answer.
    """
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    cumulative, truncated, failures, events = {}, 0.0, 0.0, 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            mine = sample.labels.get("partition") == partition
            if sample.name == "shardps_serving_event_freshness_seconds_bucket" and mine:
                cumulative[float(sample.labels["le"])] = sample.value
            elif sample.name == "shardps_serving_event_freshness_seconds_count" and mine:
                events = sample.value
            elif sample.name == "shardps_serving_event_freshness_truncated_total" and mine:
                truncated = sample.value
            elif sample.name == "shardps_serving_event_freshness_failures_total" and mine:
                failures = sample.value
    counts, below = [], 0.0
    for bound in BUCKETS:
        counts.append([bound, int(cumulative.get(bound, below) - below)])
        below = cumulative.get(bound, below)
    return {"events": int(events), "histogram": counts, "truncated": int(truncated), "failures": int(failures)}


def equals_export(address: str, servers: str, tables=MF_TABLES) -> dict:
    """Whether the replica at ``address`` serves exactly what the shards at ``servers`` hold now: every row of
    every table the shards hold (``Lookup``, compared with ``torch.equal``), and ``Score`` against the same
    formula on the exported rows and dense ``global_bias`` (``{"tables": bool, "score": bool, "rows": n}``).
    Read once training has stopped and the replica has caught up (a state with the shards' dense versions)."""
    from shardps.common.rows import rows_from
    from shardps.worker.embedding.export import export_table
    from shardps.worker.export import from_servers
    from shardps.worker.session.client import ShardClient

    clients = [ShardClient(a, index=i) for i, a in enumerate(servers.split(","))]
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.ServingStub(channel)
    try:
        exported = {t: export_table(clients, t) for t in tables}
        same, rows = True, 0
        for t, e in exported.items():
            reply = stub.Lookup(pb.LookupRequest(table=t, ids=ids_bytes(e.ids)), timeout=30)
            same &= torch.equal(rows_from(reply.rows, e.ids.numel(), reply.dim), e.weights)
            rows += e.ids.numel()
        with from_servers(servers.split(","), tables=[], allow_mixed_versions=True) as dense:  # (a shard may hold
            # no dense chunk: its version stays 0)
            mu = dense.state_dict["global_bias"].reshape(())
        user, items = exported["user"].ids[:1], exported["item"].ids[:100]
        p, b_u = exported["user"].lookup(user)[0], exported["user_bias"].lookup(user)[0, 0]
        expected = exported["item"].lookup(items) @ p + exported["item_bias"].lookup(items)[:, 0] + b_u + mu
        reply = stub.Score(pb.ScoreRequest(user=int(user[0]), items=ids_bytes(items)), timeout=30)
        score = torch.equal(rows_from(reply.scores, items.numel(), 1).reshape(-1), expected)
    finally:
        channel.close()
        for c in clients:
            c.close()
    return {"tables": bool(same), "score": bool(score), "rows": rows}


class Served:
    """``shardps serve`` beside a stream job, its freshness probe and (``qps`` > 0) a query load: a context
    manager; :meth:`finish` once the stream is trained and the trainer closed.

    Args:
        servers: the training shards (``"host:port,..."``). partition: the stream partition trained.
        period: the replica's refresh period (seconds). qps: queries per second (0: none).
        nice, realtime: the replica's ``shardps serve --nice``, ``--realtime`` (0: unchanged). client_nice,
            client_realtime, client_api: the query client's (:class:`QueryLoad` ``nice``, ``realtime``,
            ``api``). freshness_redis: the broker of the stream
            (``shardps serve --freshness-redis``: the replica's own per-event histogram, read back by
            :meth:`finish`); "": none.
    """

    def __init__(self, servers: str, partition: str, *, period: float = 0.5, qps: float = 200.0,
                 nice: int = 0, client_nice: int = 0, realtime: int = 0, client_realtime: int = 0,
                 client_api: str = "unary", freshness_redis: str = "") -> None:
        self.servers, self.partition, self.period, self.qps, self.nice = servers, partition, period, qps, nice
        self.client_nice, self.realtime, self.client_realtime = client_nice, realtime, client_realtime
        self.freshness_redis, self.client_api = freshness_redis, client_api
        self.events: dict[int, float] = {}  # stream offset -> event time (seconds): the broker entry's time
        self.process = self.probe = self.load = None

    def __enter__(self) -> "Served":
        from shardps.worker.serving.freshness import FreshnessProbe

        self.process, self.address, self.metrics = start_serve(self.servers, period=self.period, nice=self.nice,
                                                               realtime=self.realtime,
                                                               freshness_redis=self.freshness_redis)
        self.probe = FreshnessProbe(self.address, self.partition, poll=1.0).start()  # 256 states: 128 s
        if self.qps > 0:
            self.load = QueryLoad(self.address, self.qps, nice=self.client_nice,
                                  realtime=self.client_realtime, api=self.client_api).start()
        return self

    def finish(self, timeout: float = 60.0) -> dict:
        """Wait until the replica holds every event noted and dense parameters read since (at most ``timeout``
        seconds), stop the queries, and report: :func:`freshness_report`, ``"caught_up"``, ``"queries"``
        (:meth:`QueryLoad.stop`) and ``"equals_export"`` (:func:`equals_export`)."""
        trained = time.time()  # the trainer has closed: every round it pushed is applied
        caught_up = self.probe.wait_visible(max(self.events), timeout, dense_after=trained)
        queries = self.load.stop() if self.load is not None else {}
        self.probe.poll_once()
        report = {**freshness_report(self.probe, self.events), "caught_up": caught_up, "queries": queries,
                  "equals_export": equals_export(self.address, self.servers)}
        if self.metrics:
            report["prometheus"] = self.prometheus_report()
        return report

    def prometheus_report(self, timeout: float = 30.0) -> dict:
        """The replica's own ``shardps_serving_event_freshness_seconds`` histogram of this partition, read once
        it counts every event noted after the replica's first state holding the partition (at most ``timeout``
        seconds: it measures in a thread of its own), against the probe's figures for the same events:
        ``{"events", "histogram": [[upper bound, count], ...], "expected_events", "expected_histogram", "equal",
        "truncated", "failures"}``. ``equal``: the same count in every bucket."""
        held = [o for _, (_, o, _) in sorted(self.probe.states.items()) if o is not None]
        first = held[0] if held else None  # the first state naming the partition: what it held is not measured
        later = {o: t for o, t in self.events.items() if first is not None and o > first}
        expected = freshness_report(self.probe, later)
        deadline = time.monotonic() + timeout
        while True:
            got = replica_histogram(self.metrics, self.partition)
            if got["events"] >= len(later) - expected["not_visible"] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        want = [c for _, c in expected["histogram"]]
        return {**got, "expected_events": len(later) - expected["not_visible"], "expected_histogram":
                expected["histogram"], "equal": [c for _, c in got["histogram"]] == want}

    def __exit__(self, *exc) -> None:
        if self.load is not None:
            try:
                self.load.stop()
            except RuntimeError:  # the client died: what the caller raised (if anything) says more
                pass
        if self.probe is not None:
            self.probe.close()
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)

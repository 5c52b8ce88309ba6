"""``shardps train movielens --online``: MovieLens-100K's ratings as an event stream through a Redis broker.

    shardps train movielens --online --data-dir PATH/ml-100k [--redis-url redis://host:port/0] [--rate 2000]

The ratings of ``u.data`` in event-time order (the replay sorts them): the first ``--warm`` (50,000) train
the job's model (``shardps.apps.movielens.MF``, its tables on the shards) offline for ``--warm-epochs``
epochs; the rest are published by a producer process to a Redis stream at ``--rate`` events per second
and trained as they arrive. Each mini-batch (``--batch-size`` events, or fewer after ``--max-wait``
seconds) is first **scored by the current model** (progressive validation: the prediction is made
before the model trains on the event; eval mode, which reads rows without creating any) and then trained
in one sync step. The job prints and reports:

- ``progressive_rmse``: over every streamed event, of its prediction made before training on it
  (clipped to [1, 5]); ``frozen_rmse``: the same events scored by the warm-started model without updates;
  ``gain``: ``frozen_rmse - progressive_rmse``, what learning from the stream brings;
- ``events_per_s``: streamed events over the stream's wall time;
- ``latency_p50_s``/``latency_p99_s``: event-to-trained latency, from the event's entry into the broker
  (its Redis entry id's milliseconds) to the end of the step that trained it;
- ``baseline``: the same model, optimizers, warm start and stream in one process with plain torch (no
  shards, no broker, batches of ``--batch-size``): its frozen and progressive RMSE and gain;
  ``gain_vs_baseline``: shardps' gain over the baseline's (issue goal: at least 0.8);
- ``curve``: ``(event time, progressive RMSE so far, rows held)`` after each step (rows read from the
  shards' metrics every 20 steps), drawn to ``--plot`` (PNG); ``rows_held``, ``rows_held_max``.

``--ttl-days D`` evicts user and item rows unseen for D days of event time (``ttl_seconds``; every step
sends its batch's latest event time); ``--item-ttl-days`` gives the item tables their own. The stream is read by position (``RedisStreamReader``) through
``ExactlyOnce``: every step tells the shards which events it trains, so each event is trained once on every
shard even where a shard restarts from its checkpoint mid-stream (``replays`` in the report: times the
stream was read again for a shard behind).
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from shardps.apps.movielens import MF
from shardps.apps.online_serving import Served
from shardps.worker import DistributedOptimizer
from shardps.worker.stream.exactly_once import ExactlyOnce
from shardps.worker.serving.freshness import entry_seconds
from shardps.worker.stream.redis_source import RedisStreamReader, publish
from shardps.worker.stream.replay import FileReplay

COLUMNS = ["user", "item", "rating", "time"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class OnlineConfig:
    """One online movielens job (see the module docstring).

    Attributes:
        data_dir: the ``ml-100k`` folder (``u.data``). shards: shard processes started here.
        redis_url: the broker (empty: a ``redis-server`` started here, on a free port).
        warm, warm_epochs: ratings of the offline warm start, and its epochs.
        batch_size, max_wait: events per streamed step at most, and seconds a partial batch waits.
        rate: events per second the producer publishes. limit: streamed events at most (0: all the rest).
        dim, lr, bias_lr, global_lr, init_scale, seed: the model and its optimizers (``MovieLensConfig``'s).
        ttl_days: evict user and item rows unseen for this many days of event time (0: never; ``ttl_seconds``).
        item_ttl_days: evict item rows unseen for this many days instead (-1: ``ttl_days``; 0: never): items
            come back over months, a MovieLens user rates in a few sessions.
        plot: a PNG file for the progressive RMSE curve and the rows held (empty: none).
        serve: run ``shardps serve`` beside the job (refreshed every ``serve_period`` seconds, queried at
            ``serve_qps``, at ``serve --nice serve_nice`` or ``--realtime serve_realtime``, the query client at
            ``serve_client_nice`` or ``serve_client_realtime``, its queries a call each or on one ``Query``
            stream: ``serve_client_api`` ``"unary"`` or ``"stream"``) and report its freshness
            (``shardps.apps.online_serving``).

    Raises:
        ValueError: a setting out of range.
    """

    data_dir: str
    shards: int = 2
    redis_url: str = ""
    warm: int = 50_000
    warm_epochs: int = 5
    batch_size: int = 256
    max_wait: float = 0.2
    rate: float = 2000.0
    limit: int = 0
    dim: int = 32
    lr: float = 0.02
    bias_lr: float = 0.08
    global_lr: float = 1e-3
    init_scale: float = 0.01
    seed: int = 0
    ttl_days: float = 0.0
    item_ttl_days: float = -1.0
    plot: str = ""
    serve: bool = False
    serve_period: float = 0.5
    serve_qps: float = 200.0
    serve_nice: int = 0
    serve_client_nice: int = 0
    serve_realtime: int = 0
    serve_client_realtime: int = 0
    serve_client_api: str = "unary"

    def __post_init__(self) -> None:
        for name in ("shards", "warm", "warm_epochs", "batch_size", "dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not (self.rate > 0 and self.max_wait > 0 and self.limit >= 0 and self.ttl_days >= 0 and
                (self.item_ttl_days >= 0 or self.item_ttl_days == -1)):
            raise ValueError("--rate and --max-wait must be > 0, --limit, --ttl-days and --item-ttl-days >= 0")
        if not (self.serve_period >= 0.05 and self.serve_qps >= 0 and -20 <= self.serve_nice <= 19 and
                -20 <= self.serve_client_nice <= 19 and 0 <= self.serve_realtime <= 99 and
                0 <= self.serve_client_realtime <= 99):
            raise ValueError("--serve-period must be >= 0.05 seconds, --serve-qps >= 0, --serve-nice and "
                             "--serve-client-nice in [-20, 19] and --serve-realtime and --serve-client-realtime "
                             "in [0, 99]")
        if self.serve_client_api not in ("unary", "stream"):
            raise ValueError(f"--serve-client-api must be unary or stream, got {self.serve_client_api!r}")


def rating_tensors(events) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(users int64 [n], items int64 [n], ratings float32 [n])`` of MovieLens rating events."""
    return (torch.tensor([int(e.fields["user"]) for e in events]), torch.tensor([int(e.fields["item"]) for e in events]),
            torch.tensor([float(e.fields["rating"]) for e in events]))


def squared_errors(model: MF, users, items, ratings) -> torch.Tensor:
    """Squared errors of the model's clipped predictions, in eval mode (no row is created, nothing pushed)."""
    model.eval()
    with torch.no_grad():
        predicted, _, _ = model(users, items)
    model.train()
    return (predicted.clamp(1.0, 5.0) - ratings).pow(2)


def _producer(url: str, stream: str, records: list[dict], rate: float, conn) -> None:
    """The producer process (spawned): publish ``records`` (field names to values) to ``stream`` at ``rate``
    per second (blocks of 10 ms, over one connection), then the end marker. Says ``"ready"`` on ``conn`` once
    connected, starts on the first message it receives, and ends by sending ``None`` or the failure's text."""
    from shardps.worker.stream.redis_source import redis_client

    try:
        client = redis_client(url, decode_responses=True, socket_timeout=30)
        client.ping()
        conn.send("ready")
        conn.recv()  # go
        block = max(1, int(rate / 100))
        start = time.monotonic()
        for k in range(0, len(records), block):
            due = start + k / rate
            if due > time.monotonic():
                time.sleep(max(0.0, due - time.monotonic()))  # (the clock moved on since the test)
            publish(url, stream, records[k:k + block], client=client)
        publish(url, stream, [], end=True, client=client)
        client.close()
        conn.send(None)
    except Exception as exc:  # noqa: BLE001 - raised by the trainer
        conn.send(f"{type(exc).__name__}: {exc}")


class Producer:
    """The stream's producer in a process of its own (as a real event source is: it takes no interpreter
    time from the trainer): a context manager; :meth:`start` once the trainer reads, :meth:`join` at the end.
    A producer that fails or dies mid-stream is noticed at once: the stream is ended here (its end marker
    written), so the trainer's read ends instead of waiting for events that will not come, and :meth:`join`
    raises the failure.

    Raises (from ``__enter__``, :meth:`join`):
        RuntimeError: the producer could not connect to the broker, or failed or died while publishing (its
            message, or its exit code).
    """

    def __init__(self, url: str, stream: str, events, rate: float) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.url, self.stream = url, stream
        self._conn, self._child = ctx.Pipe()
        records = [{**e.fields, "time": e.time} for e in events]
        self.process = ctx.Process(target=_producer, args=(url, stream, records, rate, self._child),
                                   name="shardps-producer", daemon=True)
        self.failure: str | None = None
        self._done = threading.Event()

    def __enter__(self) -> "Producer":
        self.process.start()
        self._child.close()  # a producer that dies is then an EOF here
        try:
            said = self._conn.recv() if self._conn.poll(120) else "it did not connect to the broker within 120 s"
        except EOFError:
            self.process.join(10)
            said = f"it exited with code {self.process.exitcode}"
        if said != "ready":
            self.__exit__()
            raise RuntimeError(f"the producer failed: {said}")
        return self

    def start(self) -> None:
        """Start publishing (and watching the producer)."""
        self._conn.send("go")
        threading.Thread(target=self._watch, name="shardps-producer-watch", daemon=True).start()

    def _watch(self) -> None:
        try:
            said = self._conn.recv()
        except EOFError:
            self.process.join(10)
            said = f"it exited with code {self.process.exitcode} before publishing every event"
        if said is not None:
            self.failure = said
            log.error("the producer failed (%s): ending the stream so that the trainer stops", said)
            try:
                publish(self.url, self.stream, [], end=True)
            except Exception as exc:  # noqa: BLE001 - the broker down: the trainer's read fails on it too
                log.error("could not end the stream after the producer failed: %s", exc)
        self._done.set()

    def join(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) for the producer to publish everything.

        Raises:
            RuntimeError: it failed, or had not finished within ``timeout``.
        """
        if not self._done.wait(timeout):
            raise RuntimeError(f"the producer had not published every event {timeout:.0f} s after the trainer read "
                               "the end of the stream")
        if self.failure is not None:
            raise RuntimeError(f"the producer failed: {self.failure}")

    def __exit__(self, *exc) -> None:
        if self.process.is_alive():
            self.process.terminate()
        self.process.join(30)
        self._conn.close()


def run_online(config: OnlineConfig, say=print) -> dict:
    """The online job; returns its report (module docstring), with ``config``.

    Raises:
        FileNotFoundError: no ``u.data`` in ``data_dir``. RuntimeError: a shard, the broker or the producer
        failed (the message says which). BrokerUnavailable: the broker went away past its retry budget.
    """
    from shardps.worker.cluster import LocalCluster
    from shardps.worker.stream.local_redis import LocalRedis

    path = Path(config.data_dir) / "u.data"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: download ml-100k.zip from https://grouplens.org/datasets/"
                                "movielens/100k/ and pass --data-dir PATH/ml-100k")
    events = FileReplay(path, COLUMNS, "time", sort=True).read(10 ** 9, 0)
    warm, streamed = events[:config.warm], events[config.warm:]
    if config.limit:
        streamed = streamed[:config.limit]
    torch.manual_seed(config.seed)
    with tempfile.TemporaryDirectory(prefix="shardps-online-") as tmp, \
            LocalCluster(config.shards, min_workers=1, extra_args=("--threads", "1", "--metrics-port", "0")) as cluster:
        broker = None if config.redis_url else LocalRedis(Path(tmp) / "redis").start()
        url = config.redis_url or broker.url
        try:
            report = _train(config, cluster, url, warm, streamed, say)
        finally:
            if broker is not None:
                broker.stop()
    report["baseline"] = reference = baseline(config, warm, streamed)
    report["gain_vs_baseline"] = report["gain"] / reference["gain"] if reference["gain"] > 0 else float("nan")
    say(f"baseline (one process, no broker): progressive RMSE {reference['progressive_rmse']:.4f} (frozen "
        f"{reference['frozen_rmse']:.4f}, gain {reference['gain']:.4f}); shardps recovers "
        f"{report['gain_vs_baseline']:.2f}x its gain")
    if config.plot:
        _plot(report, config.plot)
        report["plot"] = config.plot
    return {**report, "config": asdict(config)}


class LocalMF(nn.Module):
    """The job's model in one process, the baseline: ``nn.Embedding(sparse=True)`` user and item tables of the
    ids' range, rows uniform in [-init_scale, init_scale), biases 0 (``MF``'s settings, torch's own draws)."""

    def __init__(self, dim: int, init_scale: float, mean: float, users: int, items: int) -> None:
        super().__init__()
        self.user, self.item = nn.Embedding(users, dim, sparse=True), nn.Embedding(items, dim, sparse=True)
        self.user_bias, self.item_bias = nn.Embedding(users, 1, sparse=True), nn.Embedding(items, 1, sparse=True)
        with torch.no_grad():
            for table in (self.user, self.item):
                table.weight.uniform_(-init_scale, init_scale)
            for table in (self.user_bias, self.item_bias):
                table.weight.zero_()
        self.global_bias = nn.Parameter(torch.tensor(float(mean)))

    def forward(self, users: torch.Tensor, items: torch.Tensor):
        p, q = self.user(users), self.item(items)
        rating = (p * q).sum(1) + self.user_bias(users)[:, 0] + self.item_bias(items)[:, 0] + self.global_bias
        return rating, p, q


def baseline(config: OnlineConfig, warm, streamed) -> dict:
    """One process, no shardps, no broker: the same warm start (model settings, optimizers, batches), then the
    stream in batches of ``batch_size``, each scored before it is trained. ``{"frozen_rmse",
    "progressive_rmse", "gain"}``."""
    import warnings

    users, items, ratings = rating_tensors(warm)
    su, si, sr = rating_tensors(streamed)
    model = LocalMF(config.dim, config.init_scale, float(ratings.mean()), int(max(users.max(), su.max())) + 1,
                    int(max(items.max(), si.max())) + 1)
    dense = torch.optim.Adam([model.global_bias], lr=config.global_lr)
    sparse = torch.optim.Adagrad([{"params": [model.user.weight, model.item.weight]},
                                  {"params": [model.user_bias.weight, model.item_bias.weight], "lr": config.bias_lr}],
                                 lr=config.lr, eps=1e-10)

    def step(u, i, r) -> None:
        dense.zero_grad()
        sparse.zero_grad()
        predicted, _, _ = model(u, i)
        (predicted - r).pow(2).mean().backward()
        dense.step()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Sparse invariant checks")
            sparse.step()

    generator = torch.Generator().manual_seed(config.seed)
    for _ in range(config.warm_epochs):
        for batch in torch.randperm(users.numel(), generator=generator).split(512):
            step(users[batch], items[batch], ratings[batch])
    with torch.no_grad():
        frozen = float((model(su, si)[0].clamp(1.0, 5.0) - sr).pow(2).mean().sqrt())
    errors = []
    for k in range(0, su.numel(), config.batch_size):
        u, i, r = su[k:k + config.batch_size], si[k:k + config.batch_size], sr[k:k + config.batch_size]
        with torch.no_grad():
            errors.append((model(u, i)[0].clamp(1.0, 5.0) - r).pow(2))
        step(u, i, r)
    progressive = math.sqrt(float(torch.cat(errors).mean()))
    return {"frozen_rmse": frozen, "progressive_rmse": progressive, "gain": frozen - progressive}


def _rows_held(cluster) -> int:
    """Rows the shards hold, every table (their ``shardps_shard_table_rows`` gauges)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for endpoint in cluster.endpoints:
        text = urllib.request.urlopen(f"http://{endpoint['metrics']}/metrics", timeout=30).read().decode()
        total += sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                     if s.name == "shardps_shard_table_rows")
    return int(total)


def _train(config: OnlineConfig, cluster, url: str, warm, streamed, say) -> dict:
    servers = cluster.servers
    users, items, ratings = rating_tensors(warm)
    model = MF(config.dim, config.init_scale, float(ratings.mean()), config.ttl_days * 86400.0,
               config.item_ttl_days * 86400.0 if config.item_ttl_days >= 0 else None)
    dense = torch.optim.Adam([model.global_bias], lr=config.global_lr)
    sparse = torch.optim.Adagrad([{"params": [model.user.handle, model.item.handle]},
                                  {"params": [model.user_bias.handle, model.item_bias.handle], "lr": config.bias_lr}],
                                 lr=config.lr, eps=1e-10)
    dist = DistributedOptimizer(dense, model.named_parameters(), servers=servers, model=model,
                                worker_id="online-0", sparse_optimizer=sparse)
    generator = torch.Generator().manual_seed(config.seed)
    served = None
    with contextlib.ExitStack() as stack:  # the replica (--serve) stops however the job ends
        try:
            for epoch in range(config.warm_epochs):
                for batch in torch.randperm(users.numel(), generator=generator).split(512):
                    dist.zero_grad()
                    predicted, _, _ = model(users[batch], items[batch])
                    (predicted - ratings[batch]).pow(2).mean().backward()
                    dist.set_event_time(warm[-1].time)  # the warm start is the model as of its last rating
                    dist.step()
            su, si, sr = rating_tensors(streamed)
            frozen = float(squared_errors(model, su, si, sr).mean().sqrt())
            say(f"warm start: {len(warm)} ratings x {config.warm_epochs} epochs; the frozen model's RMSE on the "
                f"{len(streamed)} streamed ratings: {frozen:.4f}")
            stream = f"shardps-movielens-{uuid.uuid4().hex[:12]}"  # a broker given may hold older runs'
            producer = stack.enter_context(Producer(url, stream, streamed, config.rate))
            source = RedisStreamReader(url, stream)
            if config.serve:
                served = stack.enter_context(Served(servers, source.partition, period=config.serve_period,
                                                    qps=config.serve_qps, nice=config.serve_nice,
                                                    client_nice=config.serve_client_nice,
                                                    realtime=config.serve_realtime,
                                                    client_realtime=config.serve_client_realtime,
                                                    client_api=config.serve_client_api, freshness_redis=url))
            producer.start()
            errors, latencies, curve, done, started = [], [], [], 0, time.monotonic()
            reader = ExactlyOnce(dist, source, config.batch_size, max_wait=config.max_wait)
            for batch in reader.batches():  # each event trained once on every shard (stream offsets on the shards)
                u, i, r = rating_tensors(batch)
                errors.append(squared_errors(model, u, i, r))  # scored before the model learns from them
                dist.zero_grad()
                predicted, _, _ = model(u, i)
                (predicted - r).pow(2).mean().backward()
                dist.set_event_time(batch[-1].time)
                dist.step()
                trained = time.time()
                latencies.extend(trained - entry_seconds(source.position(e)) for e in batch)
                if served is not None:
                    served.events.update((source.position(e), entry_seconds(source.position(e))) for e in batch)
                done += len(batch)
                rows = _rows_held(cluster) if len(curve) % 20 == 0 else curve[-1][2]  # every 20 steps
                curve.append((batch[-1].time, math.sqrt(float(torch.cat(errors).mean())), rows))
            seconds = time.monotonic() - started
            producer.join(30)
            source.close()
        finally:
            dist.close()
        if done - reader.replayed != len(streamed):
            raise RuntimeError(f"trained {done} of {len(streamed)} streamed events")
        progressive = curve[-1][1]
        q = statistics.quantiles(latencies, n=100)
        dist_rows = _rows_held(cluster)
        report = {"events": done, "frozen_rmse": frozen, "progressive_rmse": progressive, "gain": frozen - progressive,
                  "rows_held": dist_rows, "rows_held_max": max(dist_rows, *(c[2] for c in curve)),
                  "replays": reader.replays, "events_per_s": done / seconds, "latency_p50_s": q[49], "latency_p99_s": q[98], "steps": len(curve),
                  "curve": curve}
        if served is not None:
            report["serving"] = served.finish()
            _say_served(report["serving"], say)
        say(f"online: {done} events in {seconds:.1f} s ({report['events_per_s']:.0f} events/s), progressive RMSE "
            f"{progressive:.4f} (frozen {frozen:.4f}, gain {report['gain']:.4f}), event-to-trained latency p50 "
            f"{q[49] * 1e3:.0f} ms, p99 {q[98] * 1e3:.0f} ms")
        return report


def _say_served(r: dict, say) -> None:
    q = r["queries"]
    say(f"serving: event-to-visible p50 {r['p50_s']:.2f} s, p99 {r['p99_s']:.2f} s ({r['not_visible']} of "
        f"{r['events']} events never seen); delta bytes {r['delta_overhead']:.3f}x the rows' own; the replica "
        f"{'equals' if r['equals_export']['tables'] and r['equals_export']['score'] else 'DIFFERS FROM'} the export; "
        + ", ".join(f"{k} p99 {v['p99_ms']:.2f} ms ({v['failed']} failed)" for k, v in q.items()))
    if "prometheus" in r:
        p = r["prometheus"]
        say(f"serving: the replica's Prometheus histogram shardps_serving_event_freshness_seconds counts "
            f"{p['events']} events (after its first state: {p['expected_events']}), "
            f"{'bucket for bucket as measured from outside' if p['equal'] else 'NOT as measured from outside'}")


def _plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times, rmse, rows = zip(*report["curve"])
    days = [(t - times[0]) / 86400 for t in times]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(days, rmse, label="progressive RMSE (shardps, online)")
    ax.axhline(report["frozen_rmse"], color="grey", linestyle="--", label="frozen warm-started model")
    ax.set_xlabel("event time (days since the stream's first event)")
    ax.set_ylabel("RMSE")
    held = ax.twinx()
    held.plot(days, rows, color="tab:orange", label="rows held (all tables)")
    held.set_ylabel("rows held")
    ax.legend(loc="upper right")
    held.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

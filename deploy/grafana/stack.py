"""A real monitoring stack on loopback: shards, a ``shardps train digits`` job, a serving replica and Prometheus.

Used by tests/deploy/test_monitoring.py (every dashboard query and alert
expression must return data) and by ``render.py --run`` (the README's
dashboard picture). Prometheus runs with ``deploy/prometheus/prometheus.yml``
and ``alerts.yml`` as committed, except that each job's Kubernetes service
discovery (``dns_sd_configs``) is swapped for a
``file_sd_configs`` file of loopback targets (:func:`loopback_config`), and
the intervals are shortened. Shards serve metrics with ``--metrics-port 0``
(their ``... metrics on HOST:PORT`` lines, read by ``LocalCluster``); each
worker is a ``shardps train digits --worker-index I --metrics-port 0``
process whose ``worker I metrics on HOST:PORT`` line adds it to the
workers' target file while it runs. The digits job has no tables to serve,
so the replica (``shardps serve --metrics-port 0``) follows a small job of
its own (:class:`ServingLoad`).

Needs the ``prometheus`` binary (Debian/Ubuntu: ``apt-get install prometheus``)
and PyYAML. Every process started here is stopped by :meth:`MonitoringStack.stop`.

    python stack.py train-factorisation --servers HOST:PORT   # the serving load's trainer (ServingLoad starts it)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_YML = REPO_ROOT / "deploy" / "prometheus" / "prometheus.yml"
ALERTS_YML = REPO_ROOT / "deploy" / "prometheus" / "alerts.yml"
SHARD_JOB, WORKER_JOB, REPLICA_JOB = "shardps-shards", "shardps-workers", "shardps-replicas"
#: The MovieLens factorisation's tables (``shardps.apps.movielens.MF``): what the replica serves, what Score needs.
SERVING_TABLES = ("user", "item", "user_bias", "item_bias")
#: What a shard (``shardps-server shard I/N metrics on H:P``) or a worker (``worker I metrics on H:P``) prints.
METRICS_LINE = re.compile(r"metrics on (\S+):(\d+)\s*$")
_WILDCARDS = {"0.0.0.0", "::", "[::]", ""}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def scrape_address(host: str, port: int | str) -> str:
    """``host:port`` to scrape; an endpoint bound to every interface (``0.0.0.0``) is scraped on 127.0.0.1."""
    return f"{'127.0.0.1' if host in _WILDCARDS else host}:{port}"


def rate_interval(scrape_seconds: float, step_seconds: float) -> str:
    """Grafana's ``$__rate_interval`` for a scrape interval and a query step: ``max(4 scrape, step + scrape)``."""
    return f"{max(4 * scrape_seconds, step_seconds + scrape_seconds):g}s"


def grafana_expr(expr: str, rate: str) -> str:
    """A dashboard query as plain PromQL: ``$__rate_interval`` replaced by ``rate`` (e.g. ``"5s"``).

    Raises:
        ValueError: the query uses another Grafana variable (``$name``), which Prometheus cannot run.
    """
    out = expr.replace("$__rate_interval", rate)
    if m := re.search(r"\$\{?\w+", out):
        raise ValueError(f"query uses the Grafana variable {m.group(0)!r}, which only $__rate_interval may be: {expr}")
    return out


def load_config(path: Path = PROMETHEUS_YML) -> dict:
    """The committed Prometheus configuration as a dict."""
    return yaml.safe_load(path.read_text())


def loopback_config(config: dict, discovery: dict[str, dict], *, interval: str | None = None,
                    rule_files: list[Path] | None = None, keep_relabeling: bool = False) -> dict:
    """``config`` with each job's DNS service discovery replaced; everything else kept.

    Args:
        config: a Prometheus configuration (:func:`load_config`).
        discovery: per job name, what replaces ``dns_sd_configs``, e.g.
            ``{"file_sd_configs": [{"files": ["/tmp/x.json"]}]}`` or ``{"static_configs": [...]}``.
        interval: when given, the global scrape and evaluation interval (and the scrape timeout).
        rule_files: when given, absolute paths that replace ``rule_files`` (a copy's relative
            paths would not resolve).
        keep_relabeling: keep the jobs' ``relabel_configs``, if any; by default they are dropped with
            the discovery they relabel.

    Raises:
        ValueError: a job of ``config`` has no entry in ``discovery``, or an entry names no job of ``config``.
    """
    out = copy.deepcopy(config)
    jobs = [job["job_name"] for job in out["scrape_configs"]]
    if sorted(jobs) != sorted(discovery):
        raise ValueError(f"discovery must name exactly the jobs {jobs}, got {sorted(discovery)}")
    for job in out["scrape_configs"]:
        job.pop("dns_sd_configs", None)
        if not keep_relabeling:
            job.pop("relabel_configs", None)
        job.update(copy.deepcopy(discovery[job["job_name"]]))
    if interval is not None:
        out.setdefault("global", {}).update(
            scrape_interval=interval, evaluation_interval=interval, scrape_timeout=interval)
    if rule_files is not None:
        out["rule_files"] = [str(p) for p in rule_files]
    return out


def write_targets(path: Path, targets: list[str]) -> None:
    """Write a ``file_sd_configs`` file listing ``targets`` (atomically: Prometheus never reads half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps([{"targets": sorted(targets), "labels": {}}] if targets else []))
    os.replace(tmp, path)


class PrometheusAPI:
    """A client of the HTTP API of the Prometheus at ``url`` (e.g. ``http://localhost:9090``)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def api(self, path: str, **params) -> dict | list:
        """``GET /api/v1/<path>`` and return its ``data``.

        Raises:
            RuntimeError: the server answered an error (bad query, ...), naming the query.
        """
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as reply:
                body = json.load(reply)
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus /api/v1/{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """Instant query: the result vector (``[{"metric": {...}, "value": [t, "v"]}, ...]``)."""
        return self.api("query", query=expr, time=at)["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        """Range query: the result matrix (``[{"metric": {...}, "values": [[t, "v"], ...]}, ...]``)."""
        return self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step:g}")["result"]

    def targets(self) -> list[dict]:
        """Active scrape targets (``labels``, ``health``, ``lastError``, ...)."""
        return self.api("targets", state="active")["activeTargets"]

    def rules(self) -> list[dict]:
        """Every loaded rule (``name``, ``query``, ``health``, ``lastError``, ``state``), all groups together."""
        return [rule for group in self.api("rules")["groups"] for rule in group["rules"]]


class Prometheus(PrometheusAPI):
    """One ``prometheus`` server on 127.0.0.1 (a free port), with its data in ``workdir``.

    Raises (from :meth:`start`):
        RuntimeError: the binary is missing, or the server exited or was not ready in ``start_timeout``
            seconds (the message holds the end of its log).
    """

    def __init__(self, config: dict, workdir: Path, *, binary: str = "prometheus", start_timeout: float = 30.0):
        self.config, self.workdir, self.binary, self.start_timeout = config, Path(workdir), binary, start_timeout
        super().__init__("")
        self.process: subprocess.Popen | None = None
        self.config_path = self.workdir / "prometheus.yml"
        self.log_path = self.workdir / "prometheus.log"

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def start(self) -> "Prometheus":
        if shutil.which(self.binary) is None:
            raise RuntimeError(f"{self.binary!r} is not on PATH: install Prometheus (apt-get install prometheus)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        for _ in range(3):  # the free port can be taken between our probe and Prometheus' bind
            port = free_port()
            with open(self.log_path, "ab") as log:
                self.process = subprocess.Popen(
                    [self.binary, f"--config.file={self.config_path}", f"--storage.tsdb.path={self.workdir / 'data'}",
                     f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            self.url = f"http://127.0.0.1:{port}"
            if self._wait_ready():
                return self
            code = self.process.poll()
            self.stop()
            if code is None or "address already in use" not in self.log_tail():
                raise RuntimeError(f"prometheus {'exited with code ' + str(code) if code is not None else 'not ready'}"
                                   f" within {self.start_timeout:.0f}s:\n{self.log_tail()}")
        raise RuntimeError(f"prometheus found no free port in 3 tries:\n{self.log_tail()}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as reply:
                    if reply.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        return False

    def stop(self) -> None:
        """SIGTERM, wait up to 10 s, SIGKILL."""
        proc, self.process = self.process, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class TrainingJob:
    """``workers`` processes of ``shardps train digits --worker-index I --metrics-port 0`` against ``servers``.

    ``on_metrics(index, "host:port")`` is called (from a reader thread) when
    worker ``index`` reports its metrics endpoint; ``metrics_addresses`` holds them.
    """

    def __init__(self, servers: str, logdir: Path, *, workers: int = 2, epochs: int = 20, mode: str = "sync",
                 extra_args: tuple[str, ...] = (), on_metrics: Callable[[int, str], None] | None = None):
        self.servers, self.logdir, self.workers, self.epochs = servers, Path(logdir), workers, epochs
        self.mode, self.extra_args, self.on_metrics = mode, tuple(extra_args), on_metrics
        self.processes: list[subprocess.Popen] = []
        self.metrics_addresses: dict[int, str] = {}
        self.lines: dict[int, list[str]] = {}
        self._readers: list[threading.Thread] = []

    def start(self) -> "TrainingJob":
        self.logdir.mkdir(parents=True, exist_ok=True)
        for i in range(self.workers):
            cmd = [sys.executable, "-m", "shardps.cli.main", "train", "digits", "--servers", self.servers,
                   "--workers", str(self.workers), "--worker-index", str(i), "--epochs", str(self.epochs),
                   "--mode", self.mode, "--metrics-port", "0", "--log-every", "0", *self.extra_args]
            with open(self.logdir / f"worker-{i}.log", "ab") as err:
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, text=True)
            self.processes.append(proc)
            self.lines[i] = []
            reader = threading.Thread(target=self._read, args=(i, proc), daemon=True, name=f"worker-{i}-stdout")
            reader.start()
            self._readers.append(reader)
        return self

    def _read(self, index: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:  # ends at EOF: the process exited or was killed
            self.lines[index].append(line.rstrip("\n"))
            if index not in self.metrics_addresses and (m := METRICS_LINE.search(line)):
                self.metrics_addresses[index] = address = scrape_address(m.group(1), m.group(2))
                if self.on_metrics is not None:
                    self.on_metrics(index, address)

    def running(self) -> bool:
        return any(p.poll() is None for p in self.processes)

    def exit_codes(self) -> list[int | None]:
        return [p.poll() for p in self.processes]

    def log_tail(self, index: int, lines: int = 15) -> str:
        try:
            text = (self.logdir / f"worker-{index}.log").read_text(errors="replace")
        except OSError:
            text = ""
        return "\n".join((self.lines.get(index, []) + text.splitlines())[-lines:])

    def wait(self, timeout: float) -> list[int | None]:
        """Wait up to ``timeout`` seconds for every worker to exit; returns the exit codes (None: still running)."""
        deadline = time.monotonic() + timeout
        for proc in self.processes:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return self.exit_codes()

    def stop(self) -> None:
        """SIGTERM the workers still running, wait up to 10 s, SIGKILL the rest."""
        for proc in self.processes:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 10
        for proc in self.processes:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for reader in self._readers:
            reader.join(timeout=5)
        for proc in self.processes:
            if proc.stdout:
                proc.stdout.close()


class ServingLoad:
    """What the dashboard's serving panels plot: ``shardps serve --metrics-port 0`` and a client calling it.

    The replica follows a job of its own on one more shard: a process (``python stack.py
    train-factorisation``) stepping the MovieLens factorisation on random ratings every ``step_every``
    seconds, written first to a Redis stream of a ``redis-server`` started here, which the replica reads back
    for its per-event freshness (``--freshness-redis``). A client thread here sends a ``Lookup`` of 64 user ids and a ``Score`` of a user against 32
    items every ``query_every`` seconds; calls before the replica's first state end UNAVAILABLE and are
    counted so (``calls``). ``on_metrics("host:port")`` is called (from a reader thread) when the replica
    serves metrics; ``ready`` is set once it has read its first state.

    Raises (from :meth:`start`):
        RuntimeError: the shard did not start, or the replica printed no ``serving on`` and ``metrics on``
            lines within ``start_timeout`` seconds (the message holds the end of its log).
    """

    def __init__(self, logdir: Path, cluster_factory, *, period: float = 0.5, step_every: float = 0.2,
                 query_every: float = 0.1, start_timeout: float = 60.0,
                 on_metrics: Callable[[str], None] | None = None):
        self.logdir, self.cluster_factory, self.period = Path(logdir), cluster_factory, period
        self.step_every, self.query_every, self.start_timeout = step_every, query_every, start_timeout
        self.on_metrics = on_metrics
        self.cluster = self.trainer = self.replica = self.broker = None
        self.address = self.metrics_address = None
        self.lines: list[str] = []
        self.calls = {"answered": 0, "refused": 0}
        self.exit_codes: dict[str, int | None] = {}
        self.ready = threading.Event()
        self._listening = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> "ServingLoad":
        self.logdir.mkdir(parents=True, exist_ok=True)
        try:
            from shardps.worker.stream.local_redis import LocalRedis

            self.cluster = self.cluster_factory(1, min_workers=1).start()
            self.broker = LocalRedis(self.logdir / "redis").start()
            with open(self.logdir / "trainer.log", "ab") as log:
                self.trainer = subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), "train-factorisation", "--servers",
                     self.cluster.servers, "--step-every", f"{self.step_every:g}", "--redis-url", self.broker.url],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            with open(self.logdir / "replica.log", "ab") as log:
                self.replica = subprocess.Popen(
                    [sys.executable, "-m", "shardps.cli.main", "serve", "--servers", self.cluster.servers,
                     "--tables", ",".join(SERVING_TABLES), "--period", f"{self.period:g}", "--dense-every", "2",
                     "--metrics-port", "0", "--freshness-redis", self.broker.url], stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, text=True)
            self._spawn(self._read, "replica-stdout")
            self._listening.wait(self.start_timeout)
            if not (self.address and self.metrics_address):
                raise RuntimeError(f"the replica printed no 'serving on' and 'metrics on' lines within "
                                   f"{self.start_timeout:.0f}s (exit code {self.replica.poll()}):\n{self.log_tail()}")
            self._spawn(self._query, "replica-client")
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, target, name: str) -> None:
        thread = threading.Thread(target=target, daemon=True, name=name)
        thread.start()
        self._threads.append(thread)

    def _read(self) -> None:
        try:
            for line in self.replica.stdout:  # ends at EOF: the replica exited or was killed
                line = line.rstrip("\n")
                self.lines.append(line)
                if line.startswith("serving on "):
                    self.address = line[len("serving on "):].strip()
                elif self.metrics_address is None and (m := METRICS_LINE.search(line)):
                    self.metrics_address = scrape_address(m.group(1), m.group(2))
                    if self.on_metrics is not None:
                        self.on_metrics(self.metrics_address)
                elif line.startswith("serving tables "):
                    self.ready.set()
                if self.address and self.metrics_address:
                    self._listening.set()
        finally:
            self._listening.set()  # an exited replica: start() need not wait out its timeout

    def _query(self) -> None:
        import grpc

        from shardps.proto import shardps_pb2 as pb
        from shardps.proto import shardps_pb2_grpc as pb_grpc

        users, items = struct.pack("<64q", *range(64)), struct.pack("<32q", *range(32))
        with grpc.insecure_channel(self.address) as channel:
            stub = pb_grpc.ServingStub(channel)
            while not self._stop.wait(self.query_every):
                for call, request in ((stub.Lookup, pb.LookupRequest(table="user", ids=users)),
                                      (stub.Score, pb.ScoreRequest(user=1, items=items))):
                    try:
                        call(request, timeout=5)
                        self.calls["answered"] += 1
                    except grpc.RpcError:  # UNAVAILABLE before the first state: the metrics count it too
                        self.calls["refused"] += 1

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = (self.logdir / "replica.log").read_text(errors="replace")
        except OSError:
            text = ""
        return "\n".join((self.lines + text.splitlines())[-lines:])

    def stop(self) -> None:
        """Stop the client, SIGTERM the replica and the trainer (SIGKILL after 10 s), then stop the shard."""
        self._stop.set()
        try:
            for proc in (self.replica, self.trainer):
                if proc is not None and proc.poll() is None:
                    proc.terminate()
            deadline = time.monotonic() + 10
            for name, proc in (("replica", self.replica), ("trainer", self.trainer)):
                if proc is None:
                    continue
                try:
                    self.exit_codes[name] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    self.exit_codes[name] = proc.wait()
            for thread in self._threads:
                thread.join(timeout=10)
            if self.replica is not None and self.replica.stdout:
                self.replica.stdout.close()
        finally:
            if self.cluster is not None:
                self.cluster.stop()
            if self.broker is not None:
                self.broker.stop()


def train_factorisation(servers: str, step_every: float, dim: int = 8, redis_url: str = "") -> int:
    """The serving load's trainer: the MovieLens factorisation (``shardps.apps.movielens.MF``) on random ratings
    of 100 users and 200 items, a batch of 32 every ``step_every`` seconds, until SIGTERM; returns 0. Each batch
    is named as a stream's (partition ``ratings``, ``set_stream_span``), as a stream trainer's are, so the
    replica's stream offset and its panel have data: with ``redis_url`` its ratings are first written to the
    Redis stream ``ratings`` there and the span is their entry ids (so the replica's per-event freshness,
    ``--freshness-redis``, reads them back); without, offsets are entry ids of the step's time."""
    import torch

    from shardps.apps.movielens import MF
    from shardps.worker import DistributedOptimizer
    from shardps.worker.stream.exactly_once import redis_offset
    from shardps.worker.stream.redis_source import publish, redis_client

    torch.set_num_threads(1)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    model = MF(dim, 0.1, 3.5)
    dist = DistributedOptimizer(torch.optim.SGD([model.global_bias], lr=0.01), model.named_parameters(),
                                servers=servers, model=model, worker_id="serving-load",
                                sparse_optimizer=torch.optim.Adagrad([model.user.handle, model.item.handle,
                                                                      model.user_bias.handle,
                                                                      model.item_bias.handle], lr=0.05))
    g = torch.Generator().manual_seed(0)
    after = None
    broker = redis_client(redis_url, decode_responses=True) if redis_url else None
    try:
        while not stop.wait(step_every):
            users, items = torch.randint(0, 100, (32,), generator=g), torch.randint(0, 200, (32,), generator=g)
            ratings = torch.randint(1, 6, (32,), generator=g).float()
            if redis_url:
                ids = publish(redis_url, "ratings", [{"user": int(u), "item": int(i), "rating": float(r)}
                                                     for u, i, r in zip(users, items, ratings)], client=broker)
                last = redis_offset(ids[-1])
            else:
                last = max(int(time.time() * 1000) << 20, (after or 0) + 1)  # a Redis entry id: ms << 20 | seq
            dist.set_stream_span("ratings", after, last)
            dist.zero_grad()
            (model(users, items)[0] - ratings).pow(2).mean().backward()
            dist.step()
            after = last
    finally:
        dist.close()
        if broker is not None:
            broker.close()
    return 0


class MonitoringStack:
    """Shards, Prometheus and a training job on loopback; a context manager that stops all of them.

    Args:
        workdir: an empty directory for Prometheus' data, target files, checkpoints and logs.
        shards, workers, epochs, mode: the cluster and the ``train digits`` job (``min_workers = workers``).
        scrape_interval: seconds between scrapes and between rule evaluations.
        checkpoint_every_rounds: shards checkpoint every N rounds (so checkpoint metrics have data).
        cluster_factory: ``factory(num_shards, min_workers=..., extra_args=...)`` returning an unstarted
            ``LocalCluster`` (default ``shardps.worker.cluster.LocalCluster``; the tests pass ``ForkedCluster``).
        extra_worker_args: more ``shardps train digits`` flags (e.g. ``("--staleness", "2")``).
        serving: also start a :class:`ServingLoad` (a replica of a small job of its own, scraped as job
            ``shardps-replicas``, and a client calling it).

    Attributes:
        cluster, prometheus, job, replica: the parts, once started (``job`` after :meth:`start_job`;
            ``replica``, the :class:`ServingLoad`, only with ``serving``).

    Raises (from :meth:`start`):
        RuntimeError: a shard or Prometheus did not start, or a shard reported no metrics endpoint.
    """

    def __init__(self, workdir: Path, *, shards: int = 2, workers: int = 2, epochs: int = 20, mode: str = "sync",
                 scrape_interval: float = 1.0, checkpoint_every_rounds: int = 10, cluster_factory=None,
                 extra_worker_args: tuple[str, ...] = (), serving: bool = True):
        self.workdir, self.serving = Path(workdir), serving
        self.shards, self.workers, self.epochs, self.mode = shards, workers, epochs, mode
        self.scrape_interval, self.checkpoint_every_rounds = scrape_interval, checkpoint_every_rounds
        self.cluster_factory, self.extra_worker_args = cluster_factory, tuple(extra_worker_args)
        self.targets_files = {SHARD_JOB: self.workdir / "targets-shards.json",
                              WORKER_JOB: self.workdir / "targets-workers.json",
                              REPLICA_JOB: self.workdir / "targets-replicas.json"}
        self.cluster = self.prometheus = self.job = self.replica = None
        self._lock = threading.Lock()

    def start(self) -> "MonitoringStack":
        """Start the shards (metrics on), then Prometheus scraping them, then the serving load (with ``serving``);
        the workers come with :meth:`start_job`."""
        if self.cluster_factory is None:
            from shardps.worker.cluster import LocalCluster
            self.cluster_factory = LocalCluster
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            args = ("--metrics-port", "0", "--checkpoint-dir", str(self.workdir / "checkpoints"),
                    "--checkpoint-every-rounds", str(self.checkpoint_every_rounds))
            self.cluster = self.cluster_factory(self.shards, min_workers=self.workers, extra_args=args).start()
            shard_targets = shard_metrics_addresses(self.cluster)
            write_targets(self.targets_files[SHARD_JOB], shard_targets)
            write_targets(self.targets_files[WORKER_JOB], [])
            write_targets(self.targets_files[REPLICA_JOB], [])
            config = loopback_config(
                load_config(),
                {job: {"file_sd_configs": [{"files": [str(path)], "refresh_interval": "1s"}]}
                 for job, path in self.targets_files.items()},
                interval=f"{self.scrape_interval:g}s", rule_files=[ALERTS_YML])
            self.prometheus = Prometheus(config, self.workdir / "prometheus").start()
            if self.serving:
                self.replica = ServingLoad(self.workdir / "serving", self.cluster_factory, on_metrics=lambda a: (
                    write_targets(self.targets_files[REPLICA_JOB], [a]))).start()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_for_targets(self, job: str, count: int, timeout: float = 30.0) -> None:
        """Wait until ``count`` targets of scrape job ``job`` are up (Prometheus applies discovery every 5 s).

        Raises:
            RuntimeError: they were not up within ``timeout`` seconds (the message lists the targets).
        """
        deadline = time.monotonic() + timeout
        while True:
            targets = [t for t in self.prometheus.targets() if t["labels"]["job"] == job]
            if sum(t["health"] == "up" for t in targets) >= count:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{count} targets of {job} were not up within {timeout:.0f}s: "
                                   f"{[(t['scrapeUrl'], t['health'], t['lastError']) for t in targets]}")
            time.sleep(0.5)

    def start_job(self) -> TrainingJob:
        """Start the ``train digits`` workers; each is added to the workers' scrape targets once it serves metrics."""
        def add_target(index: int, address: str) -> None:
            with self._lock:
                write_targets(self.targets_files[WORKER_JOB], list(self.job.metrics_addresses.values()))

        self.job = TrainingJob(self.cluster.servers, self.workdir / "workers", workers=self.workers,
                               epochs=self.epochs, mode=self.mode, extra_args=self.extra_worker_args,
                               on_metrics=add_target)
        return self.job.start()

    def stop(self) -> None:
        """Stop the workers, the serving load, Prometheus and the shards (each even if another fails to stop)."""
        try:
            if self.job is not None:
                self.job.stop()
        finally:
            try:
                if self.replica is not None:
                    self.replica.stop()
            finally:
                try:
                    if self.prometheus is not None:
                        self.prometheus.stop()
                finally:
                    if self.cluster is not None:
                        self.cluster.stop()

    def __enter__(self) -> "MonitoringStack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def shard_metrics_addresses(cluster) -> list[str]:
    """The scrape address of each shard's metrics endpoint, from ``cluster.metrics_addresses``.

    Raises:
        RuntimeError: a shard reported no metrics endpoint (started without ``--metrics-port``?).
    """
    try:
        addresses = list(cluster.metrics_addresses)
    except (AttributeError, KeyError):  # an older LocalCluster, or a shard that printed no metrics line
        addresses = []
    if len(addresses) != cluster.num_shards:
        raise RuntimeError(f"expected {cluster.num_shards} shard metrics endpoints ('... metrics on HOST:PORT' "
                           f"lines), got {addresses}")
    return [scrape_address(*a.rsplit(":", 1)) for a in addresses]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="helper processes of the monitoring stack")
    sub = parser.add_subparsers(dest="command", required=True)
    trainer = sub.add_parser("train-factorisation", help="the serving load's trainer (ServingLoad starts it)")
    trainer.add_argument("--servers", required=True, help="the shards host:port,... in shard order")
    trainer.add_argument("--step-every", type=float, default=0.2, help="seconds between two steps (default 0.2)")
    trainer.add_argument("--redis-url", default="", help="write the ratings to the Redis stream 'ratings' there")
    args = parser.parse_args(argv)
    return train_factorisation(args.servers, args.step_every, redis_url=args.redis_url)


if __name__ == "__main__":
    sys.exit(main())

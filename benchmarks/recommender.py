"""Recommender models ported from a library: the swapped-module DeepFM against one process of plain torch.

    python benchmarks/recommender.py [--json PATH] [--quick] [--data-dir DIR] [--batch-size 4096]
                                     [--small-batch-size 512] [--steps 30] [--warmup 5] [--pairs 3]
                                     [--grid 1x1,2x2] [--one-process-threads all,1]

Model and data: ``shardps.apps.deepfm`` (``DeepFM`` with its default ``DeepFMConfig``: dim 16, MLP
112 -> 64 -> 32 -> 1, seven tables, the ``genre`` table called for two fields) on MovieLens-100K's
``u1.base`` clicks (rating >= 4), read in place from ``--data-dir`` (never copied). Every system takes
the same stream of global batches of ``--batch-size`` samples: ``deepfm.iterate_batches(seed=0,
epoch=e, drop_last=True)`` for e = 0, 1, ... (full batches only, so every step has the same batch),
with W workers each its ``rank``/``world`` slice of every global batch; the same initial values
(the sharded tables' initial rows, normal(0, ``init_std``), copied into the one-process model's
tables); Adam, lr 1e-3, ``BCEWithLogitsLoss``; sync training. Each run trains ``--warmup`` untimed
steps, then ``--steps`` timed ones.

Systems:

- ``one_process``: the library's model and trainer, no shardps: ``torch.optim.Adam`` on every
  parameter (dense gradients for the tables, as the library builds them), the step of
  ``deepfm.train_one_process`` (zero_grad, forward, loss, backward, step, the loss read every step).
  It runs once per thread count of ``--one-process-threads`` (default ``all,1``: torch's default,
  every core, then 1 thread), each in a process of its own, and the fastest of those runs is the
  round's baseline: a 2-thread torch process collapses when other processes take a core (its OpenMP
  threads spin waiting for each other: 8,100 samples/s at batch 4096 against 143,000 with 1 thread,
  one run after the other, at a load average of 7), and a baseline that collapsed would flatter shardps.
- ``shardps`` (``prefetch``): the port a user makes (``tests/integration/test_port_deepfm.py``): the
  library's model with its seven ``nn.Embedding``/``nn.EmbeddingBag`` modules swapped one by one
  (``shardps.shard_embeddings(model, init=("normal", 0.0, init_std))``: seven sharded modules, not a
  collection), ``DistributedOptimizer(Adam(dense), ..., model=model, sparse_optimizer=Adam(handles))``
  (Adam on the tables runs as lazy Adam on the shards), and the data loader (the batch stream above)
  wrapped in ``shardps.prefetching(loader, dist, ids_of)``: when the loop takes batch k, the rows of
  batch k + 1 for all seven tables are asked of every shard in one call, answered once step k's push
  is applied. Grid ``--grid`` ``WxS``: W workers x S shard processes (``LocalCluster``, ``--threads
  1``, started for each run and stopped after it). Each worker runs ``max(1, (cores - S) // W)``
  torch threads, as ``benchmarks/sparse.py``'s workers.
- ``no_prefetch``: the same port without the prefetching loader: each module pulls its own rows in
  forward, one call per module lookup (8 per step: ``genre`` twice) and shard, one after the other.

Processes: the one-process runs and the workers run in spawned processes that the benchmark starts
once and that outlive the runs (each imports torch and loads the data once: a fresh process per run
spent more time starting than training); every run builds its model, optimizers and, for shardps,
its ``DistributedOptimizer`` anew, and closes it. The shards are fresh processes for every run. All
of them are ended when the benchmark ends (or fails: a failed run's processes are killed and the
pool started again).

Interleaving: this machine's speed drifts by tens of per cent over minutes, so each figure is a
median over ``--pairs`` rounds; in each round and grid cell, the one-process runs, then the
``shardps`` run, then the ``no_prefetch`` run, each ratio taken against the one-process baseline of
its own round (the median of those ratios is the cell's ratio). Before each round the benchmark waits
at most ``--settle`` seconds (default 10) for a second in which the machine's processes keep fewer than
``--quiet-cores`` (0.5) cores busy: other people's jobs share these cores.

Figures per run: ``samples_per_s`` = global batch x timed steps / the slowest worker's wall seconds
for them (after ``DistributedOptimizer.synchronize()`` at both ends); ``loss`` = the mean over the
timed steps of the global batch's mean BCE loss (workers' losses weighted by their samples);
``last_loss`` its last step's; ``step_ms``; CPU ms per step of the training processes (``worker_cpu``,
every thread) and of the shards (``shard_cpu``); the prefetch counts (``used``: every step but the
first); ``others_cores``, the cores other processes kept busy while the run was timed (the machine's
busy CPU time from ``/proc/stat`` less the run's own processes' CPU, over the timed seconds); the load
average when the run ended. The losses of the systems should agree closely (same
model, data and initial values, sync training) but not exactly: lazy Adam on the tables (only the
rows a step touches move, their moments too) differs from dense Adam, which decays the moments of
every row at every step; they are reported, not asserted.

Goal (issue 43): the swapped-module DeepFM at 1 worker x 1 shard >= 0.5x the one-process samples/s
at ``--batch-size`` (median of the interleaved pairs' ratios), computed, printed and written.

A second row at ``--small-batch-size`` (default 512; 0: none) shows the per-step overhead. Progress
(one line per pair) goes to stderr. ``--quick``: batch 512 only, 2 + 3 steps, 1 pair: a smoke run
(under a minute on a quiet machine), not figures to quote.
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from common import cpu_seconds, emit, parser, peak_rss_bytes, table  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = Path(os.environ.get("SHARDPS_MOVIELENS_DIR") or REPO.parent / "shared" / "data" / "ml-100k")
LR = 1e-3
SEED = 0
GOAL = 0.5  # shardps 1x1 >= GOAL x one process (samples/s), at --batch-size
SYSTEMS = ("one_process", "prefetch", "no_prefetch")


# ---------------------------------------------------------------------------------------------------- model, data
def ported():
    """The library's DeepFM with its seven tables swapped for sharded modules (rows: the library's own
    distribution, normal(0, init_std))."""
    import shardps
    from shardps.apps import deepfm

    config = deepfm.DeepFMConfig()
    model = deepfm.DeepFM(config)
    shardps.shard_embeddings(model, init=("normal", 0.0, config.init_std))
    return model


def ids_of(model):
    """The ids each sharded table looks up in a batch (what the port adds for ``shardps.prefetching``)."""
    from shardps.apps import deepfm

    def ids(b) -> dict:
        return {model.user: b.user, model.item: b.item, model.genre: [b.item_genres, b.user_genres],
                model.age: b.age, model.occupation: b.occupation, model.year: b.year,
                model.linear: deepfm.first_order_ids(b)}
    return ids


def stream(train, batch_size: int, steps: int, rank: int = 0, world: int = 1):
    """The first ``steps`` global batches of the epochs 0, 1, ... (full batches only): rank ``rank``'s slices."""
    from shardps.apps import deepfm

    epochs = (deepfm.iterate_batches(train, batch_size, seed=SEED, epoch=e, rank=rank, world=world, drop_last=True)
              for e in itertools.count())
    return itertools.islice(itertools.chain.from_iterable(epochs), steps)


def _cpu(pids: list[int]) -> float:
    readings = [cpu_seconds(pid) for pid in pids]
    return math.nan if None in readings else sum(readings)


def machine_busy() -> float:
    """CPU seconds every process of the machine used so far, all cores (``/proc/stat``: user, nice, system,
    irq, softirq, steal); NaN without it. Minus a run's own processes' CPU over the run, it is what other
    processes took from the run."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return math.nan
    busy = sum(fields[:3]) + sum(fields[5:8])  # user nice system [idle iowait] irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


def cores() -> int:
    """The cores this process may use (its affinity), as ``shardps.common.cores.usable_cores`` counts them."""
    from shardps.common.cores import usable_cores

    return usable_cores()


# ---------------------------------------------------------------------------------------------------- processes
def one_process_job(train, cfg: dict) -> dict:
    """The library's model trained by plain torch in this process (with the torch threads of its pool slot)."""
    from torch import nn

    from shardps.apps import deepfm

    model = deepfm.DeepFM(deepfm.DeepFMConfig())
    start_rows = ported()  # the sharded tables' initial rows (a pure function of table, id and seed)
    with torch.no_grad():
        for name in deepfm.TABLES:
            table_ = getattr(start_rows, name)
            getattr(model, name).weight.copy_(table_.spec().initial_rows(torch.arange(table_.num_embeddings)))
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    loss_fn = nn.BCEWithLogitsLoss()
    model.train()
    losses, start, cpu, busy = [], 0.0, 0.0, 0.0
    for step, batch in enumerate(stream(train, cfg["batch"], cfg["warmup"] + cfg["steps"])):
        if step == cfg["warmup"]:
            start, cpu, busy = time.perf_counter(), time.process_time(), machine_busy()
        optimizer.zero_grad()  # the step of deepfm.train_one_process
        loss = loss_fn(model(batch), batch.label)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    seconds, cpu, busy = time.perf_counter() - start, time.process_time() - cpu, machine_busy() - busy
    return {"seconds": seconds, "cpu_seconds": cpu, "machine_busy_seconds": busy, "losses": losses,
            "samples": cfg["batch"],
            "threads": torch.get_num_threads(), "peak_rss_bytes": peak_rss_bytes()}


def worker_job(train, cfg: dict) -> dict:
    """One shardps worker (rank ``cfg['rank']``): the port of the library's model and loop."""
    from torch import nn

    import shardps
    from shardps.worker import DistributedOptimizer

    rank = cfg["rank"]
    torch.set_num_threads(cfg["threads"])
    model = ported()
    dense, handles = shardps.sharded_parameters(model)
    began = time.perf_counter()
    dist = DistributedOptimizer(torch.optim.Adam(dense, lr=LR), model.named_parameters(), servers=cfg["servers"],
                                model=model, worker_id=f"w{rank}", sparse_optimizer=torch.optim.Adam(handles, lr=LR))
    try:
        init_seconds = time.perf_counter() - began
        loss_fn = nn.BCEWithLogitsLoss()
        total = cfg["warmup"] + cfg["steps"]
        loader = stream(train, cfg["batch"], total, rank, cfg["workers"])
        if cfg["prefetch"]:
            loader = shardps.prefetching(loader, dist, ids_of(model))
        losses, samples = [], 0
        start = cpu = shards_cpu = busy = 0.0
        for step, batch in enumerate(loader):  # the library's loop
            if step == cfg["warmup"]:
                dist.synchronize()
                start, cpu, busy = time.perf_counter(), time.process_time(), machine_busy()
                shards_cpu = _cpu(cfg["shard_pids"]) if rank == 0 else 0.0
            dist.zero_grad()
            loss = loss_fn(model(batch), batch.label)
            loss.backward()
            dist.step()
            losses.append(float(loss.detach()))
            samples = len(batch)
        dist.synchronize()
        seconds, cpu, busy = time.perf_counter() - start, time.process_time() - cpu, machine_busy() - busy
        out = {"seconds": seconds, "cpu_seconds": cpu, "machine_busy_seconds": busy, "losses": losses,
               "samples": samples,
               "init_seconds": init_seconds, "threads": torch.get_num_threads(), "peak_rss_bytes": peak_rss_bytes(),
               "prefetches": dict(dist.tables.prefetches)}
        if rank == 0:
            out["shards_cpu_seconds"] = _cpu(cfg["shard_pids"]) - shards_cpu
    finally:
        dist.close()
    return out


def _serve(conn, data_dir: str, threads: int | None) -> None:
    """A pool process (spawned): imports torch and shardps and loads the data once, then runs the jobs it is
    sent (``(kind, cfg)``; ``None`` or a closed pipe: exit), answering ``("ok", figures)`` or
    ``("error", traceback)``. ``threads``: its torch threads (None: torch's default, every core)."""
    import gc
    import traceback

    if threads is not None:
        torch.set_num_threads(threads)
    from shardps.apps import deepfm

    train, _ = deepfm.load_movielens_clicks(data_dir)
    jobs = {"one_process": one_process_job, "worker": worker_job}
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the benchmark ended
            return
        if message is None:
            return
        kind, cfg = message
        try:
            conn.send(("ok", jobs[kind](train, cfg)))
        except Exception:  # noqa: BLE001 - sent back, raised there
            conn.send(("error", traceback.format_exc()))
        gc.collect()


class Pool:
    """Spawned processes that outlive the runs (a run's cost is then its training, not importing torch and
    loading the data): one per one-process thread count (``one_threads``, None: torch's default, every core;
    its slot is ``one_slot[threads]``), then ``workers`` for shardps workers (slots ``first_worker`` + rank;
    each job sets their torch threads). ``restart()`` after a failed run; ``close()`` ends them."""

    def __init__(self, data_dir: str, one_threads: list[int | None], workers: int) -> None:
        self.data_dir, self.one_threads, self.workers = data_dir, list(one_threads), workers
        self.one_slot = {threads: slot for slot, threads in enumerate(self.one_threads)}
        self.first_worker = len(self.one_threads)
        self.procs: list = []
        self.conns: list = []
        self.start()

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        slots = [(t, f"one-{t or 'default'}-threads") for t in self.one_threads]
        slots += [(1, f"worker{rank}") for rank in range(self.workers)]
        for threads, name in slots:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child, self.data_dir, threads), daemon=True,
                               name=f"recommender-{name}")
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        self.collect(list(range(len(slots))), time.monotonic() + 300.0, "pool start")

    def submit(self, slot: int, kind: str, cfg: dict) -> None:
        self.conns[slot].send((kind, cfg))

    def collect(self, slots: list[int], deadline: float, what: str) -> list:
        """The answers of ``slots`` (in order). Raises RuntimeError: a job failed (its traceback), a process
        died, or the deadline passed."""
        out = []
        for slot in slots:
            conn, proc = self.conns[slot], self.procs[slot]
            while not conn.poll(1.0):
                if not proc.is_alive():
                    raise RuntimeError(f"{what}: {proc.name} exited with code {proc.exitcode}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{what}: {proc.name} did not answer in time")
            status, value = conn.recv()
            if status == "error":
                raise RuntimeError(f"{what}: {proc.name} failed:\n{value}")
            out.append(value)
        return out

    def close(self, grace: float = 10.0) -> None:
        """Ask every process to end (``grace`` seconds each, 0: kill at once), then kill what is left."""
        if grace:
            for conn in self.conns:
                try:
                    conn.send(None)
                except OSError:
                    pass
        for proc in self.procs:
            proc.join(timeout=grace)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []

    def restart(self) -> None:
        self.close(grace=0)
        self.start()


# ---------------------------------------------------------------------------------------------------- runs
def _summary(cfg: dict, rows: list[dict]) -> dict:
    """A run's figures from its processes' rows (rank order)."""
    steps, warmup = cfg["steps"], cfg["warmup"]
    seconds = max(r["seconds"] for r in rows)
    batch = sum(r["samples"] for r in rows)
    global_losses = [sum(r["losses"][t] * r["samples"] for r in rows) / batch for t in range(warmup + steps)]
    timed = global_losses[warmup:]
    res = {"samples_per_s": batch * steps / seconds, "step_ms": 1e3 * seconds / steps, "batch": batch,
           "loss": sum(timed) / len(timed), "last_loss": timed[-1], "first_loss": global_losses[0],
           "worker_cpu_ms_per_step": 1e3 * sum(r["cpu_seconds"] for r in rows) / steps,
           "threads_per_process": rows[0]["threads"], "peak_rss_bytes": max(r["peak_rss_bytes"] for r in rows),
           "load_average": os.getloadavg()[0]}
    own = sum(r["cpu_seconds"] for r in rows) + rows[0].get("shards_cpu_seconds", 0.0)
    # cores other processes kept busy while this run was timed (rank 0's window; 0: the machine was the run's)
    res["others_cores"] = max(0.0, rows[0]["machine_busy_seconds"] - own) / rows[0]["seconds"]
    if "shards_cpu_seconds" in rows[0]:
        res["shard_cpu_ms_per_step"] = 1e3 * rows[0]["shards_cpu_seconds"] / steps
        res["init_seconds"] = max(r["init_seconds"] for r in rows)
        res["prefetches"] = rows[0]["prefetches"]
    return res


def run_one_process(pool: Pool, args, batch: int, threads: int | None) -> dict:
    cfg = {"batch": batch, "warmup": args.warmup, "steps": args.steps}
    slot = pool.one_slot[threads]
    pool.submit(slot, "one_process", cfg)
    return _summary(cfg, pool.collect([slot], time.monotonic() + args.run_timeout, "one process"))


def run_shardps(pool: Pool, args, batch: int, workers: int, shards: int, prefetch: bool) -> dict:
    """``workers`` pool workers over ``shards`` shard processes started here (and stopped at the end)."""
    from shardps.worker import LocalCluster

    if batch % workers:
        raise ValueError(f"the global batch {batch} must split evenly over {workers} workers")
    cfg = {"batch": batch, "warmup": args.warmup, "steps": args.steps, "workers": workers, "prefetch": prefetch,
           "threads": max(1, (cores() - shards) // workers)}
    deadline = time.monotonic() + args.run_timeout
    with LocalCluster(shards, min_workers=workers, extra_args=("--threads", "1")) as cluster:
        cfg.update(servers=cluster.servers, shard_pids=[proc.pid for proc in cluster.processes])
        for rank in range(workers):
            pool.submit(pool.first_worker + rank, "worker", {**cfg, "rank": rank})
        try:
            rows = pool.collect([pool.first_worker + rank for rank in range(workers)], deadline,
                                f"shardps {workers}x{shards}")
        except Exception as exc:
            logs = "\n".join(f"--- shard {i}:\n{cluster.log_tail(i)}" for i in range(shards))
            raise RuntimeError(f"{exc}\n{logs}") from exc
    return {"workers": workers, "shards": shards, "prefetch": prefetch, **_summary(cfg, rows)}


def _attempt(label: str, pool: Pool, fn, *a) -> dict:
    """``fn(pool, *a)``'s figures, or ``{"error": ...}`` (logged; the pool's processes are started again): the
    other runs still go on."""
    began = time.monotonic()
    try:
        return {**fn(pool, *a), "run_seconds": time.monotonic() - began}
    except Exception as exc:  # noqa: BLE001 - recorded in the figures and printed
        _log(f"{label}: FAILED: {exc}")
        pool.restart()
        return {"error": str(exc)}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _median(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def _get(run: dict, key: str) -> float:
    return run.get(key, math.nan)


def settle(seconds: float, quiet_cores: float) -> float:
    """Wait at most ``seconds`` for a second in which the machine's processes keep fewer than ``quiet_cores``
    cores busy (other people's jobs share these cores); the cores they kept busy in the last second measured
    (NaN: not measured, ``seconds`` <= 0 or no ``/proc/stat``)."""
    if seconds <= 0:
        return math.nan
    deadline = time.monotonic() + seconds
    while True:
        before, began = machine_busy(), time.monotonic()
        time.sleep(1.0)
        busy = (machine_busy() - before) / (time.monotonic() - began)
        if not busy >= quiet_cores or time.monotonic() >= deadline:
            return busy


def cell(pool: Pool, args, batch: int, workers: int, shards: int) -> dict:
    """``--pairs`` rounds of (one process, shardps, shardps without prefetch) for one grid cell and batch size."""
    rounds = []
    name = f"{workers}x{shards}"
    for i in range(args.pairs):
        busy_before = settle(args.settle, args.quiet_cores)
        singles = [_attempt(f"one process ({threads or 'default'} threads), batch {batch}", pool, run_one_process,
                            args, batch, threads) for threads in pool.one_threads]
        # the baseline: the fastest of the one-process runs (thread counts) of this round
        runs = {"one_process": max(singles, key=lambda r: _get(r, "samples_per_s") if "error" not in r else -1.0),
                "one_process_runs": singles, "busy_cores_before": busy_before}
        for system, prefetch in (("prefetch", True), ("no_prefetch", False)):
            runs[system] = _attempt(f"shardps {name} {system}, batch {batch}", pool, run_shardps, args, batch, workers,
                                    shards, prefetch)
        base = _get(runs["one_process"], "samples_per_s")
        for system in ("prefetch", "no_prefetch"):
            runs[f"ratio_{system}"] = _get(runs[system], "samples_per_s") / base
            runs[f"loss_difference_{system}"] = _get(runs[system], "loss") - _get(runs["one_process"], "loss")
        rounds.append(runs)
        tried = ", ".join(f"{_get(r, 'samples_per_s'):,.0f} ({r.get('threads_per_process', '?')} thr.)"
                          for r in singles)
        _log(f"batch {batch}, {workers} worker(s) x {shards} shard(s), pair {i + 1}/{args.pairs}: one process "
             f"{tried}; shardps {_get(runs['prefetch'], 'samples_per_s'):,.0f} "
             f"({runs['ratio_prefetch']:.3f}x), without prefetch {_get(runs['no_prefetch'], 'samples_per_s'):,.0f} "
             f"({runs['ratio_no_prefetch']:.3f}x); loss {_get(runs['one_process'], 'loss'):.6f} / "
             f"{_get(runs['prefetch'], 'loss'):.6f} / {_get(runs['no_prefetch'], 'loss'):.6f}; other processes kept "
             f"{max(_get(r, 'others_cores') for r in (*singles, runs['prefetch'], runs['no_prefetch'])):.2f} cores "
             f"busy at most")
    row = {"batch_size": batch, "cell": name, "workers": workers, "shards": shards}
    for system in SYSTEMS:
        for key in ("samples_per_s", "loss", "last_loss", "step_ms", "worker_cpu_ms_per_step",
                    "shard_cpu_ms_per_step"):
            values = [_get(r[system], key) for r in rounds]
            if not all(math.isnan(v) for v in values):
                row[f"{system}_{key}"] = _median(values)
    for system in ("prefetch", "no_prefetch"):
        row[f"ratio_{system}"] = _median([r[f"ratio_{system}"] for r in rounds])
        row[f"ratios_{system}"] = [r[f"ratio_{system}"] for r in rounds]
        row[f"loss_difference_{system}"] = _median([r[f"loss_difference_{system}"] for r in rounds])
    for k, threads in enumerate(pool.one_threads):
        row[f"one_process_{threads or 'default'}_threads_samples_per_s"] = _median(
            [_get(r["one_process_runs"][k], "samples_per_s") for r in rounds])
    row["others_cores"] = _median([_get(x, "others_cores") for r in rounds
                                   for x in (*r["one_process_runs"], r["prefetch"], r["no_prefetch"])])
    row["one_process_threads_fastest"] = [r["one_process"].get("threads_per_process") for r in rounds]
    row["failed_runs"] = sum("error" in x for r in rounds for x in (*r["one_process_runs"], r["prefetch"],
                                                                   r["no_prefetch"]))
    row["pairs"] = rounds
    return row


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a short smoke run (see the module docstring)")
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA,
                   help=f"the ml-100k folder (default {DEFAULT_DATA}; $SHARDPS_MOVIELENS_DIR)")
    p.add_argument("--batch-size", type=int, default=4096, help="global samples per step, every system (default 4096)")
    p.add_argument("--small-batch-size", type=int, default=512,
                   help="a second row at this global batch, for the per-step overhead (default 512; 0: none)")
    p.add_argument("--steps", type=int, default=30, help="timed steps (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    p.add_argument("--pairs", type=int, default=3, help="interleaved rounds per grid cell (default 3)")
    p.add_argument("--grid", default="1x1,2x2", help="shardps cells WORKERSxSHARDS (default 1x1,2x2)")
    p.add_argument("--one-process-threads", default="all,1",
                   help="torch threads of the one-process runs, each run in every pair; the fastest is the baseline "
                        "(all: torch's default, every core; default all,1)")
    p.add_argument("--settle", type=float, default=10.0,
                   help="before each pair, wait at most this many seconds for a quiet second (default 10; 0: no wait)")
    p.add_argument("--quiet-cores", type=float, default=0.5,
                   help="a quiet second: the machine's processes keep fewer cores busy than this (default 0.5)")
    p.add_argument("--run-timeout", type=float, default=300.0, help="seconds one run may take (default 300)")
    args = p.parse_args()
    if args.quick:
        args.batch_size, args.small_batch_size, args.steps, args.warmup, args.pairs, args.settle = 512, 0, 3, 2, 1, 0
    from shardps.apps import deepfm

    deepfm.check_files(args.data_dir)  # before anything starts
    grid = [tuple(int(v) for v in g.split("x")) for g in args.grid.split(",")]
    batches = [args.batch_size] + ([args.small_batch_size] if args.small_batch_size else [])
    load = os.getloadavg()
    _log(f"DeepFM on MovieLens-100K clicks, global batch {', '.join(map(str, batches))}, {args.warmup} + "
         f"{args.steps} steps, {args.pairs} interleaved pair(s) per cell; grid (workers x shards) {args.grid}")
    _log(f"load average at start: {load[0]:.2f} (other processes share these cores: compare with care)")
    began = time.monotonic()
    one_threads = [None if t == "all" else int(t) for t in args.one_process_threads.split(",")]
    pool = Pool(str(args.data_dir), one_threads, max(w for w, _ in grid))
    try:
        rows = [cell(pool, args, batch, workers, shards) for batch in batches for workers, shards in grid]
    finally:
        pool.close()
    wall = time.monotonic() - began

    f = lambda r, k, fmt="{:,.0f}": fmt.format(r[k]) if k in r and not math.isnan(r[k]) else "-"  # noqa: E731
    by_threads = [f"one process samples/s, {t or 'default'} thr." for t in one_threads]
    lines = [[r["batch_size"], f"{r['workers']} x {r['shards']}",
              *[f(r, f"one_process_{t or 'default'}_threads_samples_per_s") for t in one_threads],
              f(r, "prefetch_samples_per_s"), f(r, "ratio_prefetch", "{:.3f}"), f(r, "no_prefetch_samples_per_s"),
              f(r, "ratio_no_prefetch", "{:.3f}"), f(r, "one_process_step_ms", "{:.1f}"),
              f(r, "prefetch_step_ms", "{:.1f}"), f(r, "no_prefetch_step_ms", "{:.1f}"),
              f(r, "one_process_loss", "{:.5f}"), f(r, "prefetch_loss", "{:.5f}"), f(r, "no_prefetch_loss", "{:.5f}"),
              f(r, "others_cores", "{:.2f}")]
             for r in rows]
    print(table(lines, ["batch", "workers x shards", *by_threads, "shardps samples/s", "x one process",
                        "no prefetch samples/s", "x one process", "one process ms/step", "shardps ms/step",
                        "no prefetch ms/step", "one process loss", "shardps loss", "no prefetch loss",
                        "others' cores"]))
    print(f"(medians over {args.pairs} interleaved pair(s); x one process: the median of each pair's ratio to the "
          f"fastest one-process run of the pair; one process ms/step and loss: that fastest run's; loss: the mean "
          f"global-batch loss over the {args.steps} timed steps; others' cores: the median over the row's runs of the "
          "cores other processes kept busy while a run was timed)")
    goal_row = next((r for r in rows if r["batch_size"] == args.batch_size and (r["workers"], r["shards"]) == (1, 1)),
                    None)
    goal = {"goal": f"swapped-module DeepFM, 1 worker x 1 shard, >= {GOAL}x the one-process samples/s at global "
                    f"batch {args.batch_size} (median of the interleaved pairs' ratios)",
            "value": goal_row["ratio_prefetch"] if goal_row else math.nan}
    goal["met"] = bool(goal["value"] >= GOAL)
    print(f"goal: {goal['goal']}: {'met' if goal['met'] else 'NOT met'} ({goal['value']:.3f})")
    emit({"load_average_at_start": load, "batch_sizes": batches, "steps": args.steps, "warmup": args.warmup,
          "one_process_threads": args.one_process_threads, "settle": args.settle, "quiet_cores": args.quiet_cores,
          "pairs": args.pairs, "grid": args.grid, "quick": args.quick, "lr": LR, "wall_seconds": wall,
          "rows": rows, "goal": goal}, args.json)


if __name__ == "__main__":
    main()

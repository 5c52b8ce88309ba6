"""Straggler benchmark: torch DDP vs shardps sync, ssp and async with a slow worker, one run.

    python benchmarks/straggler.py [--json PATH] [--steps 60] [--model mlp|wide] [--batch-size 32]
        [--base-seconds 0.1] [--slow-factor 2.5] [--persistent-factor 2.0] [--staleness 3]
        [--no-scale-lr-by-staleness] [--optimizer adamw|sgd] [--lr LR] [--async-lr LR] [--ssp-lr LR]

What it measures: how much a slow worker costs each way of training with 3
worker processes (one torch thread each) on one machine. Every step of a
worker is its real forward/backward on a batch of ``--batch-size`` samples
plus simulated compute, ``time.sleep(base_seconds * factor)`` before the
forward, where ``factor`` is 1 for a normal step and larger for a straggler:

- **transient**: at each step one worker, drawn by ``random.Random(seed)``
  (the same sequence for every mode, known to every worker), is slow by
  ``--slow-factor`` (2.5); a worker's k-th step is slow when the k-th draw
  names it (in async/ssp a worker's k-th step is its own k-th step);
- **persistent**: worker 2 is slow by ``--persistent-factor`` (2.0) at every step.

Modes, each from the same initial parameters (shardps on a fresh
``LocalCluster`` of 2 shards, ``min_workers=3``), with the same optimizer
and lr (see "Optimizer" below):

- ``ddp``: DistributedDataParallel over Gloo (allreduce), 3 ranks;
- ``sync``: shardps bulk synchronous rounds (averages one push of every worker);
- ``ssp``: shardps stale synchronous parallel, bound ``--staleness`` (a worker
  runs at most s clocks ahead of the slowest);
- ``async``: shardps asynchronous: each push applied on arrival, no waiting.

Equal work in every mode: the job has a budget of ``3 * steps`` batches
(``3 * steps * batch_size`` samples), numbered 0 .. 3·steps-1 and generated
deterministically from their number, so every mode trains on exactly the
same samples. ``ddp`` and ``sync`` run in lockstep: worker w takes batch
``3k + w`` at its step k, ``steps`` steps each. ``ssp`` and ``async`` workers
do not run in lockstep, so they draw from the budget the way an
asynchronous job with a sample budget runs: before each step a worker takes
the next batch number from a shared counter (a ``multiprocessing.Value``)
and stops once the budget is exhausted, so a fast worker does more steps
than a slow one and the total is exactly the same. (With "every worker
runs exactly ``steps`` steps" the wall time would be set by the slowest
worker in every mode and async could never show its advantage.)

Figures per (scenario, mode):

- ``samples_per_s``: ``3 * steps * batch_size`` / wall seconds, from the
  moment the 3 workers, all set up (joined / DDP built), are told to start
  together to the moment the last worker's last ``step()`` returned (shardps
  steps block until the new parameters are in: no overlap with the next
  step, so no mode hides communication behind the simulated compute);
- ``other_ms_per_step``: per worker, the time per step outside the simulated
  compute: real forward/backward, communication and waiting for others;
- ``worker_cpu_ms_per_step`` (per worker) and ``shards_cpu_ms_per_step`` (both
  shard processes together, per applied push): CPU time (user + system) the
  timed steps cost. On a machine with few cores this, not the simulated
  compute, can set the pace: 3 workers and 2 shards share the cores;
- ``final_loss``: cross-entropy of the final model on a fixed held-out set
  of 4096 samples (ddp: rank 0's model; shardps: the parameters exported
  from the shards after every worker finished, ``shardps.worker.export``);
- ``steps_per_worker``, ``wall_seconds``; for shardps modes the shards'
  staleness histogram (``StatsReply.staleness_histogram`` of shard 0, entry i
  counting applied gradients of staleness i) and its mean and max; for ssp
  ``staleness_bound``.

The data: inputs ~ N(0, 1); labels are the argmax of a fixed random
"teacher" network (learnable, seeded); the model is an MLP (``mlp``:
32 -> 256 -> 256 -> 10, ``wide``: 256 -> 1024 -> 1024 -> 10, more compute).

Optimizer: AdamW (torch defaults, lr 3e-3; 1e-3 for ``wide``) by default,
as in ``benchmarks/train.py``; ``--optimizer sgd`` is SGD with momentum 0.9
(lr 0.05). Each default lr is the one of a small grid (AdamW 1e-4 .. 5e-3,
SGD 0.01 .. 0.1) that gave ddp/sync the lowest final loss (chosen with 20 ms
of simulated compute; the losses do not depend on it). async and ssp get
their own lr, as one tunes each method when comparing them (``--async-lr``,
``--ssp-lr``): with AdamW on the MLP, async 4e-3 and ssp 2e-3, the best final
loss of each in the transient scenario over the grid 1e-3, 1.5e-3, 2e-3,
3e-3, 4e-3, 5e-3 (one run each at the default sizes; run to run, an async
loss moves by about 0.01-0.02 with the order in which pushes land); other
optimizers and models use ``--lr``. That lr is divided by each push's
staleness on the shards (``scale_lr_by_staleness``, Zhang et al.,
"Staleness-aware Async-SGD", IJCAI 2016; ``--no-scale-lr-by-staleness``
turns it off: final losses 1.08-1.09x ddp's instead of 0.98-1.06x in runs at
20 ms). Each async/ssp push is one optimizer step on 32 samples (sync: one step on
the 96 averaged), and it is computed from parameters ~2 updates old; with
SGD + momentum 0.9 that staleness acts as extra momentum (Mitliagkas et
al., "Asynchrony begets momentum", 2016): in a serial simulation of this
job with staleness 2, async ends at loss 1.43 against sync's 0.87, while
with AdamW (whose step size does not depend on the gradient's scale) it
ends at 0.77 against 0.74.

Goals (``goals`` in the JSON, printed at the end):

- transient: ssp and async samples/s >= 1.3x ddp's, and their final loss
  <= 1.05x ddp's;
- persistent: async samples/s >= 1.3x ddp's;
- persistent ssp / ddp is reported without a goal: SSP cannot beat a
  persistent straggler by design (its fast workers wait for it every s
  clocks, so the job runs at the straggler's pace).

Reading the figures: async and ssp can only beat ddp when the time a step
waits for a straggler is larger than what a shardps step costs more than a
ddp step. On a machine with few cores that cost is CPU time: compare
``CPU ms/step`` (shardps worker plus shards, ddp worker) with
``--base-seconds``. The default 100 ms of simulated compute is a short
step for a real model on an accelerator (whose compute takes no host CPU,
like the sleep); at ``--base-seconds 0.02`` the ~25 ms of CPU that a
shardps step costs on a 2-core machine (worker plus shards, 5 processes on
2 cores) outweighs what a straggler delays and DDP wins. The async/ssp losses vary from run to run (the order in
which pushes arrive is not deterministic); ddp and sync are exactly
reproducible and equal.

Worker processes are spawned once (torch.multiprocessing, ``spawn``) and run
every (scenario, mode) in turn; every wait is bounded (``--run-timeout``) and
every process and cluster is stopped on exit and on error.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import functools
import math
import os
import queue
import random
import signal
import socket
import sys
import textwrap
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from common import emit, parser, table  # noqa: E402
from torch import nn  # noqa: E402

WORKERS = 3
SHARDS = 2
CLASSES = 10
EVAL_SAMPLES = 4096
MOMENTUM = 0.9
#: default lr of each (--optimizer, --model): the best for ddp/sync of a small grid (see the module docstring)
DEFAULT_LR = {("adamw", "mlp"): 3e-3, ("adamw", "wide"): 1e-3, ("sgd", "mlp"): 0.05, ("sgd", "wide"): 0.05}
#: async and ssp lr of (--optimizer, --model) where tuned on a grid (see the module docstring); else --lr
DEFAULT_STALE_LR = {("adamw", "mlp"): {"async": 4e-3, "ssp": 2e-3}}
OPTIMIZERS = ("adamw", "sgd")
SEED = 2024
SCENARIOS = ("transient", "persistent")
MODES = ("ddp", "sync", "ssp", "async")
PERSISTENT_STRAGGLER = 2
#: (input features, hidden width) of each model
MODELS = {"mlp": (32, 256), "wide": (256, 1024)}
SPEEDUP_GOAL = 1.3
LOSS_GOAL = 1.05
SSP_PERSISTENT_NOTE = ("no goal: SSP cannot beat a persistent straggler by design (its fast workers wait for it every "
                       "s clocks, so the job runs at the straggler's pace)")


# ---------------------------------------------------------------------------------------------- model and data
def make_model(kind: str) -> nn.Module:
    """The student MLP, with the same initial parameters in every process."""
    d_in, hidden = MODELS[kind]
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, CLASSES))


@functools.cache
def _teacher(kind: str) -> nn.Module:
    """The fixed random network whose argmax labels the data (d_in -> 64 -> tanh -> 10)."""
    d_in, _ = MODELS[kind]
    g = torch.Generator().manual_seed(SEED)
    first, second = nn.Linear(d_in, 64), nn.Linear(64, CLASSES)
    with torch.no_grad():
        for layer in (first, second):
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=g) / math.sqrt(layer.in_features))
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=g) * 0.1)
    return nn.Sequential(first, nn.Tanh(), second).eval()


def samples(kind: str, seed: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` inputs drawn with ``seed`` and the teacher's labels for them (deterministic)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, MODELS[kind][0], generator=g)
    with torch.no_grad():
        y = _teacher(kind)(x).argmax(dim=1)
    return x, y


@functools.cache
def dataset(kind: str, batches: int, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The job's batches 0 .. ``batches - 1`` (the sample budget), built before any timing."""
    return [samples(kind, SEED + 1 + i, batch_size) for i in range(batches)]


def eval_loss(kind: str, model: nn.Module) -> float:
    """Cross-entropy of ``model`` on the fixed held-out set."""
    x, y = samples(kind, SEED - 1, EVAL_SAMPLES)
    with torch.no_grad():
        return nn.functional.cross_entropy(model(x), y).item()


def make_optimizer(kind: str, params: Any, lr: float) -> torch.optim.Optimizer:
    """AdamW (torch defaults otherwise) or SGD with momentum 0.9."""
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    return torch.optim.SGD(params, lr=lr, momentum=MOMENTUM)


def straggler_draws(count: int, seed: int = SEED) -> list[int]:
    """The transient scenario's slow worker at each step index (one seeded sequence for every mode)."""
    rng = random.Random(seed)
    return [rng.choice(range(WORKERS)) for _ in range(count)]


def delay(task: dict, rank: int, step: int) -> float:
    """Simulated compute seconds of ``rank``'s own step ``step``."""
    if task["scenario"] == "transient":
        factor = task["slow_factor"] if task["draws"][step] == rank else 1.0
    else:
        factor = task["persistent_factor"] if rank == PERSISTENT_STRAGGLER else 1.0
    return task["base_seconds"] * factor


# ---------------------------------------------------------------------------------------------- worker side
#: The DDP modules of this worker process's finished runs, kept until the process ends without finalisation
#: (``os._exit``). Freeing one frees its Reducer, whose reference may be the last one to the run's Gloo process
#: group; the group's destructor then joins its worker threads while holding the GIL, and a thread that needs
#: the GIL to drop a Python object it still holds never ends: an intermittent deadlock seen with torch 2.13
#: (main thread in ``ProcessGroupGloo::~ProcessGroupGloo`` -> ``std::thread::join``, a Gloo thread in
#: ``gil_scoped_acquire``), even after ``destroy_process_group()``.
_KEEP_ALIVE: list = []


def _train_steps(task: dict, rank: int, net: nn.Module, opt: Any,
                 next_batch: Callable[[int], int | None]) -> tuple[int, float]:
    """Run steps until ``next_batch(k)`` returns None; returns (steps done, seconds slept)."""
    data = dataset(task["model"], task["budget"], task["batch_size"])
    k, slept = 0, 0.0
    while (index := next_batch(k)) is not None:
        seconds = delay(task, rank, k)
        time.sleep(seconds)
        slept += seconds
        x, y = data[index]
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        k += 1
    return k, slept


def _wait_for_go(rank: int, results: Any, go: Any, timeout: float) -> float:
    """Tell the parent this worker is set up, wait (bounded) for its go; returns when this worker was ready."""
    ready = time.monotonic()
    results.put((rank, "ready", None))
    if not go.wait(timeout):
        raise RuntimeError(f"worker {rank}: no go from the parent within {timeout:.0f} s")
    return ready


def _run_task(task: dict, rank: int, counter: Any, results: Any, go: Any) -> dict:
    """One (scenario, mode) on this worker: build, say ready, wait for the go, train, report."""
    timeout = task["timeout"]
    steps, budget = task["steps"], task["budget"]
    dataset(task["model"], budget, task["batch_size"])  # built before the clock starts
    model = make_model(task["model"])
    mode = task["mode"]

    def lockstep(k: int) -> int | None:
        return WORKERS * k + rank if k < steps else None

    def claim(_k: int) -> int | None:
        with counter.get_lock():
            if counter.value >= budget:
                return None
            counter.value += 1
            return counter.value - 1

    final_loss = None
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo", init_method=f"tcp://{task['endpoint']}", rank=rank, world_size=WORKERS,
                                timeout=datetime.timedelta(seconds=timeout))
        try:
            net = DistributedDataParallel(model)
            _KEEP_ALIVE.append(net)  # never freed: see _KEEP_ALIVE
            opt = make_optimizer(task["optimizer"], net.parameters(), task["lr"])
            ready = _wait_for_go(rank, results, go, timeout)
            start, cpu = time.monotonic(), time.process_time()
            done, slept = _train_steps(task, rank, net, opt, lockstep)
            end, cpu = time.monotonic(), time.process_time() - cpu
            if rank == 0:
                final_loss = eval_loss(task["model"], model)
        finally:
            dist.destroy_process_group()
    else:
        from shardps.worker import DistributedOptimizer

        opt = DistributedOptimizer(make_optimizer(task["optimizer"], model.parameters(), task["lr"]),
                                   model.named_parameters(), servers=task["endpoint"],
                                   worker_id=f"straggler-{rank}", mode=mode,
                                   staleness=task["staleness"] if mode == "ssp" else None,
                                   scale_lr_by_staleness=task["scale_lr"] and mode != "sync",
                                   rpc_timeout=timeout, connect_timeout=min(timeout, 30.0))
        try:
            ready = _wait_for_go(rank, results, go, timeout)
            start, cpu = time.monotonic(), time.process_time()
            done, slept = _train_steps(task, rank, model, opt, lockstep if mode == "sync" else claim)
            end, cpu = time.monotonic(), time.process_time() - cpu
        finally:
            opt.close()
    return {"ready": ready, "start": start, "end": end, "steps": done, "slept": slept, "cpu": cpu,
            "final_loss": final_loss}


def _worker_main(rank: int, tasks: Any, results: Any, counter: Any, go: Any, idle_timeout: float) -> None:
    """Worker process: run the tasks the parent sends (None ends it); report each result or error.

    Ends with ``os._exit`` once its results are flushed (see :data:`_KEEP_ALIVE`).
    SIGUSR1 prints every thread's Python stack to stderr (the parent sends it to a worker that hangs).
    """
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    parent = mp.parent_process()
    try:
        while True:
            idle_until = time.monotonic() + idle_timeout
            task = None
            while task is None and time.monotonic() < idle_until and (parent is None or parent.is_alive()):
                try:
                    task = tasks.get(timeout=2.0)
                except queue.Empty:
                    continue
                if task is None:
                    return
            if task is None:
                return  # the parent is gone or stuck: do not linger
            try:
                results.put((rank, "ok", _run_task(task, rank, counter, results, go)))
            except BaseException:  # reported to the parent, which stops everything
                results.put((rank, "error", traceback.format_exc()))
                return
    finally:
        results.close()
        results.join_thread()  # everything put is written to the pipe
        sys.stderr.flush()
        os._exit(0)


# ---------------------------------------------------------------------------------------------- parent side
def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for the Gloo rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes ``pids`` used so far (Linux ``/proc``; 0 for one that is gone)."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def staleness_summary(histogram: list[int]) -> dict:
    """Mean and max staleness of a histogram (the last bucket counts everything at or above it)."""
    total = sum(histogram)
    used = [i for i, c in enumerate(histogram) if c]
    top = used[-1] if used else 0
    return {
        "mean": sum(i * c for i, c in enumerate(histogram)) / total if total else 0.0,
        "max": top,
        "max_saturated": bool(used) and top == len(histogram) - 1,
        "applied": total,
        "histogram": histogram[: top + 1],
    }


class Workers:
    """The 3 worker processes, spawned once; :meth:`run` runs one (scenario, mode) on all of them."""

    def __init__(self, run_timeout: float) -> None:
        self.ctx = mp.get_context("spawn")
        self.run_timeout = run_timeout
        self.results = self.ctx.Queue()
        self.tasks = [self.ctx.Queue() for _ in range(WORKERS)]
        self.counter = self.ctx.Value("q", 0)
        self.go = self.ctx.Event()  # set once every worker is ready and nothing else runs: see run()
        self.processes: list = []

    def start(self) -> "Workers":
        for rank in range(WORKERS):
            p = self.ctx.Process(target=_worker_main, daemon=True, name=f"straggler-worker-{rank}",
                                 args=(rank, self.tasks[rank], self.results, self.counter, self.go,
                                       self.run_timeout + 600))
            p.start()
            self.processes.append(p)
        return self

    def run(self, task: dict, before_start: Callable[[], None], on_go: Callable[[], None]) -> list[dict]:
        """Send ``task`` to every worker and wait (bounded) for the 3 results, in rank order.

        While the workers set up, this process runs ``before_start()`` (starting
        and stopping clusters); once it is done and every worker is ready, it
        lets them start their clocks together (``go``), so that nothing but
        the run itself goes on while they are timed; ``on_go()`` runs then.

        Raises:
            RuntimeError: a worker failed (its traceback) or died, or the run took over ``run_timeout``.
        """
        with self.counter.get_lock():
            self.counter.value = 0
        for q in self.tasks:
            q.put({**task, "timeout": self.run_timeout})
        deadline = time.monotonic() + self.run_timeout
        before_start()
        ready: set[int] = set()
        out: dict[int, dict] = {}
        while len(out) < WORKERS:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(WORKERS)) - set(out))
                for rank in missing:  # their stacks, on stderr
                    if self.processes[rank].is_alive():
                        os.kill(self.processes[rank].pid, signal.SIGUSR1)
                time.sleep(1.0)
                raise RuntimeError(f"{task['scenario']}/{task['mode']}: workers {missing} did not finish within "
                                   f"{self.run_timeout:.0f} s")
            try:
                rank, status, payload = self.results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [p.name for p in self.processes if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"{task['scenario']}/{task['mode']}: worker process(es) {dead} died") from None
                continue
            if status == "error":
                raise RuntimeError(f"{task['scenario']}/{task['mode']}: worker {rank} failed:\n{payload}")
            if status == "ready":
                ready.add(rank)
                if len(ready) == WORKERS:
                    self.go.set()
                    on_go()
            else:
                out[rank] = payload
        self.go.clear()  # every worker is past it: the next run waits again
        return [out[r] for r in range(WORKERS)]

    def stop(self) -> None:
        """Ask every worker to exit; terminate (then kill) the ones still alive after a few seconds."""
        for q in self.tasks:
            try:
                q.put(None)
            except (ValueError, OSError):
                pass
        deadline = time.monotonic() + 10.0
        for p in self.processes:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
        for p in self.processes:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        self.processes = []


class Clusters:
    """Fresh 2-shard ``LocalCluster``s, each started in the background while the run before it sets up.

    A cluster is only started or stopped outside the timed part of a run:
    :meth:`settle` (called by the parent before it lets the workers start
    their clocks) waits until the cluster being started serves and every
    cluster being stopped has exited.
    """

    def __init__(self) -> None:
        self.live: list = []
        self.threads: list[threading.Thread] = []
        self._next: Any = None
        self._error: list[BaseException] = []

    def prepare(self) -> None:
        """Start the next run's cluster in the background (taken by :meth:`take`)."""
        from shardps.worker import LocalCluster

        cluster = LocalCluster(SHARDS, min_workers=WORKERS)
        self.live.append(cluster)
        self._next = cluster

        def start() -> None:
            try:
                cluster.start()
            except BaseException as exc:  # re-raised by take()
                self._error.append(exc)

        self._background(start, "start-cluster")

    @property
    def pending(self) -> bool:
        """A cluster was prepared and not taken yet."""
        return self._next is not None

    def take(self) -> Any:
        """The cluster :meth:`prepare` started (started now if none was), once it serves.

        Raises:
            RuntimeError: a shard did not start (LocalCluster's message).
        """
        if self._next is None:
            self.prepare()
        self.settle()
        cluster, self._next = self._next, None
        if self._error:
            raise self._error.pop()
        return cluster

    def release(self, cluster: Any) -> None:
        """Stop ``cluster`` in the background."""
        self._background(cluster.stop, "stop-cluster")

    def settle(self, timeout: float = 120.0) -> None:
        """Wait (bounded) until every background start and stop is done."""
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(timeout=max(0.1, deadline - time.monotonic()))
        self.threads = [t for t in self.threads if t.is_alive()]
        if self.threads:
            raise RuntimeError(f"starting or stopping a cluster took over {timeout:.0f} s")

    def stop_all(self) -> None:
        """Stop every cluster (on exit and on error)."""
        try:
            self.settle()
        finally:
            for cluster in self.live:
                cluster.stop()  # a no-op for a cluster already stopped
            self.live = []

    def _background(self, fn: Callable[[], Any], name: str) -> None:
        """Run ``fn()`` in a daemon thread that :meth:`settle` waits for."""
        thread = threading.Thread(target=fn, name=name, daemon=True)
        thread.start()
        self.threads.append(thread)


def shardps_figures(cluster: Any, kind: str) -> dict:
    """The final model's loss (parameters exported from the shards) and shard 0's staleness histogram."""
    from shardps.worker.client import ShardClient
    from shardps.worker.export import from_servers

    exported = from_servers(cluster.servers, wait_seconds=30.0)
    model = make_model(kind)
    model.load_state_dict(exported.state_dict, strict=True)
    client = ShardClient(cluster.addresses[0], index=0, connect_timeout=10.0, rpc_timeout=30.0)
    try:
        stats = client.stats()
    finally:
        client.close()
    return {"final_loss": eval_loss(kind, model), "shard_versions": list(exported.versions),
            "staleness": staleness_summary([int(c) for c in stats.staleness_histogram])}


def run_one(workers: Workers, clusters: Clusters, args: Any, scenario: str, mode: str, shardps_later: bool) -> dict:
    """One (scenario, mode) on a fresh cluster (shardps modes); also starts a later shardps run's cluster."""
    budget = WORKERS * args.steps
    task = {"scenario": scenario, "mode": mode, "steps": args.steps, "budget": budget, "batch_size": args.batch_size,
            "model": args.model, "optimizer": args.optimizer,
            "lr": {"async": args.async_lr, "ssp": args.ssp_lr}.get(mode, args.lr), "base_seconds": args.base_seconds,
            "slow_factor": args.slow_factor, "persistent_factor": args.persistent_factor, "staleness": args.staleness,
            "scale_lr": args.scale_lr_by_staleness, "draws": straggler_draws(budget)}
    began = time.monotonic()
    cluster = None
    if mode == "ddp":
        task["endpoint"] = f"127.0.0.1:{free_port()}"
    else:
        cluster = clusters.take()
        task["endpoint"] = cluster.servers

    def before_start() -> None:
        if shardps_later and not clusters.pending:
            clusters.prepare()
        clusters.settle()

    shard_cpu: list[float] = []

    def on_go() -> None:
        if cluster is not None:
            shard_cpu.append(process_cpu_seconds([p.pid for p in cluster.processes]))

    try:
        rows = workers.run(task, before_start, on_go)
        if cluster is not None:
            shard_cpu.append(process_cpu_seconds([p.pid for p in cluster.processes]))
        wall = max(r["end"] for r in rows) - min(r["start"] for r in rows)
        steps = [r["steps"] for r in rows]
        if sum(steps) != budget:
            raise RuntimeError(f"{scenario}/{mode}: {sum(steps)} steps instead of the budget {budget}")
        result: dict[str, Any] = {
            "samples_per_s": budget * args.batch_size / wall,
            "wall_seconds": wall,
            "samples": budget * args.batch_size,
            "steps_per_worker": steps,
            "slept_seconds_per_worker": [round(r["slept"], 4) for r in rows],
            # per step, the time a worker spent outside its simulated compute: real compute, communication, waiting
            "other_ms_per_step": [round(1e3 * (r["end"] - r["start"] - r["slept"]) / max(1, r["steps"]), 2)
                                  for r in rows],
            # CPU time (user + system) per step of each worker process, and of all shard processes together
            "worker_cpu_ms_per_step": [round(1e3 * r["cpu"] / max(1, r["steps"]), 2) for r in rows],
        }
        if len(shard_cpu) == 2:
            result["shards_cpu_ms_per_step"] = round(1e3 * (shard_cpu[1] - shard_cpu[0]) / budget, 2)
        if cluster is None:
            result["final_loss"] = rows[0]["final_loss"]
        else:
            result.update(shardps_figures(cluster, args.model))
            applied = result["staleness"]["applied"]
            if applied != budget:
                raise RuntimeError(f"{scenario}/{mode}: shard 0 applied {applied} gradients, not {budget}")
        if mode == "ssp":
            result["staleness_bound"] = args.staleness
        start = min(r["start"] for r in rows)
        result["untimed_seconds"] = {"before": start - began, "workers_setup": max(r["ready"] for r in rows) - began,
                                     "after": time.monotonic() - start - wall}
        return result
    finally:
        if cluster is not None:
            clusters.release(cluster)


def goals(results: dict) -> dict:
    """The goal ratios against ddp (see the module docstring)."""
    def ratio(scenario: str, mode: str, key: str) -> float:
        return results[scenario][mode][key] / results[scenario]["ddp"][key]

    out: dict[str, dict] = {}
    for scenario in SCENARIOS:
        for mode in ("ssp", "async"):
            speed = ratio(scenario, mode, "samples_per_s")
            loss = ratio(scenario, mode, "final_loss")
            if scenario == "persistent" and mode == "ssp":
                out[f"{scenario}_{mode}_samples_per_s_vs_ddp"] = {"value": speed, "goal": None, "met": None,
                                                                  "note": SSP_PERSISTENT_NOTE}
            else:
                out[f"{scenario}_{mode}_samples_per_s_vs_ddp"] = {"value": speed, "goal": f">= {SPEEDUP_GOAL}",
                                                                  "met": speed >= SPEEDUP_GOAL}
            if scenario == "transient":
                out[f"{scenario}_{mode}_final_loss_vs_ddp"] = {"value": loss, "goal": f"<= {LOSS_GOAL}",
                                                               "met": loss <= LOSS_GOAL}
            else:
                out[f"{scenario}_{mode}_final_loss_vs_ddp"] = {"value": loss, "goal": None, "met": None}
    return out


def cpu_ms_per_step(r: dict) -> float:
    """CPU milliseconds one step costs: the mean worker's, plus the shards' (shardps modes)."""
    return sum(r["worker_cpu_ms_per_step"]) / WORKERS + r.get("shards_cpu_ms_per_step", 0.0)


def report(results: dict, goal_figures: dict) -> str:
    """The figures and the goal ratios as text tables."""
    rows = []
    for scenario in SCENARIOS:
        ddp = results[scenario]["ddp"]
        for mode in MODES:
            r = results[scenario][mode]
            st = r.get("staleness")
            rows.append([scenario, mode + (f" s={r['staleness_bound']}" if mode == "ssp" else ""),
                         f"{r['samples_per_s']:.0f}", f"{r['samples_per_s'] / ddp['samples_per_s']:.2f}",
                         f"{r['final_loss']:.4f}", f"{r['final_loss'] / ddp['final_loss']:.3f}",
                         f"{r['wall_seconds']:.2f}", "/".join(map(str, r["steps_per_worker"])),
                         f"{st['mean']:.2f}/{st['max']}" if st else "-",
                         f"{sum(r['other_ms_per_step']) / WORKERS:.1f}", f"{cpu_ms_per_step(r):.1f}"])
    text = table(rows, ["scenario", "mode", "samples/s", "vs ddp", "final loss", "vs ddp", "wall s",
                        "steps/worker", "staleness mean/max", "non-sleep ms/step", "CPU ms/step"])
    text += ("\n(non-sleep ms/step: a worker's time per step outside the simulated compute, mean over workers; "
             "CPU ms/step:\n a worker process's CPU time per step, mean over workers, plus the shard processes' per "
             "step)")
    notes = [g["note"] for g in goal_figures.values() if g.get("note")]
    goal_rows = [[name, f"{g['value']:.3f}", g["goal"] or "-",
                  "-" if g["met"] is None else ("yes" if g["met"] else "NO"),
                  f"[{notes.index(g['note']) + 1}]" if g.get("note") else ""]
                 for name, g in goal_figures.items()]
    footnotes = "".join("\n" + textwrap.fill(f"[{i + 1}] {note}", 118, subsequent_indent="    ")
                        for i, note in enumerate(notes))
    return text + "\n\n" + table(goal_rows, ["ratio", "value", "goal", "met", "note"]) + "\n" + footnotes


def main() -> None:
    """Parse the arguments, run every (scenario, mode), print the tables, write the JSON."""
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="steps per worker in lockstep modes; the job's budget is "
                   "3 x steps batches in every mode (default 60)")
    p.add_argument("--model", choices=sorted(MODELS), default="mlp")
    p.add_argument("--batch-size", type=int, default=32, help="samples per worker per step (default 32)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="adamw (default) or sgd (momentum 0.9), the same in every mode")
    p.add_argument("--lr", type=float, help="learning rate of every mode (default: adamw 3e-3, 1e-3 with "
                   "--model wide; sgd 0.05)")
    p.add_argument("--async-lr", type=float, help="learning rate of async (default: adamw mlp 4e-3, else --lr; "
                   "see the module docstring)")
    p.add_argument("--ssp-lr", type=float, help="learning rate of ssp (default: adamw mlp 2e-3, else --lr)")
    p.add_argument("--base-seconds", type=float, default=0.1, help="simulated compute per step (default 0.1)")
    p.add_argument("--slow-factor", type=float, default=2.5, help="transient straggler's slowdown (default 2.5)")
    p.add_argument("--persistent-factor", type=float, default=2.0,
                   help="persistent straggler's (worker 2) slowdown (default 2.0)")
    p.add_argument("--staleness", type=int, default=3, help="ssp bound s (default 3)")
    p.add_argument("--scale-lr-by-staleness", action=argparse.BooleanOptionalAction, default=True,
                   help="async/ssp: the shards divide each push's lr by max(1, staleness) (Zhang et al., IJCAI "
                   "2016; default on)")
    p.add_argument("--run-timeout", type=float, default=180.0,
                   help="seconds one (scenario, mode) may take before the benchmark gives up (default 180)")
    args = p.parse_args()
    if args.lr is None:
        args.lr = DEFAULT_LR[args.optimizer, args.model]
    tuned = args.lr == DEFAULT_LR[args.optimizer, args.model] and (args.optimizer, args.model) in DEFAULT_STALE_LR
    if args.async_lr is None:
        args.async_lr = DEFAULT_STALE_LR[args.optimizer, args.model]["async"] if tuned else args.lr
    if args.ssp_lr is None:
        args.ssp_lr = DEFAULT_STALE_LR[args.optimizer, args.model]["ssp"] if tuned else args.lr
    if args.steps < 1 or args.batch_size < 1 or args.staleness < 0 or args.base_seconds < 0:
        p.error("--steps and --batch-size must be >= 1, --staleness and --base-seconds >= 0")
    params = sum(q.numel() for q in make_model(args.model).parameters())
    initial_loss = eval_loss(args.model, make_model(args.model))
    print(f"{args.model}: {params / 1e3:.0f} k parameters, {WORKERS} workers, {SHARDS} shards, {args.steps} steps x "
          f"{args.batch_size} samples per worker ({WORKERS * args.steps * args.batch_size} samples per mode), "
          f"base {args.base_seconds * 1e3:.0f} ms/step, transient x{args.slow_factor}, "
          f"persistent worker {PERSISTENT_STRAGGLER} x{args.persistent_factor}, ssp s={args.staleness}, "
          f"{args.optimizer} lr {args.lr} (ssp {args.ssp_lr}, async {args.async_lr}), initial loss {initial_loss:.4f}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # clean up below on SIGTERM too
    began = time.monotonic()
    results: dict[str, dict] = {}
    workers = Workers(args.run_timeout)
    clusters = Clusters()
    try:
        clusters.prepare()  # the first shardps run's cluster starts while the workers do
        workers.start()
        plan = [(scenario, mode) for scenario in SCENARIOS for mode in MODES]
        for i, (scenario, mode) in enumerate(plan):
            shardps_later = any(m != "ddp" for _, m in plan[i + 1:])
            r = run_one(workers, clusters, args, scenario, mode, shardps_later)
            results.setdefault(scenario, {})[mode] = r
            st = r.get("staleness")
            print(f"[{time.monotonic() - began:6.1f} s] {scenario:<10} {mode:<5} {r['samples_per_s']:7.0f} samples/s  "
                  f"final loss {r['final_loss']:.4f}  wall {r['wall_seconds']:.2f} s  steps {r['steps_per_worker']}  "
                  f"non-sleep ms/step {r['other_ms_per_step']}  CPU ms/step {cpu_ms_per_step(r):.1f}"
                  + (f"  staleness mean {st['mean']:.2f} max {st['max']}" if st else "")
                  + f"  (setup {r['untimed_seconds']['before']:.1f} s)", flush=True)
    finally:
        workers.stop()
        clusters.stop_all()
    goal_figures = goals(results)
    print()
    print(report(results, goal_figures))
    total = time.monotonic() - began
    print(f"\nbenchmark wall time {total:.1f} s", flush=True)
    out = {
        "config": {"model": args.model, "params": params, "workers": WORKERS, "shards": SHARDS, "steps": args.steps,
                   "batch_size": args.batch_size, "budget_batches": WORKERS * args.steps,
                   "optimizer": args.optimizer, "lr": args.lr, "async_lr": args.async_lr, "ssp_lr": args.ssp_lr,
                   "momentum": MOMENTUM if args.optimizer == "sgd" else None,
                   "base_seconds": args.base_seconds, "slow_factor": args.slow_factor,
                   "persistent_factor": args.persistent_factor, "persistent_straggler": PERSISTENT_STRAGGLER,
                   "staleness_bound": args.staleness, "scale_lr_by_staleness": args.scale_lr_by_staleness,
                   "seed": SEED, "initial_loss": initial_loss},
        **results["transient"],
        "persistent": results["persistent"],
        "goals": goal_figures,
        "benchmark_wall_seconds": total,
    }
    emit(out, args.json)


if __name__ == "__main__":
    main()

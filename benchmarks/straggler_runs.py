"""Running one (scenario, mode) of the straggler benchmark: its worker processes and shard clusters.

:class:`Workers` spawns the 3 worker processes once; :class:`Clusters`
starts each shardps run's fresh 2-shard cluster in the background, outside
the timed part; :func:`run_one` times one run and gathers its figures
(see ``benchmarks/straggler.py`` for what each figure means).
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp
from common import cpu_seconds, free_port
from straggler_job import WORKERS, eval_loss, make_model, straggler_draws, worker_main

#: shard processes of a shardps run (``--shards``): one holds this 300 KB model; each more adds a push-pull stream
#: per worker per step, CPU that 3 workers and the shards share on a small machine
SHARDS = 1


def process_cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes ``pids`` used so far (Linux ``/proc``; 0 for one that is gone)."""
    return sum(cpu_seconds(pid) or 0.0 for pid in pids)


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
            p = self.ctx.Process(target=worker_main, daemon=True, name=f"straggler-worker-{rank}",
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
    """Fresh ``LocalCluster``s of ``shards`` shards (default :data:`SHARDS`), each started in the background
    while the run before it sets up.

    A cluster is only started or stopped outside the timed part of a run:
    :meth:`settle` (called by the parent before it lets the workers start
    their clocks) waits until the cluster being started serves and every
    cluster being stopped has exited.
    """

    def __init__(self, shards: int = SHARDS) -> None:
        self.shards = shards
        self.live: list = []
        self.threads: list[threading.Thread] = []
        self._next: Any = None
        self._error: list[BaseException] = []

    def prepare(self) -> None:
        """Start the next run's cluster in the background (taken by :meth:`take`)."""
        from shardps.worker import LocalCluster

        cluster = LocalCluster(self.shards, min_workers=WORKERS)
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
    from shardps.worker.session.client import ShardClient
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
            "scale_lr": args.scale_lr_by_staleness, "schedule": args.schedule, "draws": straggler_draws(budget)}
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

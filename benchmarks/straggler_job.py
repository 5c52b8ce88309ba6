"""The straggler benchmark's job: model, data, simulated stragglers, and what each worker process runs.

Imported by ``benchmarks/straggler.py`` (which describes the benchmark) and
by its spawned worker processes. Every function is deterministic given its
arguments: each worker process builds the same initial model, the same
batches and the same straggler draws.
"""

from __future__ import annotations

import datetime
import faulthandler
import functools
import math
import os
import queue
import random
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORKERS = 3
CLASSES = 10
EVAL_SAMPLES = 4096
MOMENTUM = 0.9
SEED = 2024
PERSISTENT_STRAGGLER = 2
#: (input features, hidden width) of each model
MODELS = {"mlp": (32, 256), "wide": (256, 1024)}


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


def lr_factor(schedule: str, index: int, budget: int) -> float:
    """The learning rate's factor for batch ``index`` of a budget of ``budget`` batches.

    ``constant``: 1. ``cosine``: half a cosine from 1 down to 0 over the budget
    (Loshchilov & Hutter, "SGDR", ICLR 2017, without restarts), by the batch's
    round ``index // WORKERS``: in the lockstep modes every worker of a step
    uses the same lr, and in every mode a batch is trained with the same lr.
    """
    if schedule == "constant":
        return 1.0
    return 0.5 * (1.0 + math.cos(math.pi * (index // WORKERS) / (budget // WORKERS)))


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
        for group in opt.param_groups:
            group["lr"] = task["lr"] * lr_factor(task["schedule"], index, task["budget"])
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
        from shardps.worker import ConsistencyOptions, DistributedOptimizer, WireOptions

        opt = DistributedOptimizer(make_optimizer(task["optimizer"], model.parameters(), task["lr"]),
                                   model.named_parameters(), servers=task["endpoint"], worker_id=f"straggler-{rank}",
                                   consistency=ConsistencyOptions(
                                       mode=mode, staleness=task["staleness"] if mode == "ssp" else None,
                                       scale_lr_by_staleness=task["scale_lr"] and mode != "sync"),
                                   wire=WireOptions(rpc_timeout=timeout, connect_timeout=min(timeout, 30.0)))
        try:
            ready = _wait_for_go(rank, results, go, timeout)
            start, cpu = time.monotonic(), time.process_time()
            done, slept = _train_steps(task, rank, model, opt, lockstep if mode == "sync" else claim)
            end, cpu = time.monotonic(), time.process_time() - cpu
        finally:
            opt.close()
    return {"ready": ready, "start": start, "end": end, "steps": done, "slept": slept, "cpu": cpu,
            "final_loss": final_loss}


def worker_main(rank: int, tasks: Any, results: Any, counter: Any, go: Any, idle_timeout: float) -> None:
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

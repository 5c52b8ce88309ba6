"""The main job: train an MLP on scikit-learn's handwritten digits with shardps (sync, BSP).

Data: ``sklearn.datasets.load_digits`` (8x8 images, 1,797 samples, shipped
with scikit-learn: no download), split 80/20 with a fixed seed, pixels
scaled to [0, 1]. Every worker shuffles the training split with the same
seed each epoch and takes its slice of each global batch of
``workers * batch_size`` samples, so a sync step sees exactly the global
batch a single process would.

The shards' version is the step counter: round ``v`` is epoch
``v // steps_per_epoch``, step ``v % steps_per_epoch``, at learning rate
``learning_rate(config, v)``, and every worker stops when the shards reach
``total_steps(config)``. A worker that joins mid-job (a restarted rank under
torchrun, say) therefore takes up the job where the shards are instead of
starting again from step 0. :func:`run` starts every worker as a process of
its own; :func:`train_worker` is one worker, for launchers that start one
process per worker (``shardps train digits --worker-index``).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from shardps.apps.processes import run_workers
from shardps.common.security import ChannelSecurity

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class DigitsConfig:
    """Settings of ``shardps train digits``.

    Attributes:
        workers: worker processes (each one a shardps worker).
        shards: shard processes to start when ``servers`` is empty.
        servers: addresses of running shards (``host:port``, shard order); empty starts a LocalCluster.
        epochs: passes over the training split.
        lr: peak AdamW learning rate (cosine decay to 0 over the run).
        batch_size: samples per worker per step.
        hidden: width of the MLP's two hidden layers.
        seed: seed of the split, the shuffles and the initial weights.
        chunk_bytes: largest chunk in bytes.
        push_dtype, pull_dtype: wire types ("fp32", "bf16", "fp16").
        progress: show a progress bar (worker 0).
        job_name: names the workers: worker ``i`` joins as ``<job_name>-rank<i>`` (see :func:`rank_worker_id`).
        mode: ``"sync"``, ``"async"`` or ``"ssp"`` (see ``DistributedOptimizer``).
        local_ranks: processes per worker ("node"): they reduce their gradients with
            torch.distributed (Gloo) first and push as one contributor (``shardps.worker.node.optimizer``).
        staleness: ssp's bound (required with ``mode="ssp"``).
        metrics_port: serve each worker process's Prometheus metrics: process ``k`` (of
            ``workers x local_ranks``) on ``metrics_port + k``, or on a free port when 0;
            each prints ``worker K metrics on HOST:PORT``. Embedded shards then serve
            theirs on free ports too. None: off.
        security: TLS / mutual TLS / bearer token of every channel to the shards
            (``shardps.common.security.ChannelSecurity``; running ``servers`` only).
            Never written to the report.
        resume: a job the running ``servers`` already hold past version 0:
            ``"allow"`` continues it (each worker logs ``continuing job J at version V;
            `shardps reset` starts over`` at WARNING), ``"refuse"`` refuses it
            (``shardps train digits --fresh-job``): :func:`run` checks once, before
            any worker starts; :func:`train_worker` passes it to the optimizer.
    """

    workers: int = 2
    shards: int = 2
    servers: tuple[str, ...] = ()
    epochs: int = 40
    lr: float = 3e-3
    batch_size: int = 32
    hidden: int = 128
    seed: int = 0
    chunk_bytes: int = 1 << 20
    push_dtype: str = "fp32"
    pull_dtype: str = "fp32"
    progress: bool = True
    job_name: str = "digits"
    mode: str = "sync"
    staleness: int | None = None
    local_ranks: int = 1
    metrics_port: int | None = None
    security: ChannelSecurity | None = field(default=None, repr=False)
    resume: str = "allow"

    def __post_init__(self) -> None:
        from shardps.worker.config import ConsistencyOptions
        from shardps.worker.job import check_resume

        ConsistencyOptions(mode=self.mode, staleness=self.staleness)  # ValueError names the fix
        check_resume(self.resume)
        if not (0 < len(self.job_name) <= 200 and self.job_name.isprintable() and " " not in self.job_name):
            raise ValueError(f"job_name must be 1 to 200 printable characters without spaces, got {self.job_name!r}")
        for name in ("workers", "shards", "epochs", "batch_size", "hidden", "local_ranks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.security is not None and not self.servers:
            raise ValueError("TLS and token settings apply to running shards: give servers (--servers)")
        if self.servers and len(self.servers) != self.shards:
            # The number of shards is the number of addresses given.
            object.__setattr__(self, "shards", len(self.servers))


def load_split(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train, y_train, x_test, y_test)``: float32 ``[N, 64]`` in [0, 1] and int64 ``[N]``."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    idx_train, idx_test = train_test_split(
        torch.arange(len(y)).numpy(), test_size=0.2, random_state=seed, stratify=y.numpy()
    )
    return x[idx_train], y[idx_train], x[idx_test], y[idx_test]


def make_model(hidden: int, seed: int) -> nn.Module:
    """MLP 64 -> hidden -> hidden -> 10 with ReLU, initialised from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


@functools.lru_cache(maxsize=8)
def _train_size(seed: int) -> int:
    return len(load_split(seed)[1])


def steps_per_epoch(config: DigitsConfig) -> int:
    """Sync steps (rounds) per epoch: the training split's size over the global batch ``workers * batch_size``.

    Raises:
        ValueError: the global batch is larger than the training split.
    """
    n_train = _train_size(config.seed)
    global_batch = config.workers * config.local_ranks * config.batch_size
    if global_batch > n_train:
        raise ValueError(f"workers * batch_size = {global_batch} exceeds the {n_train} training samples")
    return n_train // global_batch


def epoch_of(config: DigitsConfig, version: int, local_steps: int) -> int:
    """The epoch (1-based, at most ``config.epochs``) a worker is in after ``local_steps`` of its own steps.

    Sync: every round is one global batch, so the shards' ``version`` counts the
    job's steps. Async/ssp: the version counts every worker's pushes, so a
    worker's epoch follows its own step counter.
    """
    steps = version if config.mode == "sync" else local_steps
    return min(steps // steps_per_epoch(config) + 1, config.epochs)


def total_steps(config: DigitsConfig) -> int:
    """The shards' version at which every worker stops.

    Sync: the job's rounds, ``epochs * steps_per_epoch`` (each round averages
    every worker's batch). async/ssp: every push is a version, so
    ``epochs * steps_per_epoch * workers`` pushes, which see as many samples.
    """
    rounds = config.epochs * steps_per_epoch(config)
    return rounds if config.mode == "sync" else rounds * config.workers


def learning_rate(config: DigitsConfig, version: int) -> float:
    """The learning rate of round ``version``: cosine decay from ``config.lr`` to 0 over :func:`total_steps`.

    A pure function of the shards' version, so a worker that joins mid-job
    (or is restarted) sends the same rate as the others.
    """
    total = total_steps(config)
    return config.lr * 0.5 * (1.0 + math.cos(math.pi * min(version, total) / total))


def rank_worker_id(job_name: str, index: int) -> str:
    """The stable id of worker ``index`` of job ``job_name``: ``<job_name>-rank<index>``.

    The same index always gets the same id, so a restarted process rejoins
    the shards as the same member.
    """
    return f"{job_name}-rank{index}"


def train_worker(
    config: DigitsConfig,
    index: int,
    *,
    worker_id: str | None = None,
    connect_timeout: float = 30.0,
    rpc_timeout: float = 120.0,
    wait_for_workers: float = 0.0,
    on_join: Callable[[int, bool, list[str]], None] | None = None,
    on_step: Callable[[int, int, float], None] | None = None,
    on_wait: Callable[[str], None] | None = None,
    local_rank: int = 0,
    group=None,
) -> dict:
    """Run worker ``index`` of ``config.workers`` in this process against the running shards ``config.servers``.

    The shards' version is the global step counter: the worker starts at the
    version it pulls when it joins (0 for a new job; the current one for a
    worker that joins mid-job or is restarted) and stops once the shards
    reach :func:`total_steps`. Round ``v`` uses epoch ``v // steps_per_epoch``'s
    shuffle, this worker's slice of that round's global batch and
    :func:`learning_rate` ``(v)``, so every worker agrees on them whenever it
    joined. In async/ssp modes versions are pushes, which several workers may
    compute from the same version: each worker then walks its own slice
    (``index::workers``) of each epoch's shuffle with its own step counter. Sets ``torch.set_num_threads(1)`` (workers and shards share the
    node's cores).

    Args:
        config: the job's settings; ``config.servers`` must list the shards.
        index: this worker's index in ``[0, config.workers)``: its slice of every global batch.
        worker_id: the id this worker joins with (default ``rank_worker_id(config.job_name, index)``).
        connect_timeout: seconds to wait for each shard to answer, and for a crashed
            predecessor's lease on ``worker_id`` to expire.
        rpc_timeout: deadline of every call in seconds (a round waits for a dead member up to its lease).
        wait_for_workers: after joining, wait up to this many seconds (polling shard 0's
            Stats every 0.2 s) until the job has ``config.workers`` members, so that
            workers restarted together (torchrun restarts a whole group) take up the
            job together instead of the first one back running rounds alone; 0 (the
            default) starts at once. Nothing is refused when the time runs out.
        on_join: called once joined, before any wait, with ``(version, resumed, members)``.
        on_step: called after every step with ``(steps this process ran, shards' version, loss)``.
        on_wait: called with one sentence when a step has waited over 2 s, saying what for (the progress bar shows it).
        local_rank, group: with ``config.local_ranks > 1``, this process's rank in its
            node and the node's ``torch.distributed`` group (initialised by the caller;
            None: the default group). The node joins as one contributor
            (``shardps.worker.node.optimizer.NodeOptimizer``) with ``worker_id``.

    Returns:
        ``worker_id``, ``worker_index``, ``workers``, ``joined_version``,
        ``resumed``, ``version`` (the shards' version at the end),
        ``local_steps`` (steps this process ran), ``steps`` (the job's rounds),
        ``test_accuracy`` (fraction of the 360 test images) and ``final_loss``
        (mean cross-entropy over the training split), both of this worker's
        final parameters.

    Raises:
        ValueError: bad settings (no servers, ``index`` out of range, a global batch larger than the data).
        ConnectionError: a shard did not answer within ``connect_timeout``.
        shardps.worker.session.client.ShardRpcError: a shard refused a call (e.g. this worker was dropped).
        shardps.worker.job.RunningJobError: ``config.resume`` is ``"refuse"`` and the job is past version 0.
    """
    from shardps.worker.config import ConsistencyOptions, ObservabilityOptions, WireOptions
    from shardps.worker.node.optimizer import NodeOptimizer
    from shardps.worker.optimizer import DistributedOptimizer

    if not config.servers:
        raise ValueError("train_worker needs running shards: give config.servers")
    if not 0 <= index < config.workers:
        raise ValueError(f"worker index {index} is outside [0, {config.workers})")
    torch.set_num_threads(1)  # workers and shards share the node's cores
    x_train, y_train, x_test, y_test = load_split(config.seed)
    model = make_model(config.hidden, config.seed)
    per_epoch, total = steps_per_epoch(config), total_steps(config)
    slots = config.workers * config.local_ranks  # batches per round: one per process
    slot = index * config.local_ranks + local_rank
    global_batch = slots * config.batch_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=1e-4)
    loss_fn = nn.CrossEntropyLoss()
    orders: dict[int, torch.Tensor] = {}
    local_steps = 0
    worker_id = worker_id or rank_worker_id(config.job_name, index)
    options = dict(servers=list(config.servers), resume=config.resume,
                   consistency=ConsistencyOptions(mode=config.mode, staleness=config.staleness),
                   wire=WireOptions(chunk_bytes=config.chunk_bytes, push_dtype=config.push_dtype,
                                    pull_dtype=config.pull_dtype, connect_timeout=connect_timeout,
                                    rpc_timeout=rpc_timeout, security=config.security))
    metrics_port = None if config.metrics_port is None else config.metrics_port + slot if config.metrics_port else 0
    if metrics_port is not None or on_wait is not None:
        options["observability"] = ObservabilityOptions(metrics_port=metrics_port, on_wait=on_wait)
    if config.local_ranks > 1:
        wrapper = NodeOptimizer(optimizer, model.named_parameters(), node_id=worker_id, group=group, **options)
    else:
        wrapper = DistributedOptimizer(optimizer, model.named_parameters(), worker_id=worker_id, **options)
    with wrapper as dist:
        version = joined = dist.version
        metrics = dist.metrics
        if metrics is not None and dist.metrics_port is not None:
            print(f"worker {slot} metrics on 0.0.0.0:{dist.metrics_port}", flush=True)
        if on_join is not None:
            on_join(joined, dist.resumed, dist.members)
        deadline = time.monotonic() + wait_for_workers
        while local_rank == 0 and time.monotonic() < deadline and len(dist.stats()[0].members) < config.workers:
            time.sleep(0.2)  # bounded by wait_for_workers; rounds wait for this member meanwhile
        while version < total:
            # sync: the round's slot of the global batch; async/ssp: this worker's own slice, own step counter
            epoch, step = divmod(version if config.mode == "sync" else local_steps, per_epoch)
            if epoch not in orders:
                orders = {epoch: torch.randperm(
                    len(y_train), generator=torch.Generator().manual_seed(config.seed * 1000 + epoch))}
            if config.mode == "sync":
                mine = orders[epoch][step * global_batch + slot * config.batch_size :][: config.batch_size]
            else:
                mine = orders[epoch][slot::slots][step * config.batch_size :][: config.batch_size]
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(config, version)
            dist.zero_grad()
            loss = loss_fn(model(x_train[mine]), y_train[mine])
            loss.backward()
            dist.step()
            if metrics is not None:
                metrics.count_samples(len(mine) * config.local_ranks)  # the node's samples
            version = dist.version
            local_steps += 1
            if on_step is not None:
                on_step(local_steps, version, loss.item())
        with torch.no_grad():
            final_loss = loss_fn(model(x_train), y_train).item()
            accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        return {
            "worker_id": worker_id, "worker_index": index, "local_ranks": config.local_ranks, "workers": config.workers,
            "joined_version": joined, "resumed": dist.resumed, "version": version, "local_steps": local_steps,
            "steps": total, "test_accuracy": accuracy, "final_loss": final_loss,
        }


def _worker(process: int, config: DigitsConfig, result_path: str) -> None:
    """One process of :func:`run`: local rank ``process % local_ranks`` of worker (node) ``process // local_ranks``.

    Process 0 shows the progress bar and writes the result. With several
    local ranks, each node's processes form a Gloo group (file rendezvous
    next to ``result_path``).
    """
    from tqdm import tqdm

    index, local_rank = divmod(process, config.local_ranks)
    if config.local_ranks > 1:
        import torch.distributed as torch_dist

        torch_dist.init_process_group("gloo", init_method=f"file://{result_path}.node{index}", rank=local_rank,
                                      world_size=config.local_ranks)
    bar = tqdm(total=total_steps(config), desc="train digits", unit="step",
               disable=process != 0 or not config.progress)

    def progress(local_steps: int, version: int, loss: float) -> None:
        bar.update(version - bar.n)
        bar.set_postfix(epoch=f"{epoch_of(config, version, local_steps)}/{config.epochs}", loss=f"{loss:.4f}",
                        refresh=False)

    def waiting(sentence: str) -> None:  # from the optimizer's wait watcher, after 2 s of waiting
        bar.set_postfix_str(f"waiting: {sentence}")

    try:
        result = train_worker(config, index, on_step=progress, on_wait=waiting if process == 0 else None,
                              local_rank=local_rank)
    finally:
        bar.close()
    if process == 0:
        Path(result_path).write_text(json.dumps(result))


def run(config: DigitsConfig) -> dict:
    """Train with ``config.workers`` worker processes; returns the report.

    Report keys: ``test_accuracy`` (fraction of the 360 test images),
    ``final_loss`` (mean cross-entropy over the training split with the final
    parameters), ``steps``, ``version``, ``wall_seconds``, ``workers``,
    ``shards``, ``mode``, ``servers``, the config, and worker 0's
    :func:`train_worker` result (``worker_id``, ``resumed``, ...).

    Raises:
        RuntimeError: a worker or a shard failed (the message says which and why).
        shardps.worker.job.RunningJobError: ``config.resume`` is ``"refuse"`` and the running ``config.servers``
            hold a job past version 0 (no worker started).
    """
    from shardps.worker.cluster import LocalCluster
    from shardps.worker.job import refuse_running_job

    start = time.perf_counter()
    if config.servers and config.resume == "refuse":
        refuse_running_job(config.servers, security=config.security)
    # every worker of this run continues what the others started (one may join after the first rounds)
    workers_config = replace(config, resume="allow")
    with tempfile.TemporaryDirectory(prefix="shardps-digits-") as tmp:
        result_path = str(Path(tmp) / "result.json")
        if config.servers:
            servers, embedded = list(config.servers), None
        else:
            metrics = ("--metrics-port", "0") if config.metrics_port is not None else ()
            embedded = LocalCluster(config.shards, min_workers=config.workers, extra_args=metrics).start()
            servers = embedded.addresses
            for i, address in enumerate(embedded.metrics_addresses):
                print(f"shard {i} metrics on {address}", flush=True)
        try:
            run_workers(_worker, (replace(workers_config, servers=tuple(servers)), result_path),
                        config.workers * config.local_ranks, "digits")
        finally:
            if embedded is not None:
                embedded.stop()
        result = json.loads(Path(result_path).read_text())
    return {
        **result,
        "wall_seconds": time.perf_counter() - start,
        "workers": config.workers,
        "local_ranks": config.local_ranks,
        "shards": config.shards,
        "mode": config.mode,
        "servers": "embedded" if embedded is not None else ",".join(servers),
        "config": {k: v for k, v in asdict(config).items() if k != "security"},
    }

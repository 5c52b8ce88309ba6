"""``shardps train movielens``: biased matrix factorisation on MovieLens-100K, user and item tables on the shards.

    shardps train movielens --data-dir PATH/ml-100k [--workers 2] [--shards 2] [--epochs 25]

The model predicts a rating as ``<p_u, q_i> + b_u + b_i + g`` (Koren, Bell
and Volinsky, "Matrix factorization techniques for recommender systems",
IEEE Computer 2009): four hashed ``ShardedEmbedding`` tables (user and
item vectors of ``dim`` values, user and item biases) whose rows live on
the shards with their Adagrad state, and one dense global bias ``g``
(Adam). It trains on the standard split's ``u1.base`` and reports the
RMSE on ``u1.test`` (predictions clipped to [1, 5]). Each worker takes
its half of every global batch (sync: the same result as one process on
the whole batch); the loss adds an L2 term on the rows the batch looked
up, weighted by ``(count / mean count) ** -reg_alpha`` with the id's count
in ``u1.base``, so rare rows are pulled harder towards zero (the tables'
optimizers take no weight decay).

The MovieLens licence forbids redistribution: the data is read from
``--data-dir`` and never copied; get it from
https://grouplens.org/datasets/movielens/100k/ (``ml-100k.zip``).
"""

from __future__ import annotations

import hashlib
import json
import math
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn

from shardps.apps.processes import run_workers
from shardps.worker import DistributedOptimizer, ShardedEmbedding

#: SHA-256 of the files of the standard split this job reads.
SHA256 = {
    "u1.base": "ce253ec86c448b44fb3ba9a30d12dcfc2e9210cbde71efada3730c22e9ac212a",
    "u1.test": "18c6014a4b2c7324f250a63f8904a7b16b2b19f911129e346141507b0cbac950",
}
SOURCE = "https://grouplens.org/datasets/movielens/100k/"


@dataclass(frozen=True, kw_only=True)
class MovieLensConfig:
    """One movielens job.

    Attributes:
        data_dir: the ``ml-100k`` folder (``u1.base``, ``u1.test``).
        workers, shards: worker processes, and shards to start when ``servers`` is empty.
        servers: running shards ``host:port`` in shard order (empty: start ``shards`` of them here).
        epochs, batch_size: passes over ``u1.base``; ratings per worker per step.
        dim: values per user/item vector.
        lr, bias_lr: Adagrad learning rates of the vector and the bias tables; global_lr: Adam's, of ``g``.
        lam_user, lam_item, reg_alpha: the L2 term (module docstring).
        init_scale: vectors start uniform in [-init_scale, init_scale); biases at 0.
        seed: shuffles; progress: show a progress bar.
        resume: a job the running ``servers`` already hold past version 0 (a run
            before this one): ``"allow"`` continues it (each worker logs ``continuing
            job J at version V; `shardps reset` starts over`` at WARNING), ``"refuse"``
            refuses it before any worker starts (``--fresh-job``).

    Raises:
        ValueError: a setting out of range (the message names it).
    """

    data_dir: str
    workers: int = 2
    shards: int = 2
    servers: tuple[str, ...] = ()
    epochs: int = 25
    batch_size: int = 512
    dim: int = 64
    lr: float = 0.02
    bias_lr: float = 0.08
    global_lr: float = 1e-3
    lam_user: float = 0.05
    lam_item: float = 0.2
    reg_alpha: float = 0.5
    init_scale: float = 0.01
    seed: int = 0
    progress: bool = True
    resume: str = "allow"

    def __post_init__(self) -> None:
        from shardps.worker.job import check_resume

        check_resume(self.resume)
        for name in ("workers", "shards", "epochs", "batch_size", "dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("lr", "bias_lr", "global_lr", "lam_user", "lam_item", "reg_alpha", "init_scale"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")


def check_data(data_dir: str) -> dict[str, Path]:
    """The split's files in ``data_dir``, their SHA-256 checked.

    Raises:
        FileNotFoundError: a file is missing (the message says where to get the data).
        ValueError: a file's SHA-256 is not MovieLens-100K's.
    """
    paths = {name: Path(data_dir) / name for name in SHA256}
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"MovieLens-100K not found: {', '.join(missing)} missing. Download ml-100k.zip from "
                                f"{SOURCE} (its licence forbids redistribution), unzip it and pass --data-dir "
                                "PATH/ml-100k")
    for name, path in paths.items():
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != SHA256[name]:
            raise ValueError(f"{path} has SHA-256 {digest}, not MovieLens-100K's {SHA256[name]}: a damaged or "
                             f"other file; download ml-100k.zip again from {SOURCE}")
    return paths


def load(path: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(users int64 [n], items int64 [n], ratings float32 [n])`` of a ``u*.base``/``u*.test`` file."""
    rows = [line.split("\t") for line in path.read_text().splitlines() if line]
    return (torch.tensor([int(r[0]) for r in rows]), torch.tensor([int(r[1]) for r in rows]),
            torch.tensor([float(r[2]) for r in rows]))


class MF(nn.Module):
    """Biased matrix factorisation: ``forward(users, items)`` (int64 ``[B]``) -> ``(ratings [B], p_u, q_i)``."""

    def __init__(self, dim: int, init_scale: float, mean: float, ttl_seconds: float = 0.0,
                 item_ttl_seconds: float | None = None) -> None:
        super().__init__()
        # rows unseen for this much event time are evicted (0: never); items may keep theirs longer
        users = {"ttl_seconds": ttl_seconds}
        items = {"ttl_seconds": ttl_seconds if item_ttl_seconds is None else item_ttl_seconds}
        self.user = ShardedEmbedding(None, dim, init_scale=init_scale, **users)
        self.item = ShardedEmbedding(None, dim, init_scale=init_scale, **items)
        self.user_bias = ShardedEmbedding(None, 1, init_scale=0.0, **users)
        self.item_bias = ShardedEmbedding(None, 1, init_scale=0.0, **items)
        self.global_bias = nn.Parameter(torch.tensor(float(mean)))

    def forward(self, users: torch.Tensor, items: torch.Tensor):
        p, q = self.user(users), self.item(items)
        rating = (p * q).sum(1) + self.user_bias(users)[:, 0] + self.item_bias(items)[:, 0] + self.global_bias
        return rating, p, q


def serving_model() -> MF:
    """The job's model for ``shardps serve --model shardps.apps.movielens:serving_model``: an unattached :class:`MF`
    with :class:`MovieLensConfig`'s default ``dim`` (64) and ``init_scale`` (0.01), whose rows and global bias
    come from the replica's state; ``forward(users, items)`` (int64 ``[B]``) answers the ratings first (float32
    ``[B]``), which Predict returns. A job trained with other ``--dim`` needs a factory of its own."""
    fields = MovieLensConfig.__dataclass_fields__
    return MF(fields["dim"].default, fields["init_scale"].default, 0.0)


def _row_weights(ids: torch.Tensor, alpha: float) -> torch.Tensor:
    """``(count / mean count) ** -alpha`` per id value (a dense lookup vector indexed by id)."""
    counts = torch.bincount(ids).float()
    seen = counts > 0
    weights = torch.ones_like(counts)
    weights[seen] = (counts[seen] / counts[seen].mean()).pow(-alpha)
    return weights


def steps_per_epoch(config: MovieLensConfig, n: int) -> int:
    return math.ceil(n / (config.batch_size * config.workers))


def train_worker(config: MovieLensConfig, index: int, on_step=None) -> dict:
    """Worker ``index`` of ``config.workers``: train, then (every worker) evaluate on ``u1.test``.

    Returns: ``{"test_rmse", "train_loss" (the last epoch's mean), "steps", "worker_id"}``.

    Raises:
        FileNotFoundError, ValueError: see :func:`check_data`; ShardRpcError: a shard refused.
    """
    torch.set_num_threads(1)
    paths = check_data(config.data_dir)
    users, items, ratings = load(paths["u1.base"])
    test_users, test_items, test_ratings = load(paths["u1.test"])
    weight_user, weight_item = _row_weights(users, config.reg_alpha), _row_weights(items, config.reg_alpha)
    model = MF(config.dim, config.init_scale, float(ratings.mean()))
    dense = torch.optim.Adam([model.global_bias], lr=config.global_lr)
    sparse = torch.optim.Adagrad([{"params": [model.user.handle, model.item.handle]},
                                  {"params": [model.user_bias.handle, model.item_bias.handle], "lr": config.bias_lr}],
                                 lr=config.lr, eps=1e-10)
    worker_id = f"movielens-rank{index}"
    dist = DistributedOptimizer(dense, model.named_parameters(), servers=list(config.servers), model=model,
                                worker_id=worker_id, sparse_optimizer=sparse, resume=config.resume)
    generator = torch.Generator().manual_seed(config.seed)
    n, per_step = users.numel(), config.batch_size * config.workers
    steps, losses = 0, []
    try:
        for _ in range(config.epochs):
            order = torch.randperm(n, generator=generator)  # the same on every worker
            losses = []
            for start in range(0, n, per_step):
                part = torch.chunk(order[start:start + per_step], config.workers)
                if index >= len(part):
                    part = (order[:0],) * config.workers  # a last global batch smaller than the workers
                batch = part[index]
                dist.zero_grad()
                if batch.numel():
                    u, i = users[batch], items[batch]
                    predicted, p, q = model(u, i)
                    error = (predicted - ratings[batch]).pow(2)
                    l2 = config.lam_user * weight_user[u] * p.pow(2).sum(1) + \
                        config.lam_item * weight_item[i] * q.pow(2).sum(1)
                    (error + l2).mean().backward()
                    losses.append(float(error.detach().mean()))
                dist.step()
                steps += 1
                if on_step is not None:
                    on_step(steps, losses[-1] if losses else float("nan"))
        dist.synchronize()
        model.eval()
        with torch.no_grad():
            predicted, _, _ = model(test_users, test_items)
        rmse = math.sqrt(float((predicted.clamp(1.0, 5.0) - test_ratings).pow(2).mean()))
    finally:
        dist.close()
    return {"test_rmse": rmse, "train_loss": sum(losses) / max(len(losses), 1), "steps": steps,
            "worker_id": worker_id}


def _worker(index: int, config: MovieLensConfig, result_path: str) -> None:
    from tqdm import tqdm

    total = config.epochs * steps_per_epoch(config, 80000)
    bar = tqdm(total=total, desc="train movielens", unit="step", disable=index != 0 or not config.progress)

    def progress(steps: int, loss: float) -> None:
        bar.update(steps - bar.n)
        bar.set_postfix(mse=f"{loss:.4f}", refresh=False)

    try:
        result = train_worker(config, index, on_step=progress)
    finally:
        bar.close()
    if index == 0:
        Path(result_path).write_text(json.dumps(result))


def run(config: MovieLensConfig) -> dict:
    """Train with ``config.workers`` worker processes (and ``config.shards`` shards started here unless
    ``config.servers``); returns worker 0's result plus ``wall_seconds``, ``workers``, ``shards``, the config.

    Raises:
        FileNotFoundError, ValueError: the data (see :func:`check_data`).
        RuntimeError: a worker or a shard failed (the message says which and why).
        shardps.worker.job.RunningJobError: ``config.resume`` is ``"refuse"`` and the running ``config.servers``
            hold a job past version 0 (no worker started).
    """
    from shardps.worker.cluster import LocalCluster
    from shardps.worker.job import refuse_running_job

    check_data(config.data_dir)  # before anything starts
    if config.servers and config.resume == "refuse":
        refuse_running_job(config.servers)
    workers = replace(config, resume="allow")  # the workers of one run continue what the first of them started
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="shardps-movielens-") as tmp:
        result_path = str(Path(tmp) / "result.json")
        embedded = None if config.servers else LocalCluster(config.shards, min_workers=config.workers,
                                                            extra_args=("--threads", "1")).start()
        servers = tuple(config.servers) or tuple(embedded.addresses)
        try:
            run_workers(_worker, (replace(workers, servers=servers), result_path), config.workers, "movielens")
        finally:
            if embedded is not None:
                embedded.stop()
        result = json.loads(Path(result_path).read_text())
    return {**result, "wall_seconds": time.perf_counter() - start, "workers": config.workers,
            "shards": len(servers), "config": asdict(config)}

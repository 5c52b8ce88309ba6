"""The main job: train an MLP on scikit-learn's handwritten digits with shardps (sync, BSP).

Data: ``sklearn.datasets.load_digits`` (8x8 images, 1,797 samples, shipped
with scikit-learn: no download), split 80/20 with a fixed seed, pixels
scaled to [0, 1]. Every worker shuffles the training split with the same
seed each epoch and takes its slice of each global batch of
``workers * batch_size`` samples, so a sync step sees exactly the global
batch a single process would.
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch import nn

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

    def __post_init__(self) -> None:
        for name in ("workers", "shards", "epochs", "batch_size", "hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr}")
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


def _worker(index: int, config: DigitsConfig, servers: list[str], result_path: str) -> None:
    from tqdm import tqdm

    from shardps.worker.optimizer import DistributedOptimizer

    torch.set_num_threads(1)  # workers and shards share the node's cores
    x_train, y_train, x_test, y_test = load_split(config.seed)
    model = make_model(config.hidden, config.seed)
    global_batch = config.workers * config.batch_size
    steps_per_epoch = len(y_train) // global_batch
    if steps_per_epoch == 0:
        raise ValueError(f"workers * batch_size = {global_batch} exceeds the {len(y_train)} training samples")
    total = steps_per_epoch * config.epochs
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)
    loss_fn = nn.CrossEntropyLoss()
    with DistributedOptimizer(
        optimizer, model.named_parameters(), servers=servers, worker_id=f"digits-worker-{index}",
        chunk_bytes=config.chunk_bytes, push_dtype=config.push_dtype, pull_dtype=config.pull_dtype,
    ) as dist:
        bar = tqdm(total=total, desc="train digits", unit="step", disable=index != 0 or not config.progress)
        for epoch in range(config.epochs):
            order = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(config.seed * 1000 + epoch))
            for step in range(steps_per_epoch):
                mine = order[step * global_batch + index * config.batch_size :][: config.batch_size]
                dist.zero_grad()
                loss = loss_fn(model(x_train[mine]), y_train[mine])
                loss.backward()
                dist.step()
                scheduler.step()
                bar.update(1)
                bar.set_postfix(epoch=epoch + 1, loss=f"{loss.item():.4f}", refresh=False)
        bar.close()
        if index == 0:
            with torch.no_grad():
                final_loss = loss_fn(model(x_train), y_train).item()
                accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
            Path(result_path).write_text(
                json.dumps({"test_accuracy": accuracy, "final_loss": final_loss, "steps": total,
                            "version": dist.version})
            )


def run(config: DigitsConfig) -> dict:
    """Train with ``config.workers`` worker processes; returns the report.

    Report keys: ``test_accuracy`` (fraction of the 360 test images),
    ``final_loss`` (mean cross-entropy over the training split with the final
    parameters), ``steps``, ``wall_seconds``, ``workers``, ``shards``,
    ``mode``, ``servers``, and the config.

    Raises:
        RuntimeError: a worker or a shard failed (the message says which and why).
    """
    from shardps.worker.cluster import LocalCluster

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="shardps-digits-") as tmp:
        result_path = str(Path(tmp) / "result.json")
        if config.servers:
            servers, embedded = list(config.servers), None
        else:
            embedded = LocalCluster(config.shards, min_workers=config.workers).start()
            servers = embedded.addresses
        try:
            mp.start_processes(
                _worker, args=(config, servers, result_path), nprocs=config.workers, join=True, start_method="spawn"
            )
        except mp.ProcessRaisedException as exc:
            raise RuntimeError(f"a digits worker failed:\n{exc}") from None
        except mp.ProcessExitedException as exc:
            raise RuntimeError(f"a digits worker died: {exc}") from None
        finally:
            if embedded is not None:
                embedded.stop()
        result = json.loads(Path(result_path).read_text())
    return {
        **result,
        "wall_seconds": time.perf_counter() - start,
        "workers": config.workers,
        "shards": config.shards,
        "mode": "sync",
        "servers": "embedded" if embedded is not None else ",".join(servers),
        "config": asdict(config),
    }

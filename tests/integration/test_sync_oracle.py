"""Exact oracle: sync (BSP) training on W workers equals one process training on the whole batch.

Each worker computes the mean loss over its slice of the global batch; the
shards average the W gradients, which equals the gradient of the mean loss
over the whole batch, and then run the same torch.optim class. After 20
steps the parameters must agree to 1e-5. Workers are threads of this test
process, each with its own model replica; shards are real processes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardps.worker.config import WireOptions
from shardps.worker.optimizer import DistributedOptimizer
from tests.support.threads import run_workers

STEPS = 20
BATCH = 12  # divisible by 1, 2 and 3 workers
CHUNK_BYTES = 256  # 64 fp32 elements: the 16x40 weight spans 10 chunks


def make_model() -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(16, 40), nn.Tanh(), nn.Linear(40, 5))


def make_optimizer(name: str, model: nn.Module):
    """Two param groups (so group hyperparameters and per-group lr travel) and an LR scheduler."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    if name == "adamw":
        opt = torch.optim.AdamW(
            [{"params": weights}, {"params": biases, "weight_decay": 0.0}], lr=0.02, weight_decay=0.05
        )
    else:
        opt = torch.optim.SGD(
            [{"params": weights}, {"params": biases, "lr": 0.05}], lr=0.1, momentum=0.9, nesterov=True
        )
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    x = torch.randn(STEPS, BATCH, 16, generator=g)
    y = torch.randint(0, 5, (STEPS, BATCH), generator=g)
    return x, y


def train_single(name: str) -> nn.Module:
    return train_single_with_optimizer(name)[0]


def train_single_with_optimizer(name: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = make_model()
    opt, sched = make_optimizer(name, model)
    x, y = data()
    for step in range(STEPS):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[step]), y[step]).backward()
        opt.step()
        sched.step()
    return model, opt


def train_sharded(name: str, workers: int, servers: list[str], overlap: bool = False,
                  streamed: bool = False, device: str = "cpu", push_credit_bytes: int = 0,
                  pushed_at_step: frozenset[int] = frozenset(), stream_processes: bool = False,
                  between_steps=None) -> list[nn.Module]:
    """The job on ``workers`` worker threads, each replica and its batches on ``device``; the workers in
    ``pushed_at_step`` push their gradients at ``step()``, in key order (the others from backward's hooks);
    ``between_steps(worker, step, dist)`` runs after each step."""
    x, y = data()
    x, y = x.to(device), y.to(device)
    per = BATCH // workers
    models = [make_model().to(device) for _ in range(workers)]

    def worker(i: int) -> None:
        model = models[i]
        opt, sched = make_optimizer(name, model)
        with DistributedOptimizer(opt, model.named_parameters(), servers=servers, worker_id=f"w{i}",
                                  model=model if overlap else None, push_during_backward=i not in pushed_at_step,
                                  wire=WireOptions(chunk_bytes=CHUNK_BYTES, rpc_timeout=60.0,
                                                   streamed=streamed, push_credit_bytes=push_credit_bytes,
                                                   stream_processes=stream_processes)) as dist:
            for step in range(STEPS):
                dist.zero_grad()
                part = slice(i * per, (i + 1) * per)
                nn.functional.cross_entropy(model(x[step, part]), y[step, part]).backward()
                dist.step()
                sched.step()
                if step % 7 == 3:
                    dist.synchronize()  # waits for the pull; never starts a round of its own
                if between_steps is not None:
                    between_steps(i, step, dist)
            assert dist.version == STEPS
            assert not opt.state, "the local optimizer must never allocate state"

    run_workers(workers, worker)
    return models


@pytest.mark.parametrize("name", ["adamw", "sgd_nesterov"])
@pytest.mark.parametrize("num_shards", [1, 2, 3])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_sync_matches_single_process(start_cluster, name: str, num_shards: int, workers: int) -> None:
    cluster = start_cluster(num_shards, min_workers=workers)
    expected = train_single(name)
    initial = make_model()
    for replica in train_sharded(name, workers, cluster.addresses):
        for (key, want), got, init in zip(
            expected.named_parameters(), replica.parameters(), initial.parameters()
        ):
            assert (want - init).abs().max() > 1e-3, "training did not move the parameters"
            diff = (want - got).abs().max().item()
            assert diff < 1e-5, f"{key}: max |single - sharded| = {diff}"


@pytest.mark.parametrize("name", ["adamw", "sgd_nesterov"])
def test_overlapped_pulls_match_single_process(start_cluster, name: str) -> None:
    """With model= given, step() returns early and each layer's forward waits for its own parameters."""
    cluster = start_cluster(2, min_workers=2)
    expected = train_single(name)
    for replica in train_sharded(name, 2, cluster.addresses, overlap=True):
        for (key, want), got in zip(expected.named_parameters(), replica.parameters()):
            diff = (want - got).abs().max().item()
            assert diff < 1e-5, f"{key}: max |single - sharded| = {diff}"

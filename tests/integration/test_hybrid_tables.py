"""Hybrid consistency: dense parameters sync, sparse tables async (``ConsistencyOptions(tables="async")``).

Two workers (threads) and two real shard processes. With async tables each worker's rows are applied
on their own as they arrive, the worker's gradient whole, while the dense rounds stay sync (averaged over
the workers). The workers' ids are disjoint, so the order in which the shards apply their pushes cannot
change the result, and one process gives the exact oracle: the dense layer stepped with the workers' mean
gradient, each table row with its own worker's gradient (the sum over workers, one of which is zero). Sync
tables would average the rows' gradients over the workers and fail it. Also: a worker whose tables mode
differs from the job's is refused, and tables with an async dense mode are refused naming the hybrid form.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from shardps.worker import ConsistencyOptions, DistributedOptimizer, ShardedEmbedding
from tests.support.forked import cluster_fixture
from tests.support.threads import run_workers

N, DIM, STEPS, WORKERS, SCALE = 40, 4, 8, 2, 0.3
HYBRID = ConsistencyOptions(mode="sync", tables="async")


class Net(nn.Module):
    def __init__(self, sharded: bool) -> None:
        super().__init__()
        self.emb = ShardedEmbedding(N, DIM, name="emb", init_scale=SCALE) if sharded else \
            nn.Embedding(N, DIM, sparse=True)
        if not sharded:
            with torch.no_grad():
                self.emb.weight.copy_(ShardedEmbedding(N, DIM, name="emb", init_scale=SCALE).spec().initial_rows(
                    torch.arange(N)))
        self.head = nn.Linear(DIM, 1)
        with torch.no_grad():
            self.head.weight.copy_(torch.linspace(-0.5, 0.5, DIM)[None])
            self.head.bias.zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids)).squeeze(1)


def batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``worker``'s ids (its own half of the table: disjoint from the other's) and targets."""
    g = torch.Generator().manual_seed(100 * step + worker)
    half = N // WORKERS
    return torch.randint(worker * half, (worker + 1) * half, (6,), generator=g), torch.randn(6, generator=g)


def table_handles(model: Net) -> list[torch.Tensor]:
    return [model.emb.handle] if hasattr(model.emb, "handle") else [model.emb.weight]


def oracle() -> Net:
    model = Net(sharded=False)
    dense, sparse = torch.optim.SGD(model.head.parameters(), lr=0.1), torch.optim.Adagrad(table_handles(model), lr=0.3)
    for step in range(STEPS):
        dense.zero_grad()
        sparse.zero_grad()
        sum(nn.functional.mse_loss(model(ids), y) for ids, y in (batch(w, step) for w in range(WORKERS))).backward()
        for p in model.head.parameters():  # the dense round averages over the workers; each row keeps its own
            p.grad /= WORKERS
        dense.step()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Sparse invariant checks")
            sparse.step()
    return model


def train(servers: str, worker: int, out: dict) -> None:
    model = Net(sharded=True)
    dist = DistributedOptimizer(torch.optim.SGD(model.head.parameters(), lr=0.1), model.named_parameters(),
                                servers=servers, model=model, worker_id=f"w{worker}", consistency=HYBRID,
                                sparse_optimizer=torch.optim.Adagrad(table_handles(model), lr=0.3))
    try:
        for step in range(STEPS):
            dist.zero_grad()
            ids, y = batch(worker, step)
            nn.functional.mse_loss(model(ids), y).backward()
            dist.step()
        dist.synchronize()
        out[worker] = {"emb": dist.tables.export("emb").weight(),
                       "head": {k: v.detach().clone() for k, v in model.head.state_dict().items()}}
    finally:
        dist.close()


shards = cluster_fixture(2, min_workers=WORKERS)


def test_hybrid_training_applies_each_workers_rows_whole_and_keeps_the_dense_part_sync(shards):
    shards.reset()
    out: dict = {}
    run_workers(WORKERS, lambda w: train(shards.servers, w, out), timeout=240)
    want = oracle()
    ref = want.emb.weight.detach()
    for w in range(WORKERS):  # both workers read the same tables and the same dense parameters
        assert torch.allclose(out[w]["emb"], ref, atol=1e-6, rtol=0), (w, (out[w]["emb"] - ref).abs().max())
        for k, v in out[w]["head"].items():
            assert torch.allclose(v, want.head.state_dict()[k], atol=1e-6, rtol=0), (w, k)


def test_a_worker_with_another_tables_mode_is_refused(shards):
    shards.reset()
    first = Net(sharded=True)
    dist = DistributedOptimizer(torch.optim.SGD(first.head.parameters(), lr=0.1), first.named_parameters(),
                                servers=shards.servers, model=first, worker_id="w0", consistency=HYBRID,
                                sparse_optimizer=torch.optim.Adagrad(table_handles(first)))
    try:
        second = Net(sharded=True)
        with pytest.raises(Exception, match=r"ConsistencyOptions\(tables=\)"):
            DistributedOptimizer(torch.optim.SGD(second.head.parameters(), lr=0.1), second.named_parameters(),
                                 servers=shards.servers, model=second, worker_id="w1",
                                 sparse_optimizer=torch.optim.Adagrad(table_handles(second)))
    finally:
        dist.close()


@pytest.mark.parametrize("mode", [dict(mode="async"), dict(mode="ssp", staleness=2)])
def test_tables_with_an_async_dense_mode_are_refused_naming_the_hybrid_form(mode):
    model = Net(sharded=True)
    with pytest.raises(ValueError, match=r"tables='async'\) \(hybrid"):
        DistributedOptimizer(torch.optim.SGD(model.head.parameters(), lr=0.1), model.named_parameters(),
                             servers="127.0.0.1:1", model=model, consistency=ConsistencyOptions(**mode, tables="async"),
                             sparse_optimizer=torch.optim.Adagrad(table_handles(model)))
    with pytest.raises(ValueError, match="tables must be 'sync' or 'async'"):
        ConsistencyOptions(tables="ssp")

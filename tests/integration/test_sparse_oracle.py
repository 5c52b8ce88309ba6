"""Sync training of sharded embedding tables equals one process with torch's sparse modules and optimizers.

Two workers (threads, each its own DistributedOptimizer) and three real
shard processes train ``ShardedEmbeddingBag`` (sum with
``per_sample_weights``, and mean) and ``ShardedEmbedding`` (with
``padding_idx``) plus a dense layer for 20 steps; the oracle is one
process running ``nn.EmbeddingBag(sparse=True)``/``nn.Embedding(sparse=True)``
with the same torch optimizer on both workers' batches, the loss being the
mean of the two workers' losses (gradients averaged over workers, as for
dense). The batches repeat ids within a batch and carry ids only one
worker sees. Every row of every table must match within 1e-6. The same
holds with the two bags looked up through a ``ShardedEmbeddingBagCollection``
(several tables in one pull per shard), and with that collection prefetching
the next step's rows while each step computes, each on both kernel paths
(FBGEMM's fused pooled lookup, and torch per bag: ``SHARDPS_TABLE_KERNELS``).
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from torch import nn

from shardps.common.rows import initial_rows
from shardps.worker.embedding.fused import KERNELS_ENV
from shardps.worker import DistributedOptimizer, ShardedEmbedding, ShardedEmbeddingBag, ShardedEmbeddingBagCollection

N, DIM, STEPS, WORKERS = 50, 4, 20, 2
SCALE = 0.3


class Net(nn.Module):
    """Three tables and a dense head; ``sharded`` picks shardps modules or torch's sparse ones; ``collection``
    looks the two bags up through one ``ShardedEmbeddingBagCollection`` (one pull per shard for both)."""

    def __init__(self, sharded: bool, collection: bool = False) -> None:
        super().__init__()
        self.collection = collection
        if collection:
            self.bags = ShardedEmbeddingBagCollection({
                "a": ShardedEmbeddingBag(N, DIM, mode="sum", init_scale=SCALE, name="bag_sum"),
                "b": ShardedEmbeddingBag(N, DIM, mode="mean", init_scale=SCALE, name="bag_mean")})
            self.emb = ShardedEmbedding(N, DIM, padding_idx=0, init_scale=SCALE)
        elif sharded:
            self.bag_sum = ShardedEmbeddingBag(N, DIM, mode="sum", init_scale=SCALE)
            self.bag_mean = ShardedEmbeddingBag(N, DIM, mode="mean", init_scale=SCALE)
            self.emb = ShardedEmbedding(N, DIM, padding_idx=0, init_scale=SCALE)
        else:
            self.bag_sum = nn.EmbeddingBag(N, DIM, mode="sum", sparse=True)
            self.bag_mean = nn.EmbeddingBag(N, DIM, mode="mean", sparse=True)
            self.emb = nn.Embedding(N, DIM, padding_idx=0, sparse=True)
            with torch.no_grad():
                for name in ("bag_sum", "bag_mean", "emb"):
                    getattr(self, name).weight.copy_(initial_rows(name, torch.arange(N), DIM, 0, SCALE,
                                                                  0 if name == "emb" else -1))
        self.head = nn.Linear(3 * DIM, 1)
        with torch.no_grad():  # from a generator of its own: the workers are threads sharing torch's global one
            self.head.weight.copy_(torch.randn(1, 3 * DIM, generator=torch.Generator().manual_seed(0)) * 0.3)
            self.head.bias.zero_()

    def tables(self) -> list[nn.Module]:
        if self.collection:
            return [self.bags.bags["a"], self.bags.bags["b"], self.emb]
        return [self.bag_sum, self.bag_mean, self.emb]

    def forward(self, batch: dict) -> torch.Tensor:
        if self.collection:
            out = self.bags(features(batch))
            a, b = out["a"], out["b"]
        else:
            a = self.bag_sum(batch["ids"], batch["offsets"], per_sample_weights=batch["weights"])
            b = self.bag_mean(batch["ids2d"])
        c = self.emb(batch["seq"]).sum(dim=1)
        return self.head(torch.cat([a, b, c], dim=1)).squeeze(1)


def batches(worker: int, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + worker)
    lo, hi = (0, 30) if worker == 0 else (20, N)  # ids 0..19 only worker 0 sees, 30..49 only worker 1
    ids = torch.randint(lo, hi, (12,), generator=g)
    ids[3] = ids[4]  # repeated within a batch
    seq = torch.randint(lo, hi, (4, 3), generator=g)
    seq[0, 0] = 0  # the padding id
    return {"ids": ids, "offsets": torch.tensor([0, 3, 7, 9]), "weights": torch.rand(12, generator=g),
            "ids2d": torch.randint(lo, hi, (4, 3), generator=g), "seq": seq,
            "y": torch.randn(4, generator=g)}


def optimizers(kind: str, model: Net):
    tables = model.tables()
    handles = [t.handle if hasattr(t, "handle") else t.weight for t in tables]
    if kind == "sgd":
        sparse = torch.optim.SGD(handles, lr=0.5)
    elif kind == "adagrad":
        sparse = torch.optim.Adagrad(handles, lr=0.3, initial_accumulator_value=0.1, eps=1e-8)
    else:
        sparse = torch.optim.SparseAdam(handles, lr=0.05, betas=(0.8, 0.95))
    return torch.optim.SGD(model.head.parameters(), lr=0.1), sparse


def oracle(kind: str) -> Net:
    model = Net(sharded=False)
    dense, sparse = optimizers(kind, model)
    for step in range(STEPS):
        dense.zero_grad()
        sparse.zero_grad()
        loss = sum(nn.functional.mse_loss(model(b), b["y"]) for b in (batches(w, step) for w in range(WORKERS)))
        (loss / WORKERS).backward()
        dense.step()
        with warnings.catch_warnings():  # torch's own sparse Adagrad notes that it skips invariant checks
            warnings.filterwarnings("ignore", message="Sparse invariant checks")
            sparse.step()
    return model


def features(b: dict) -> dict:
    return {"a": (b["ids"], b["offsets"], b["weights"]), "b": b["ids2d"]}


def train_sharded(kind: str, servers: str, worker: int, out: dict, collection: str) -> None:
    """``collection``: "" (the bags alone), "collection" (through one), "prefetch" (and each step prefetches the
    next batch's rows; every fifth step it prefetches other ids, which the next forward drops)."""
    model = Net(sharded=True, collection=bool(collection))
    dense, sparse = optimizers(kind, model)
    dist = DistributedOptimizer(dense, model.named_parameters(), servers=servers, model=model,
                                worker_id=f"w{worker}", sparse_optimizer=sparse)
    try:
        for step in range(STEPS):
            dist.zero_grad()
            b = batches(worker, step)
            loss = nn.functional.mse_loss(model(b), b["y"])
            if collection == "prefetch":
                model.bags.prefetch(features(batches(worker, step + 1 if step % 5 != 4 else step + 7)))
            loss.backward()
            dist.step()
        if collection == "prefetch":  # 16 forwards used their prefetch; 3 dropped one of other ids
            assert dist.tables.prefetches == {"used": 16, "dropped": 3, "pulled_again": 0}, dist.tables.prefetches
        dist.synchronize()
        if worker == 0:
            out["tables"] = {name: dist.tables.export(name) for name in ("bag_sum", "bag_mean", "emb")}
            out["head"] = {k: v.detach().clone() for k, v in model.head.state_dict().items()}
    finally:
        dist.close()


@pytest.fixture(scope="module")
def shards():
    from tests.support.forked import ForkedCluster
    with ForkedCluster(3, min_workers=WORKERS) as cluster:
        yield cluster


@pytest.mark.parametrize("kind,collection,kernels", [
    ("sgd", "", "auto"), ("adagrad", "", "auto"), ("sparse_adam", "", "auto"),
    ("adagrad", "collection", "torch"), ("adagrad", "collection", "fbgemm"),
    ("sparse_adam", "prefetch", "torch"), ("sparse_adam", "prefetch", "fbgemm")])
def test_sync_tables_equal_one_process_with_torch_sparse_optimizers(shards, kind, collection, kernels, monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, kernels)  # a collection pools with FBGEMM's fused kernel or per bag in torch
    from shardps.worker.session.client import ShardClient
    for address in shards.addresses:  # a fresh job per optimizer
        client = ShardClient(address, index=0)
        try:
            client.reset()
        finally:
            client.close()
    out, errors = {}, []

    def run(w):
        try:
            train_sharded(kind, shards.servers, w, out, collection)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w,)) for w in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    assert not errors, errors
    want = oracle(kind)
    for name in ("bag_sum", "bag_mean", "emb"):
        export = out["tables"][name]
        got = export.weight()
        ref = getattr(want, name).weight.detach()
        assert torch.allclose(got, ref, atol=1e-6, rtol=0), (name, (got - ref).abs().max())
        touched = set(export.ids.tolist())
        assert {1, 2, 45, 48} & touched, "ids seen by one worker only were trained"
        assert 0 not in touched or name != "emb", "the padding row is never trained"
    for k, v in out["head"].items():
        assert torch.allclose(v, want.head.state_dict()[k], atol=1e-6, rtol=0)

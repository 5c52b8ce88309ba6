"""One table serving several features, and int32 ids, as TorchRec users bring them.

A ``ShardedEmbeddingBagCollection`` whose bag ``user`` serves two features
(``user`` and ``friend``, TorchRec's ``feature_names``) and whose ids,
offsets and per-sample weights come as int32 (``KeyedJaggedTensor``'s usual)
trains with two workers (threads, each its own DistributedOptimizer) and two
real shard processes as one process trains ``nn.EmbeddingBag(sparse=True)``
called for both features with Adagrad: every row within 1e-6, with and
without prefetching. Before, the collection named the shared table twice in
one pull and the shard refused it (``a pull names a table twice``), and
int32 ids were refused.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import shardps
from shardps.common.rows import initial_rows
from shardps.worker import DistributedOptimizer, ShardedEmbedding, ShardedEmbeddingBag, ShardedEmbeddingBagCollection
from shardps.worker.embedding.collection import merged, spread
from tests.support.forked import cluster_fixture
from tests.support.forked import cluster_fixture
from tests.support.threads import run_workers

N, DIM, STEPS, WORKERS, SCALE = 40, 4, 12, 2, 0.3


class Net(nn.Module):
    def __init__(self, sharded: bool) -> None:
        super().__init__()
        self.sharded = sharded
        if sharded:
            user = ShardedEmbeddingBag(N, DIM, mode="sum", init_scale=SCALE, name="user")
            item = ShardedEmbeddingBag(N, DIM, mode="mean", init_scale=SCALE, name="item")
            self.bags = ShardedEmbeddingBagCollection({"user": user, "friend": user, "item": item})
        else:
            self.user = nn.EmbeddingBag(N, DIM, mode="sum", sparse=True)
            self.item = nn.EmbeddingBag(N, DIM, mode="mean", sparse=True)
            with torch.no_grad():
                for name in ("user", "item"):
                    getattr(self, name).weight.copy_(initial_rows(name, torch.arange(N), DIM, 0, SCALE, -1))
        self.head = nn.Linear(3 * DIM, 1)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(1, 3 * DIM, generator=torch.Generator().manual_seed(0)) * 0.3)
            self.head.bias.zero_()

    def tables(self) -> list[nn.Module]:
        return [self.bags.bags["user"], self.bags.bags["item"]] if self.sharded else [self.user, self.item]

    def forward(self, b: dict) -> torch.Tensor:
        if self.sharded:
            out = self.bags(features(b))
            parts = [out["user"], out["friend"], out["item"]]
        else:
            parts = [self.user(b["user"].long(), b["user_offsets"].long(), per_sample_weights=b["user_weights"]),
                     self.user(b["friend"].long(), b["friend_offsets"].long()), self.item(b["item"].long())]
        return self.head(torch.cat(parts, dim=1)).squeeze(1)


def features(b: dict) -> dict:
    return {"user": (b["user"], b["user_offsets"], b["user_weights"]), "friend": (b["friend"], b["friend_offsets"]),
            "item": b["item"]}


def batch(worker: int, step: int) -> dict:
    g = torch.Generator().manual_seed(100 * step + worker)
    lo, hi = (0, 25) if worker == 0 else (15, N)
    i32 = dict(dtype=torch.int32)
    return {"user": torch.randint(lo, hi, (10,), generator=g).to(**i32), "user_offsets": torch.tensor([0, 4, 6], **i32),
            "user_weights": torch.rand(10, generator=g),
            "friend": torch.randint(lo, hi, (7,), generator=g).to(**i32), "friend_offsets": torch.tensor([0, 1, 5], **i32),
            "item": torch.randint(lo, hi, (3, 2), generator=g).to(**i32), "y": torch.randn(3, generator=g)}


def optimizers(model: Net):
    handles = [t.handle if hasattr(t, "handle") else t.weight for t in model.tables()]
    return torch.optim.SGD(model.head.parameters(), lr=0.1), torch.optim.Adagrad(handles, lr=0.3, eps=1e-8)


def oracle() -> Net:
    model = Net(sharded=False)
    dense, sparse = optimizers(model)
    for step in range(STEPS):
        dense.zero_grad()
        sparse.zero_grad()
        loss = sum(nn.functional.mse_loss(model(b), b["y"]) for b in (batch(w, step) for w in range(WORKERS)))
        (loss / WORKERS).backward()
        dense.step()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Sparse invariant checks")
            sparse.step()
    return model


def train(servers: str, worker: int, prefetch: bool, out: dict) -> None:
    model = Net(sharded=True)
    dense, sparse = optimizers(model)
    dist = DistributedOptimizer(dense, model.named_parameters(), servers=servers, model=model,
                                worker_id=f"w{worker}", sparse_optimizer=sparse)
    try:
        for step in range(STEPS):
            dist.zero_grad()
            b = batch(worker, step)
            loss = nn.functional.mse_loss(model(b), b["y"])
            if prefetch:
                model.bags.prefetch(features(batch(worker, step + 1)))
            loss.backward()
            dist.step()
        if prefetch:
            assert dist.tables.prefetches["used"] == STEPS - 1, dist.tables.prefetches
        dist.synchronize()
        if worker == 0:
            out["tables"] = {name: dist.tables.export(name).weight() for name in ("user", "item")}
            out["head"] = {k: v.detach().clone() for k, v in model.head.state_dict().items()}
    finally:
        dist.close()


shards = cluster_fixture(2, min_workers=WORKERS)


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_table_shared_by_two_features_with_int32_ids_trains_as_one_process(shards, prefetch):
    shards.reset()
    out: dict = {}
    run_workers(WORKERS, lambda w: train(shards.servers, w, prefetch, out), timeout=240)
    want = oracle()
    for name in ("user", "item"):
        ref = getattr(want, name).weight.detach()
        assert torch.allclose(out["tables"][name], ref, atol=1e-6, rtol=0), (name, (out["tables"][name] - ref).abs().max())
    for k, v in out["head"].items():
        assert torch.allclose(v, want.head.state_dict()[k], atol=1e-6, rtol=0)


one_shard = cluster_fixture(1)


def test_int32_ids_train_and_serve_as_int64_ids_bit_for_bit(one_shard):
    """ShardedEmbedding and ShardedEmbeddingBag given int32 ids (and int32 offsets) train exactly as with int64;
    the local model built from the state answers int32 ids as the live one."""
    shards, states = one_shard, []
    for dtype in (torch.int64, torch.int32):
        shards.reset()
        model = nn.ModuleDict({"emb": ShardedEmbedding(None, DIM), "bag": ShardedEmbeddingBag(N, DIM, mode="sum"),
                               "head": nn.Linear(DIM, 1)})
        with torch.no_grad():
            model["head"].weight.fill_(0.5)
            model["head"].bias.zero_()
        dense = torch.optim.SGD(model["head"].parameters(), lr=0.1)
        dist = DistributedOptimizer(dense, model.named_parameters(), servers=shards.servers,
                                    model=model, worker_id="w0", sparse_optimizer=torch.optim.Adagrad(
                                        [model["emb"].handle, model["bag"].handle], lr=0.3))
        try:
            for step in range(4):
                g = torch.Generator().manual_seed(step)
                ids = (torch.randint(0, 1000, (6,), generator=g) * 7919).to(dtype)
                bag_ids = torch.randint(0, N, (9,), generator=g).to(dtype)
                dist.zero_grad()
                loss = (model["head"](model["emb"](ids)).pow(2).sum()
                        + model["head"](model["bag"](bag_ids, torch.tensor([0, 4], dtype=dtype))).sum())
                loss.backward()
                dist.step()
            state = model.state_dict()
            probe = torch.tensor([0, 7919, 12], dtype=dtype)
            with torch.no_grad():
                live = model["emb"](probe)
        finally:
            dist.close()
        local = shardps.local_model(model, state)
        with torch.no_grad():
            assert torch.equal(local["emb"](probe), live)
        states.append(state)
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), k


def test_merged_pulls_each_table_once_and_spreads_its_rows_back():
    parts = [("a", torch.tensor([1, 5, 9])), ("b", torch.tensor([2])), ("a", torch.tensor([0, 5]))]
    pulled, where = merged(parts)
    assert [name for name, _ in pulled] == ["a", "b"]
    assert torch.equal(pulled[0][1], torch.tensor([0, 1, 5, 9]))
    rows = [ids.float().unsqueeze(1) * 10 for _, ids in pulled]  # a row that names its id
    got = spread(rows, where)
    for (_, ids), r in zip(parts, got):
        assert torch.equal(r, ids.float().unsqueeze(1) * 10)
    assert got[1] is rows[1]  # a table pulled for one feature: its rows as they came

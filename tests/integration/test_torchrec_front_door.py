"""TorchRec's front door: its ``DLRM`` trains with a sharded collection in place of its ``EmbeddingBagCollection``.

``ShardedEmbeddingBagCollection(tables=[EmbeddingBagConfig, ...])`` goes where TorchRec's
``EmbeddingBagCollection(tables=...)`` went, and TorchRec's own ``DLRM`` takes it with no other change: a
``KeyedJaggedTensor`` batch (int32 ids and offsets, table ``t1`` shared by features ``f1`` and ``f3``) in,
a ``KeyedTensor`` out. Two workers (threads, each its own ``DistributedOptimizer``) and two real shard
processes train it in sync; one process trains the same ``DLRM`` with TorchRec's own collection, started
from the shards' initial rows, on both workers' batches: every table row and dense parameter within 1e-5.
The trained state then gives a local model (``shardps.local_model``) equal to the live one, bit for bit.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn
from torchrec import DataType, EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor, PoolingType
from torchrec.models.dlrm import DLRM

import shardps
from shardps.common.rows import initial_rows
from shardps.worker import DistributedOptimizer, ShardedEmbeddingBag, ShardedEmbeddingBagCollection
from shardps.worker.embedding.fused import KERNELS_ENV
from tests.support.forked import cluster_fixture
from tests.support.threads import run_workers

N1, N2, DIM, DENSE, B, STEPS, WORKERS = 60, 40, 8, 4, 6, 10, 2
ATOL = 1e-5


def configs() -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name="t1", embedding_dim=DIM, num_embeddings=N1, feature_names=["f1", "f3"]),
            EmbeddingBagConfig(name="t2", embedding_dim=DIM, num_embeddings=N2, feature_names=["f2"],
                               pooling=PoolingType.MEAN)]


def dlrm(sharded: bool) -> DLRM:
    """TorchRec's DLRM over the sharded collection, or over TorchRec's own holding the shards' initial rows; the
    dense layers drawn from one seed in both."""
    if sharded:
        collection = ShardedEmbeddingBagCollection(tables=configs())
    else:
        collection = EmbeddingBagCollection(tables=configs())
        with torch.no_grad():
            for config in collection.embedding_bag_configs():
                bound = math.sqrt(1 / config.num_embeddings)  # TorchRec's default init_fn: uniform(-bound, bound)
                collection.embedding_bags[config.name].weight.copy_(initial_rows(
                    config.name, torch.arange(config.num_embeddings), DIM, 0, 0.0, -1, "uniform", (-bound, bound)))
    torch.manual_seed(0)
    return DLRM(embedding_bag_collection=collection, dense_in_features=DENSE, dense_arch_layer_sizes=[16, DIM],
                over_arch_layer_sizes=[8, 1])


def batch(worker: int, step: int) -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
    """Worker ``worker``'s batch of ``step``: dense ``[B, DENSE]``, a KJT of int32 ids (bags of 0-3 ids; the two
    workers' ids overlap), labels ``[B]``."""
    g = torch.Generator().manual_seed(1000 * step + worker)
    lengths = torch.randint(0, 4, (3 * B,), generator=g, dtype=torch.int32)
    counts = lengths.view(3, B).sum(1).tolist()
    values = torch.cat([torch.randint(0, n, (c,), generator=g) for n, c in zip((N1, N2, N1), counts)])
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2", "f3"], values=values.to(torch.int32), lengths=lengths)
    return torch.randn(B, DENSE, generator=g), kjt, torch.randint(0, 2, (B,), generator=g).float()


def loss_of(model: DLRM, worker: int, step: int) -> torch.Tensor:
    dense, kjt, labels = batch(worker, step)
    return nn.functional.binary_cross_entropy_with_logits(model(dense, kjt).squeeze(1), labels)


def split(model: DLRM) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """SGD on the dense layers, Adagrad on the tables (the handles, or TorchRec's weights)."""
    tables = [p for n, p in model.named_parameters() if n.endswith(("handle", "weight")) and "sparse_arch" in n]
    dense = [p for n, p in model.named_parameters() if "sparse_arch" not in n]
    return torch.optim.SGD(dense, lr=0.1), torch.optim.Adagrad(tables, lr=0.05)


def oracle() -> DLRM:
    model = dlrm(sharded=False)
    dense, sparse = split(model)
    for step in range(STEPS):
        dense.zero_grad()
        sparse.zero_grad()
        (sum(loss_of(model, w, step) for w in range(WORKERS)) / WORKERS).backward()
        dense.step()
        sparse.step()
    return model


def train(servers: str, model: DLRM, worker: int, out: dict) -> None:
    dense, sparse = split(model)
    dist = DistributedOptimizer(dense, model.named_parameters(), servers=servers, model=model,
                                worker_id=f"w{worker}", sparse_optimizer=sparse)
    try:
        for step in range(STEPS):
            dist.zero_grad()
            loss_of(model, worker, step).backward()
            dist.step()
        dist.synchronize()
        if worker == 0:
            out["state"] = model.state_dict()
            dense_x, kjt, _ = batch(0, STEPS)
            with torch.no_grad():
                out["live"] = model(dense_x, kjt)
            out["kt"] = model.sparse_arch.embedding_bag_collection(kjt)
    finally:
        dist.close()


shards = cluster_fixture(2, min_workers=WORKERS)


@pytest.mark.parametrize("kernels", ["torch", "fbgemm"])
def test_torchrec_dlrm_with_the_sharded_collection_trains_as_one_process(shards, kernels, monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, kernels)  # the collection pools with FBGEMM's fused kernel, or per bag in torch
    shards.reset()
    models = [dlrm(sharded=True) for _ in range(WORKERS)]  # built here: torch.manual_seed is process-wide
    out: dict = {}
    run_workers(WORKERS, lambda w: train(shards.servers, models[w], w, out), timeout=240)
    want = oracle()
    initial = {k.split(".")[-2]: v for k, v in dlrm(sharded=False).state_dict().items() if "embedding_bags" in k}
    kt = out["kt"]
    assert isinstance(kt, KeyedTensor) and kt.keys() == ["f1", "f3", "f2"] and kt.values().shape == (B, 3 * DIM)
    state, reference = out["state"], want.state_dict()
    prefix = "sparse_arch.embedding_bag_collection."
    for table, features in (("t1", ("f1", "f3")), ("t2", ("f2",))):
        ref = reference[f"{prefix}embedding_bags.{table}.weight"]
        for feature in features:  # a shared table is in the state under each of its features
            got = state[f"{prefix}bags.{feature}.weight"]
            assert torch.allclose(got, ref, atol=ATOL, rtol=0), (feature, (got - ref).abs().max())
        assert not torch.allclose(ref, initial[table], atol=1e-3, rtol=0), f"table {table} did not train"
    dense = {k: v for k, v in reference.items() if not k.startswith(prefix)}
    for k, v in dense.items():
        assert torch.allclose(state[k], v, atol=ATOL, rtol=0), (k, (state[k] - v).abs().max())
    local = shardps.local_model(dlrm(sharded=True), state)  # the trained DLRM without shards
    dense_x, kjt, _ = batch(0, STEPS)
    with torch.no_grad():
        assert torch.equal(local(dense_x, kjt), out["live"])


def test_a_weighted_collection_pools_as_torchrecs(shards):
    """is_weighted=True: the KJT's per-id weights scale the rows of a sum bag, as TorchRec's collection does."""
    shards.reset()
    tables = [EmbeddingBagConfig(name="w", embedding_dim=DIM, num_embeddings=N1, feature_names=["a", "b"])]
    coll = ShardedEmbeddingBagCollection(tables, is_weighted=True)
    ref = EmbeddingBagCollection(tables=tables, is_weighted=True)
    bound = math.sqrt(1 / N1)
    with torch.no_grad():
        ref.embedding_bags["w"].weight.copy_(initial_rows("w", torch.arange(N1), DIM, 0, 0.0, -1, "uniform",
                                                          (-bound, bound)))
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["a", "b"], values=torch.tensor([3, 7, 7, 1, 59, 0], dtype=torch.int64),
        lengths=torch.tensor([2, 0, 1, 1, 1, 1], dtype=torch.int32), weights=torch.tensor([.5, 2, 1, -1, 3, .25]))
    x = nn.Parameter(torch.zeros(1))  # the job's dense part: a sharded collection alone has none
    dist = DistributedOptimizer(torch.optim.SGD([x], lr=0.1), [("x", x)], servers=shards.servers, model=coll,
                                worker_id="w0", sparse_optimizer=torch.optim.Adagrad([coll.bags["a"].handle]))
    try:
        with torch.no_grad():
            got = coll(kjt)
    finally:
        dist.close()
    want = ref(kjt)
    assert got.keys() == want.keys() and torch.allclose(got.values(), want.values(), atol=1e-7, rtol=0)
    with pytest.raises(ValueError, match="is_weighted=True"):
        ShardedEmbeddingBagCollection(tables)(KeyedJaggedTensor.from_lengths_sync(
            keys=["a", "b"], values=kjt.values(), lengths=kjt.lengths(), weights=kjt.weights()))


# ------------------------------------------------------------------ configs the shards cannot hold: refused
@pytest.mark.parametrize("change, match", [
    (dict(pooling=PoolingType.NONE), "pooling NONE is not supported"),
    (dict(data_type=DataType.INT8), "data_type INT8 is not supported"),
    (dict(init_fn=lambda w: w.fill_(1)), "cannot run on the shards"),
])
def test_configs_the_shards_cannot_hold_are_refused_naming_what_to_use(change, match):
    with pytest.raises(ValueError, match=match):
        ShardedEmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=5,
                                                                 **change)])
    with pytest.raises(ValueError, match="Duplicate table name t"):
        ShardedEmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=5)] * 2)


def test_init_fns_become_the_shards_row_initialisers():
    make = functools.partial
    cases = [(None, ("uniform", -math.sqrt(1 / 5), math.sqrt(1 / 5))),
             (make(torch.nn.init.normal_, mean=0.5, std=0.1), ("normal", 0.5, 0.1)),
             (make(torch.nn.init.zeros_), ("zeros", ())), (make(torch.nn.init.constant_, val=2.0), ("constant", 2.0))]
    for init_fn, (kind, *args) in cases:
        coll = ShardedEmbeddingBagCollection(tables=[EmbeddingBagConfig(
            name="t", embedding_dim=4, num_embeddings=5, init_fn=init_fn)])
        bag = coll.bags["t"]
        assert bag.init == kind and bag.include_last_offset and bag.mode == "sum", (kind, bag.init)
        if kind != "zeros":
            assert bag.init_args == pytest.approx(tuple(args)), (kind, bag.init_args)


def test_a_collection_of_bags_describes_itself_as_configs():
    user = ShardedEmbeddingBag(10, 4, mode="sum", name="user")
    coll = ShardedEmbeddingBagCollection({"user": user, "friend": user, "item": ShardedEmbeddingBag(7, 4, name="i")})
    got = {(c.name, tuple(c.feature_names), c.num_embeddings, c.pooling) for c in coll.embedding_bag_configs()}
    assert got == {("user", ("user", "friend"), 10, PoolingType.SUM), ("i", ("item",), 7, PoolingType.MEAN)}
    assert not coll.is_weighted()
    with pytest.raises(ValueError, match="hashed"):
        ShardedEmbeddingBagCollection({"h": ShardedEmbeddingBag(None, 4)}).embedding_bag_configs()


def test_variable_batch_sizes_per_feature_are_refused():
    coll = ShardedEmbeddingBagCollection(tables=configs())
    kjt = KeyedJaggedTensor(keys=["f1", "f2", "f3"], values=torch.tensor([1, 2, 3]),
                            lengths=torch.tensor([1, 1, 1]), stride_per_key_per_rank=[[1], [1], [1]])
    with pytest.raises(ValueError, match="variable_stride_per_key"):
        coll(kjt)

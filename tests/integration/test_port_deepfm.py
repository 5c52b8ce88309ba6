"""Porting a library's recommender to shardps, end to end: DeepFM on MovieLens-100K, 2 workers x 2 shards.

The model is ``shardps.apps.deepfm.DeepFM``, written as a recommender
library writes it (plain ``nn.Embedding``/``nn.EmbeddingBag``: 7 tables, one
of them called for two fields, single ids and bags, a ``padding_idx``,
``per_sample_weights``). The port is what a user does:

- ``shardps.shard_embeddings(model, init=...)`` swaps the 7 tables in place;
- the library's one Adam becomes two over ``shardps.sharded_parameters(model)``
  (Adam on the tables runs as lazy Adam on the shards);
- the library's data loader is wrapped in ``shardps.prefetching``, so the
  trainer's loop stays the library's (no ``prefetch()`` call in it).

Two workers (threads, each its own ``DistributedOptimizer``) train 2
epochs on ``u1.base`` (rating >= 4 is a click), each its half of every
global batch, on two real shard processes. Checked:

- the state saved with ``model.state_dict()`` loaded into
  ``shardps.local_model`` answers exactly what the live sharded model answers
  on ``u1.test``, bit for bit;
- the test AUC is within 0.005 of the same model trained in one process by
  the library's own trainer with ``torch.optim.Adam`` on every parameter.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

import shardps
from shardps.apps import deepfm
from shardps.worker import DistributedOptimizer
from tests.support.forked import ForkedCluster

DATA = Path(os.environ.get("SHARDPS_MOVIELENS_DIR") or
            Path(__file__).resolve().parents[2].parent / "shared" / "data" / "ml-100k")
CONFIG = deepfm.DeepFMConfig()
EPOCHS, BATCH, LR, WORKERS = 2, 512, 1e-3, 2


def ported() -> deepfm.DeepFM:
    """The library's model with its tables on the shards, rows from the library's own distribution."""
    model = deepfm.DeepFM(CONFIG)
    tables = shardps.shard_embeddings(model, init=("normal", 0.0, CONFIG.init_std))
    assert sorted(tables) == sorted(deepfm.TABLES) and model.genre.padding_idx == 0
    return model


def ids_of(model):
    """The ids each table will look up in a batch (the one line the port adds to the trainer)."""
    def ids(b: deepfm.ClickBatch) -> dict:
        return {model.user: b.user, model.item: b.item, model.genre: [b.item_genres, b.user_genres],
                model.age: b.age, model.occupation: b.occupation, model.year: b.year,
                model.linear: deepfm.first_order_ids(b)}
    return ids


def train_worker(rank: int, servers: str, train, out: dict, done: threading.Barrier) -> None:
    model = ported()
    dense, handles = shardps.sharded_parameters(model)
    dist = DistributedOptimizer(torch.optim.Adam(dense, lr=LR), model.named_parameters(), servers=servers,
                                model=model, worker_id=f"w{rank}",
                                sparse_optimizer=torch.optim.Adam(handles, lr=LR))
    loss_fn = torch.nn.BCEWithLogitsLoss()
    try:
        for epoch in range(EPOCHS):
            loader = deepfm.iterate_batches(train, BATCH, seed=0, epoch=epoch, rank=rank, world=WORKERS)
            for batch in shardps.prefetching(loader, dist, ids_of(model)):  # the library's loop, unchanged
                dist.zero_grad()
                loss_fn(model(batch), batch.label).backward()
                dist.step()
        dist.synchronize()
        if rank == 0:
            out["state"] = model.state_dict()
            out["live"] = deepfm.predict(model, out["test"])
            out["model"] = model
            out["prefetches"] = dict(dist.tables.prefetches)
        done.wait(timeout=120)
    finally:
        dist.close()


def one_process(train) -> deepfm.DeepFM:
    """The library's trainer on the same model, starting from the same rows, Adam on every parameter."""
    reference = deepfm.DeepFM(CONFIG)
    start = ported()
    with torch.no_grad():
        for name in deepfm.TABLES:
            table = getattr(start, name)
            getattr(reference, name).weight.copy_(table.spec().initial_rows(torch.arange(table.num_embeddings)))
    assert not reference.genre.weight[0].any()
    deepfm.train_one_process(reference, train, epochs=EPOCHS, batch_size=BATCH, seed=0,
                             dense_optimizer=torch.optim.Adam(reference.parameters(), lr=LR))
    return reference


@pytest.mark.timeout(600)
def test_a_ported_deepfm_trains_saves_and_serves_like_the_library_model():
    train, test = deepfm.load_movielens_clicks(DATA)
    out, errors = {"test": test}, []
    done = threading.Barrier(WORKERS)
    with ForkedCluster(2, min_workers=WORKERS) as cluster:
        def run(rank: int) -> None:
            try:
                train_worker(rank, cluster.servers, train, out, done)
            except BaseException as exc:  # reported below
                errors.append(exc)
                done.abort()

        threads = [threading.Thread(target=run, args=(r,)) for r in range(WORKERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=480)
        assert not any(t.is_alive() for t in threads), "a worker hung"
    assert not errors, errors
    steps = EPOCHS * -(-len(train) // BATCH)
    assert out["prefetches"] == {"used": steps - EPOCHS, "dropped": 0, "pulled_again": 0}, out["prefetches"]

    local = shardps.local_model(out["model"], out["state"])
    assert torch.equal(deepfm.predict(local, test), out["live"]), "the local model answers otherwise"

    sharded_auc = deepfm.roc_auc(out["live"], test.label)
    reference_auc = deepfm.auc(one_process(train), test)
    print(f"test AUC: shardps 2x2 {sharded_auc:.4f}, one process {reference_auc:.4f}")
    assert sharded_auc > 0.7
    assert abs(sharded_auc - reference_auc) <= 0.005, (sharded_auc, reference_auc)

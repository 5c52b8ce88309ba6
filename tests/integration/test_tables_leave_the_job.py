"""A recommender model's tables leave the job: ``state_dict()``, the local model, eval on a live job, after close.

One worker trains bounded and hashed tables (``ShardedEmbedding``,
``ShardedEmbeddingBag`` with ``padding_idx`` and ``mode="mean"``) on two real
shard processes. Then:

- ``model.state_dict()`` holds every table (bounded: ``weight``; hashed:
  sorted ``ids`` + ``rows``), never the empty ``handle``;
- ``shardps.local_model`` of that state (in memory, ``torch.save``d, and
  safetensors) answers exactly what the live sharded model answers, bit for
  bit, hashed ids never trained included (their initial rows), and so does
  its ``torch.jit.trace`` at another batch size;
- an eval forward (``model.eval()`` + ``torch.no_grad()``) on the live job
  reads rows without making any and pushes nothing (the shards' table metrics
  and sparse rounds do not move);
- after ``close()`` a forward and ``state_dict()`` say the job is closed and
  name ``shardps.local_model``; loading a state into the sharded model raises,
  naming it too;
- a data loader wrapped in ``shardps.prefetching`` trains bit for bit as the
  plain loop does, its lookups served by the prefetches.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import shardps
from shardps.worker import DistributedOptimizer, ShardedEmbedding, ShardedEmbeddingBag
from shardps.worker.embedding.local import HashedEmbedding, HashedEmbeddingBag
from tests.support.forked import ForkedCluster
from tests.support.prom import scrape, value

STEPS = 6


class Rec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user = ShardedEmbedding(30, 4)  # bounded
        self.genres = ShardedEmbeddingBag(12, 4, mode="mean", padding_idx=0)  # bounded, a padded bag
        self.item = ShardedEmbedding(None, 4, init=("normal", 0.0, 0.3))  # hashed
        self.tags = ShardedEmbeddingBag(None, 4, mode="sum", padding_idx=7)  # hashed bag, padding id 7
        self.head = nn.Linear(16, 1)

    def forward(self, b: dict) -> torch.Tensor:
        x = torch.cat([self.user(b["user"]), self.genres(b["genres"]), self.item(b["item"]),
                       self.tags(b["tags"], b["offsets"])], dim=1)
        return self.head(x).squeeze(1)


def batch(step: int, n: int = 8, item_range: int = 1000) -> dict:
    g = torch.Generator().manual_seed(step)
    genres = torch.randint(0, 12, (n, 3), generator=g)
    genres[0] = 0  # a bag of padding only
    tags = torch.randint(0, 40, (2 * n,), generator=g) * 1_000_003
    tags[1] = 7
    return {"user": torch.randint(0, 30, (n,), generator=g), "genres": genres,
            "item": torch.randint(0, item_range, (n,), generator=g) * 7919 - 3_000_000, "tags": tags,
            "offsets": torch.arange(0, 2 * n, 2), "y": torch.randn(n, generator=g),
            "genres2": torch.randint(0, 12, (2 * n,), generator=g)}  # a second field of `genres` (TwoFields)


class TwoFields(Rec):
    """``Rec`` whose padded bag table ``genres`` is called for a second field too (as a DeepFM's genre table)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(20, 1)

    def forward(self, b: dict) -> torch.Tensor:
        x = torch.cat([self.user(b["user"]), self.genres(b["genres"]), self.item(b["item"]),
                       self.tags(b["tags"], b["offsets"]), self.genres(b["genres2"], b["offsets"])], dim=1)
        return self.head(x).squeeze(1)


def features(b: dict) -> tuple:
    return b["user"], b["genres"], b["item"], b["tags"], b["offsets"]


@pytest.fixture(scope="module")
def shards():
    with ForkedCluster(2, extra_args=("--metrics-port", "0")) as cluster:
        yield cluster


def reset(cluster: ForkedCluster) -> None:
    cluster.reset()


def start(cluster, model: Rec) -> DistributedOptimizer:
    torch.manual_seed(0)
    model.head.reset_parameters()
    dense, handles = shardps.sharded_parameters(model)
    return DistributedOptimizer(torch.optim.Adam(dense, lr=0.01), model.named_parameters(), servers=cluster.servers,
                                model=model, sparse_optimizer=torch.optim.Adagrad(handles, lr=0.1))


def train(model: Rec, dist: DistributedOptimizer, loader) -> None:
    for b in loader:
        dist.zero_grad()
        nn.functional.mse_loss(model(b), b["y"]).backward()
        dist.step()
    dist.synchronize()


def test_the_local_model_answers_what_the_live_model_answers_bit_for_bit(shards, tmp_path):
    reset(shards)
    model = Rec()
    dist = start(shards, model)
    try:
        train(model, dist, [batch(s) for s in range(STEPS)])
        state = model.state_dict()
        # unseen hashed ids (a range never trained) read their initial rows, live and local
        test = batch(100, n=32, item_range=2000)
        model.eval()
        with torch.no_grad():
            live = model(test)
            live_other = model(batch(101, n=5, item_range=3000))
        model.train()
    finally:
        dist.close()
    assert "user.handle" not in state and set(state) == {
        "user.weight", "genres.weight", "item.ids", "item.rows", "tags.ids", "tags.rows", "head.weight", "head.bias"}
    assert state["user.weight"].shape == (30, 4) and state["genres.weight"].shape == (12, 4)
    assert not state["genres.weight"][0].any(), "the padding row reads as zeros"
    ids = state["item.ids"]
    assert ids.dtype == torch.int64 and bool((ids[1:] > ids[:-1]).all()) and state["item.rows"].shape == (len(ids), 4)
    assert 7 not in state["tags.ids"].tolist(), "the padding id is never a trained row"

    torch.save(state, tmp_path / "state.pt")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "state.safetensors"))
    for source in (state, tmp_path / "state.pt", tmp_path / "state.safetensors"):
        local = shardps.local_model(model, source).eval()
        assert isinstance(local.item, HashedEmbedding) and isinstance(local.tags, HashedEmbeddingBag)
        assert type(local.user) is nn.Embedding and type(local.genres) is nn.EmbeddingBag
        with torch.no_grad():
            assert torch.equal(local(test), live)
    traced = torch.jit.trace(local, (test,), strict=False)  # a dict input: traced through its tensors
    with torch.no_grad():
        assert torch.equal(traced(batch(101, n=5, item_range=3000)), live_other)  # another batch size, other ids
    unseen = torch.tensor([-5, 2**62, 123])
    assert torch.equal(local.item(unseen), model.item.spec().initial_rows(unseen))


def test_eval_on_a_live_job_makes_no_rows_and_pushes_nothing(shards):
    reset(shards)
    model = Rec()
    dist = start(shards, model)

    def counters() -> dict:
        samples = [scrape(ep["metrics"]) for ep in shards.endpoints]
        out = {}
        for name in ("rows", "rows_pushed_total", "admitted_total"):
            out[name] = sum(value(s, f"shardps_shard_table_{name}", shard=i, table="item")
                            for i, s in enumerate(samples))
        out["rounds"] = sum(value(s, "shardps_shard_sparse_rounds_total", shard=i) for i, s in enumerate(samples))
        return out

    try:
        train(model, dist, [batch(s) for s in range(3)])
        rows_before = dist.tables.export("item")  # first: the last step's rows applied (step() hands them off)
        before = counters()
        model.eval()
        with torch.no_grad():
            for s in range(5):
                model(batch(200 + s, item_range=5000))  # ids never trained
        with torch.no_grad():
            unseen = torch.tensor([99_999_999])
            assert torch.equal(model.item(unseen), model.item.spec().initial_rows(unseen))
        model.train()
        after, rows_after = counters(), dist.tables.export("item")
        assert before == after, (before, after)
        assert torch.equal(rows_before.ids, rows_after.ids) and torch.equal(rows_before.weights, rows_after.weights)
        assert before["rows"] == rows_before.ids.numel() > 0
    finally:
        dist.close()


def test_a_closed_job_says_how_to_evaluate_and_loading_rows_into_shards_is_refused(shards):
    reset(shards)
    model = Rec()
    with pytest.raises(RuntimeError, match="not attached to shards yet"):
        model.state_dict()
    dist = start(shards, model)
    try:
        train(model, dist, [batch(0)])
        state = model.state_dict()
        with pytest.raises(RuntimeError, match="shardps.local_model"):
            model.load_state_dict(state)
        with pytest.raises(RuntimeError, match="user.weight"):  # strict: the tables' keys are missing
            model.load_state_dict({k: v for k, v in state.items() if k.startswith("head.")})
    finally:
        dist.close()
    with pytest.raises(RuntimeError, match="DistributedOptimizer was closed.*shardps.local_model"):
        model(batch(0))
    with pytest.raises(RuntimeError, match="DistributedOptimizer was closed"):
        model.state_dict()
    local = shardps.local_model(model, state)  # the state saved before close() still makes the local model
    assert torch.equal(local.user.weight, state["user.weight"])


def plain_and_prefetching(shards, edit=lambda b: b, make=Rec) -> list[tuple[dict, dict]]:
    """``(state_dict, prefetch counts)`` after STEPS steps of the plain loop, then of the loop over a prefetching
    loader; the trainer passes each batch through ``edit`` before its forward."""
    results = []
    for prefetch in (False, True):
        reset(shards)
        model = make()
        dist = start(shards, model)
        try:
            loader = [batch(s) for s in range(STEPS)]
            if prefetch:
                genres = (lambda b: [b["genres"], b["genres2"]]) if make is TwoFields else (lambda b: b["genres"])
                loader = shardps.prefetching(loader, dist, lambda b: {model.user: b["user"], model.genres: genres(b),
                                                                      "item": b["item"], model.tags: b["tags"]})
            train(model, dist, (edit(b) for b in loader))
            results.append((model.state_dict(), dict(dist.tables.prefetches)))
        finally:
            dist.close()
    return results


def test_a_prefetching_loader_trains_bit_for_bit_as_the_plain_loop(shards):
    (plain, _), (fetched, counts) = plain_and_prefetching(shards)
    assert counts == {"used": STEPS - 1, "dropped": 0, "pulled_again": 0}, counts
    for k in plain:
        assert torch.equal(plain[k], fetched[k]), k


def test_a_table_called_for_two_fields_reuses_the_loaders_lookups_and_trains_bit_for_bit(shards, monkeypatch):
    """A padded bag table called for two fields (ids_of gives it both tensors): each lookup reuses what the
    loader made of its own tensor (no second check or sort of the ids: counted), the padding id included, and
    training equals the plain loop bit for bit."""
    checks = []
    real = ShardedEmbeddingBag.check_lookup

    def counted(self, ids):
        checks.append(self.name)
        return real(self, ids)

    monkeypatch.setattr(ShardedEmbeddingBag, "check_lookup", counted)
    (plain, _), (fetched, counts) = plain_and_prefetching(shards, make=TwoFields)
    # the plain loop checks both fields' ids at every step; the prefetching loop only the first batch's (no step
    # before it to prefetch it during)
    assert checks.count("genres") == 2 * STEPS + 2, checks
    assert counts == {"used": STEPS - 1, "dropped": 0, "pulled_again": 0}, counts
    for k in plain:
        assert torch.equal(plain[k], fetched[k]), k


def test_ids_edited_after_the_loader_gave_them_are_looked_up_as_edited(shards):
    """A lookup reuses what the prefetching loader made of a tensor's ids only while the tensor is unedited: a
    trainer that edits the batch's ids in place trains as the plain loop on the edited ids, bit for bit, also
    where the edit went round autograd's version counter (through a NumPy view of the tensor)."""
    def edited(b: dict) -> dict:
        b["user"][:3] = 29 - b["user"][:3]  # in place: the tensor ids_of saw, edited after it saw it
        b["item"].add_(7919)
        version = b["genres"]._version
        b["genres"].numpy()[1:, 0] = 11 - b["genres"].numpy()[1:, 0]  # unseen by the version counter
        assert b["genres"]._version == version
        return b

    (plain, _), (fetched, _) = plain_and_prefetching(shards, edited)
    for k in plain:
        assert torch.equal(plain[k], fetched[k]), k


@pytest.mark.gpu
def test_the_local_model_runs_on_cuda_as_on_the_cpu():
    """No shard needed: a state made here, loaded into the local model on the CPU and on CUDA (initial rows of
    unseen hashed ids are computed on the device; float32 sums may differ in the last bit on the GPU)."""
    model = Rec()
    g = torch.Generator().manual_seed(0)
    state = {"user.weight": torch.randn(30, 4, generator=g), "genres.weight": torch.randn(12, 4, generator=g),
             "item.ids": torch.arange(0, 4000, 7) * 7919 - 3_000_000, "tags.ids": torch.arange(0, 40, 3) * 1_000_003,
             "head.weight": torch.randn(1, 16, generator=g), "head.bias": torch.zeros(1)}
    state["genres.weight"][0] = 0
    state["item.rows"] = torch.randn(len(state["item.ids"]), 4, generator=g)
    state["tags.rows"] = torch.randn(len(state["tags.ids"]), 4, generator=g)
    cpu = shardps.local_model(model, state).eval()
    cuda = shardps.local_model(model, state).eval().to("cuda")
    b = batch(300, n=64, item_range=2000)
    with torch.no_grad():
        want = cpu(b)
        got = cuda({k: v.to("cuda") for k, v in b.items()}).cpu()
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()

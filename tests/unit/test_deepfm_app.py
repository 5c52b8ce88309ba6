"""``shardps.apps.deepfm``: the plain-PyTorch DeepFM "library model", its MovieLens-100K clicks and trainer.

The data is read in place from ``shared/data/ml-100k`` in the folder that holds this checkout, or from
``$SHARDPS_MOVIELENS_DIR`` (as ``tests/integration/test_movielens.py``; never copied, never skipped).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from shardps.apps import deepfm
from shardps.apps.deepfm import ClickBatch, DeepFM, DeepFMConfig

DATA = Path(os.environ.get("SHARDPS_MOVIELENS_DIR") or
            Path(__file__).resolve().parents[2].parent / "shared" / "data" / "ml-100k")


@pytest.fixture(scope="module")
def clicks():
    assert (DATA / "u1.base").is_file(), f"MovieLens-100K is expected at {DATA}"
    return deepfm.load_movielens_clicks(DATA)


def _tables(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}


def _same(a: ClickBatch, b: ClickBatch) -> None:
    for field in dataclasses.fields(ClickBatch):
        x, y = getattr(a, field.name), getattr(b, field.name)
        assert x.dtype == y.dtype and torch.equal(x, y), field.name


def test_the_model_has_seven_bounded_plain_tables_one_of_them_padded() -> None:
    model = DeepFM()
    tables = _tables(model)
    assert list(tables) == list(deepfm.TABLES) and len(tables) == 7
    bags = {name for name, m in tables.items() if isinstance(m, nn.EmbeddingBag)}
    assert bags == {"genre", "linear"}
    assert all(type(m) in (nn.Embedding, nn.EmbeddingBag) for m in tables.values())
    assert [name for name, m in tables.items() if m.padding_idx is not None] == ["genre"]
    assert tables["genre"].padding_idx == 0 and torch.all(tables["genre"].weight[0] == 0)
    assert tables["genre"].mode == "mean" and tables["linear"].mode == "sum"
    assert {name: m.num_embeddings for name, m in tables.items()} == {
        "user": 944, "item": 1683, "genre": 20, "age": 7, "occupation": 21, "year": 80, "linear": 2775}
    assert not any(m.sparse for m in tables.values())
    assert all(m.sparse for m in _tables(DeepFM(DeepFMConfig(sparse=True))).values())
    assert "shardps" not in inspect.getsource(DeepFM)
    assert len(model.table_parameters()) == 7
    assert len(model.table_parameters()) + len(model.dense_parameters()) == len(list(model.parameters()))
    for a, b in zip(DeepFM().parameters(), model.parameters()):
        assert torch.equal(a, b)  # the seed fixes the initial values
    with pytest.raises(ValueError, match="dropout"):
        DeepFMConfig(dropout=1.0)


def test_one_table_serves_two_fields_each_other_one_field(clicks) -> None:
    train, _ = clicks
    model = DeepFM()
    calls: dict[str, list[tuple]] = {name: [] for name in deepfm.TABLES}
    for name, table in _tables(model).items():
        table.register_forward_hook(lambda m, args, kwargs, out, name=name: calls[name].append((args, out, kwargs)),
                                    with_kwargs=True)
    batch = train.take(torch.arange(64))
    logits = model(batch)
    assert logits.shape == (64,) and logits.dtype == torch.float32
    assert {name: len(c) for name, c in calls.items()} == {name: 2 if name == "genre" else 1 for name in calls}
    (padded,), _, _ = calls["genre"][0]
    assert padded.shape == (64, deepfm.MAX_GENRES) and (padded == 0).any()  # 2-D, padded with padding_idx
    (flat, offsets), _, _ = calls["genre"][1]
    assert flat.dim() == 1 and offsets.shape == (64,)  # 1-D ids with offsets
    (ids, offsets), _, kwargs = calls["linear"][0]
    assert ids.dim() == 1 and offsets.shape == (64,) and ids.max() < deepfm.LINEAR_SIZE
    assert kwargs["per_sample_weights"].shape == ids.shape  # 1 for single ids, 1/n for the n genres of a bag
    for name in ("user", "item", "age", "occupation", "year"):
        (single,), out, _ = calls[name][0]
        assert single.shape == (64,) and single.dtype == torch.int64 and out.shape == (64, 16)
    # sample 0's first-order term: its single ids' weights plus the mean weight of each genre field
    w, starts = model.linear.weight[:, 0], deepfm.LINEAR_STARTS
    user_genres = batch.user_genres[:int(batch.user_genre_offsets[1])]
    genres = batch.item_genres[0][batch.item_genres[0] > 0]
    expected = (sum(w[int(getattr(batch, f)[0]) + s] for f, s in zip(("user", "item", "age", "occupation", "year"),
                                                                     starts))
                + w[genres + starts[5]].mean() + w[user_genres + starts[6]].mean())
    assert torch.allclose(calls["linear"][0][1][0, 0], expected)
    # the mean of a padded bag is the mean of its genres only
    row = model.genre.weight[batch.item_genres[0][batch.item_genres[0] > 0]].mean(0)
    assert torch.allclose(calls["genre"][0][1][0], row)


def test_the_clicks_load_with_their_features(clicks) -> None:
    train, test = clicks
    assert (len(train), len(test)) == (80000, 20000)
    assert abs(float(train.label.mean()) - 0.55175) < 1e-6 and set(train.label.unique().tolist()) == {0.0, 1.0}
    batch = train.take(torch.arange(len(train)))
    sizes = {"user": 944, "item": 1683, "age": 7, "occupation": 21, "year": 80, "item_genres": 20, "user_genres": 20}
    for name, size in sizes.items():
        ids = getattr(batch, name)
        assert ids.dtype == torch.int64 and 0 <= int(ids.min()) and int(ids.max()) < size, name
    assert batch.item_genres.shape[1] == deepfm.MAX_GENRES and (batch.item_genres[:, 0] > 0).all()
    assert batch.user_genres.min() > 0 and batch.label.dtype == torch.float32
    assert train[0]["item_genres"].tolist() == [4, 5, 6, 0, 0, 0]  # Toy Story: animation, children's, comedy
    assert test.user_genres is train.user_genres  # the favourite genres come from u1.base only


def test_collate_and_a_data_loader_give_the_batches_of_iterate_batches(clicks) -> None:
    train, _ = clicks
    indices = torch.tensor([5, 0, 79999, 123, 123])
    _same(deepfm.collate([train[int(i)] for i in indices]), train.take(indices))
    parts = [p.tolist() for p in deepfm.batch_indices(len(train), 1000, seed=3, epoch=2)]
    loader = torch.utils.data.DataLoader(train, batch_sampler=parts, collate_fn=deepfm.collate)
    for count, (a, b) in enumerate(zip(loader, deepfm.iterate_batches(train, 1000, seed=3, epoch=2))):
        _same(a, b)
        if count == 3:
            break
    with pytest.raises(ValueError):
        deepfm.collate([])


@pytest.mark.parametrize("world", [2, 3])
def test_the_ranks_slices_in_order_make_up_the_global_batch(clicks, world) -> None:
    train, _ = clicks
    batch_size = 7001  # not a multiple of world, nor of 80000: a short last batch
    whole = list(deepfm.iterate_batches(train, batch_size, seed=1, epoch=4))
    ranks = [list(deepfm.iterate_batches(train, batch_size, seed=1, epoch=4, rank=r, world=world))
             for r in range(world)]
    assert len(whole) == 12 and all(len(r) == len(whole) for r in ranks)
    for step, batch in enumerate(whole):
        parts = [r[step] for r in ranks]
        assert max(len(p) for p in parts) - min(len(p) for p in parts) <= 1
        for field in ("user", "item", "age", "occupation", "year", "item_genres", "user_genres", "label"):
            assert torch.equal(torch.cat([getattr(p, field) for p in parts]), getattr(batch, field)), field
    order = torch.cat([torch.cat(p) for p in zip(*[deepfm.batch_indices(80000, batch_size, seed=1, epoch=4, rank=r,
                                                                         world=world) for r in range(world)])])
    assert torch.equal(order.sort().values, torch.arange(80000))  # every sample once an epoch
    other = next(deepfm.batch_indices(80000, batch_size, seed=1, epoch=5))
    assert not torch.equal(other, next(deepfm.batch_indices(80000, batch_size, seed=1, epoch=4)))
    with pytest.raises(ValueError, match="rank"):
        next(deepfm.batch_indices(10, 4, rank=2, world=2))


def test_the_last_parts_may_be_empty_and_the_model_takes_them(clicks) -> None:
    train, _ = clicks
    parts = [list(deepfm.iterate_batches(train, 79999, shuffle=False, rank=r, world=2)) for r in range(2)]
    assert [len(p[-1]) for p in parts] == [1, 0]
    assert DeepFM()(parts[1][-1]).shape == (0,)
    assert len(list(deepfm.iterate_batches(train, 79999, drop_last=True))) == 1


def test_roc_auc_equals_sklearns_with_ties() -> None:
    from sklearn.metrics import roc_auc_score

    generator = torch.Generator().manual_seed(0)
    for n in (2, 17, 1000, 20000):
        labels = torch.randint(0, 2, (n,), generator=generator).float()
        labels[:2] = torch.tensor([0.0, 1.0])
        scores = torch.randint(0, max(n // 10, 2), (n,), generator=generator).float() + labels * 0.5 * (n % 3)
        assert abs(deepfm.roc_auc(scores, labels) - roc_auc_score(labels.numpy(), scores.numpy())) < 1e-6
    assert deepfm.roc_auc(torch.ones(4), torch.tensor([0.0, 1.0, 0.0, 1.0])) == 0.5
    with pytest.raises(ValueError, match="both classes"):
        deepfm.roc_auc(torch.rand(5), torch.ones(5))


def test_the_data_files_are_checked(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="grouplens.org/datasets/movielens/100k"):
        deepfm.load_movielens_clicks(tmp_path)
    for name in ("u1.base", "u1.test", "u.item"):
        (tmp_path / name).symlink_to(DATA / name)  # read in place, never copied
    with pytest.raises(FileNotFoundError, match="u.user"):
        deepfm.load_movielens_clicks(tmp_path)
    (tmp_path / "u.user").write_text("1|24|M|technician|85711\n")
    with pytest.raises(ValueError, match="not MovieLens-100K's"):
        deepfm.load_movielens_clicks(tmp_path)


@pytest.mark.parametrize("sparse", [False, True])
def test_one_epoch_in_one_process_beats_chance_by_far(clicks, sparse) -> None:
    train, test = clicks
    model = DeepFM(DeepFMConfig(sparse=sparse))
    if sparse:  # the tables' sparse gradients go to SparseAdam, the rest to Adam
        dense = torch.optim.Adam(model.dense_parameters(), lr=1e-3)
        tables = torch.optim.SparseAdam(model.table_parameters(), lr=1e-3)
    else:  # a library model: Adam on everything
        dense, tables = torch.optim.Adam(model.parameters(), lr=1e-3), None
    start = time.perf_counter()
    result = deepfm.train_one_process(model, train, epochs=1, batch_size=512, dense_optimizer=dense,
                                      sparse_optimizer=tables, seed=0)
    score = deepfm.auc(model, test)
    print(f"sparse={sparse}: test AUC {score:.4f}, {result['samples_per_s']:.0f} samples/s, "
          f"{time.perf_counter() - start:.1f} s")
    assert result["steps"] == 157 and result["samples"] == 80000
    assert result["epoch_losses"][0] < 0.66
    assert score > 0.65

"""A DeepFM click model on MovieLens-100K, written as a plain-PyTorch recommender library writes it.

The model (Guo et al., "DeepFM: a factorization-machine based neural network for CTR prediction",
IJCAI 2017) sums a first-order term, the FM's pairwise interactions of the field vectors and a deep
MLP over the concatenated field vectors. :class:`DeepFM` uses only ``torch.nn`` (nothing of shardps):
seven bounded tables (int64 ids, sizes fixed by the data), plain attributes of the model, meant to be
swapped for shardps' sharded ones:

- ``user`` ``nn.Embedding(944, dim)``, ``item`` (1683), ``age`` (7), ``occupation`` (21), ``year`` (80):
  one id per sample, ``[B]``;
- ``genre`` ``nn.EmbeddingBag(20, dim, mode="mean", padding_idx=0)``: one table for two fields, called
  twice: the item's genres ``[B, 6]`` padded with 0, and the user's favourite genres, flat with offsets;
- ``linear`` ``nn.EmbeddingBag(2775, 1, mode="sum")``: the first-order term, every field's ids shifted
  into one range (:data:`LINEAR_FIELDS`), with offsets and ``per_sample_weights`` (1/n on n genres).

Data: :func:`load_movielens_clicks` reads ``u1.base`` (train) and ``u1.test`` (test) with ``u.user``
and ``u.item`` from the ``ml-100k`` folder (SHA-256 checked; never copied: the licence forbids it).
The label is a "click": 1.0 when the rating is >= 4 (55% of ``u1.base``). A user's favourite genres
are the (at most 3) genres making >= 10% of the genre tags of the items they rated in ``u1.base``.

Batches: :func:`iterate_batches` (or a ``DataLoader`` with ``batch_sampler`` from
:func:`batch_indices` and ``collate_fn=collate``) gives global batches in a ``(seed, epoch)`` order;
with ``rank``/``world`` each worker gets its contiguous slice (``torch.tensor_split``), and the slices in
rank order make up the global batch. :func:`train_one_process` is the library's trainer
(``BCEWithLogitsLoss``), :func:`auc` its evaluation (ROC AUC, ties at their average rank).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from shardps.apps import movielens

#: SHA-256 of every file read: the split's (``movielens.SHA256``) and the user and item files.
SHA256 = {**movielens.SHA256,
          "u.user": "f120e114da2e8cf314fd28f99417c94ae9ddf1cb6db8ce0e4b5995d40e90e62c",
          "u.item": "553841ebc7de3a0fd0d6b62a204ea30c1e651aacfb2814c7a6584ac52f2c5701"}

NUM_USERS, NUM_ITEMS = 944, 1683  # ids as in the files (1..943, 1..1682); row 0 unused
NUM_GENRES = 20  # 0 pads, 1..19 are u.item's 19 genre flags in order
NUM_AGES = 7  # <18, 18-24, 25-34, 35-44, 45-49, 50-55, 56+
AGE_BOUNDS = (18, 25, 35, 45, 50, 56)
NUM_OCCUPATIONS = 21  # u.user's occupations, sorted
NUM_YEARS = 80  # 0 unknown, 1..79 the release year clipped to [1920, 1998]
MAX_GENRES, MAX_USER_GENRES = 6, 3
#: Sizes of the first-order (``linear``) table's fields, in the order their ids are shifted into it.
LINEAR_FIELDS = {"user": NUM_USERS, "item": NUM_ITEMS, "age": NUM_AGES, "occupation": NUM_OCCUPATIONS,
                 "year": NUM_YEARS, "item_genres": NUM_GENRES, "user_genres": NUM_GENRES}
LINEAR_SIZE = sum(LINEAR_FIELDS.values())  # 2775
LINEAR_STARTS = tuple(sum(list(LINEAR_FIELDS.values())[:i]) for i in range(len(LINEAR_FIELDS)))
#: The model's table attributes; ``genre`` serves two fields.
TABLES = ("user", "item", "genre", "age", "occupation", "year", "linear")


@dataclass(frozen=True, kw_only=True)
class DeepFMConfig:
    """A :class:`DeepFM`'s shape and initialisation.

    Attributes:
        dim: values per field vector; mlp: the deep part's hidden sizes (ReLU), then a last ``Linear(., 1)``.
        init_std: field vectors and first-order weights start ``N(0, init_std)`` (padding row 0 at zero).
        dropout: after each hidden layer (0: none); seed: the parameters' initial values.
        sparse: build the tables with ``sparse=True`` (sparse gradients, for ``torch.optim.SparseAdam``,
            ``Adagrad`` or ``SGD`` on :meth:`DeepFM.table_parameters`); ``False`` is ``nn.Embedding``'s default.

    Raises:
        ValueError: a size < 1, ``init_std`` < 0 or ``dropout`` outside [0, 1).
    """

    dim: int = 16
    mlp: tuple[int, ...] = (64, 32)
    init_std: float = 0.01
    dropout: float = 0.0
    seed: int = 0
    sparse: bool = False

    def __post_init__(self) -> None:
        if self.dim < 1 or any(h < 1 for h in self.mlp):
            raise ValueError(f"dim and mlp sizes must be >= 1, got dim={self.dim} mlp={self.mlp}")
        if not self.init_std >= 0 or not 0 <= self.dropout < 1:
            raise ValueError(f"init_std must be >= 0 and dropout in [0, 1), got {self.init_std}, {self.dropout}")


@dataclass
class ClickBatch:
    """A batch of ``B`` (user, item) pairs; every id tensor is int64.

    Attributes:
        user, item, age, occupation, year: ``[B]`` single ids of their tables.
        item_genres: ``[B, MAX_GENRES]`` genre ids 1..19 of the item, padded with 0.
        user_genres: ``[N]`` the user's favourite genre ids (1..19), all samples' one after the other;
        user_genre_offsets: ``[B]`` each sample's start in ``user_genres`` (``nn.EmbeddingBag`` offsets).
        label: ``[B]`` float32, 1.0 for a click (rating >= 4).
    """

    user: torch.Tensor
    item: torch.Tensor
    age: torch.Tensor
    occupation: torch.Tensor
    year: torch.Tensor
    item_genres: torch.Tensor
    user_genres: torch.Tensor
    user_genre_offsets: torch.Tensor
    label: torch.Tensor

    def __len__(self) -> int:
        return self.user.numel()

    def to(self, device) -> ClickBatch:
        """The same batch with every tensor on ``device``."""
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)})


class DeepFM(nn.Module):
    """DeepFM over MovieLens' fields: ``forward(batch: ClickBatch) -> logits float32 [B]``.

    Seven tables (module docstring), a first-order bias and the MLP; ``genre`` is called twice per
    forward (item genres and the user's favourite genres). Tables are ``sparse=False`` (``nn.Embedding``'s
    default) unless ``config.sparse``; ids outside a table raise ``IndexError`` in torch.
    """

    def __init__(self, config: DeepFMConfig = DeepFMConfig()) -> None:
        super().__init__()
        self.config = config
        d = config.dim
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            sparse = config.sparse
            self.user = nn.Embedding(NUM_USERS, d, sparse=sparse)
            self.item = nn.Embedding(NUM_ITEMS, d, sparse=sparse)
            self.genre = nn.EmbeddingBag(NUM_GENRES, d, mode="mean", padding_idx=0, sparse=sparse)
            self.age = nn.Embedding(NUM_AGES, d, sparse=sparse)
            self.occupation = nn.Embedding(NUM_OCCUPATIONS, d, sparse=sparse)
            self.year = nn.Embedding(NUM_YEARS, d, sparse=sparse)
            self.linear = nn.EmbeddingBag(LINEAR_SIZE, 1, mode="sum", sparse=sparse)
            for name in TABLES:
                nn.init.normal_(getattr(self, name).weight, std=config.init_std)
            with torch.no_grad():
                self.genre.weight[0].zero_()
            self.bias = nn.Parameter(torch.zeros(()))
            layers, width = [], 7 * d
            for hidden in config.mlp:
                layers += [nn.Linear(width, hidden), nn.ReLU()]
                layers += [nn.Dropout(config.dropout)] if config.dropout else []
                width = hidden
            self.mlp = nn.Sequential(*layers, nn.Linear(width, 1))

    def table_parameters(self) -> list[nn.Parameter]:
        """The seven tables' weights (in :data:`TABLES` order); :meth:`dense_parameters` is the rest."""
        return [getattr(self, name).weight for name in TABLES]

    def dense_parameters(self) -> list[nn.Parameter]:
        """Every parameter that is not a table's weight: the first-order bias and the MLP's."""
        tables = {id(p) for p in self.table_parameters()}
        return [p for p in self.parameters() if id(p) not in tables]

    def forward(self, batch: ClickBatch) -> torch.Tensor:
        vectors = torch.stack([
            self.user(batch.user), self.item(batch.item),
            self.genre(batch.item_genres),  # [B, L] padded: the mean of the non-pad rows
            self.genre(batch.user_genres, batch.user_genre_offsets),  # the same table, a second field
            self.age(batch.age), self.occupation(batch.occupation), self.year(batch.year)], dim=1)  # [B, 7, d]
        ids, offsets, weights = self.first_order_bag(batch)
        first = self.bias + self.linear(ids, offsets, per_sample_weights=weights)[:, 0]
        second = 0.5 * (vectors.sum(1).pow(2) - vectors.pow(2).sum(1)).sum(1)
        deep = self.mlp(vectors.flatten(1))[:, 0]
        return first + second + deep

    def first_order_bag(self, batch: ClickBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ids [M], offsets [B], per_sample_weights [M])`` of the ``linear`` table: each sample's single
        ids (weight 1), then its item genres and its favourite genres (weight 1 / their count), every field
        shifted by its start in :data:`LINEAR_FIELDS`."""
        b, off = len(batch), torch.tensor(LINEAR_STARTS, device=batch.user.device)
        singles = torch.stack([batch.user, batch.item, batch.age, batch.occupation, batch.year], 1) + off[:5]
        user_lengths = torch.diff(batch.user_genre_offsets, append=batch.user_genre_offsets.new_tensor(
            [batch.user_genres.numel()]))
        owner = torch.repeat_interleave(torch.arange(b, device=singles.device), user_lengths)
        slot = torch.arange(batch.user_genres.numel(), device=singles.device) - batch.user_genre_offsets[owner]
        width = int(user_lengths.max()) if b else 0
        user_padded = singles.new_zeros((b, width)).index_put_((owner, slot), batch.user_genres)
        item_kept, user_kept = batch.item_genres > 0, user_padded > 0  # 0 pads
        matrix = torch.cat([singles, batch.item_genres + off[5], user_padded + off[6]], 1)
        count = torch.cat([torch.ones_like(singles), item_kept.sum(1, keepdim=True).expand_as(item_kept),
                           user_lengths[:, None].expand_as(user_kept)], 1)
        keep = torch.cat([torch.ones_like(singles, dtype=torch.bool), item_kept, user_kept], 1)
        lengths = keep.sum(1)
        offsets = torch.cumsum(lengths, 0) - lengths
        return matrix[keep], offsets, 1.0 / count[keep].float()


def first_order_ids(batch: ClickBatch) -> torch.Tensor:
    """The ids :meth:`DeepFM.first_order_bag` looks up in the ``linear`` table (int64, in another order, repeats
    kept): what a prefetching data loader needs, without building the bag."""
    off = LINEAR_STARTS
    singles = torch.stack([batch.user, batch.item, batch.age, batch.occupation, batch.year], 1)
    singles = singles + torch.tensor(off[:5], device=singles.device)
    genres = batch.item_genres[batch.item_genres > 0]
    return torch.cat([singles.reshape(-1), genres + off[5], batch.user_genres + off[6]])


class ClickDataset(torch.utils.data.Dataset):
    """The clicks of one file with their features: ``dataset[i]`` is one sample (a dict, see :func:`collate`),
    ``dataset.take(indices)`` a :class:`ClickBatch` (the same as ``collate`` of those samples, faster).

    Attributes:
        user, item: int64 ``[n]``; label: float32 ``[n]``; the per-user (``age``, ``occupation``
        ``[NUM_USERS]``, ``user_genres [NUM_USERS, MAX_USER_GENRES]`` 0-padded) and per-item (``year``
        ``[NUM_ITEMS]``, ``item_genres [NUM_ITEMS, MAX_GENRES]`` 0-padded) features.
    """

    def __init__(self, user, item, label, *, age, occupation, user_genres, year, item_genres) -> None:
        self.user, self.item, self.label = user, item, label
        self.age, self.occupation, self.user_genres = age, occupation, user_genres
        self.year, self.item_genres = year, item_genres

    def __len__(self) -> int:
        return self.user.numel()

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        u, it = self.user[i], self.item[i]
        genres = self.user_genres[u]
        return {"user": u, "item": it, "age": self.age[u], "occupation": self.occupation[u], "year": self.year[it],
                "item_genres": self.item_genres[it], "user_genres": genres[genres > 0], "label": self.label[i]}

    def take(self, indices: torch.Tensor) -> ClickBatch:
        """The samples at ``indices`` (int64 ``[B]``, any order) as one batch."""
        u, it = self.user[indices], self.item[indices]
        genres = self.user_genres[u]
        keep = genres > 0
        lengths = keep.sum(1)
        return ClickBatch(user=u, item=it, age=self.age[u], occupation=self.occupation[u], year=self.year[it],
                          item_genres=self.item_genres[it], user_genres=genres[keep],
                          user_genre_offsets=torch.cumsum(lengths, 0) - lengths, label=self.label[indices])


def collate(samples: list[dict[str, torch.Tensor]]) -> ClickBatch:
    """``DataLoader``'s ``collate_fn``: :class:`ClickDataset` samples -> a :class:`ClickBatch`.

    Raises:
        ValueError: ``samples`` is empty.
    """
    if not samples:
        raise ValueError("collate needs at least one sample")
    stack = {k: torch.stack([s[k] for s in samples]) for k in samples[0] if k != "user_genres"}
    lengths = torch.tensor([s["user_genres"].numel() for s in samples])
    return ClickBatch(**stack, user_genres=torch.cat([s["user_genres"] for s in samples]),
                      user_genre_offsets=torch.cumsum(lengths, 0) - lengths)


def check_files(data_dir: str | Path) -> dict[str, Path]:
    """The four files read, in ``data_dir``, their SHA-256 checked (the split by ``movielens.check_data``).

    Raises:
        FileNotFoundError: a file is missing (the message says where to get the data).
        ValueError: a file's SHA-256 is not MovieLens-100K's.
    """
    paths = movielens.check_data(str(data_dir))
    for name in ("u.user", "u.item"):
        path = paths[name] = Path(data_dir) / name
        if not path.is_file():
            raise FileNotFoundError(f"MovieLens-100K not found: {path} missing. Download ml-100k.zip from "
                                    f"{movielens.SOURCE} (its licence forbids redistribution) and unzip it")
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != SHA256[name]:
            raise ValueError(f"{path} has SHA-256 {digest}, not MovieLens-100K's {SHA256[name]}: a damaged or "
                             f"other file; download ml-100k.zip again from {movielens.SOURCE}")
    return paths


def load_movielens_clicks(data_dir: str | Path) -> tuple[ClickDataset, ClickDataset]:
    """``(train, test)``: ``u1.base`` and ``u1.test`` of ``data_dir`` (the ``ml-100k`` folder) as clicks.

    Raises:
        FileNotFoundError, ValueError: see :func:`check_files`.
    """
    paths = check_files(data_dir)
    users = [line.split("|") for line in paths["u.user"].read_text().splitlines() if line]
    jobs = sorted({u[3] for u in users})
    age, occupation = torch.zeros(NUM_USERS, dtype=torch.int64), torch.zeros(NUM_USERS, dtype=torch.int64)
    for u in users:
        age[int(u[0])] = sum(int(u[1]) >= bound for bound in AGE_BOUNDS)
        occupation[int(u[0])] = jobs.index(u[3])
    items = [line.split("|") for line in paths["u.item"].read_text(encoding="latin-1").splitlines() if line]
    year = torch.zeros(NUM_ITEMS, dtype=torch.int64)
    flags = torch.zeros(NUM_ITEMS, NUM_GENRES, dtype=torch.int64)
    for it in items:
        year[int(it[0])] = min(max(int(it[2][-4:]), 1920), 1998) - 1919 if it[2] else 0
        flags[int(it[0]), 1:] = torch.tensor([int(x) for x in it[5:24]])
    # each item's genre ids first (ascending), then zeros: a stable sort of "is not a genre"
    ranked = torch.sort((flags == 0).to(torch.int8), dim=1, stable=True).indices[:, :MAX_GENRES]
    item_genres = torch.where(flags.gather(1, ranked) > 0, ranked, 0)
    train_user, train_item, train_rating = movielens.load(paths["u1.base"])
    counts = torch.zeros(NUM_USERS, NUM_GENRES).index_add_(0, train_user, flags[train_item].float())
    top = torch.sort(counts, dim=1, descending=True, stable=True)
    liked = top.values[:, :MAX_USER_GENRES] >= (0.1 * counts.sum(1, keepdim=True)).clamp(min=1e-9)
    user_genres = torch.where(liked, top.indices[:, :MAX_USER_GENRES], 0)
    features = dict(age=age, occupation=occupation, user_genres=user_genres, year=year, item_genres=item_genres)
    test_user, test_item, test_rating = movielens.load(paths["u1.test"])
    return tuple(ClickDataset(user, item, (rating >= 4).float(), **features)
                 for user, item, rating in ((train_user, train_item, train_rating),
                                            (test_user, test_item, test_rating)))


def batch_indices(n: int, batch_size: int, *, seed: int = 0, epoch: int = 0, shuffle: bool = True,
                  rank: int = 0, world: int = 1, drop_last: bool = False) -> Iterator[torch.Tensor]:
    """Rank ``rank``'s part (int64 ``[<= ceil(batch_size / world)]``) of each global batch of ``batch_size``
    of ``range(n)``, in a permutation fixed by ``(seed, epoch)`` (or in order without ``shuffle``).

    A part is ``torch.tensor_split(global_batch, world)[rank]``: the parts in rank order are the
    global batch, and a part may be empty when the last batch is smaller than ``world``
    (``drop_last`` drops that last, short batch). As a DataLoader's ``batch_sampler``, pass
    ``[part.tolist() for part in batch_indices(...)]``.

    Raises:
        ValueError: ``batch_size`` or ``world`` < 1, ``rank`` outside ``[0, world)``, ``seed`` or ``epoch`` < 0.
    """
    if batch_size < 1 or world < 1 or not 0 <= rank < world or seed < 0 or epoch < 0:
        raise ValueError(f"need batch_size >= 1, 0 <= rank < world, seed and epoch >= 0; got "
                         f"batch_size={batch_size} rank={rank} world={world} seed={seed} epoch={epoch}")
    order = (torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
             if shuffle else torch.arange(n))
    stop = n - n % batch_size if drop_last else n
    for start in range(0, stop, batch_size):
        yield torch.tensor_split(order[start:start + batch_size], world)[rank]


def iterate_batches(data: ClickDataset, batch_size: int, **kwargs) -> Iterator[ClickBatch]:
    """``data.take`` of each part of :func:`batch_indices` (same keywords); a part may have 0 samples."""
    for indices in batch_indices(len(data), batch_size, **kwargs):
        yield data.take(indices)


def train_one_process(model: nn.Module, train: ClickDataset, *, epochs: int, batch_size: int,
                      dense_optimizer: torch.optim.Optimizer, sparse_optimizer: torch.optim.Optimizer | None = None,
                      seed: int = 0, on_step: Callable[[int, float], None] | None = None) -> dict:
    """The library's trainer: ``epochs`` passes of mean ``BCEWithLogitsLoss`` over shuffled batches of
    ``batch_size`` (epoch ``e`` in the order ``batch_indices(seed=seed, epoch=e)``); each step zeroes,
    steps both optimizers (``sparse_optimizer``: e.g. ``SparseAdam`` on ``sparse=True`` tables, or None).

    Returns: ``{"epoch_losses": [mean loss per epoch], "steps", "samples", "seconds", "samples_per_s"}``.
    """
    optimizers = [o for o in (dense_optimizer, sparse_optimizer) if o is not None]
    loss_fn = nn.BCEWithLogitsLoss()
    model.train()
    steps = samples = 0
    epoch_losses = []
    start = time.perf_counter()
    for epoch in range(epochs):
        total = 0.0
        for batch in iterate_batches(train, batch_size, seed=seed, epoch=epoch):
            for optimizer in optimizers:
                optimizer.zero_grad()
            loss = loss_fn(model(batch), batch.label)
            loss.backward()
            for optimizer in optimizers:
                optimizer.step()
            steps, samples, total = steps + 1, samples + len(batch), total + float(loss.detach()) * len(batch)
            if on_step is not None:
                on_step(steps, float(loss.detach()))
        epoch_losses.append(total / max(len(train), 1))
    seconds = time.perf_counter() - start
    return {"epoch_losses": epoch_losses, "steps": steps, "samples": samples, "seconds": seconds,
            "samples_per_s": samples / seconds if seconds > 0 else float("nan")}


@torch.no_grad()
def predict(model: nn.Module, data: ClickDataset, batch_size: int = 4096) -> torch.Tensor:
    """The model's logits (float32 ``[n]``) for every sample of ``data``, in order, in eval mode."""
    was_training = model.training
    model.eval()
    try:
        return torch.cat([model(b) for b in iterate_batches(data, batch_size, shuffle=False)]).float()
    finally:
        model.train(was_training)


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC AUC of ``scores`` (``[n]``, higher = more likely positive) for 0/1 ``labels`` (``[n]``):
    the Mann-Whitney U statistic, tied scores at their average rank (``sklearn.metrics.roc_auc_score``).

    Raises:
        ValueError: shapes differ, or ``labels`` do not hold both classes.
    """
    scores, labels = scores.detach().reshape(-1).double(), labels.detach().reshape(-1)
    if scores.shape != labels.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and labels {tuple(labels.shape)} differ")
    positive = labels > 0.5
    n_pos = int(positive.sum())
    n_neg = labels.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError(f"ROC AUC needs both classes, got {n_pos} positives and {n_neg} negatives")
    values, inverse, counts = torch.unique(scores, sorted=True, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    ranks = (ends - (counts.double() - 1) / 2)[inverse]  # 1-based average rank of each score
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def auc(model: nn.Module, test: ClickDataset, batch_size: int = 4096) -> float:
    """ROC AUC of ``model``'s logits on ``test``'s clicks (:func:`predict`, :func:`roc_auc`)."""
    return roc_auc(predict(model, test, batch_size), test.label)

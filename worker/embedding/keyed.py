"""TorchRec's front door: tables from ``EmbeddingBagConfig``s, a ``KeyedJaggedTensor`` in, a ``KeyedTensor`` out.

``ShardedEmbeddingBagCollection(tables=[EmbeddingBagConfig, ...], is_weighted=False)`` is built as
TorchRec's ``EmbeddingBagCollection(tables=..., is_weighted=...)`` is, and a model written for that
class (TorchRec's ``DLRM``) takes it in its place with no other change: ``forward(kjt)`` returns a
``KeyedTensor`` of ``[B, sum of dims]`` keyed as TorchRec keys it, and ``embedding_bag_configs()`` returns
the configs. What each config field becomes on the shards (the rest is not read):

- ``name``: the table's name on the shards; ``num_embeddings``: a bounded table (ids in ``[0, N)``);
  ``embedding_dim``; ``feature_names`` (none: the table's name): every feature is looked up in the table,
  and a table several features share is pulled once per step for the union of their ids;
- ``pooling``: ``SUM`` or ``MEAN`` (``NONE`` is refused: sequence embeddings are not bags);
- ``data_type``: ``FP32``, or ``FP16`` (rows stored and sent as float16, ``ShardedTable(dtype=)``; other
  types are refused);
- ``init_fn``: TorchRec's default, uniform in ``[weight_init_min, weight_init_max]``, or a
  ``functools.partial`` of ``torch.nn.init.uniform_``/``normal_``/``zeros_``/``constant_``: the rows start
  from that distribution, drawn on the shards as a function of (table, id, seed) (``shardps.common.rows``),
  so they are not torch's draws. Any other ``init_fn`` is refused: the shards cannot run it.

The batch is TorchRec's: ``kjt.to_dict()``'s jagged values (int32 or int64 ids), B + 1 offsets per
feature, and the per-id weights when ``is_weighted``. Features with variable batch sizes per key
(``variable_stride_per_key``) are refused. Importing this module does not import torchrec; building a
collection from configs, or returning a ``KeyedTensor``, needs it installed (``pip install --no-deps
torchrec==1.8.0`` after ``pip install -e ".[torchrec]"``: README).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

__all__ = ["bags_from_configs", "configs_of", "features_of", "is_keyed_jagged", "keyed_tensor"]

#: ``torch.nn.init`` functions a config's ``init_fn`` may be a ``functools.partial`` of, and the row
#: initialiser each becomes (``shardps.common.rows.parse_init``) from the partial's keywords.
_INITS = {
    "uniform_": lambda kw: ("uniform", kw.get("a", 0.0), kw.get("b", 1.0)),
    "normal_": lambda kw: ("normal", kw.get("mean", 0.0), kw.get("std", 1.0)),
    "zeros_": lambda kw: "zeros",
    "constant_": lambda kw: ("constant", kw["val"]),
}


def is_keyed_jagged(features) -> bool:
    """Whether ``features`` is a TorchRec ``KeyedJaggedTensor`` (checked without importing torchrec)."""
    return type(features).__name__ == "KeyedJaggedTensor" and hasattr(features, "to_dict")


def _torchrec():
    try:
        import torchrec
    except ImportError as exc:
        raise ImportError("TorchRec's types need torchrec: pip install -e \".[torchrec]\" && pip install --no-deps "
                          "torchrec==1.8.0 (README, 'TorchRec models')") from exc
    return torchrec


def _init_of(config) -> tuple | str:
    """The row initialiser (``ShardedTable(init=)``) of ``config.init_fn``. Raises ValueError: one the shards
    cannot run."""
    fn = config.init_fn
    if isinstance(fn, functools.partial) and getattr(fn.func, "__module__", "") == "torch.nn.init" \
            and fn.func.__name__ in _INITS and not fn.args:
        try:
            return _INITS[fn.func.__name__](fn.keywords)
        except KeyError:
            pass
    raise ValueError(f"EmbeddingBagConfig {config.name!r}: init_fn {fn!r} cannot run on the shards (rows start "
                     "there, drawn per id): leave init_fn unset (uniform in [weight_init_min, weight_init_max]) or "
                     "give functools.partial(torch.nn.init.uniform_, a=, b=) / normal_(mean=, std=) / zeros_ / "
                     "constant_(val=)")


def bags_from_configs(tables: Sequence, *, seed: int = 0) -> tuple[dict, list[str], list[int]]:
    """The bags of TorchRec's ``EmbeddingBagConfig`` list ``tables``: ``({embedding name: ShardedEmbeddingBag},
    [(embedding name, feature name)] in TorchRec's output order, [embedding dim per embedding name])``. A
    table's features share one bag; a feature in several tables is named ``feature@table``, as TorchRec names
    it (``get_embedding_names_by_table``). Rows start as the config's ``init_fn`` says, seeded by ``seed``.

    Raises:
        ValueError: two tables with one name; pooling other than SUM or MEAN; a data type other than FP32;
            an ``init_fn`` the shards cannot run (module docstring).
        TypeError: an entry that is not an ``EmbeddingBagConfig``.
    """
    from shardps.worker.embedding.modules import ShardedEmbeddingBag
    torchrec = _torchrec()
    from torchrec.modules.embedding_modules import get_embedding_names_by_table
    if not tables:
        raise ValueError("tables is empty: give at least one EmbeddingBagConfig")
    seen: set[str] = set()
    for config in tables:
        if not isinstance(config, torchrec.EmbeddingBagConfig):
            raise TypeError(f"tables takes EmbeddingBagConfig, got {type(config).__name__}")
        if config.name in seen:
            raise ValueError(f"Duplicate table name {config.name}")
        seen.add(config.name)
        if not config.feature_names:
            config.feature_names = [config.name]  # as TorchRec's EmbeddingBagCollection
        if config.pooling.name not in ("SUM", "MEAN"):
            raise ValueError(f"EmbeddingBagConfig {config.name!r}: pooling {config.pooling.name} is not supported "
                             "(bags pool): use PoolingType.SUM or PoolingType.MEAN")
        if config.data_type.name not in ("FP32", "FP16"):
            raise ValueError(f"EmbeddingBagConfig {config.name!r}: data_type {config.data_type.name} is not "
                             "supported: the shards hold float32 or float16 rows (use DataType.FP32 or FP16)")
    bags, keys, dims = {}, [], []
    for config, names in zip(tables, get_embedding_names_by_table(list(tables))):
        bag = ShardedEmbeddingBag(config.num_embeddings, config.embedding_dim, mode=config.pooling.name.lower(),
                                  include_last_offset=True, name=config.name, seed=seed, init=_init_of(config),
                                  dtype=torch.float16 if config.data_type.name == "FP16" else torch.float32)
        for feature, key in zip(config.feature_names, names):
            bags[key] = bag
            keys.append((key, feature))
            dims.append(config.embedding_dim)
    return bags, keys, dims


def configs_of(bags: dict) -> list:
    """``EmbeddingBagConfig``s describing the bags of a collection built from bags: one per table (features in
    key order), pooling and dim as the bag's, the default ``init_fn`` left to TorchRec. Raises ValueError: a
    hashed table (TorchRec's configs need ``num_embeddings``) or a ``max`` bag."""
    torchrec = _torchrec()
    by_bag: dict[int, list[str]] = {}
    for key, bag in bags.items():
        by_bag.setdefault(id(bag), []).append(key)
    out = []
    for keys in by_bag.values():
        bag = bags[keys[0]]
        if bag.num_embeddings is None or bag.mode == "max":
            raise ValueError(f"bag {keys[0]!r} has no EmbeddingBagConfig: a hashed table or a max bag")
        out.append(torchrec.EmbeddingBagConfig(
            num_embeddings=bag.num_embeddings, embedding_dim=bag.embedding_dim, name=bag.name or keys[0],
            feature_names=list(keys), pooling=getattr(torchrec.PoolingType, bag.mode.upper()),
            data_type=torchrec.DataType.FP16 if bag.dtype == torch.float16 else torchrec.DataType.FP32))
    return out


def features_of(kjt, keys: Sequence[tuple[str, str]], weighted: bool) -> dict:
    """``{embedding name: (ids, B + 1 offsets[, per-id weights])}`` of a ``KeyedJaggedTensor`` for ``keys``
    (``[(embedding name, feature name)]``). Raises ValueError: variable batch sizes per key, no weights where
    ``weighted``, weights where not; KeyError: a feature the batch lacks."""
    if kjt.variable_stride_per_key():
        raise ValueError("a KeyedJaggedTensor with variable batch sizes per feature (variable_stride_per_key) is "
                         "not supported: give every feature the same batch size")
    if weighted != (kjt.weights_or_none() is not None):
        raise ValueError("the collection is weighted (is_weighted=True) but the batch has no weights" if weighted
                         else "the batch has weights but the collection is not weighted: build it with "
                              "is_weighted=True")
    jagged = kjt.to_dict()
    missing = [feature for _, feature in keys if feature not in jagged]
    if missing:
        raise KeyError(f"the batch has no feature {missing[0]!r} (it has {', '.join(kjt.keys())})")
    out = {}
    for key, feature in keys:
        j = jagged[feature]
        out[key] = (j.values(), j.offsets(), j.weights()) if weighted else (j.values(), j.offsets())
    return out


def keyed_tensor(pooled: dict[str, torch.Tensor], keys: Sequence[tuple[str, str]], dims: Sequence[int]):
    """A TorchRec ``KeyedTensor`` of ``pooled`` (``{embedding name: float [B, dim]}``) in ``keys``' order."""
    whole = getattr(pooled, "whole", None)  # one fused call's output, the features in the keys' order
    if whole is None or list(pooled) != [key for key, _ in keys]:
        whole = torch.cat([pooled[key] for key, _ in keys], dim=1)
    return _torchrec().KeyedTensor(keys=[key for key, _ in keys], length_per_key=list(dims), values=whole)

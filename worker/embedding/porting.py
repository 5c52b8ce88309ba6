"""Porting a recommender library's model: its ``nn.Embedding``/``nn.EmbeddingBag`` modules swapped for sharded ones.

A library's model (DeepFM, DLRM, DCN...) builds its tables as plain
``nn.Embedding``/``nn.EmbeddingBag`` modules and its trainer builds one
optimizer over ``model.parameters()``. Two calls port it::

    tables = shardps.shard_embeddings(model)             # in place; {path: sharded module}
    dense, handles = shardps.sharded_parameters(model)   # the optimizer's two halves
    dist = DistributedOptimizer(torch.optim.Adam(dense, lr=1e-3), model.named_parameters(), servers=...,
                                model=model, sparse_optimizer=torch.optim.Adam(handles, lr=1e-3))

``shard_embeddings`` keeps each module's ``num_embeddings`` (bounded
tables, as in the library; ``hashed=`` names the ones to make hashed),
``embedding_dim``, ``padding_idx``, ``mode`` and ``include_last_offset``,
and gives every reference to a module the same sharded one (a table shared
by two fields stays one table). The rows start from
``nn.Embedding``'s own distribution, normal(0, 1), drawn per (table, id,
seed) on the shards (``init=`` chooses another, e.g. what the library's
``reset_parameters`` draws): the library's randomly initialised ``weight``
is not copied, since no worker holds the table. Options a sharded table
cannot honour (``max_norm``, ``scale_grad_by_freq``, dense ``weight``
edits) are refused, naming the module.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from shardps.worker.embedding.modules import ShardedEmbedding, ShardedEmbeddingBag, ShardedTable, is_table_handle

__all__ = ["shard_embeddings", "sharded_parameters"]

#: The row initialiser of a swapped module: nn.Embedding's and nn.EmbeddingBag's reset_parameters draw N(0, 1).
TORCH_INIT = ("normal", 0.0, 1.0)


def _check(path: str, module: nn.Module) -> None:
    """Raises ValueError: ``module`` uses an option a sharded table cannot honour."""
    if getattr(module, "max_norm", None) is not None:
        raise ValueError(f"{path}: max_norm renormalises rows inside forward, which a sharded table cannot do; "
                         "remove max_norm (or keep this module local by leaving it out with only=)")
    if getattr(module, "scale_grad_by_freq", False):
        raise ValueError(f"{path}: scale_grad_by_freq is not supported by sharded tables; remove it (or leave this "
                         "module out with only=)")


def _sharded(path: str, module: nn.Module, hashed: bool, table_kw: dict) -> ShardedTable:
    kw = {"init": TORCH_INIT, **table_kw, "padding_idx": module.padding_idx}
    size = None if hashed else module.num_embeddings
    if isinstance(module, nn.EmbeddingBag):
        return ShardedEmbeddingBag(size, module.embedding_dim, mode=module.mode,
                                   include_last_offset=module.include_last_offset, **kw)
    return ShardedEmbedding(size, module.embedding_dim, **kw)


def shard_embeddings(model: nn.Module, *, only: Iterable[str] | None = None, hashed: Iterable[str] = (),
                     **table_kw) -> dict[str, ShardedTable]:
    """Replace ``model``'s ``nn.Embedding``/``nn.EmbeddingBag`` modules by sharded ones, in place.

    Args:
        model: the model; changed in place (every reference to a replaced module).
        only: module paths to replace (default: every ``nn.Embedding``/``nn.EmbeddingBag``).
        hashed: module paths to make hashed tables (``num_embeddings=None``: any int64 id).
        table_kw: passed to every new module (``init``, ``seed``, ``min_count``, ``ttl_rounds``, ``capacity``,
            ``max_bytes``...; ``init`` defaults to normal(0, 1), as ``nn.Embedding``'s).

    Returns:
        ``{path: new module}``, one entry per table (a shared module under its first path). The tables are
        named by these paths on the shards.

    Raises:
        ValueError: ``only``/``hashed`` name a path that is not an embedding module; a module uses
            ``max_norm`` or ``scale_grad_by_freq``; ``table_kw`` sets ``padding_idx``.
    """
    if "padding_idx" in table_kw:
        raise ValueError("padding_idx is taken from each module; do not pass it to shard_embeddings")
    found = {path: m for path, m in model.named_modules()
             if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and path}
    hashed = set(hashed)
    wanted = set(found) if only is None else set(only)
    unknown = sorted((wanted | hashed) - set(found))
    if unknown:
        raise ValueError(f"{unknown[0]!r} is not an nn.Embedding/nn.EmbeddingBag of the model "
                         f"(found: {', '.join(sorted(found)) or 'none'})")
    made: dict[int, ShardedTable] = {}
    out: dict[str, ShardedTable] = {}
    for path, module in found.items():
        if path not in wanted:
            continue
        _check(path, module)
        made[id(module)] = out[path] = _sharded(path, module, path in hashed, table_kw)
        out[path].name = path
    replace_modules(model, made)
    return out


def replace_modules(model: nn.Module, new: dict[int, nn.Module]) -> None:
    """Put ``new[id(m)]`` wherever ``model`` holds a submodule ``m`` (every reference: a module shared by two
    parents or attributes is replaced under each)."""
    at = [(path, m) for path, m in model.named_modules(remove_duplicate=False) if path and id(m) in new]
    for path, m in at:
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, new[id(m)])


def sharded_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(dense parameters, table handles)`` of ``model``: the dense ones for the ``DistributedOptimizer``'s
    optimizer, the handles for its ``sparse_optimizer`` (each parameter once, in ``model.parameters()`` order)."""
    dense, handles = [], []
    for p in model.parameters():
        (handles if is_table_handle(p) else dense).append(p)
    return dense, handles

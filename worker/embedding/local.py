"""A trained model without shards: sharded tables turned into plain local modules, for evaluation and serving.

``local_model(model, state)`` copies ``model`` and replaces every sharded
table (``ShardedEmbedding``/``ShardedEmbeddingBag``) by a module that needs
no shard, then loads ``state``:

- a **bounded** table (``num_embeddings`` N) becomes ``nn.Embedding`` /
  ``nn.EmbeddingBag`` (same ``padding_idx``, ``mode``,
  ``include_last_offset``) with the trained ``weight`` ``[N, dim]``;
- a **hashed** table becomes :class:`HashedEmbedding` /
  :class:`HashedEmbeddingBag`: the trained rows as sorted ``ids`` and their
  ``rows``, looked up with ``torch.searchsorted``. An id that is not among
  them (never trained, not admitted yet, or evicted) reads as its
  **deterministic initial row** (``TableSpec.initial_rows``: a function of
  table name, id and seed), exactly what the live table reads for it, so
  the local model's outputs equal the sharded model's bit for bit.

``state`` is what the user saved: ``model.state_dict()`` of the live model
(a mapping, or a ``.pt``/``.safetensors`` file of it), or the file
``shardps export`` wrote (tables under their names on the shards). None
reads the live model's own ``state_dict()`` (its tables are pulled from the
shards once this worker's last push is applied; call it between steps).

The local model is a plain ``nn.Module``: it runs on CPU or CUDA
(``.to(device)``), under ``torch.no_grad()``, and through
``torch.jit.trace``, which is the supported path to a serialisable
program (tested at one batch size, run at another). ``torch.export`` with
a dynamic batch size is not supported for hashed bags: the export
specialises their id count; bounded tables are torch's own modules. (TorchRec's ``torchrec.inference`` builds a predict module from a
trained model the same way; Monolith serves from exported tables.)
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from shardps.common.rows import TableSpec
from shardps.worker.embedding.modules import ShardedEmbedding, ShardedEmbeddingBag, ShardedTable, bags, table_keys
from shardps.worker.embedding.porting import replace_modules

__all__ = ["HashedEmbedding", "HashedEmbeddingBag", "local_model", "load_state"]


class _HashedTable(nn.Module):
    """What both hashed local modules share: the trained rows (buffers ``ids``, ``rows``) and the lookup."""

    def __init__(self, spec: TableSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embedding_dim = spec.embedding_dim
        self.padding_idx = spec.padding_idx if spec.padding_idx >= 0 else None
        self.register_buffer("ids", torch.empty(0, dtype=torch.int64))
        self.register_buffer("rows", torch.empty(0, spec.embedding_dim))
        self.trained = 0  # rows held (a Python int, so that a traced lookup has no data-dependent branch)

    def extra_repr(self) -> str:
        return f"hashed, {self.embedding_dim}, name={self.spec.name!r}, rows={self.ids.numel()}"

    def _load_from_state_dict(self, state_dict, prefix, *args) -> None:
        ids, rows = state_dict.get(prefix + "ids"), state_dict.get(prefix + "rows")
        if ids is not None and rows is not None:  # any number of rows: take the saved tensors' shapes
            if ids.dim() != 1 or rows.shape != (ids.numel(), self.embedding_dim):
                raise ValueError(f"{prefix}ids/rows: expected int64 [n] and float32 [n, {self.embedding_dim}], got "
                                 f"{tuple(ids.shape)} and {tuple(rows.shape)}")
            if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
                raise ValueError(f"{prefix}ids must be sorted and unique (as model.state_dict() and shardps export "
                                 "write them)")
            self.ids = torch.empty_like(ids, dtype=torch.int64, device=self.ids.device)
            self.rows = torch.empty_like(rows, dtype=torch.float32, device=self.rows.device)
            self.trained = ids.numel()
        super()._load_from_state_dict(state_dict, prefix, *args)

    def rows_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The row of each of int64 ``ids`` ``[n]``: the trained one, else the initial one (the padding id:
        zeros). float32 ``[n, dim]`` on the module's device."""
        flat = ids.reshape(-1).to(self.ids.device, torch.int64)
        initial = self.spec.initial_rows(flat)
        if not self.trained:
            return initial
        at = torch.searchsorted(self.ids, flat).clamp_(max=self.trained - 1)
        hit = self.ids.index_select(0, at) == flat
        return torch.where(hit.unsqueeze(1), self.rows.index_select(0, at), initial)


class HashedEmbedding(_HashedTable):
    """A hashed ``ShardedEmbedding``'s trained rows, local: ``forward(input)`` -> ``[*input.shape, dim]`` float32
    for int64 ``input`` of any shape (module docstring for ids not trained). Built by :func:`local_model`."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.rows_of(input).view(*input.shape, self.embedding_dim)


class HashedEmbeddingBag(_HashedTable):
    """A hashed ``ShardedEmbeddingBag``'s trained rows, local: ``forward(input, offsets=None,
    per_sample_weights=None)`` as ``nn.EmbeddingBag``'s, ``[B, dim]`` float32 (the padding id is left out of its
    bag). Built by :func:`local_model`."""

    def __init__(self, spec: TableSpec, mode: str = "mean", include_last_offset: bool = False) -> None:
        super().__init__(spec)
        self.mode, self.include_last_offset = mode, include_last_offset

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        flat = input.reshape(-1).to(self.ids.device, torch.int64)
        weight = self.rows_of(flat)
        index = torch.ones_like(flat).cumsum(0).sub_(1).view(input.shape)  # each id its own row, in order
        pad = None
        if self.padding_idx is not None:  # a zero row first, left out of every bag (as the live module's)
            weight = torch.cat([weight.new_zeros(1, self.embedding_dim), weight])
            index = torch.where(flat.view(input.shape) == self.padding_idx, 0, index + 1)
            pad = 0
        return bags(index, weight, None if offsets is None else offsets.to(weight.device), self.mode,
                    per_sample_weights, self.include_last_offset, pad)


def _local_module(module: ShardedTable, path: str, saved: dict | None = None) -> nn.Module:
    """The plain module that replaces one sharded table at ``path`` (module docstring); ``saved``: the table's
    spec fields as an export file records them (they decide a hashed table's initial rows), else the module's."""
    spec = module.spec(path)
    if saved is not None:
        spec = TableSpec(**{**saved, "name": spec.name})
    pad = module.padding_idx
    if isinstance(module, ShardedEmbeddingBag):
        if module.num_embeddings:
            return nn.EmbeddingBag(module.num_embeddings, module.embedding_dim, mode=module.mode,
                                   include_last_offset=module.include_last_offset, padding_idx=pad)
        return HashedEmbeddingBag(spec, module.mode, module.include_last_offset)
    if isinstance(module, ShardedEmbedding):
        if module.num_embeddings:
            return nn.Embedding(module.num_embeddings, module.embedding_dim, padding_idx=pad)
        return HashedEmbedding(spec)
    raise TypeError(f"no local module for a {type(module).__name__}")


def load_state(source: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """Read a saved state: ``(state_dict, {table name: spec fields})`` (the second empty for a plain
    ``state_dict`` file). ``*.safetensors`` (``model.state_dict()`` saved with safetensors, or a ``shardps export``
    file whose ``shardps.tables`` metadata names its tables), else ``torch.load(weights_only=True)``.

    Raises:
        FileNotFoundError: no such file. ValueError: a file that is neither.
    """
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"no saved state at {path}")
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            state = {k: f.get_tensor(k) for k in f.keys()}
        return state, json.loads(meta.get("shardps.tables", "{}"))
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, Mapping):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a state_dict")
    return dict(state), {}


def _by_module_path(state: Mapping[str, torch.Tensor], tables: dict[str, dict],
                    modules: dict[str, ShardedTable]) -> dict[str, torch.Tensor]:
    """``state`` with an export's table keys (``<table name>.weight``...) renamed to the module paths of
    ``modules`` (``{path: module}``) where a table's name differs from its path."""
    out = dict(state)
    for path, module in modules.items():
        name = module.name or path
        if name == path or name not in tables:
            continue
        for old, new in zip(table_keys(name + ".", module.num_embeddings), table_keys(path + ".", module.num_embeddings)):
            if old in out:
                out[new] = out.pop(old)
    return out


def local_model(model: nn.Module, state: Mapping[str, torch.Tensor] | str | Path | None = None) -> nn.Module:
    """A copy of ``model`` whose sharded tables are local modules holding ``state``'s rows (module docstring).

    Args:
        model: a model with ``ShardedEmbedding``/``ShardedEmbeddingBag`` modules (attached or not; it is not
            changed).
        state: ``model.state_dict()`` saved (a mapping or a file), a ``shardps export`` file, or None (the live
            model's ``state_dict()``, its tables read from the shards).

    Returns:
        The copy, in ``model``'s training mode, on the CPU (move it with ``.to(device)``), with every entry of
        ``state`` loaded (``strict``: a missing or unexpected key raises), without the model's module hooks
        (training installs its own there).

    Raises:
        RuntimeError: ``state`` is None and a table is not attached (never, or its job was closed); ``state``
            does not fit the model (``load_state_dict``'s message names the keys).
        ValueError: a hashed table's ``ids``/``rows`` are malformed.
        FileNotFoundError: ``state`` names no file.
    """
    sharded = {path: m for path, m in model.named_modules() if isinstance(m, ShardedTable)}
    tables: dict[str, dict] = {}
    if state is None:
        state = model.state_dict()
    elif isinstance(state, (str, Path)):
        state, tables = load_state(state)
    state = _by_module_path(state, tables, sharded)
    memo = {}
    for m in sharded.values():  # the copy leaves the shards behind: no connection, no step in flight
        memo[id(m.tables)] = None
        memo[id(m.pending)] = []
    for m in model.modules():  # nor the hooks training installed (DistributedOptimizer(model=) waits, ...)
        for name, hooks in vars(m).items():
            if name.endswith("hooks") and isinstance(hooks, dict) and hooks:
                memo[id(hooks)] = type(hooks)()
    local = copy.deepcopy(model, memo)
    new = {}
    for path, m in sharded.items():
        new[id(local.get_submodule(path))] = replacement = _local_module(m, path, tables.get(m.name or path))
        replacement.train(m.training)
    replace_modules(local, new)  # every reference (a table shared by two fields stays one module)
    local.load_state_dict(dict(state), strict=True)
    return local

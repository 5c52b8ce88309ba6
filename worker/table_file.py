"""The export file: the dense ``state_dict`` and every sparse table in one safetensors file, and reading it back.

Keys of a table ``T`` (its name on the shards, by default its module's path
in the model, so that ``T.weight`` is the key ``model.state_dict()`` gives a
plain ``nn.Embedding``/``nn.EmbeddingBag`` there):

- bounded (``num_embeddings`` N > 0): ``T.weight``, float32 ``[N, dim]``:
  the trained rows, every other id its initial row
  (``TableSpec.initial_rows``, the padding row zero), which is
  ``TableExport.weight()``;
- hashed (``num_embeddings`` 0): ``T.ids``, int64 ``[n]`` ascending, and
  ``T.rows``, float32 ``[n, dim]``: the trained rows only (an id not in
  ``T.ids`` reads as its initial row).

The header's metadata holds ``job_id``, ``versions`` (each shard's dense
version, comma-separated) and, when there are tables, ``shardps.tables``
(JSON ``{T: {field: value}}`` of every ``TableSpec`` field but the name, so
:func:`read_export` rebuilds the specs without the model) and
``shardps.sparse_rounds`` (each shard's sparse round).

Memory: :func:`write_export` lays the header out from the sizes the source
declared, then streams (``shardps.common.safetensors_stream.StreamWriter``):
the dense tensors (already in memory), then each table's merged pages
(``shardps.worker.table_sources``); a bounded table goes out in blocks of
:data:`BLOCK_BYTES` of initial rows with that block's trained rows written
over them, a hashed one as its pages come. The process holds at most one
page per shard, the merged page and one block, whatever the table's size.

Tables go only to ``.safetensors``: a ``.pt`` file (``torch.save``) is one
pickle built in memory, so :func:`write_export` refuses tables with it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from shardps.common.rows import TableSpec
from shardps.common.safetensors_stream import DTYPES, StreamWriter
from shardps.worker.table_sources import TableError, TableSource

__all__ = ["BLOCK_BYTES", "ROUNDS_KEY", "TABLES_KEY", "Progress", "parse_tables", "read_export", "table_entries",
           "tables_json", "write_export"]

#: Metadata key of the tables' specs (JSON).
TABLES_KEY = "shardps.tables"
#: Metadata key of each shard's sparse round (comma-separated).
ROUNDS_KEY = "shardps.sparse_rounds"
#: Bytes of a bounded table's rows written per block (its initial rows take about 8 times this while computed).
BLOCK_BYTES = 64 << 10
#: ``progress(table, rows written, rows of the table)``: called after each block or page of a table.
Progress = Callable[[str, int, int], None]


def table_entries(spec: TableSpec, trained_rows: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(key, dtype name, shape)`` of the tensors table ``spec`` takes in the file (module docstring)."""
    if spec.num_embeddings:
        return [(f"{spec.name}.weight", "F32", (spec.num_embeddings, spec.embedding_dim))]
    return [(f"{spec.name}.ids", "I64", (trained_rows,)),
            (f"{spec.name}.rows", "F32", (trained_rows, spec.embedding_dim))]


def tables_json(specs: Mapping[str, TableSpec]) -> str:
    """``shardps.tables``' JSON: every field of each spec (``dataclasses.asdict``) but the name, under the name."""
    out = {}
    for name, spec in specs.items():
        fields = dataclasses.asdict(spec)
        fields.pop("name")
        for name_, default in (("dtype", "float32"), ("ttl_seconds", 0.0)):
            if fields[name_] == default:  # defaults left out: the files stay readable by shardps before these fields
                fields.pop(name_)
        out[name] = fields
    return json.dumps(out, sort_keys=True)


def parse_tables(text: str, where: str = "the file") -> dict[str, TableSpec]:
    """The specs in ``shardps.tables``' JSON ``text``.

    Raises:
        ValueError: not a JSON object of objects, a field ``TableSpec`` does not have (a newer shardps wrote
            it), or a value out of range (the message names the table and ``where``).
    """
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{where}: its {TABLES_KEY} metadata is not JSON ({exc})") from None
    if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in raw.values()):
        raise ValueError(f"{where}: its {TABLES_KEY} metadata is not an object of objects")
    known = {f.name for f in dataclasses.fields(TableSpec)} - {"name"}
    specs = {}
    for name, fields in raw.items():
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"{where}: table {name!r} has fields {unknown} this shardps does not know (written by a "
                             "newer shardps?)")
        try:
            specs[name] = TableSpec(name=name, **fields)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: table {name!r} has a bad spec: {exc}") from None
    return specs


def _check_keys(dense: Mapping[str, torch.Tensor], entries: list[tuple[str, str, tuple[int, ...]]]) -> None:
    """Raises ValueError: a table's key is a dense key too, or another table's (both named)."""
    owner: dict[str, str] = {k: "a dense tensor" for k in dense}
    for key, _, _ in entries:
        table = key.rsplit(".", 1)[0]
        if key in owner:
            raise ValueError(f"table {table!r} would be written as {key!r}, which is already {owner[key]}: rename the "
                             "table (ShardedEmbedding(..., name=)) or export without it (tables=)")
        owner[key] = f"the key of table {table!r}"


def write_export(path: str | Path, state_dict: Mapping[str, torch.Tensor], metadata: Mapping[str, str],
                 source: TableSource | None = None, progress: Progress | None = None) -> Path:
    """Write ``state_dict`` and every table of ``source`` to ``path`` (module docstring), atomically.

    ``.safetensors``: streamed, memory bounded (module docstring). Otherwise ``torch.save`` of the
    plain ``state_dict`` (no tables). Before renaming the file into place, ``source.finish()`` checks that
    the shards did not change meanwhile.

    Args:
        path: the output; its folder is created. Nothing is left there when this raises.
        state_dict: the dense tensors (CPU).
        metadata: safetensors metadata (strings; ``job_id``, ``versions``).
        source: the tables (None: none).
        progress: called as tables are written.

    Raises:
        ValueError: tables with a ``.pt`` path; a table key equal to a dense or another table's key; a
            dense dtype safetensors does not take.
        TableError: a table's rows are malformed or changed during a live export (see ``table_sources``).
        OSError: not enough free space for the file, or the disk refused.
        ShardRpcError, ConnectionError: a live shard failed.
    """
    path = Path(path)
    specs = dict(source.specs) if source is not None else {}
    if path.suffix != ".safetensors":
        if specs:
            raise ValueError(f"{path}: sparse tables are exported only to .safetensors files (streamed with bounded "
                             f"memory; torch.save would build the whole file in memory): use --out "
                             f"{path.with_suffix('.safetensors').name}")
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({k: v.contiguous() for k, v in state_dict.items()}, path)
        return path
    tables = [e for name, spec in specs.items() for e in table_entries(spec, source.rows(name))]
    _check_keys(state_dict, tables)
    bad = sorted(k for k, v in state_dict.items() if v.dtype not in DTYPES)
    if bad:
        raise ValueError(f"dense tensors of dtypes safetensors cannot take here: {bad[:5]}")
    meta = dict(metadata)
    if specs:
        meta[TABLES_KEY] = tables_json(specs)
        meta[ROUNDS_KEY] = ",".join(map(str, source.rounds))
    dense = [(k, DTYPES[v.dtype], tuple(v.shape)) for k, v in state_dict.items()]
    with StreamWriter(path, dense + tables, meta) as writer:
        for key, value in state_dict.items():
            writer.write(key, value)
        for name, spec in specs.items():
            if spec.num_embeddings:
                _write_bounded(writer, spec, source, progress)
            else:
                done, total, pages = 0, source.rows(name), source.pages(name)
                while (page := next(pages, None)) is not None:
                    writer.write(f"{name}.ids", page[0])
                    writer.write(f"{name}.rows", page[1])
                    done += page[0].numel()
                    del page  # before the next page is read: one merged page in memory at a time
                    if progress is not None:
                        progress(name, done, total)
        if source is not None:
            source.finish()
        return writer.commit()


def _write_bounded(writer: StreamWriter, spec: TableSpec, source: TableSource, progress: Progress | None) -> None:
    """``spec.name + ".weight"``: blocks of initial rows, each with the trained rows of its ids written over."""
    n, key = spec.num_embeddings, f"{spec.name}.weight"
    block = max(1, BLOCK_BYTES // (4 * spec.embedding_dim))
    pages = source.pages(spec.name)
    ids = torch.empty(0, dtype=torch.int64)
    rows = torch.empty(0, spec.embedding_dim)
    ended = False
    for start in range(0, n, block):
        end = min(n, start + block)
        out = spec.initial_rows(torch.arange(start, end, dtype=torch.int64))
        while True:
            if not ids.numel():
                ids = rows = None  # the last page goes before the next is read
                page = None if ended else next(pages, None)
                if page is None:
                    ids, rows, ended = torch.empty(0, dtype=torch.int64), torch.empty(0, spec.embedding_dim), True
                    break
                ids, rows = page
                del page
            take = int(torch.searchsorted(ids, end))  # ids below the block's end (they are >= start: ascending)
            if take:
                out.index_copy_(0, ids[:take] - start, rows[:take])  # (indexed assignment is far slower on CPU)
                ids, rows = ids[take:], rows[take:]
            if ids.numel():
                break  # the rest belongs to later blocks
        writer.write(key, out)
        del out
        if progress is not None:
            progress(spec.name, end, n)
    leftover = ids.numel() + sum(p[0].numel() for p in pages)  # runs the merge's own end checks
    if leftover:
        raise TableError(f"table {spec.name!r}: {leftover} rows with ids past its {n} rows")


def read_export(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, TableSpec]]:
    """Read an export file: the whole ``state_dict`` (dense tensors and every table's tensors) and the tables' specs.

    Args:
        path: a ``.safetensors`` file written by ``shardps export`` (or any safetensors state_dict: no
            tables then), or a ``.pt`` file (``torch.load(weights_only=True)``, never tables).

    Returns:
        ``(state, specs)``: ``state`` maps keys to CPU tensors (a bounded table ``T``: ``T.weight`` float32
        ``[N, dim]``; hashed: ``T.ids`` int64 ``[n]`` ascending and ``T.rows`` float32 ``[n, dim]``);
        ``specs`` maps each table's name to its ``TableSpec``.

    Raises:
        ValueError: the file cannot be read as a state_dict, its ``shardps.tables`` metadata is malformed, or
            a table's tensors are missing, of another dtype or shape, or (hashed) its ids are not ascending.
        FileNotFoundError: no such file.
    """
    path = Path(path)
    if path.suffix != ".safetensors":
        state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ValueError(f"{path}: not a state_dict of tensors")
        return state, {}
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
        state = load_file(str(path))
    except SafetensorError as exc:
        raise ValueError(f"{path}: not a valid safetensors file ({exc})") from None
    specs = parse_tables(metadata[TABLES_KEY], str(path)) if TABLES_KEY in metadata else {}
    for name, spec in specs.items():
        keys = table_entries(spec, 0)
        got = [state.get(k) for k, _, _ in keys]
        if any(t is None for t in got):
            raise ValueError(f"{path}: table {name!r} lacks its tensors {[k for k, _, _ in keys]}")
        if spec.num_embeddings:
            ok = got[0].dtype == torch.float32 and tuple(got[0].shape) == keys[0][2]
        else:
            ids, rows = got
            ok = ids.dtype == torch.int64 and ids.dim() == 1 and rows.dtype == torch.float32 and \
                tuple(rows.shape) == (ids.numel(), spec.embedding_dim) and not bool((ids[1:] <= ids[:-1]).any())
        if not ok:
            raise ValueError(f"{path}: table {name!r}'s tensors do not match its spec "
                             f"({[(k, t.dtype, tuple(t.shape)) for (k, _, _), t in zip(keys, got)]})")
    return state, specs

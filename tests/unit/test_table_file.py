"""The export file without shards: the streamed safetensors writer, the merge of the shards' pages, the refusals.

Sources here are in memory (:class:`Pages`): each shard's rows cut into pages
as a shard or a checkpoint would send them. The real shards and the CLI are in
``tests/integration/test_table_export.py``.
"""

from __future__ import annotations

import json
import os
import struct

import grpc
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from shardps.common.rows import TableSpec, ids_bytes, rows_bytes, shard_of
from shardps.common.safetensors_stream import StreamWriter, read_header, read_rows
from shardps.worker.export import Export
from shardps.worker.table_file import TABLES_KEY, parse_tables, read_export, tables_json
from shardps.proto import shardps_pb2 as pb
from shardps.worker.session.client import ShardRpcError
from shardps.worker.table_sources import LiveTables, TableError, TableSource

SHARDS = 3


class Pages(TableSource):
    """Tables whose trained rows are given whole, split over ``SHARDS`` shards by ``shard_of``, in pages."""

    def __init__(self, *tables: tuple[TableSpec, tuple[torch.Tensor, torch.Tensor]], page: int = 7, edit=None):
        super().__init__(SHARDS)
        self.data, self.page, self.edit = {}, page, edit
        for spec, (ids, rows) in tables:
            order = torch.argsort(ids)
            ids, rows = ids[order], rows[order]
            where = shard_of(spec.name, ids, SHARDS)
            self.specs[spec.name] = spec
            self.data[spec.name] = [(ids[where == s], rows[where == s]) for s in range(SHARDS)]
            self.counts[spec.name] = [int((where == s).sum()) for s in range(SHARDS)]
        self.rounds = [5] * SHARDS
        self.finished = self.closed = False

    def streams(self, name):
        def stream(s):
            ids, rows = self.data[name][s]
            for start in range(0, ids.numel(), self.page):
                page = ids[start: start + self.page].clone(), rows[start: start + self.page].clone()
                yield self.edit(s, start, *page) if self.edit else page
        return [stream(s) for s in range(SHARDS)]

    def finish(self):
        self.finished = True

    def close(self):
        self.closed = True


def trained(spec: TableSpec, ids) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor(ids, dtype=torch.int64)
    return ids, torch.randn(ids.numel(), spec.embedding_dim)


def weight(spec: TableSpec, ids, rows) -> torch.Tensor:
    """``TableExport.weight()``'s matrix, computed whole."""
    out = spec.initial_rows(torch.arange(spec.num_embeddings))
    out[ids] = rows
    return out


DENSE = {"lin.weight": torch.randn(3, 4), "lin.bias": torch.randn(3), "bn.num_batches_tracked": torch.tensor(7),
         "half": torch.randn(5).to(torch.bfloat16), "mask": torch.tensor([True, False])}


def test_tables_and_dense_tensors_stream_into_one_valid_safetensors_file(tmp_path, monkeypatch):
    monkeypatch.setattr("shardps.worker.table_file.BLOCK_BYTES", 4 * 8 * 10)  # blocks of 10 rows: many blocks
    torch.manual_seed(0)
    bounded = TableSpec(name="emb.user", embedding_dim=8, num_embeddings=95, padding_idx=3, seed=4,
                        optimizer="adagrad")
    hashed = TableSpec(name="emb.item", embedding_dim=5, min_count=2)
    empty = TableSpec(name="cold", embedding_dim=2)
    b_ids, b_rows = trained(bounded, [0, 1, 9, 10, 11, 40, 41, 94])
    h_ids, h_rows = trained(hashed, [-(2**63), 2**63 - 1, -5, 0, 17, 123456789, *range(1000, 1040)])
    source = Pages((bounded, (b_ids, b_rows)), (hashed, (h_ids, h_rows)), (empty, trained(empty, [])))
    seen = []
    export = Export(dict(DENSE), [4, 4, 4], "job-1", source)
    path = export.save(tmp_path / "out" / "model.safetensors", progress=lambda *a: seen.append(a))
    assert source.finished and not list(tmp_path.joinpath("out").glob(".*partial"))
    export.close()
    assert source.closed

    loaded = load_file(path)  # safetensors' own reader takes the file
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        assert torch.equal(f.get_slice("emb.user.weight")[10:12], loaded["emb.user.weight"][10:12])
    assert meta["job_id"] == "job-1" and meta["versions"] == "4,4,4" and meta["shardps.sparse_rounds"] == "5,5,5"
    assert json.loads(meta[TABLES_KEY])["emb.user"]["optimizer"] == "adagrad"
    assert all(torch.equal(loaded[k], v) for k, v in DENSE.items())
    assert torch.equal(loaded["emb.user.weight"], weight(bounded, b_ids, b_rows))
    assert loaded["emb.user.weight"][3].abs().sum() == 0  # the padding row
    order = torch.argsort(h_ids)
    assert torch.equal(loaded["emb.item.ids"], h_ids[order]) and torch.equal(loaded["emb.item.rows"], h_rows[order])
    assert loaded["cold.ids"].shape == (0,) and loaded["cold.rows"].shape == (0, 2)
    assert {a[0] for a in seen} == {"emb.user", "emb.item"} and ("emb.user", 95, 95) in seen

    state, specs = read_export(path)
    assert specs == {"emb.user": bounded, "emb.item": hashed, "cold": empty}
    assert state.keys() == loaded.keys()
    assert export.table_rows() == 8 + 46 and export.table_rows("emb.item") == 46


def test_the_writer_lays_out_what_safetensors_writes_and_reads_rows_back(tmp_path):
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(10), "c": torch.ones(2, dtype=torch.float16),
               "z": torch.zeros(0, 3)}
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    with StreamWriter(ours, [(k, {torch.float32: "F32", torch.int64: "I64", torch.float16: "F16"}[v.dtype],
                              tuple(v.shape)) for k, v in tensors.items()], {"k": "v"}) as w:
        for k, v in tensors.items():
            for piece in v.reshape(-1).split(3):
                w.write(k, piece)
        w.commit()
    save_file(tensors, str(theirs), metadata={"k": "v"})
    assert ours.read_bytes() == theirs.read_bytes()  # the same bytes as safetensors' own writer
    fd = os.open(ours, os.O_RDONLY)
    try:
        meta, entries, start = read_header(fd)
        assert meta == {"k": "v"} and torch.equal(read_rows(fd, entries["a"], start, 1, 2), tensors["a"][1:3])
        with pytest.raises(ValueError, match="outside"):
            read_rows(fd, entries["b"], start, 8, 5)
    finally:
        os.close(fd)


def test_an_incomplete_or_overfull_write_leaves_no_file(tmp_path):
    out = tmp_path / "x.safetensors"
    w = StreamWriter(out, [("a", "F32", (4,))])
    with pytest.raises(ValueError, match="takes 16 bytes"):
        w.write("a", torch.zeros(5))
    with pytest.raises(ValueError, match="incomplete"):
        w.commit()
    assert not list(tmp_path.iterdir())
    with pytest.raises(OSError, match="bytes free"):
        StreamWriter(out, [("a", "F32", (1 << 50,))])
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("edit, says", [
    (lambda s, start, ids, rows: (ids.flip(0), rows), "out of order"),
    (lambda s, start, ids, rows: (ids + 1, rows), "another shard holds"),
    (lambda s, start, ids, rows: (ids, rows[:, :2]), "float32"),
    (lambda s, start, ids, rows: (ids[:-1], rows[:-1]) if start == 0 else (ids, rows), "declared"),
])
def test_malformed_pages_are_refused_and_leave_no_file(tmp_path, edit, says):
    spec = TableSpec(name="t", embedding_dim=4)
    source = Pages((spec, trained(spec, list(range(0, 300, 3)))), edit=edit)
    with pytest.raises(TableError, match=says):
        Export({}, [1], "j", source).save(tmp_path / "m.safetensors")
    assert not list(tmp_path.iterdir())


def test_a_bounded_tables_id_outside_its_range_is_refused(tmp_path):
    spec = TableSpec(name="t", embedding_dim=2, num_embeddings=10)
    ids, rows = trained(spec, [1, 2, 3])
    source = Pages((spec, (ids, rows)), edit=lambda s, start, i, r: (i + 10 * (i == i.max()), r))
    with pytest.raises(TableError, match=r"outside \[0, 10\)|another shard"):
        Export({}, [1], "j", source).save(tmp_path / "m.safetensors")


def test_key_collisions_and_pt_files_are_refused(tmp_path):
    spec = TableSpec(name="lin", embedding_dim=4, num_embeddings=3)
    with pytest.raises(ValueError, match="'lin.weight', which is already a dense tensor"):
        Export(dict(DENSE), [1], "j", Pages((spec, trained(spec, [1])))).save(tmp_path / "m.safetensors")
    a, b = TableSpec(name="x", embedding_dim=2), TableSpec(name="x.ids", embedding_dim=2, num_embeddings=4)
    with pytest.raises(ValueError, match="'x.ids.weight'|already the key of table"):
        Export({"x.ids.weight": torch.zeros(1)}, [1], "j", Pages((a, trained(a, [])), (b, trained(b, [])))).save(
            tmp_path / "m.safetensors")
    with pytest.raises(ValueError, match="only to .safetensors"):
        Export({}, [1], "j", Pages((spec, trained(spec, [1])))).save(tmp_path / "m.pt")
    assert not list(tmp_path.iterdir())
    Export(dict(DENSE), [1], "j").save(tmp_path / "m.pt")  # no tables: torch.save as before
    state, specs = read_export(tmp_path / "m.pt")
    assert specs == {} and state.keys() == DENSE.keys() and all(torch.equal(state[k], v) for k, v in DENSE.items())


def test_read_export_refuses_bad_metadata_and_tables_that_do_not_match_their_spec(tmp_path):
    spec = TableSpec(name="t", embedding_dim=3)
    path = tmp_path / "m.safetensors"
    save_file({"t.ids": torch.tensor([3, 1]), "t.rows": torch.zeros(2, 3)}, str(path),
              metadata={TABLES_KEY: tables_json({"t": spec})})
    with pytest.raises(ValueError, match="do not match its spec"):
        read_export(path)
    save_file({"t.ids": torch.tensor([3])}, str(path), metadata={TABLES_KEY: tables_json({"t": spec})})
    with pytest.raises(ValueError, match="lacks its tensors"):
        read_export(path)
    with pytest.raises(ValueError, match="newer shardps"):
        parse_tables(json.dumps({"t": {"embedding_dim": 3, "colour": "red"}}))
    with pytest.raises(ValueError, match="bad spec"):
        parse_tables(json.dumps({"t": {"embedding_dim": 0}}))
    path.write_bytes(struct.pack("<Q", 10) + b"{}")
    with pytest.raises(ValueError, match="not a valid safetensors"):
        read_export(path)


class FakeShard:
    """The ``ShardClient`` calls ``LiveTables`` makes, answered from ``ids``/``rows`` as a shard would."""

    def __init__(self, spec, ids, rows, *, round_=3, version=7, limit=None, change_after=None):
        self.spec, self.ids, self.rows, self.round, self.version = spec, ids, rows, round_, version
        self.limit, self.change_after, self.calls, self.closed = limit, change_after, 0, False
        self.address = "fake:1"

    def export_rows(self, table, state=False, timeout=None, offset=0, max_rows=0):
        if table != self.spec.name:
            raise ShardRpcError(0, self.address, "export_rows", grpc.StatusCode.FAILED_PRECONDITION, "not declared")
        if self.limit and max_rows > self.limit:
            raise ShardRpcError(0, self.address, "export_rows", grpc.StatusCode.RESOURCE_EXHAUSTED, "too large")
        self.calls += 1
        if self.change_after and self.calls > self.change_after:
            self.round += 1
        part = slice(offset, offset + max_rows if max_rows else None)
        return pb.ExportRowsReply(spec=self.spec.to_proto(), ids=ids_bytes(self.ids[part]),
                                  weights=rows_bytes(self.rows[part]), round=self.round, total_rows=self.ids.numel())

    def stats(self):
        return pb.StatsReply(version=self.version)

    def close(self):
        self.closed = True


def fake_shards(spec, count=2000, options=None):
    ids, rows = trained(spec, sorted(torch.randperm(10**6)[:count].tolist()))
    where = shard_of(spec.name, ids, 2)
    shards = [FakeShard(spec, ids[where == s], rows[where == s], **(options or {}).get(s, {})) for s in range(2)]
    return shards, (ids, rows)


def test_live_tables_merge_pages_and_take_smaller_pages_from_a_shard_with_a_lower_limit(tmp_path):
    spec = TableSpec(name="t", embedding_dim=3)
    shards, (ids, rows) = fake_shards(spec, options={1: {"limit": 100}})
    source = LiveTables(shards, ["t"], versions=[7, 7], max_message_bytes=4 << 10)  # pages of 102 rows
    path = Export({}, [7, 7], "j", source).save(tmp_path / "m.safetensors")
    state, _ = read_export(path)
    assert torch.equal(state["t.ids"], ids) and torch.equal(state["t.rows"], rows)
    assert shards[0].calls > 5 and shards[1].calls > shards[0].calls  # many pages; shard 1's of 51 rows
    source.close()
    assert all(s.closed for s in shards)


def test_live_tables_refuse_rows_or_versions_that_change_and_shards_that_disagree(tmp_path):
    spec = TableSpec(name="t", embedding_dim=3)
    shards, _ = fake_shards(spec, options={0: {"change_after": 3}})
    with pytest.raises(TableError, match="changed during the export.*export between steps"):
        Export({}, [7, 7], "j", LiveTables(shards, ["t"], max_message_bytes=4 << 10)).save(tmp_path / "m.safetensors")
    shards, _ = fake_shards(spec, options={1: {"version": 8}})
    with pytest.raises(TableError, match="went from version 7 to 8"):
        Export({}, [7, 7], "j", LiveTables(shards, ["t"], versions=[7, 7])).save(tmp_path / "m.safetensors")
    shards, _ = fake_shards(spec, options={1: {"round_": 4}})
    with pytest.raises(TableError, match=r"sparse rounds \[3, 4\]"):
        LiveTables(shards, ["t"])
    assert LiveTables(shards, ["t"], allow_mixed_versions=True).rounds == [3, 4]
    shards, _ = fake_shards(spec)
    shards[1].spec = TableSpec(name="t", embedding_dim=3, seed=1)
    with pytest.raises(TableError, match="different specs: seed: 0 vs 1"):
        LiveTables(shards, ["t"])
    with pytest.raises(ShardRpcError, match="not declared"):
        LiveTables(shards, ["other"])
    assert not list(tmp_path.iterdir())

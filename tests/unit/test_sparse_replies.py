"""The sparse calls' replies, encoded once by the shard (``server/sparse/replies.py``), are the messages protobuf
would build, bit for bit once parsed; their sizes are known before they are built; the memory they hold is
refused past the budget and given back."""

from __future__ import annotations

import asyncio
import re

import pytest
import torch

from shardps.common.rows import TableSpec, ids_bytes, rows_bytes, state_widths
from shardps.proto import shardps_pb2 as pb
from shardps.server.errors import ResourceExhausted
from shardps.server.sparse import fused, replies
from shardps.server.sparse.table import RowTable
from shardps.server.sparse.tables import SparseTables, _Push


class _Config:
    memory_budget_bytes = 1 << 40
    table_max_bytes = 1 << 40
    shard_index = 0
    max_message_bytes = 8 << 20


class _Store:
    config = _Config()


def _shard(**specs) -> SparseTables:
    """A shard's tables ``name=(dim, optimizer, spec fields)``, each with rows 0..9 after one SGD-like round."""
    tables = SparseTables(_Store())
    for name, (dim, optimizer, kw) in specs.items():
        spec = TableSpec(name=name, embedding_dim=dim, optimizer=optimizer, hyperparams={}, **kw)
        tables.tables[name] = RowTable(spec, 1 << 40, tables.index, len(tables.tables))
    ids = torch.arange(10)
    tables._update([_Push(0, {n: (ids, torch.full((10, t.spec.embedding_dim), 0.5), 0.1)
                              for n, t in tables.tables.items()})], 0)
    tables.round = 1
    return tables


def test_a_pull_reply_encoded_once_is_the_message_protobuf_builds():
    shard = _shard(a=(3, "sgd", {}), b=(3, "sgd", {"padding_idx": 4}), c=(5, "adagrad", {}))
    a, b, c = (shard.tables[n] for n in "abc")
    # rows and ids that are not rows, a padding id, a table asked for no ids
    asked = [(a, torch.tensor([3, 99, 7])), (b, torch.tensor([4, 1])), (c, torch.empty(0, dtype=torch.int64))]
    for several, parts in ((True, asked), (False, asked[:1]), (False, [(c, torch.empty(0, dtype=torch.int64))])):
        for round_ in (0, 1, 2**40):
            shard._round_base = round_ - shard._applied  # the reply's round: what the shard counts
            want_rows = shard._read(parts, "w-plain")
            reply = replies.PullReply([t for t, _ in parts], [i.numel() for _, i in parts], several, _Config())
            views = shard._read(parts, "w-reply", None, reply)
            data = reply.take()
            assert len(data) <= reply.size
            want = pb.PullRowsReply(parts=[rows_bytes(r) for r in want_rows], round=round_) if several else \
                pb.PullRowsReply(rows=rows_bytes(want_rows[0]), round=round_)
            assert pb.PullRowsReply.FromString(data) == want
            assert all(torch.equal(v, r) for v, r in zip(views, want_rows))
            assert all(torch.equal(shard._pulled["w-reply", t.spec.name][2], r) for (t, _), r in zip(parts, want_rows))


def test_a_pull_reply_over_the_message_limit_is_refused_before_anything_is_built():
    shard = _shard(wide=(65536, "sgd", {}))
    table = shard.tables["wide"]
    with pytest.raises(ResourceExhausted, match=r"over the shard's message limit of 8388608 bytes "
                                                 r"\(--max-message-bytes\)") as err:
        replies.PullReply([table], [480], False, _Config())
    assert str(480 * 65536 * 4) in str(err.value)
    replies.PullReply([table], [31], False, _Config())  # 31 rows of 256 KiB fit under 8 MiB


def test_an_export_page_encoded_once_is_the_message_protobuf_builds_and_is_sized_first():
    shard = _shard(t=(4, "adam", {}))
    table = shard.tables["t"]
    table.step = 3
    ids, slots = table.items()
    order = torch.argsort(ids)
    ids, slots = ids[order], slots[order]
    for offset, max_rows, state in ((0, 0, True), (2, 5, False), (8, 5, True), (20, 1, True)):
        page = replies.ExportReply.page(table, offset, max_rows, state, _Config())
        data = page.read(lambda: 7)
        assert len(data) <= page.size
        sel = slice(min(offset, 10), min(offset, 10) + page.rows)
        want = pb.ExportRowsReply(spec=table.spec.to_proto(), ids=ids_bytes(ids[sel]),
                                  weights=rows_bytes(table.weights[slots[sel]]), round=7, step=3, total_rows=10)
        if state:
            for name, width in state_widths("adam", 4).items():
                want.state[name] = rows_bytes(table.state[name][slots[sel]])
                want.state_width[name] = width
        assert pb.ExportRowsReply.FromString(data) == want
    # a page over the limit names the max_rows that fits: that many rows fit, one more does not
    small = type("Small", (), {"max_message_bytes": 400})()
    with pytest.raises(ResourceExhausted, match=r"--max-message-bytes\): ask for at most \d+ rows a page "
                                                r"\(max_rows\)") as err:
        replies.ExportReply.page(table, 0, 0, True, small)
    fits = int(re.search(r"at most (\d+) rows", str(err.value)).group(1))
    assert 0 < fits < 10
    assert replies.ExportReply(table, 0, fits, True).size <= 400 < replies.ExportReply(table, 0, fits + 1, True).size
    replies.ExportReply.page(table, 0, fits, True, small)


def test_reads_into_a_reply_match_plain_reads_with_initial_values_in_blocks(monkeypatch):
    shard = _shard(a=(6, "sgd", {}), b=(6, "sgd", {"init": "normal", "init_args": (0.0, 1.0)}),
                   c=(3, "sgd", {"padding_idx": 12}))
    parts = [(shard.tables[n], torch.arange(5, 40)) for n in "abc"]
    tables, ids = [t for t, _ in parts], [i for _, i in parts]
    found = shard.find(parts)
    whole = fused.read_rows(tables, ids, found)
    monkeypatch.setattr(fused, "INIT_BLOCK_VALUES", 7)  # one row a block for dim 6, two for dim 3
    out = [torch.full((i.numel(), t.spec.embedding_dim), float("nan")) for t, i in parts]
    got = fused.read_rows(tables, ids, found, out)
    assert all(g is o for g, o in zip(got, out))
    assert all(torch.equal(g, w) for g, w in zip(got, whole))
    assert bool((got[2][ids[2] == 12] == 0).all())


def test_the_memory_a_reply_holds_is_refused_past_the_budget_and_given_back(monkeypatch):
    monkeypatch.setattr(replies, "resident_bytes", lambda: 100 << 20)
    monkeypatch.setattr(replies, "free_heap_bytes", lambda: 10 << 20)
    budget = replies.ReplyBudget(type("Config", (), {"memory_budget_bytes": 164 << 20})())
    held = budget.hold(32 << 20, "a reply", "ask for less")
    budget.hold(40 << 20, "a reply", "ask for less").release()  # fits once what malloc holds free is left out
    with pytest.raises(ResourceExhausted, match=r"a reply needs about 52428800 bytes .* the shard holds 94371840 bytes "
                                                r".* and its replies in flight 33554432 more, past its memory budget "
                                                r"of 171966464 bytes \(--memory-budget-bytes\): ask for less"):
        budget.hold(50 << 20, "a reply", "ask for less")
    callbacks = []
    held.until(callbacks.append)
    assert budget.held == 32 << 20
    callbacks[0]("the gRPC context")
    callbacks[0]("the gRPC context")  # once only
    assert budget.held == 0

    class Reply:
        need, describe = 16 << 20, staticmethod(lambda: "a reply")

    async def failing() -> bytes:
        assert budget.held == 16 << 20
        raise ValueError("the read failed")

    with pytest.raises(ValueError):
        asyncio.run(budget.serve(Reply, "ask for less", None, failing))
    assert budget.held == 0

    async def fine() -> bytes:
        return b"bytes"

    assert asyncio.run(budget.serve(Reply, "ask for less", None, fine)) == b"bytes" and budget.held == 0


def test_a_stats_reply_is_sized_before_it_is_built_and_refused_past_the_limit():
    from types import SimpleNamespace as NS

    from shardps.server.service import _check_stats_size

    ids = [f"{k:04d}" + "w" * 252 for k in range(1024)]  # --max-workers ids of --max-id-chars characters
    keys = [pb.KeySpec(key="k" * 1000 + str(k), shape=[3, 4]) for k in range(700)]
    plan = pb.PlanSpec(keys=keys, num_shards=1, chunk_bytes=1 << 20)
    specs = {f"t{k}": NS(spec=TableSpec(name=f"t{k}" + "x" * 120, embedding_dim=8)) for k in range(64)}
    store = NS(members=NS(ids=lambda: ids), rounds=NS(rejoining={"r" * 256}, staleness=NS(counts=[1] * 8)),
               tables=NS(tables=specs), job=NS(plan_bytes=plan.SerializeToString()),
               config=NS(max_message_bytes=1 << 20))
    _check_stats_size(store, False)  # about 0.6 MiB: fits 1 MiB
    with pytest.raises(ResourceExhausted, match=r"the Stats reply would take up to \d+ bytes \(1024 members' ids.*"
                                                r"message limit of 1048576 bytes \(--max-message-bytes\): ask without "
                                                r"the plan"):
        _check_stats_size(store, True)  # the plan adds 0.7 MiB
    # the estimate bounds the reply protobuf builds from the same contents
    store.config.max_message_bytes = 1 << 30
    full = pb.StatsReply(members=ids, pushed=ids, clocks=[2**63] * len(ids), rejoining=["r" * 256], plan=plan,
                         staleness_histogram=[2**63] * 8, job_id="j" * 64, digest="d" * 64, incarnation="i" * 32,
                         plan_fingerprint="f" * 64, optimizer="AdamW")
    if "tables" in pb.StatsReply.DESCRIPTOR.fields_by_name:
        full.tables.extend(t.spec.to_proto() for t in specs.values())
    limit = full.ByteSize() - 1
    store.config.max_message_bytes = limit
    with pytest.raises(ResourceExhausted):
        _check_stats_size(store, True)

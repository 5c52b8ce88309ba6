"""A push larger than one message: the worker's split (``push_parts``) and the shard's join (``PushParts``)."""

from __future__ import annotations

import pytest
import torch

from shardps.common.rows import ids_from, rows_from
from shardps.server.errors import Aborted, InvalidArgument
from shardps.server.sparse.requests import PushParts
from shardps.worker.embedding.tables import push_parts


def entries() -> list[tuple]:
    g = torch.Generator().manual_seed(0)
    return [("a", torch.arange(0, 3000, 3), torch.randn(1000, 64, generator=g), 0.5),
            ("empty", torch.empty(0, dtype=torch.int64), torch.empty(0, 8), 0.1),
            ("b", torch.arange(500) * 11, torch.randn(500, 8, generator=g), 0.25)]


@pytest.mark.parametrize("limit", [64 << 20, 200_000, 40_000])
def test_parts_stay_under_half_the_limit_and_join_back_to_the_whole_push(limit):
    parts = push_parts("w0", "s", 7, entries(), limit)
    assert all(p.ByteSize() <= limit // 2 for p in parts)
    if limit == 64 << 20:
        assert len(parts) == 1 and parts[0].parts == 0
    else:
        assert len(parts) >= 3 and [p.part for p in parts] == list(range(len(parts)))
        assert {p.parts for p in parts} == {len(parts)} and {p.push for p in parts} == {7}
    joined, held = None, PushParts()
    for p in [*reversed(parts[:-1]), parts[-1]]:  # the earlier parts in any order, then the last
        joined = held.add(p)
    assert joined is not None
    got = {t.table: t for t in joined.tables}
    for name, ids, grads, lr in entries():
        assert torch.equal(ids_from(got[name].ids), ids)
        assert torch.equal(rows_from(got[name].grads, ids.numel(), grads.shape[1]), grads)
        assert got[name].lr == lr


def test_a_row_too_large_for_half_the_limit_is_refused():
    with pytest.raises(ValueError, match="one row of table 'a' takes 264 bytes, over half the message limit"):
        push_parts("w0", "s", 1, entries(), 400)


def test_a_push_of_another_number_drops_the_parts_held_and_a_member_that_leaves_drops_its_own():
    parts = push_parts("w0", "s", 1, entries(), 40_000)
    newer = push_parts("w0", "s", 2, entries(), 40_000)
    held = PushParts()
    assert held.add(parts[0]) is None
    assert held.add(newer[0]) is None  # push 1 given up (its call failed): its parts are dropped
    assert [held.add(p) is None for p in newer[1:]] == [True] * (len(newer) - 2) + [False]
    assert held.add(parts[0]) is None
    held.drop("w0")
    assert all(held.add(p) is None for p in parts[1:-1])  # parts[0] left with the member
    with pytest.raises(Aborted, match=r"push 1 came without its parts \[0\].*send the whole push again"):
        held.add(parts[-1])  # the worker sends the whole push again (SparseTables.wait_sent)
    assert all(held.add(p) is None for p in parts[:-1]) and held.add(parts[-1]) is not None
    assert held.add(parts[0]) is None
    with pytest.raises(InvalidArgument, match="came in"):
        held.add(type(parts[0])(worker_id="w0", session="s", push=1, part=0, parts=2))

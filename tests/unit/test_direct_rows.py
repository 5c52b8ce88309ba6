"""A served table's direct rows answer every lookup exactly as the table's sorted-id lookup does.

``ReplicaState.lookup`` gathers from ``DirectRows`` when the ids it is asked for fall in the table's dense range,
and asks ``TableExport.lookup`` otherwise; each test compares both answers with ``torch.equal`` over ids held,
ids not held inside the range, ids outside it, a padding id, and after deltas that push, evict and add ids.
"""

from __future__ import annotations

import pytest
import torch

from shardps.common.rows import TableSpec
from shardps.worker.embedding.export import TableDelta, TableExport
from shardps.worker.serving.direct import MAX_ELEMENTS, SPAN_FACTOR, SPAN_SLACK, direct_rows
from shardps.worker.serving.replica import ReplicaState

DIM = 4


def table(ids: list[int], seed: int = 0, **spec) -> TableExport:
    ids = torch.tensor(sorted(ids), dtype=torch.int64)
    weights = torch.randn(ids.numel(), DIM, generator=torch.Generator().manual_seed(seed))
    return TableExport(TableSpec(name="t", embedding_dim=DIM, seed=3, init_scale=0.5, **spec), ids, weights, {}, 0, [])


def delta(spec: TableSpec, ids: list[int], evicted: list[int], seed: int) -> TableDelta:
    ids = torch.tensor(sorted(ids), dtype=torch.int64)
    return TableDelta(spec, ids, torch.randn(ids.numel(), DIM, generator=torch.Generator().manual_seed(seed)),
                      torch.tensor(sorted(evicted), dtype=torch.int64), [1], False, ["a"])


def same_answers(state: ReplicaState, t: TableExport, asked: torch.Tensor) -> None:
    assert torch.equal(state.lookup("t", asked), t.lookup(asked))


def test_lookups_in_and_around_the_range_equal_the_table_s():
    t = table([100, 101, 103, 104, 110, 130], padding_idx=102)
    direct = direct_rows(t)
    assert direct is not None and direct.lo < 100 and direct.lo + direct.rows.shape[0] > 130
    state = ReplicaState({"t": t}, direct={"t": direct})
    inside = torch.tensor([[100, 102, 105], [130, 104, 129]])  # held, padding, not held; any shape
    assert direct.lookup(inside.reshape(-1)) is not None
    same_answers(state, t, inside)
    outside = torch.tensor([100, 10**6, -5])  # one id outside: the table answers all of them
    assert direct.lookup(outside) is None
    same_answers(state, t, outside)
    assert torch.equal(state.lookup("t", torch.tensor([102]))[0], torch.zeros(DIM))  # the padding row reads zeros


def test_deltas_update_the_rows_they_touch_and_a_range_that_grows_is_made_again():
    t0 = table(list(range(0, 200, 2)))
    d0 = direct_rows(t0)
    span = d0.rows.shape[0]
    steps = [([4, 6, 201], [8, 10]),  # pushed (one new id inside the room), evicted
             ([8], []),  # an evicted id comes back
             ([5000], [0]),  # an id beyond the range's room: made again
             ([10**6], [])]  # and one so far that the ids are too sparse: no direct rows
    for k, (pushed, evicted) in enumerate(steps):
        change = delta(t0.spec, pushed, evicted, seed=k + 1)
        t1 = change.apply(t0)
        kept = d0.rows.clone()
        d1 = direct_rows(t1, d0, torch.cat([change.ids, change.evicted]))
        assert torch.equal(d0.rows, kept)  # the previous state's rows are never changed
        if d1 is not None:  # every id of the range, answered by the direct rows alone, through the state too
            inside = torch.arange(d1.lo, d1.lo + d1.rows.shape[0])
            assert torch.equal(d1.lookup(inside), t1.lookup(inside))
            state = ReplicaState({"t": t1}, direct={"t": d1})
            assert torch.equal(state.lookup("t", inside), t1.lookup(inside))
            assert torch.equal(state.lookup("t", inside.int()), t1.lookup(inside))  # int32 ids: the same rows
        if k < 2:
            assert d1 is not None and d1.lo == d0.lo and d1.rows.shape[0] == span  # updated in place
        if k == 2:
            assert d1 is not None and d1.lo + d1.rows.shape[0] > 5000 and d1.lookup(torch.tensor([5000])) is not None
        asked = torch.arange(-60, 260)  # across the range's ends: the table answers
        assert torch.equal(ReplicaState({"t": t1}, direct={"t": d1} if d1 is not None else {}).lookup("t", asked),
                           t1.lookup(asked))
        t0, d0 = t1, d1
    assert d0 is None


@pytest.mark.parametrize("ids", [[0, 2**40], [-(2**62) - 1, -(2**62)], [2**62 - 1, 2**62]])
def test_sparse_or_extreme_ids_have_no_direct_rows(ids):
    assert direct_rows(table(ids)) is None


def dense(n: int, dim: int, step: int = 1) -> TableExport:
    return TableExport(TableSpec(name="t", embedding_dim=dim), torch.arange(0, n * step, step), torch.zeros(n, dim),
                       {}, 0, [])


def test_direct_rows_stay_within_their_bounds_room_included():
    dim = 512
    fits = MAX_ELEMENTS // dim  # 32,768 rows of 512 elements: the element budget exactly
    rows = direct_rows(dense(fits - 100, dim))
    assert rows is not None and rows.rows.numel() <= MAX_ELEMENTS  # its room to grow shrinks to fit
    assert direct_rows(dense(fits + 1, dim)) is None  # dense, but over the element budget
    sparse = dense(1001, 4, step=69)  # 69,001 ids wide for 1,001 rows: SPAN_FACTOR * 1001 + SPAN_SLACK = 69,540
    made = direct_rows(sparse)
    assert made is not None and made.rows.shape[0] <= SPAN_FACTOR * 1001 + SPAN_SLACK
    grown = direct_rows(sparse, made, torch.tensor([5], dtype=torch.int64))  # nothing new outside: in place
    assert grown is not None and grown.lo == made.lo and grown.rows.shape == made.rows.shape
    assert direct_rows(table([])) is None


def test_ids_of_another_dtype_never_take_the_direct_rows():
    rows = direct_rows(table(list(range(2**40, 2**40 + 50))))
    assert rows is not None
    assert rows.lookup(torch.tensor([3], dtype=torch.int32)) is None  # 3 - 2**40 in int32 would wrap
    assert rows.lookup(torch.tensor([2**40 + 3])) is not None

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
from shardps.worker.serving.direct import MAX_ELEMENTS, direct_rows
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
        d1 = direct_rows(t1, d0, torch.cat([change.ids, change.evicted]))
        asked = torch.arange(-60, 260)
        if d1 is not None:  # every id of the range, answered by the direct rows alone
            inside = torch.arange(d1.lo, d1.lo + d1.rows.shape[0])
            assert torch.equal(d1.lookup(inside), t1.lookup(inside))
        if k < 2:
            assert d1 is not None and d1.lo == d0.lo and d1.rows.shape[0] == span  # updated in place
            assert d1.rows.data_ptr() != d0.rows.data_ptr()  # a copy: the previous state is never changed
            assert d1.lookup(asked[(asked >= d1.lo) & (asked < d1.lo + span)]) is not None
        if k == 2:
            assert d1 is not None and d1.lo + d1.rows.shape[0] > 5000 and d1.lookup(torch.tensor([5000])) is not None
        assert torch.equal(ReplicaState({"t": t1}, direct={"t": d1} if d1 is not None else {}).lookup("t", asked),
                           t1.lookup(asked))
        assert torch.equal(ReplicaState({"t": t0}, direct={"t": d0}).lookup("t", asked), t0.lookup(asked))
        t0, d0 = t1, d1
    assert d0 is None


@pytest.mark.parametrize("ids", [[0, 2**40], [-(2**62) - 1, -(2**62)], [2**62 - 1, 2**62]])
def test_sparse_or_extreme_ids_have_no_direct_rows(ids):
    assert direct_rows(table(ids)) is None


def test_direct_rows_stay_within_their_element_budget():
    n = MAX_ELEMENTS // DIM  # a range of exactly the budget
    t = TableExport(TableSpec(name="t", embedding_dim=DIM), torch.tensor([0, n - 1]), torch.zeros(2, DIM), {}, 0, [])
    assert direct_rows(t) is None  # 2 ids over n: too sparse anyway
    dense = TableExport(TableSpec(name="t", embedding_dim=DIM), torch.arange(1000), torch.zeros(1000, DIM), {}, 0, [])
    rows = direct_rows(dense)
    assert rows is not None and rows.rows.numel() <= MAX_ELEMENTS and rows.rows.shape[0] >= 1000
    assert direct_rows(table([])) is None

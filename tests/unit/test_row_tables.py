"""Tables of one shard share its id index under their own tags: equal ids in two tables are two rows, and one
table's eviction, admission or growth never touches the other's rows."""

import torch

from shardps.common.rows import TableSpec, initial_rows
from shardps.server.sparse.tables import SparseTables, _Push


class _Config:
    memory_budget_bytes = 1 << 40
    table_max_bytes = 1 << 40
    shard_index = 0


class _Store:
    config = _Config()


def _shard(**specs) -> SparseTables:
    tables = SparseTables(_Store())
    from shardps.server.sparse.table import RowTable
    for name, kw in specs.items():
        spec = TableSpec(name=name, embedding_dim=2, optimizer="sgd", hyperparams={}, **kw)
        tables.tables[name] = RowTable(spec, 1 << 40, tables.index, len(tables.tables))
    return tables


def _round(tables: SparseTables, number: int, **pushed) -> None:
    parts = {name: (ids, torch.ones(ids.numel(), 2), 1.0) for name, ids in pushed.items()}
    tables._update([_Push(number, parts)], number)


def test_equal_ids_in_two_tables_are_two_rows_and_eviction_stays_in_its_table():
    tables = _shard(a={"ttl_rounds": 2}, b={}, c={"capacity": 2})
    ids = torch.tensor([5, 6, 7])
    _round(tables, 0, a=ids, b=ids, c=ids)
    a, b, c = (tables.tables[n] for n in "abc")
    assert (a.rows, b.rows, c.rows) == (3, 3, 2)  # c keeps its 2 most recently pushed rows
    _round(tables, 1, b=ids[:1])
    _round(tables, 2, b=ids[:1])
    assert (a.rows, b.rows) == (0, 3)  # a's rows idle for 2 rounds are gone; b's equal ids stay
    read = tables._read([(a, ids), (b, ids)], "w0")
    assert torch.equal(read[0], initial_rows("a", ids, 2, 0, a.spec.init_scale))
    want = initial_rows("b", ids, 2, 0, b.spec.init_scale) - 1.0
    want[0] -= 2.0  # id 5 was pushed in three rounds
    assert torch.equal(read[1], want)
    assert len(tables.index) == b.rows + c.rows
    assert a.counts["evicted_ttl"] == 3 and c.counts["evicted_capacity"] == 1


def test_a_round_after_its_pulls_reuses_their_slots_and_gives_the_same_rows():
    g = torch.Generator().manual_seed(3)
    with_pulls, without = _shard(a={}, b={"ttl_rounds": 3}), _shard(a={}, b={"ttl_rounds": 3})
    for number in range(12):
        pushes = []
        for w in ("w0", "w1"):
            ids = {n: torch.unique(torch.randint(0, 40, (15,), generator=g)) for n in "ab"}
            grads = {n: torch.randn(i.numel(), 2, generator=g) for n, i in ids.items()}
            if number % 4 != 3:  # now and then a push that is not what its worker pulled
                with_pulls._read([(with_pulls.tables[n], ids[n]) for n in "ab"], w)
            pushes.append(_Push(number, {n: (ids[n], grads[n], 0.5) for n in "ab"}, w))
        hits = []
        original = with_pulls.find
        with_pulls.find = lambda parts: hits.append(len(parts)) or original(parts)
        with_pulls._update(pushes, number)
        with_pulls.find = original
        assert hits == ([0] if number % 4 != 3 else [2])  # no lookup left when every push matched its pull
        without._update([_Push(p.number, p.tables) for p in pushes], number)
    for n in "ab":
        got, want = with_pulls.tables[n], without.tables[n]
        assert got.rows == want.rows
        probe = torch.arange(40)
        assert torch.equal(with_pulls._read([(got, probe)], "x")[0], without._read([(want, probe)], "x")[0])

"""``IdIndex`` (the shard's id -> slot map of sparse tables) against a Python dict, through growth, removal and
rehashing, with ids colliding on purpose."""

import pytest
import torch

from shardps.server.sparse.index import IdIndex


def _check(index: IdIndex, oracle: dict[int, int], probe: torch.Tensor) -> None:
    got = index.find(probe).tolist()
    assert got == [oracle.get(i, -1) for i in probe.tolist()]
    ids, slots, tags = index.items()
    assert bool((tags == 0).all())
    assert dict(zip(ids.tolist(), slots.tolist())) == oracle
    assert len(index) == len(oracle)


def test_index_matches_a_dict_through_inserts_removals_and_rehashes():
    g = torch.Generator().manual_seed(7)
    index, oracle, next_slot = IdIndex(capacity=16), {}, 0
    # ids from the whole int64 range, plus a dense block (many share home positions in a small table)
    pool = torch.cat([torch.randint(-2**63, 2**63 - 1, (3000,), generator=g), torch.arange(-500, 500)]).unique()
    for step in range(40):
        batch = pool[torch.randint(0, pool.numel(), (300,), generator=g)].unique()
        absent = torch.tensor([i not in oracle for i in batch.tolist()], dtype=torch.bool)
        new = batch[absent]
        slots = torch.arange(next_slot, next_slot + new.numel())
        next_slot += new.numel()
        index.insert(new, slots)
        oracle.update(zip(new.tolist(), slots.tolist()))
        if step % 3 == 2:  # remove a third of what is held, and some ids never held
            held = torch.tensor(sorted(oracle), dtype=torch.int64)
            gone = held[torch.randperm(held.numel(), generator=g)[: held.numel() // 3]]
            asked = torch.cat([gone, torch.tensor([2**62 + 11, -(2**62) - 3])])
            removed = index.remove(asked)
            assert removed.tolist() == [oracle.pop(i) for i in gone.tolist()]
        probe = torch.cat([batch, pool[torch.randint(0, pool.numel(), (200,), generator=g)]])
        _check(index, oracle, probe)
    assert index.cap >= len(oracle) * 4 // 3
    assert index.find(torch.empty(0, dtype=torch.int64)).numel() == 0


def test_full_windows_are_probed_past():
    # ids placed in a 16-entry table up to 3/4 full: the probe runs past full windows and wraps around
    index = IdIndex(capacity=16)
    ids = torch.arange(12, dtype=torch.int64) * 16  # a table of 16 entries: spread or not, 12 fit
    index.insert(ids, torch.arange(12))
    assert index.cap == 16
    assert index.find(ids).tolist() == list(range(12))
    assert index.find(ids + 1).tolist() == [-1] * 12


def test_tags_keep_equal_ids_of_different_tables_apart():
    index = IdIndex(capacity=16)
    ids = torch.tensor([5, -9, 2**62], dtype=torch.int64)
    index.insert(ids, torch.tensor([0, 1, 2]), tags=0)
    index.insert(ids, torch.tensor([10, 11, 12]), tags=3)
    index.insert(torch.cat([ids, ids]), torch.tensor([20, 21, 22, 30, 31, 32]),
                 tags=torch.tensor([1, 1, 1, 2, 2, 2]))
    assert index.find(ids, 0).tolist() == [0, 1, 2]
    assert index.find(ids, 3).tolist() == [10, 11, 12]
    assert index.find(ids, torch.tensor([1, 2, 4])).tolist() == [20, 31, -1]
    assert index.remove(ids[:1], 3).tolist() == [10]
    assert index.find(ids, 3).tolist() == [-1, 11, 12] and index.find(ids, 0).tolist() == [0, 1, 2]
    assert len(index) == 11


def test_keys_inserted_later_count_at_once_and_are_in_place_for_every_other_call():
    index = IdIndex(capacity=16)
    index.insert(torch.arange(10), torch.arange(10))
    index.insert_later(torch.arange(10, 40), torch.arange(10, 40), torch.zeros(30, dtype=torch.int64))
    index.insert_later(torch.arange(40, 45), torch.arange(40, 45), torch.zeros(5, dtype=torch.int64))
    assert len(index) == 45 and index.size == 10  # counted, not placed yet (len is safe from another thread)
    assert index.find(torch.tensor([3, 12, 44, 45])).tolist() == [3, 12, 44, -1]  # placed by the lookup
    index.insert_later(torch.arange(50, 53), torch.arange(50, 53), torch.zeros(3, dtype=torch.int64))
    assert index.remove(torch.tensor([51, 0])).tolist() == [51, 0]
    _check(index, {i: i for i in [*range(1, 45), 50, 52]}, torch.arange(-3, 60))


def test_direct_tags_beside_hashed_ones_match_a_dict_through_inserts_and_removals():
    """Bounded tables' tags kept in direct arrays (``make_direct``) and hashed tags in one index, looked up,
    inserted and removed in mixed batches: the same answers as a dict; ids outside a direct tag's range read -1."""
    from shardps.server.sparse.index import DIRECT_MAX_IDS

    g = torch.Generator().manual_seed(11)
    index, oracle, next_slot = IdIndex(capacity=16), {}, 0
    limits = {1: 50, 3: 7}  # direct tags and their num_embeddings; tags 0 and 2 hashed
    for tag, n in limits.items():
        index.make_direct(tag, n)
    with pytest.raises(ValueError, match="holds keys already"):
        index.make_direct(1, 50)
    with pytest.raises(ValueError, match="1 to"):
        index.make_direct(4, DIRECT_MAX_IDS + 1)

    def ids_of(tag: int, k: int) -> torch.Tensor:
        n = limits.get(tag, 0)
        return torch.randint(0, n, (k,), generator=g) if n else torch.randint(-2**40, 2**40, (k,), generator=g)

    for step in range(30):
        tags = torch.randint(0, 4, (120,), generator=g)
        ids = torch.cat([ids_of(int(t), 1) for t in tags])
        keys = list(dict.fromkeys(zip(tags.tolist(), ids.tolist())))  # unique (tag, id), in order
        new = [k for k in keys if k not in oracle]
        new_tags = torch.tensor([t for t, _ in new], dtype=torch.int64)
        new_ids = torch.tensor([i for _, i in new], dtype=torch.int64)
        slots = torch.arange(next_slot, next_slot + len(new))
        next_slot += len(new)
        index.insert(new_ids, slots, new_tags)
        oracle.update(zip(new, slots.tolist()))
        if step % 4 == 3:  # remove some held keys and some never held, in one mixed batch
            held = list(oracle)
            gone = [held[int(j)] for j in torch.randperm(len(held), generator=g)[: len(held) // 3]]
            asked = gone + [(1, 49) if (1, 49) not in oracle else (0, 2**41), (2, -5)]
            removed = index.remove(torch.tensor([i for _, i in asked]), torch.tensor([t for t, _ in asked]))
            assert removed.tolist() == [oracle.pop(k) for k in asked if k in oracle]  # in the order asked
        probe_tags = torch.randint(0, 4, (200,), generator=g)
        probe_ids = torch.cat([ids_of(int(t), 1) for t in probe_tags])
        probe_ids[:5] = torch.tensor([-1, 50, 7, 2**62, -2**62])  # out of every direct range
        probe_tags[:5] = torch.tensor([1, 1, 3, 1, 3])
        got = index.find(probe_ids, probe_tags).tolist()
        assert got == [oracle.get((t, i), -1) for t, i in zip(probe_tags.tolist(), probe_ids.tolist())]
        for tag in range(4):  # one tag alone, as a table asks
            mine = [(i, s) for (t, i), s in oracle.items() if t == tag]
            ids, slots, tags_back = index.items(tag)
            assert dict(zip(ids.tolist(), slots.tolist())) == dict(mine) and bool((tags_back == tag).all())
            if tag in limits:
                assert ids.tolist() == sorted(ids.tolist())
                assert index.find(ids, tag).tolist() == slots.tolist()
        ids, slots, tags_back = index.items()
        assert dict(zip(zip(tags_back.tolist(), ids.tolist()), slots.tolist())) == oracle
        assert len(index) == len(oracle)
    with pytest.raises(ValueError, match="outside its bounded table's range"):
        index.insert(torch.tensor([50]), torch.tensor([0]), 1)


def test_keys_of_direct_tags_never_wait_for_a_flush():
    """``insert_later`` puts keys of direct tags in at once and holds the others; ``find_direct`` answers the direct
    ones without flushing them, and refuses keys of hashed tags."""
    index = IdIndex(capacity=16)
    index.make_direct(2, 10)
    index.insert_later(torch.tensor([4, 9, 123]), torch.tensor([0, 1, 2]), torch.tensor([2, 2, 0]))
    assert index.pending and len(index) == 3
    assert index.direct_keys(torch.tensor([2, 0, 2])).tolist() == [True, False, True]
    assert index.direct_keys(2) is True and index.direct_keys(0) is False
    assert index.find_direct(torch.tensor([9, 4, 5]), 2).tolist() == [1, 0, -1]
    assert index.pending  # the hashed key still waits
    with pytest.raises(ValueError, match="direct tags only"):
        index.find_direct(torch.tensor([123]), 0)
    assert index.find(torch.tensor([123, 4]), torch.tensor([0, 2])).tolist() == [2, 0] and not index.pending

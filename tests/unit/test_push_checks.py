"""The sparse push's batched check: every table's ids strictly increasing, one comparison for all tables."""

import torch

from shardps.server.sparse.requests import increasing


def t(*ids):
    return torch.tensor(ids, dtype=torch.int64)


def test_each_part_is_checked_on_its_own_and_their_boundaries_are_not_compared():
    assert increasing([t(5, 9), t(1, 3)])  # part 2 starts below part 1's end: fine
    assert increasing([t(1), t(), t(0)])
    assert increasing([t(), t(1, 2)])
    assert increasing([t(), t()])
    assert increasing([t(-2**63, 2**63 - 1)])
    assert not increasing([t(1, 2), t(3, 3)])  # a repeat in the last part
    assert not increasing([t(4, 4), t(1, 2)])  # a repeat in the first part
    assert not increasing([t(1, 2), t(9, 5), t(7)])  # decreasing inside a part
    assert not increasing([t(2, 1)])


def test_the_batched_check_agrees_with_one_check_per_part():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        parts = [torch.randint(0, 12, (int(torch.randint(0, 5, (1,), generator=g)),), generator=g).sort().values
                 for _ in range(int(torch.randint(1, 5, (1,), generator=g)))]
        alone = all(bool((p[1:] > p[:-1]).all()) for p in parts)
        assert increasing(parts) == alone

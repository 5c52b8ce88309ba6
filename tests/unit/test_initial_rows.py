"""Tables' initial rows and placement against a plain-Python SplitMix64: the values a table starts from (and the
shard an id lives on) never change between versions or with how the tensors are computed."""

import math

import torch

from shardps.common.rows import initial_rows, initial_rows_by, initial_rows_salted, mix, salt, shard_of_salted

MASK = (1 << 64) - 1


def _mix(x: int) -> int:  # SplitMix64's finaliser on unsigned 64-bit ints
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _uniform_24(i: int, s: int, d: int) -> float:  # the 24-bit uniform of column d of id i under salt s
    return (_mix((_mix((i ^ s) & MASK) + d) & MASK) >> 40) / (1 << 24)


IDS = [0, 1, -1, 7, 2**62 + 3, -(2**63), 2**63 - 1, 123456789]


def test_mix_and_placement_equal_plain_splitmix64():
    ids = torch.tensor(IDS, dtype=torch.int64)
    assert mix(ids).tolist() == [_signed(_mix(i & MASK)) for i in IDS]
    s = salt("t", -1)
    assert shard_of_salted(ids, s, 5).tolist() == [(_mix((i ^ s) & MASK) >> 1) % 5 for i in IDS]


def test_initial_rows_equal_plain_splitmix64_for_every_initialiser():
    ids = torch.tensor(IDS, dtype=torch.int64)
    s, dim = salt("user", 3), 6
    u = [[_uniform_24(i, s, d) for d in range(dim)] for i in IDS]
    want = torch.tensor([[(x * 2.0 - 1.0) for x in row] for row in u], dtype=torch.float32) * 0.25
    assert torch.equal(initial_rows_salted(ids, s, dim, 0.25), want)
    assert torch.equal(initial_rows("user", ids, dim, 3, 0.25), want)
    uniform = torch.tensor(u, dtype=torch.float32) * (0.5 - -0.25) + -0.25
    assert torch.equal(initial_rows_by(ids, s, dim, "uniform", (-0.25, 0.5)), uniform)
    normal = initial_rows_by(ids, s, dim, "normal", (1.0, 2.0))  # Box-Muller on the same bits: close, in float32
    for i, row in zip(IDS, normal.tolist()):
        for d, got in enumerate(row):
            z = _mix((_mix((i ^ s) & MASK) + d) & MASK)
            a, b = (z >> 40) / (1 << 24), ((z >> 16) & ((1 << 24) - 1)) / (1 << 24)
            assert math.isclose(got, 1.0 + 2.0 * math.sqrt(-2.0 * math.log1p(-a)) * math.cos(2 * math.pi * b),
                                rel_tol=1e-5, abs_tol=1e-5)
    salts = torch.tensor([salt(str(k), 0) for k in range(len(IDS))])
    scales = torch.linspace(0.1, 0.8, len(IDS))
    mixed = initial_rows_salted(ids, salts, dim, scales)  # several tables in one call: row by row the same
    for k, i in enumerate(IDS):
        assert torch.equal(mixed[k], initial_rows_salted(torch.tensor([i]), int(salts[k]), dim, scales[k:k + 1])[0])

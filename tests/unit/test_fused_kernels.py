"""FBGEMM's fused pooled lookup (``worker/embedding/fused.py``) against torch's per-feature ``embedding_bag``.

Features of every form a collection passes (``[B, L]`` ids, flat ids with ``B`` or ``B + 1`` offsets, empty
bags, weighted sums, several dims), pooled by one FBGEMM call: the outputs and every row gradient equal
the torch path's within float rounding. ``SHARDPS_TABLE_KERNELS`` picks the path; steps that do not qualify
(a padding id, rows off the CPU, unequal batch sizes) fall back to torch (``None``).
"""

from __future__ import annotations

import pytest
import torch

from shardps.worker.embedding import fused
from shardps.worker.embedding.modules import bags

pytestmark = pytest.mark.skipif(not fused.available(), reason="FBGEMM's CPU kernels (fbgemm-gpu-cpu) not installed")
B = 6


def features(weighted: bool) -> list[tuple]:
    g = torch.Generator().manual_seed(0)
    out = []
    for k, (rows, dim) in enumerate([(5, 4), (9, 8), (3, 4), (7, 2)]):
        weight = torch.randn(rows, dim, generator=g).requires_grad_()
        if k % 2 == 0:  # [B, L] ids
            index, offsets, last = torch.randint(0, rows, (B, 3), generator=g), None, False
        else:  # flat ids and offsets, bags of 0 to 4 ids
            lengths = torch.randint(0, 5, (B,), generator=g)
            index = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
            last = k == 3
            offsets = offsets if last else offsets[:-1]
        psw = torch.rand(index.numel(), generator=g) if weighted else None
        out.append((weight, index, offsets, psw, last))
    return out


@pytest.mark.parametrize("mode,weighted", [("sum", False), ("mean", False), ("sum", True)])
def test_one_fused_call_pools_as_torch_per_feature(mode, weighted, monkeypatch):
    monkeypatch.setenv(fused.KERNELS_ENV, "fbgemm")
    mine, ref = features(weighted), features(weighted)
    whole = fused.pooled(mine, mode)
    assert whole is not None and whole.shape == (B, sum(w.shape[1] for w, *_ in mine))
    got = whole.split([w.shape[1] for w, *_ in mine], dim=1)
    want = [bags(index, weight, offsets, mode, psw.reshape(index.shape) if psw is not None and offsets is None
                 else psw, last, None) for weight, index, offsets, psw, last in ref]
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)
    torch.cat(got, 1).pow(2).sum().backward()
    torch.cat(want, 1).pow(2).sum().backward()
    for (a, *_), (b, *_) in zip(mine, ref):
        assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=0)


def test_steps_that_do_not_qualify_fall_back_to_torch(monkeypatch):
    monkeypatch.setenv(fused.KERNELS_ENV, "fbgemm")
    fs = features(False)
    assert fused.pooled(fs, "max") is None  # no max pooling in FBGEMM's dense kernel
    assert fused.pooled([fs[0], (fs[1][0].double(), *fs[1][1:])], "sum") is None  # float64 rows
    short = (fs[0][0], fs[0][1][:3], None, None, False)
    assert fused.pooled([fs[0], short], "sum") is None  # batch sizes differ
    with_pad = [(*f[:5], "sum", 0 if k == 1 else None) for k, f in enumerate(fs)]
    got, whole = fused.pooled_by_mode(with_pad)
    assert got[1] is None and all(g is not None for k, g in enumerate(got) if k != 1) and whole is None
    got, whole = fused.pooled_by_mode([(*f[:5], "sum", None) for f in fs])
    assert whole is not None and torch.equal(torch.cat(got, 1), whole)
    monkeypatch.setenv(fused.KERNELS_ENV, "torch")
    assert fused.pooled(fs, "sum") is None and fused.kernels() == "torch"
    monkeypatch.setenv(fused.KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match="auto, fbgemm or torch"):
        fused.kernels()

"""Overlapped pulls (model=): each forward waits for exactly the parameters it reads."""

from __future__ import annotations

import copy

import torch
from torch import nn

from shardps.worker.config import WireOptions
from shardps.worker.optimizer import DistributedOptimizer
from tests.support.threads import run_workers

STEPS = 12


class AttentionNet(nn.Module):
    """MultiheadAttention reads ``out_proj.weight`` without calling ``out_proj``; ``empty`` has no elements."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.empty = nn.Parameter(torch.empty(0))
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, _ = self.attn(x, x, x)
        return self.out(a.mean(dim=1)) + self.empty.sum()


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, 5, 16, generator=g), torch.randint(0, 4, (6,), generator=g)


def test_overlap_waits_for_parameters_read_without_a_module_call(start_cluster) -> None:
    # SGD, not Adam: the key part of in_proj_bias has a zero true gradient (softmax cancels it), and
    # Adam's 1/sqrt(v) would blow its rounding residue up to lr-sized steps in any 2-way split.
    torch.manual_seed(3)
    initial = AttentionNet()
    reference = copy.deepcopy(initial)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        x, y = data(step)
        ref_opt.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        ref_opt.step()

    cluster = start_cluster(2, min_workers=2)
    replicas = [copy.deepcopy(initial) for _ in range(2)]
    learned: dict = {}

    def worker(i: int) -> None:
        model = replicas[i]
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        with DistributedOptimizer(opt, model.named_parameters(), servers=cluster.addresses, worker_id=f"w{i}",
                                  model=model, wire=WireOptions(chunk_bytes=256)) as dist:
            for step in range(STEPS):
                x, y = data(step)
                part = slice(3 * i, 3 * i + 3)
                dist.zero_grad()
                nn.functional.cross_entropy(model(x[part]), y[part]).backward()
                dist.step()
                if step == 0:
                    learned[i] = dict(dist._waits.wait_keys)

    run_workers(2, worker)
    # out_proj's forward never runs, so attention itself waits for its weights
    attn_keys = learned[0][id(replicas[0].attn)]
    assert {"attn.in_proj_weight", "attn.out_proj.weight", "attn.out_proj.bias"} <= set(attn_keys)
    for replica in replicas:
        for (key, want), got in zip(reference.named_parameters(), replica.parameters()):
            assert torch.allclose(want, got, rtol=0, atol=1e-5), key

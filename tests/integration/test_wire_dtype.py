"""Narrow wire types: gradients and/or parameters travel as bf16/fp16; shards keep fp32 master weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardps.worker.config import WireOptions
from shardps.worker.optimizer import DistributedOptimizer

STEPS = 5


def make() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(7)
    model = nn.Linear(32, 16)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 32, generator=g), torch.randn(8, 16, generator=g)


def run(model: nn.Module, optimizer) -> nn.Module:
    """STEPS steps with a torch optimizer or a DistributedOptimizer (same interface)."""
    for step in range(STEPS):
        x, y = batch(step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return model


def reference() -> nn.Module:
    return run(*make())


def train(servers: list[str], push: str, pull: str) -> nn.Module:
    model, opt = make()
    with DistributedOptimizer(opt, model.named_parameters(), servers=servers,
                              wire=WireOptions(push_dtype=push, pull_dtype=pull, chunk_bytes=256)) as dist:
        return run(model, dist)


def representable(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return torch.equal(t, t.to(dtype).float())


@pytest.mark.parametrize("wire, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_narrow_wire_keeps_fp32_master_weights(start_cluster, wire: str, dtype: torch.dtype) -> None:
    want = reference()
    # narrow pulls: the model receives parameters rounded to the wire type
    narrow = train(start_cluster(2).addresses, wire, wire)
    for p, ref in zip(narrow.parameters(), want.parameters()):
        assert representable(p.detach(), dtype)
        assert (p - ref).abs().max() < 2e-2
    # narrow pushes, fp32 pulls: the shards' fp32 master weights come back unrounded
    master = train(start_cluster(2).addresses, wire, "fp32")
    for p, ref in zip(master.parameters(), want.parameters()):
        assert not representable(p.detach(), dtype)
        assert (p - ref).abs().max() < 5e-3

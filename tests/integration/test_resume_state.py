"""Optimizer state loaded into the wrapped optimizer before wrapping is carried to the shards, or refused loudly.

Resuming fine-tuning from a plain torch checkpoint: ``opt.load_state_dict(saved)``
then ``DistributedOptimizer(opt, ...)``. The continuation must equal plain
torch continuing from the same state; a worker carrying other state into a
running job is refused at construction, its optimizer given back unchanged.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shardps import DistributedOptimizer, WireOptions

STEPS_BEFORE, STEPS_AFTER = 5, 10


def net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(70 + step)
    return torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)


def train(model: nn.Module, opt, steps: range) -> None:
    for step in steps:
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def checkpoint() -> tuple[dict, dict]:
    """Plain torch AdamW trained STEPS_BEFORE steps: (model state, optimizer state)."""
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    train(model, opt, range(STEPS_BEFORE))
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())


def test_state_loaded_before_wrapping_continues_like_plain_torch(start_cluster) -> None:
    model_state, opt_state = checkpoint()
    reference = net()
    reference.load_state_dict(model_state)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.1)
    ref_opt.load_state_dict(copy.deepcopy(opt_state))  # torch keeps the loaded tensors and steps them in place
    train(reference, ref_opt, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))

    cluster = start_cluster(2)
    model = net()
    model.load_state_dict(model_state)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    opt.load_state_dict(copy.deepcopy(opt_state))
    with DistributedOptimizer(opt, model.named_parameters(), servers=cluster.servers,
                              wire=WireOptions(chunk_bytes=256)) as dist:
        assert not opt.state, "the local optimizer holds no state: it lives on the shards"
        train(model, dist, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
        dist.synchronize()
        shard_state = dist.state_dict()
    for (key, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=key)
    for index, entries in ref_opt.state_dict()["state"].items():
        for name, value in entries.items():
            torch.testing.assert_close(torch.as_tensor(shard_state["state"][index][name]).float(),
                                       torch.as_tensor(value).float(), rtol=0, atol=1e-5)


def test_other_state_carried_into_a_running_job_is_refused_and_the_optimizer_kept(start_cluster) -> None:
    model_state, opt_state = checkpoint()
    cluster = start_cluster(1)
    first = net()
    first_opt = torch.optim.AdamW(first.parameters(), lr=0.01, weight_decay=0.1)
    with DistributedOptimizer(first_opt, first.named_parameters(), servers=cluster.servers) as dist:
        train(first, dist, range(3))  # the job runs from fresh state: its moments differ from the checkpoint's
        dist.synchronize()
        late = net()
        late.load_state_dict(model_state)
        late_opt = torch.optim.AdamW(late.parameters(), lr=0.01, weight_decay=0.1)
        late_opt.load_state_dict(opt_state)
        before = copy.deepcopy(late_opt.state_dict())
        with pytest.raises(ValueError, match="dist.load_state_dict"):
            DistributedOptimizer(late_opt, late.named_parameters(), servers=cluster.servers, worker_id="late")
        after = late_opt.state_dict()
        assert set(after["state"]) == set(before["state"])
        for index, entries in before["state"].items():
            for name, value in entries.items():
                assert torch.equal(torch.as_tensor(after["state"][index][name]), torch.as_tensor(value))
        assert "late" not in dist.stats()[0].members

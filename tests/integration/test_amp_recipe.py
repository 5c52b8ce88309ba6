"""The AMP recipe a DDP script already has, on a DistributedOptimizer: refused at the first call, never silent.

``scaler.scale(loss).backward(); scaler.unscale_(x); [clip_grad_norm_]; scaler.step(x); scaler.update()``
with ``x`` the wrapper or the optimizer it wraps would unscale, clip and skip
each worker's own gradient, which is not what one process does with the whole
batch. So ``scaler.unscale_(x)`` (and ``scaler.step(x)``, which unscales
first) raise at the first call, before any gradient changes, naming
``grad_scaler=``, whether or not the scaler was also given to the wrapper. The
supported path the message names (``grad_scaler=scaler``, ``max_grad_norm=``,
``dist.step()``) equals the recipe in one process to 1e-5 after 10 steps.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardps.worker.config import WireOptions
from shardps.worker.optimizer import DistributedOptimizer
from tests.support.recipe_net import Net, batch, part
from tests.support.threads import run_workers

STEPS = 10
MAX_NORM = 0.5


def scaler() -> torch.amp.GradScaler:
    # grows every 3 steps, so the scale changes during the run (on CPU with fp32, nothing overflows)
    return torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)


def one_process(clip: bool) -> dict[str, torch.Tensor]:
    """The DDP user's recipe in one process on the whole batch."""
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    s = scaler()
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step)
        s.scale(nn.functional.cross_entropy(model(x), y)).backward()
        s.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        s.step(opt)
        s.update()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def recipe_on_wrapper(servers: str, worker: int, target: str, clip: bool, give_scaler: bool, unscale: bool) -> str:
    """The standard recipe with ``scaler.*(x)``, ``x`` the wrapper or the wrapped optimizer; what the first call
    raised (``""``: nothing), after checking that the gradients are untouched by it."""
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    s = scaler()
    with DistributedOptimizer(opt, model.named_parameters(), servers=servers, worker_id=f"w{worker}",
                              grad_scaler=s if give_scaler else None,
                              wire=WireOptions(rpc_timeout=20.0)) as dist:
        x = dist if target == "wrapper" else opt
        xb, yb = batch(0)
        xb, yb = xb[part(worker)], yb[part(worker)]
        s.scale(nn.functional.cross_entropy(model(xb), yb)).backward()
        before = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        try:
            if unscale:
                s.unscale_(x)
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            s.step(x)
            s.update()
        except RuntimeError as exc:
            after = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
            assert all(torch.equal(before[k], after[k]) for k in before), "the refused call changed a gradient"
            return str(exc)
    return ""


@pytest.mark.parametrize("give_scaler", [False, True], ids=["plain-wrapper", "grad_scaler-given"])
@pytest.mark.parametrize("target", ["wrapper", "wrapped"])
@pytest.mark.parametrize("steps", ["unscale+clip+step", "unscale+step", "step"])
def test_standard_amp_recipe_is_refused_at_the_first_call(start_cluster, steps: str, target: str,
                                                          give_scaler: bool) -> None:
    cluster = start_cluster(2)
    clip, unscale = "clip" in steps, "unscale" in steps
    errors = run_workers(2, lambda w: recipe_on_wrapper(cluster.servers, w, target, clip, give_scaler, unscale),
                         timeout=60)
    for error in errors:
        assert "GradScaler.unscale_/step" in error and "grad_scaler=scaler" in error, error


def supported_path(servers: str, worker: int, clip: bool) -> dict[str, torch.Tensor]:
    """What the refusal advises: ``grad_scaler=scaler`` (and ``max_grad_norm=``), ``dist.step()``."""
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    s = scaler()
    with DistributedOptimizer(opt, model.named_parameters(), servers=servers, worker_id=f"w{worker}", grad_scaler=s,
                              max_grad_norm=MAX_NORM if clip else None, wire=WireOptions(rpc_timeout=20.0)) as dist:
        for step in range(STEPS):
            dist.zero_grad()
            x, y = batch(step)
            # the mean over this worker's rows; the shards average the workers (equal shares: the global mean)
            s.scale(nn.functional.cross_entropy(model(x[part(worker)]), y[part(worker)])).backward()
            dist.step()
            s.update()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.parametrize("clip", [False, True], ids=["no-clip", "clip"])
def test_the_advised_path_equals_the_recipe_in_one_process(start_cluster, clip: bool) -> None:
    cluster = start_cluster(2, min_workers=2)
    expected = one_process(clip)
    for got in run_workers(2, lambda w: supported_path(cluster.servers, w, clip), timeout=120):
        for k, v in expected.items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-5, msg=k)


def test_the_wrapped_optimizer_is_its_own_again_after_close(start_cluster) -> None:
    """After close() the optimizer's param_groups is its own list again (with any group added meanwhile), and
    a GradScaler may unscale it."""
    cluster = start_cluster(1)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    groups = opt.param_groups
    with DistributedOptimizer(opt, model.named_parameters(), servers=cluster.servers):
        assert opt.param_groups is not groups and opt.param_groups == groups
    assert opt.param_groups is groups
    s = scaler()
    s.scale(nn.functional.cross_entropy(model(batch(0)[0]), batch(0)[1])).backward()
    s.unscale_(opt)

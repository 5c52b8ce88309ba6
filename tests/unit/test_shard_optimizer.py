"""ShardOptimizer applies a round all-or-nothing: a refused round leaves parameters and state bit-identical."""

import pytest
import torch

from shardps.common.optim import OptimizerSpecError, optimizer_spec
from shardps.server.dense import optimizer as shard_optimizer
from shardps.server.dense.optimizer import RoundRefused, ShardOptimizer


def make(cls=torch.optim.AdamW, numel=1000, **hyper):
    spec = optimizer_spec(cls([torch.nn.Parameter(torch.zeros(1))], lr=0.01, **hyper))
    torch.manual_seed(0)
    params = {0: torch.randn(numel)}
    return ShardOptimizer(spec, params, {0: (0, 0, numel)}), params


def state_copy(opt: ShardOptimizer) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for st in opt.optimizer.state.values()
            for k, v in st.items()}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k], k


def test_step_that_raises_is_rolled_back(monkeypatch) -> None:
    """Item 8's last resort: if torch raises in a step, the round is refused and nothing changed."""
    monkeypatch.setattr(shard_optimizer, "SEGMENT", 256)  # several segments: the failure is in a later one
    opt, params = make()
    opt.apply({0: torch.randn(1000)}, {0}, [0.01])  # state exists now
    before_p, before_s = params[0].clone(), state_copy(opt)
    opt.optimizer.param_groups[0]["eps"] = "not a number"  # what a step that torch refuses looks like
    with pytest.raises(RoundRefused, match="step\\(\\) raised"):
        opt.apply({0: torch.randn(1000)}, {0}, [0.01])
    assert torch.equal(params[0], before_p)
    assert_same(state_copy(opt), before_s)


def test_non_finite_in_a_late_segment_changes_nothing(monkeypatch) -> None:
    monkeypatch.setattr(shard_optimizer, "SEGMENT", 256)
    opt, params = make(torch.optim.SGD, momentum=0.9)
    opt.apply({0: torch.ones(1000)}, {0}, [0.01])
    before_p, before_s = params[0].clone(), state_copy(opt)
    grad = torch.ones(1000)
    grad[900] = 3e38  # momentum buffer 0.9 * 1 + 3e38 is finite, but lr 1e10 x that overflows the parameter
    with pytest.raises(RoundRefused, match="parameters non-finite") as err:
        opt.apply({0: grad}, {0}, [1e10])
    assert err.value.key == 0
    assert torch.equal(params[0], before_p)
    assert_same(state_copy(opt), before_s)


def test_dry_run_matches_the_real_step_exactly(monkeypatch) -> None:
    """Segments are stepped by the same kernel as the whole buffer: a passing round equals plain torch."""
    monkeypatch.setattr(shard_optimizer, "SEGMENT", 256)
    opt, params = make(numel=1000, weight_decay=0.1)
    ref = params[0].clone().requires_grad_()
    ref_opt = torch.optim.AdamW([ref], lr=0.01, weight_decay=0.1, fused=True)
    for step in range(3):
        g = torch.randn(1000, generator=torch.Generator().manual_seed(step))
        opt.apply({0: g.clone()}, {0}, [0.01])
        ref.grad = g
        ref_opt.step()
    assert torch.equal(params[0], ref.detach())


def test_trial_refuses_settings_torch_only_refuses_at_step() -> None:
    spec = optimizer_spec(torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=0.01))
    spec.group_hyperparams_json[0] = '{"lr": 0.01, "betas": [0.9]}'
    with pytest.raises(OptimizerSpecError, match="trial step"):
        ShardOptimizer.trial(spec)
    spec.group_hyperparams_json[0] = '{"lr": 0.01, "eps": 0.0, "betas": [0.9, 0.999]}'
    assert ShardOptimizer.trial(spec) == 2  # exp_avg and exp_avg_sq per element


def test_keys_without_gradient_are_skipped_like_torch() -> None:
    """A key absent from ``present`` keeps its value and state: weight decay and momentum do not move it."""
    spec = optimizer_spec(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9,
                                          weight_decay=0.1))
    params = {0: torch.randn(30)}
    opt = ShardOptimizer(spec, params, {0: (0, 0, 10), 1: (0, 10, 30)})
    refs = [params[0][:10].clone().requires_grad_(), params[0][10:].clone().requires_grad_()]
    ref_opt = torch.optim.SGD(refs, lr=0.1, momentum=0.9, weight_decay=0.1, fused=True)
    for step in range(4):
        g = torch.randn(30, generator=torch.Generator().manual_seed(step))
        present = {0, 1} if step % 2 == 0 else {0}
        opt.apply({0: g.clone()}, present, [0.1])
        refs[0].grad = g[:10].clone()
        refs[1].grad = g[10:].clone() if 1 in present else None
        ref_opt.step()
    assert torch.equal(params[0][:10], refs[0].detach()) and torch.equal(params[0][10:], refs[1].detach())
    assert torch.equal(opt.get_state()[1]["momentum_buffer"], ref_opt.state[refs[1]]["momentum_buffer"])


def test_report_unscales_and_measures_the_norm_of_present_keys() -> None:
    spec = optimizer_spec(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    params = {0: torch.zeros(6)}
    opt = ShardOptimizer(spec, params, {0: (0, 0, 2), 1: (0, 2, 6)})
    grads = {0: torch.tensor([2.0, 4.0, 100.0, 100.0, 100.0, 100.0])}
    part, found_inf = opt.report(grads, {0}, 0.5, 2.0)
    assert not found_inf and part == pytest.approx(1.0 + 4.0)
    assert torch.equal(grads[0][:2], torch.tensor([1.0, 2.0]))
    grads = {0: torch.tensor([1.0, float("inf"), 0, 0, 0, 0])}
    assert opt.report(grads, {0}, 0.5, 2.0)[1]

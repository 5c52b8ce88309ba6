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


# ---------------------------------------------------------------- the finite proof and its fallback
def snapshot(opt: ShardOptimizer, params: dict) -> dict:
    """Every byte a refused round must leave alone: parameters, every state entry (step counts too), lrs."""
    return {"params": {g: t.clone() for g, t in params.items()},
            "state": {k: {n: v.clone() for n, v in st.items()} for k, st in opt.get_state().items()},
            "hyper": [dict(pg, params=None) for pg in opt.optimizer.param_groups]}


def assert_unchanged(before: dict, after: dict) -> None:
    assert before["params"].keys() == after["params"].keys()
    for g in before["params"]:  # bit for bit: NaN != NaN would fail, and -0.0 vs 0.0 is caught by the view
        assert torch.equal(before["params"][g].view(torch.int32), after["params"][g].view(torch.int32))
    assert before["state"].keys() == after["state"].keys()
    for k, st in before["state"].items():
        assert st.keys() == after["state"][k].keys(), k
        for n, v in st.items():
            assert v.dtype == after["state"][k][n].dtype and v.view(-1).view(torch.uint8).equal(
                after["state"][k][n].view(-1).view(torch.uint8)), (k, n)
    assert before["hyper"] == after["hyper"]


def no_dry_run(monkeypatch) -> None:
    def fail(self) -> None:
        raise AssertionError("an ordinary round took the dry run")

    monkeypatch.setattr(ShardOptimizer, "_dry_run", fail)


@pytest.mark.parametrize("cls, hyper", [
    (torch.optim.SGD, {}), (torch.optim.SGD, dict(momentum=0.9, weight_decay=1e-4, nesterov=True)),
    (torch.optim.Adam, dict(weight_decay=0.1)), (torch.optim.Adam, dict(amsgrad=True, maximize=True)),
    (torch.optim.AdamW, {}), (torch.optim.Adagrad, dict(lr_decay=0.01, weight_decay=0.01)),
    (torch.optim.RMSprop, dict(momentum=0.9)),
], ids=lambda v: v.__name__ if isinstance(v, type) else ",".join(v) or "defaults")
def test_ordinary_rounds_are_proved_finite_without_the_dry_run(monkeypatch, cls, hyper) -> None:
    """Rounds of an ordinary training run skip the dry run, and equal torch's own steps bit for bit."""
    no_dry_run(monkeypatch)
    spec = optimizer_spec(cls([torch.nn.Parameter(torch.zeros(1))], lr=0.01, **hyper))
    params = {0: torch.randn(300, generator=torch.Generator().manual_seed(1))}
    opt = ShardOptimizer(spec, params, {0: (0, 0, 100), 1: (0, 100, 300)})
    refs = [params[0][:100].clone().requires_grad_(), params[0][100:].clone().requires_grad_()]
    ref = cls(refs, lr=0.01, **hyper, **({"foreach": True} if cls is torch.optim.RMSprop else {"fused": True}))
    for step in range(30):
        g = torch.randn(300, generator=torch.Generator().manual_seed(step)) * 10.0 ** (step % 7 - 3)
        present = {1} if step % 3 == 1 else {0, 1}  # (torch's fused SGD cannot start some buffers later)
        opt.apply({0: g.clone()}, present, [0.01])
        refs[0].grad = g[:100].clone() if 0 in present else None
        refs[1].grad = g[100:].clone()
        ref.step()
    assert opt.proved == 30 and opt.dry_runs == 0
    assert torch.equal(params[0], torch.cat([r.detach() for r in refs]))


def test_an_update_that_overflows_takes_the_exact_path_and_changes_nothing() -> None:
    """The rare path: a finite gradient and lr 1e38 (SGD) overflow the parameters; bit for bit nothing changes."""
    opt, params = make(torch.optim.SGD, momentum=0.9)
    for _ in range(3):
        opt.apply({0: torch.randn(1000)}, {0}, [0.01])
    assert opt.proved == 3
    before = snapshot(opt, params)
    with pytest.raises(RoundRefused, match="would make the parameters non-finite") as err:
        opt.apply({0: torch.full((1000,), 10.0)}, {0}, [1e38])
    assert err.value.key == 0
    assert_unchanged(before, snapshot(opt, params))
    opt.apply({0: torch.ones(1000)}, {0}, [0.01])  # and the next ordinary round is proved again
    assert opt.proved == 4 and opt.dry_runs == 0


def test_adam_state_overflow_and_step_counts_are_left_alone() -> None:
    """A 1e22 gradient squares past float32 in exp_avg_sq: refused; Adam's step counts are not advanced."""
    opt, params = make(torch.optim.Adam)
    opt.apply({0: torch.randn(1000)}, {0}, [0.01])
    before = snapshot(opt, params)
    assert before["state"][0]["step"].item() == 1
    with pytest.raises(RoundRefused, match="would make the optimizer state non-finite"):
        opt.apply({0: torch.full((1000,), 1e22)}, {0}, [0.01])
    assert_unchanged(before, snapshot(opt, params))


def test_huge_parameters_are_measured_and_refused() -> None:
    """Finite, small gradient; parameters near float32's limit, so Adam's L2 term overflows the state."""
    spec = optimizer_spec(torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=0.01, weight_decay=10.0))
    params = {0: torch.full((64,), 3e38)}
    opt = ShardOptimizer(spec, params, {0: (0, 0, 64)})
    before = snapshot(opt, params)
    with pytest.raises(RoundRefused, match="non-finite"):
        opt.apply({0: torch.ones(64)}, {0}, [0.01])
    assert_unchanged(before, snapshot(opt, params))


def test_parameters_written_outside_apply_are_measured_again() -> None:
    """Bounds carried from round to round are dropped when the buffer's version moves (an in-place write)."""
    opt, params = make(torch.optim.Adam, weight_decay=10.0)
    for _ in range(3):
        opt.apply({0: torch.randn(1000)}, {0}, [0.01])
    params[0].fill_(3e38)  # stale bounds would prove the next round; it must be refused instead
    before = snapshot(opt, params)
    with pytest.raises(RoundRefused, match="non-finite"):
        opt.apply({0: torch.ones(1000)}, {0}, [0.01])
    assert_unchanged(before, snapshot(opt, params))


def test_loaded_state_is_measured_before_the_next_proof() -> None:
    """A loaded state with a negative exp_avg_sq (sqrt of it is NaN) is caught, not proved from old bounds."""
    opt, params = make(torch.optim.Adam)
    opt.apply({0: torch.randn(1000)}, {0}, [0.01])
    state = opt.get_state()
    state[0]["exp_avg_sq"][7] = -1.0
    opt.load_state(state)
    before = snapshot(opt, params)
    with pytest.raises(RoundRefused, match="non-finite"):
        opt.apply({0: torch.randn(1000)}, {0}, [0.01])
    assert_unchanged(before, snapshot(opt, params))


def test_torch_raising_after_counting_puts_the_step_counts_back(monkeypatch) -> None:
    """Torch increments the step counts before its fused kernel runs; a kernel that raises leaves them counted.
    The round is refused with the counts, the first-time state of a new key, and the lr put back."""
    spec = optimizer_spec(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.01))
    params = {0: torch.randn(30)}
    opt = ShardOptimizer(spec, params, {0: (0, 0, 10), 1: (0, 10, 30)})
    opt.apply({0: torch.randn(30)}, {0}, [0.01])  # key 1 has no state yet
    before = snapshot(opt, params)

    def broken(*args, **kwargs):
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(torch, "_fused_adamw_", broken)
    with pytest.raises(RoundRefused, match="step\\(\\) raised: kernel failed"):
        opt.apply({0: torch.randn(30)}, {0, 1}, [0.5])
    assert_unchanged(before, snapshot(opt, params))
    assert opt.optimizer.param_groups[0]["lr"] == 0.01
    monkeypatch.undo()
    opt.apply({0: torch.randn(30)}, {0, 1}, [0.01])
    assert opt.get_state()[0]["step"].item() == 2 and opt.get_state()[1]["step"].item() == 1


CASES = [
    (torch.optim.SGD, dict(momentum=0.9, weight_decay=1.0)), (torch.optim.SGD, dict(momentum=0.5, nesterov=True)),
    (torch.optim.Adam, {}), (torch.optim.Adam, dict(amsgrad=True, weight_decay=1.0)),
    (torch.optim.Adam, dict(eps=0.0)), (torch.optim.AdamW, dict(betas=(0.99, 0.9), weight_decay=3.0)),
    (torch.optim.Adagrad, dict(lr_decay=0.1, eps=1e-30)), (torch.optim.RMSprop, dict(momentum=0.9, alpha=0.5)),
    (torch.optim.RMSprop, dict(centered=True)),
]


@pytest.mark.parametrize("cls, hyper", CASES, ids=lambda v: v.__name__ if isinstance(v, type) else ",".join(v))
def test_accepts_exactly_the_finite_rounds(cls, hyper) -> None:
    """Against a reference shard that steps without any check, over rounds whose gradients and learning rates
    sweep from tiny to overflowing: a round is applied iff the reference's step is finite, then bit for bit
    equal; a refused one changes nothing. After every proved round the carried bounds hold."""
    spec = optimizer_spec(cls([torch.nn.Parameter(torch.zeros(1))], lr=0.01, **hyper))
    gen = torch.Generator().manual_seed(len(str(hyper)) + len(cls.__name__))
    slices = {0: (0, 0, 24), 1: (0, 24, 64)}
    params = {0: torch.randn(64, generator=gen) * 10.0 ** torch.randint(-20, 8, (64,), generator=gen)}
    ref_params = {0: params[0].clone()}
    opt, ref = ShardOptimizer(spec, params, slices), ShardOptimizer(spec, ref_params, slices)
    scales, lrs = [0.0, 1e-30, 1e-3, 1.0, 1e3, 1e12, 1e19, 1e25, 3e38], [0.0, 1e-3, 0.1, 1e3, 1e20, 1e38]
    accepted = 0
    for step in range(60):
        scale = scales[int(torch.randint(len(scales), (1,), generator=gen))]
        lr = lrs[int(torch.randint(len(lrs), (1,), generator=gen))] if step % 3 == 0 else 0.01
        g = torch.randn(64, generator=gen) * scale
        present = [{0, 1}, {0}, {1}][step % 3]
        try:
            ref.apply({0: g.clone()}, present, [lr], check=False)
            ref_ok = all(torch.isfinite(t).all() for t in [ref_params[0], *(
                v for st in ref.get_state().values() for v in st.values())])
        except Exception:  # torch refused the step itself
            ref_ok = False
        before = snapshot(opt, params)
        try:
            opt.apply({0: g.clone()}, present, [lr])
            ok = True
        except RoundRefused:
            ok = False
        assert ok == ref_ok, (step, scale, lr)
        if ok:
            accepted += 1
            assert torch.equal(params[0], ref_params[0])
            assert_unchanged(snapshot(ref, ref_params), snapshot(opt, params))
        else:
            assert_unchanged(before, snapshot(opt, params))
            ref_params[0].copy_(params[0])
            ref.load_state(opt.get_state())
        b = opt._bounds.get(0)
        if ok and b is not None and not b.fresh:
            assert params[0].abs().max().item() <= b.p
            for st in opt.get_state().values():
                for name, v in st.items():
                    if name in b.state:
                        assert v.abs().max().item() <= b.state[name], name
                if b.k is not None and "exp_avg" in st:
                    assert (st["exp_avg"].abs() <= b.k * (st["exp_avg_sq"].sqrt() + b.e)).all()
    assert accepted >= 10 and accepted <= 55, accepted  # both answers were given


def test_a_bound_given_by_the_caller_replaces_the_gradient_pass(monkeypatch) -> None:
    """``apply(grad_bound=...)`` (made where the gradient was received) skips apply's own pass; same result."""
    from shardps.server.dense import bounds

    opt, params = make(torch.optim.AdamW)
    ref, ref_params = make(torch.optim.AdamW)
    g = torch.randn(1000)
    ref.apply({0: g.clone()}, {0}, [0.01])
    given = bounds.average_bound([bounds.grad_bound([g])])
    assert given >= g.abs().max().item()
    monkeypatch.setattr(bounds, "grad_bound", lambda buffers: pytest.fail("the gradient was read again"))
    opt.apply({0: g.clone()}, {0}, [0.01], grad_bound=given)
    assert opt.proved == 1 and torch.equal(params[0], ref_params[0])
    before = snapshot(opt, params)
    with pytest.raises(RoundRefused, match="not finite"):  # an infinite bound: the exact path decides
        opt.apply({0: torch.full((1000,), float("nan"))}, {0}, [0.01], grad_bound=float("inf"))
    assert_unchanged(before, snapshot(opt, params))


def test_average_bound() -> None:
    from shardps.server.dense.bounds import LIMIT, average_bound

    assert average_bound([]) == 0.0
    assert 2.0 <= average_bound([1.0, 2.0]) <= 2.0 * (1 + 1e-6)
    assert 0.5 <= average_bound([1.0], inv_scale=0.5) <= 0.5 * (1 + 1e-6)
    assert average_bound([LIMIT, LIMIT]) == float("inf")  # the workers' sum could overflow
    assert average_bound([float("nan")]) == float("inf")

"""Recipe oracles: what users write around torch.optim gives what single-process torch (or DDP) gives.

Two workers (threads of this process, each with its own replica, optimizer,
scheduler and GradScaler) train against two real shard processes; the
reference is one process training on the whole batch (or real DDP for
BatchNorm, whose batch statistics are per rank). After training, every
parameter must agree within 1e-5. Model and data: ``tests/support/recipe_net.py``.
"""

from __future__ import annotations

import copy
import math
import threading
import time

import grpc
import pytest
import torch
from torch import nn
from torch.nn.utils import clip_grad_norm_

from shardps.worker.session.client import ShardRpcError
from shardps.worker.config import WireOptions
from shardps.worker.optimizer import DistributedOptimizer, GradientEditedError
from tests.support.forked import start_process
from tests.support.procs import shard_stats
from tests.support.recipe_net import WORKERS, Net, ddp_rank, loss_of, part
from tests.support.threads import run_workers

STEPS = 12
TOL = 1e-5


@pytest.fixture
def servers(start_cluster) -> list[str]:
    """Two fresh shards (a job per test) that wait for both workers every round."""
    return start_cluster(2, min_workers=WORKERS).addresses


def make_opt(name: str, params) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)


def distributed(opt, replica: nn.Module, servers: list[str], worker: int, **kwargs) -> DistributedOptimizer:
    return DistributedOptimizer(opt, replica.named_parameters(), servers=servers, worker_id=f"w{worker}",
                                wire=WireOptions(chunk_bytes=256, rpc_timeout=60.0), **kwargs)


def assert_same(reference: nn.Module, replica: nn.Module, what: str = "") -> None:
    for (key, want), got in zip(reference.state_dict().items(), replica.state_dict().values()):
        diff = (want.double() - got.double()).abs().max().item()
        assert diff <= TOL, f"{what}{key}: max |reference - shardps| = {diff}"


# ---------------------------------------------------------------- 1. clipping
@pytest.mark.parametrize("name, norm_type", [("sgd", 2.0), ("adamw", math.inf)])
def test_max_grad_norm_equals_clip_grad_norm(servers, name: str, norm_type: float) -> None:
    max_norm = 0.05
    reference, norms = Net(), []
    opt = make_opt(name, reference.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(reference, step).backward()
        norms.append(clip_grad_norm_(reference.parameters(), max_norm, norm_type=norm_type).item())
        opt.step()
    assert min(norms) > max_norm, "the clip must bind every step"

    def work(i: int):
        model, seen = Net(), []
        with distributed(make_opt(name, model.parameters()), model, servers, i, max_grad_norm=max_norm,
                         norm_type=norm_type) as dist:
            for step in range(STEPS):
                dist.zero_grad()
                loss_of(model, step, part(i)).backward()
                dist.step()
                seen.append(dist.last_grad_norm)
        return model, seen

    for model, seen in run_workers(WORKERS, work):
        assert_same(reference, model)
        assert seen == pytest.approx(norms, rel=1e-5)


# ---------------------------------------------------------------- 2. AMP
OVERFLOW_STEP = 5


def loss_weight(step: int) -> torch.Tensor:
    """Per-row loss weights: at OVERFLOW_STEP worker 1's rows weigh 1e38, so the scaled gradient overflows."""
    w = torch.ones(8)
    if step == OVERFLOW_STEP:
        w[part(1)] = 1e38
    return w


def scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)


@pytest.mark.parametrize("clip", [None, 0.05])
def test_grad_scaler_unscales_skips_the_overflow_everywhere_and_updates_the_scale(servers, clip) -> None:
    reference, sc, scales = Net(), scaler(), []
    opt = make_opt("adamw", reference.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        sc.scale(loss_of(reference, step, weight=loss_weight(step))).backward()
        sc.unscale_(opt)
        if clip:
            clip_grad_norm_(reference.parameters(), clip)
        sc.step(opt)
        sc.update()
        scales.append(sc.get_scale())
    assert scales[OVERFLOW_STEP] == scales[OVERFLOW_STEP - 1] / 2, "the reference must skip the overflowing step"
    assert max(scales) > 2.0**16, "the scale must also grow"

    def work(i: int):
        model, sc, seen = Net(), scaler(), []
        with distributed(make_opt("adamw", model.parameters()), model, servers, i, grad_scaler=sc,
                         max_grad_norm=clip) as dist:
            for step in range(STEPS):
                dist.zero_grad()
                sc.scale(loss_of(model, step, part(i), loss_weight(step))).backward()
                dist.step()
                sc.update()
                seen.append((sc.get_scale(), dist.last_step_skipped))
            skipped = [s.rounds_skipped for s in dist.stats()]
        return model, seen, skipped

    for model, seen, skipped in run_workers(WORKERS, work):
        assert_same(reference, model)
        assert seen == [(s, step == OVERFLOW_STEP) for step, s in enumerate(scales)]
        assert skipped == [1, 1], "every shard skips the overflowing round, and only it"


# ---------------------------------------------------------------- 3. hyperparameters
def schedule(name: str, how: str, model: nn.Module):
    opt = make_opt(name, model.parameters())
    if how == "onecycle":
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS, cycle_momentum=True)
        return opt, lambda step: sched.step()

    def by_hand(step: int) -> None:
        if step == 4:
            group = opt.param_groups[0]
            group["weight_decay"] = 0.3
            if "momentum" in group:
                group["momentum"] = 0.5
            else:
                group["betas"] = (0.8, 0.99)
    return opt, by_hand


@pytest.mark.parametrize("name, how", [("adamw", "onecycle"), ("sgd", "onecycle"), ("sgd", "by_hand"),
                                       ("adamw", "by_hand")])
def test_every_hyperparameter_reaches_the_shards(servers, name: str, how: str) -> None:
    reference = Net()
    opt, after_step = schedule(name, how, reference)
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(reference, step).backward()
        opt.step()
        after_step(step)

    def work(i: int):
        model = Net()
        opt, after_step = schedule(name, how, model)
        with distributed(opt, model, servers, i) as dist:
            for step in range(STEPS):
                dist.zero_grad()
                loss_of(model, step, part(i)).backward()
                dist.step()
                after_step(step)
        return model

    for model in run_workers(WORKERS, work):
        assert_same(reference, model)


# ---------------------------------------------------------------- 4, 5. parameters without gradients
def fine_tuning(name: str, variant: str):
    model = Net()
    if variant == "frozen":  # frozen after the optimizer was built: in a param group, grad always None
        opt = make_opt(name, model.parameters())
        model.frozen.requires_grad_(False)
    else:  # the fine-tuning pattern: an optimizer over some parameters, model.named_parameters() passed
        opt = make_opt(name, [p for n, p in model.named_parameters() if not n.startswith("frozen.")])
    return model, opt


@pytest.mark.parametrize("variant", ["frozen", "subset"])
@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_parameters_without_gradient_are_left_alone(servers, name: str, variant: str) -> None:
    """Frozen layer, a branch unused on odd steps (and by worker 0 only every 4th), parameters outside the optimizer."""
    initial = Net()
    reference, opt = fine_tuning(name, variant)
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(reference, step).backward()
        opt.step()

    def work(i: int):
        model, opt = fine_tuning(name, variant)
        with distributed(opt, model, servers, i) as dist:
            for step in range(STEPS):
                dist.zero_grad()
                loss_of(model, step, part(i)).backward()
                dist.step()
        return model

    for model in run_workers(WORKERS, work):
        assert_same(reference, model)
        assert torch.equal(model.frozen.weight, initial.frozen.weight), "a frozen layer must never move"
        assert not torch.equal(model.branch.weight, initial.branch.weight), "the branch must train"


# ---------------------------------------------------------------- 6. buffers
def test_batchnorm_buffers_follow_ddp(servers, tmp_path) -> None:
    """Compared with real DDP (2 Gloo ranks, broadcast_buffers=True): parameters and rank 0's buffers."""
    processes = [start_process(ddp_rank, (r, WORKERS, str(tmp_path / "init"), str(tmp_path / f"ddp{r}.pt"), STEPS))
                 for r in range(WORKERS)]
    deadline = time.monotonic() + 180
    # bounded wait: until every rank saved its state (or exited), then 10 s for a clean exit
    while time.monotonic() < deadline and not all((tmp_path / f"ddp{r}.pt").exists() or p.exitcode is not None
                                                  for r, p in enumerate(processes)):
        time.sleep(0.2)
    for p in processes:
        p.join(timeout=10)
    saved = [(tmp_path / f"ddp{r}.pt").exists() for r in range(WORKERS)]
    for p, done in zip(processes, saved):
        if p.exitcode is None and done:  # its state is saved whole; it hangs in Gloo's teardown (seen under load)
            p.terminate()
            p.join(10)
    assert all(saved) and all(p.exitcode in (0, -15) for p in processes), (
        f"a DDP reference rank failed: exit codes {[p.exitcode for p in processes]}, saved {saved}")
    reference = Net(batch_norm=True)
    reference.load_state_dict(torch.load(tmp_path / "ddp0.pt"))

    def work(i: int):
        model = Net(batch_norm=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        with distributed(opt, model, servers, i, model=model) as dist:
            for step in range(STEPS):
                dist.zero_grad()
                loss_of(model, step, part(i)).backward()
                dist.step()
            dist.synchronize()
        return model

    models = run_workers(WORKERS, work)
    for model in models:
        assert_same(reference, model)
    for (key, a), b in zip(models[0].named_buffers(), models[1].buffers()):
        assert torch.equal(a, b), f"buffer {key} differs between the workers"
    assert models[0].norm.num_batches_tracked.item() == STEPS


# ---------------------------------------------------------------- 7. optimizer state
def test_state_dict_round_trip_through_a_plain_optimizer(start_cluster, tmp_path) -> None:
    """shardps (steps 0-5) -> checkpoint -> plain AdamW (6-11) equals plain AdamW (0-11); and plain -> new job."""
    half = STEPS // 2
    reference = Net()
    opt = make_opt("adamw", reference.parameters())
    for step in range(STEPS):
        if step == half:
            torch.save({"model": reference.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "plain.pt")
        opt.zero_grad()
        loss_of(reference, step).backward()
        opt.step()
    plain = torch.load(tmp_path / "plain.pt")

    def first_half(i: int):
        model = Net()
        with distributed(make_opt("adamw", model.parameters()), model, servers_a, i) as dist:
            for step in range(half):
                dist.zero_grad()
                loss_of(model, step, part(i)).backward()
                dist.step()
            state = dist.state_dict()
            assert dist._optimizer.state_dict()["state"].keys() == state["state"].keys()  # the usual call works too
        if i == 0:
            torch.save({"model": model.state_dict(), "optimizer": state}, tmp_path / "shardps.pt")

    servers_a = start_cluster(2, min_workers=WORKERS).addresses
    run_workers(WORKERS, first_half)
    ckpt = torch.load(tmp_path / "shardps.pt")
    saved, want = ckpt["optimizer"], plain["optimizer"]
    assert saved["state"].keys() == want["state"].keys() and saved["param_groups"] == want["param_groups"]
    for index, entries in want["state"].items():
        assert entries.keys() == saved["state"][index].keys()
        for name, value in entries.items():
            got = saved["state"][index][name]
            assert got.shape == value.shape and (got - value).abs().max() <= TOL, (index, name)

    resumed = Net()
    resumed.load_state_dict(ckpt["model"])
    opt = make_opt("adamw", resumed.parameters())
    opt.load_state_dict(ckpt["optimizer"])
    for step in range(half, STEPS):
        opt.zero_grad()
        loss_of(resumed, step).backward()
        opt.step()
    assert_same(reference, resumed, "shardps checkpoint into plain AdamW: ")

    def second_half(i: int):
        model = Net()
        model.load_state_dict(plain["model"])
        opt = make_opt("adamw", model.parameters())
        with distributed(opt, model, servers_b, i) as dist:
            opt.load_state_dict(plain["optimizer"])  # the wrapped optimizer's call goes to the shards
            for step in range(half, STEPS):
                dist.zero_grad()
                loss_of(model, step, part(i)).backward()
                dist.step()
        return model

    servers_b = start_cluster(2, min_workers=WORKERS).addresses
    for model in run_workers(WORKERS, second_half):
        assert_same(reference, model, "plain checkpoint into a new shardps job: ")


def test_optimizer_state_loads_all_or_nothing_and_only_between_rounds(servers) -> None:
    models = [Net(), Net()]
    dists = [distributed(make_opt("adamw", m.parameters()), m, servers, i) for i, m in enumerate(models)]
    try:
        def step(i: int, at: int) -> None:
            dists[i].zero_grad()
            loss_of(models[i], at, part(i)).backward()
            dists[i].step()

        run_workers(WORKERS, lambda i: step(i, 0))
        saved = dists[1].state_dict()
        before = [st.digest for st in shard_stats(servers, digest=True)]
        bad = copy.deepcopy(saved)  # a valid change of the first parameter (on both shards), and an entry
        bad["state"][0]["exp_avg"] += 1.0  # AdamW does not keep for the last one (on shard 1 only)
        bad["state"][len(bad["state"]) - 1]["nope"] = torch.zeros(())
        with pytest.raises(ShardRpcError, match="nope") as err:
            dists[1].load_state_dict(bad)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert [st.digest for st in shard_stats(servers, digest=True)] == before, "no shard may load any of it"

        worker0 = threading.Thread(target=step, args=(0, 1), daemon=True)
        worker0.start()  # worker 0 pushes round 1; the round waits for worker 1
        deadline = time.monotonic() + 60
        while any(list(st.pushed) != ["w0"] for st in dists[1].stats()):
            assert time.monotonic() < deadline, "worker 0's push never arrived"
            time.sleep(0.05)
        changed = copy.deepcopy(saved)
        changed["state"][0]["exp_avg"] += 1.0
        with pytest.raises(ShardRpcError, match="a round is in progress") as err:
            dists[1].load_state_dict(changed)
        assert err.value.code == grpc.StatusCode.ABORTED
        dists[1].load_state_dict(saved)  # the same state: accepted any time (every worker may load a checkpoint)
        step(1, 1)
        worker0.join(60)
        assert [s.version for s in dists[1].stats()] == [2, 2]
        assert dists[1].state_dict()["state"][0]["step"].item() == 2  # body.weight, stepped in both rounds
    finally:
        for d in dists:
            d.close()


def test_workers_that_clip_differently_are_refused(servers) -> None:
    """Every shard must clip by one coefficient: a round whose workers ask for different norms changes nothing."""
    def work(i: int) -> str:
        model = Net()
        with distributed(make_opt("sgd", model.parameters()), model, servers, i, max_grad_norm=0.1 * (i + 1)) as dist:
            loss_of(model, 0, part(i)).backward()
            with pytest.raises(ShardRpcError) as err:
                dist.step()
            assert [s.version for s in dist.stats()] == [0, 0]
            return err.value.details

    for details in run_workers(WORKERS, work):
        assert "different loss scales or clipping" in details


@pytest.mark.parametrize("streamed", [True, False])
def test_workers_that_step_different_learning_rates_are_refused(servers, streamed: bool) -> None:
    """Two workers at lr 0.1 and 0.2 in one round: every shard used the first one's without a word. Now the round
    is refused for both, naming both lrs, and nothing is applied; streamed or not."""
    def work(i: int) -> str:
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1 * (i + 1))
        dist = DistributedOptimizer(opt, model.named_parameters(), servers=servers, worker_id=f"w{i}",
                                    wire=WireOptions(chunk_bytes=256, rpc_timeout=60.0, streamed=streamed))
        with dist:
            loss_of(model, 0, part(i)).backward()
            with pytest.raises(ShardRpcError) as err:
                dist.step()
                dist.synchronize()
            assert [s.version for s in dist.stats()] == [0, 0]
            return err.value.details

    for details in run_workers(WORKERS, work):
        assert "pushed different learning rates ([0.1] vs [0.2])" in details, details


# ---------------------------------------------------------------- editing gradients
def test_editing_a_pushed_gradient_raises_with_the_fix(start_cluster) -> None:
    servers = start_cluster(1).addresses
    model = Net()
    opt = make_opt("sgd", model.parameters())
    with distributed(opt, model, servers, 0) as dist:
        with pytest.raises(RuntimeError, match=r"call dist.step\(\)"):
            opt.step()  # the wrapped optimizer would update the model behind the shards' back
        loss_of(model, 0).backward()
        clip_grad_norm_(model.parameters(), 1e-3)  # in place, after the hooks pushed
        with pytest.raises(GradientEditedError, match="max_grad_norm=") as err:
            dist.step()
        assert "push_during_backward=False" in str(err.value)
        assert dist.stats()[0].version == 0, "nothing may be applied from a torn push"
    opt.step()  # after close() the optimizer is the user's again


def test_push_at_step_allows_any_edit(servers) -> None:
    """With push_during_backward=False, gradients edited between backward() and step() are the ones applied.

    The edit is linear (a per-layer gradient multiplier), so editing each
    worker's gradient equals editing the averaged one.
    """
    def edit(model: nn.Module) -> None:
        for i, p in enumerate(model.parameters()):
            if p.grad is not None:
                p.grad.mul_(0.5 + i / 4)

    reference = Net()
    opt = make_opt("sgd", reference.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(reference, step).backward()
        edit(reference)
        opt.step()

    def work(i: int):
        model = Net()
        with distributed(make_opt("sgd", model.parameters()), model, servers, i, push_during_backward=False) as dist:
            for step in range(STEPS):
                dist.zero_grad()
                loss_of(model, step, part(i)).backward()
                edit(model)
                dist.step()
        return model

    for model in run_workers(WORKERS, work):
        assert_same(reference, model)

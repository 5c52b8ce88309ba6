"""Values that reach the optimizer: learning rates, averaged gradients, updates, initial parameters, settings.

Every refused request is checked against the shard's state afterwards
(version, open round, digest of parameters and optimizer state), and the
shard must then apply a correct round exactly as torch would.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from torch import nn

from shardps.proto import shardps_pb2 as pb
from shardps.common.codec import decode_frame
from shardps.worker.session.client import ShardClient, ShardRpcError
from tests.support.raw import RawWorker, plan_and_spec, raw_stream, snapshot


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(20, 10)


def start(start_cluster, make_optimizer, workers=("a",)):
    """One shard initialised by worker ``a``; returns (cluster, client, raw workers, model, optimizer)."""
    cluster = start_cluster(1, min_workers=len(workers))
    m = model()
    opt = make_optimizer(m.parameters())
    plan, spec = plan_and_spec(m, opt)
    client = ShardClient(cluster.addresses[0], index=0, rpc_timeout=20.0)
    raw = [RawWorker(client, w, plan, spec) for w in workers]
    for w in raw:
        w.join()
    raw[0].init(0, dict(m.named_parameters()))
    return cluster, client, raw, m, opt


def pulled(w: RawWorker, version: int) -> dict[str, torch.Tensor]:
    """The parameters at ``version`` as pulled by ``w``, by key."""
    out = {k.key: torch.empty(k.numel) for k in w.plan.keys}
    request = pb.PullRequest(min_version=version, plan_fingerprint=w.plan.fingerprint, worker_id=w.worker_id,
                             session=w.session)
    for raw in w.client.pull(request):
        f = decode_frame(raw)
        out[f.header.key][f.header.offset : f.header.offset + f.header.numel] = torch.frombuffer(
            bytearray(f.payload), dtype=torch.float32)
    return out


def torch_step(m: nn.Module, make_optimizer, grad_fill: float, steps: int = 1) -> dict[str, torch.Tensor]:
    """What single-process torch gives after ``steps`` steps with every gradient equal to ``grad_fill``."""
    ref = model()
    ref.load_state_dict(m.state_dict())
    opt = make_optimizer(ref.parameters())
    for _ in range(steps):
        for p in ref.parameters():
            p.grad = torch.full_like(p, grad_fill)
        opt.step()
    return {k: v.detach().reshape(-1) for k, v in ref.named_parameters()}


def assert_matches(got: dict, want: dict) -> None:
    for k in want:
        assert torch.allclose(got[k], want[k], rtol=0, atol=1e-6), k


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


@pytest.mark.parametrize("lr", [float("nan"), float("inf"), -1e6], ids=["nan", "inf", "negative"])
def test_bad_learning_rates_are_refused(start_cluster, lr: float) -> None:
    """Item 3: a non-finite or negative lr in the round header is INVALID_ARGUMENT and changes nothing."""
    _, client, (a,), m, _ = start(start_cluster, sgd)
    before = snapshot(client)
    with pytest.raises(ShardRpcError, match="learning rate of param group 0") as err:
        a.push(0, lrs=[lr])
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert snapshot(client) == before
    assert a.push(0, fill=0.5).version == 1
    assert_matches(pulled(a, 1), torch_step(m, sgd, 0.5))


def test_overflowing_average_is_refused_for_every_pusher(start_cluster) -> None:
    """Item 4: two finite 3e38 gradients overflow when averaged; both pushers get the error, nothing changes."""
    _, client, (a, b), m, _ = start(start_cluster, sgd, workers=("a", "b"))
    before = snapshot(client)
    a.push(0, fill=3e38)  # accepted: the round waits for b
    with pytest.raises(ShardRpcError, match="round 0 was refused: the averaged gradient is not finite") as err:
        b.push(0, fill=3e38)  # the last pusher's call carries the refusal
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(ShardRpcError, match="round 0 was refused") as err:
        a.pull(1)  # and a, waiting for version 1, gets it too instead of waiting forever
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert snapshot(client) == before  # parameters, momentum, version and the open round untouched
    a.push(0, fill=0.5)  # the shard collects round 0 again: retries are not mistaken for duplicates
    assert b.push(0, fill=0.5).version == 1
    assert_matches(pulled(a, 1), torch_step(m, sgd, 0.5))


def test_refused_round_keeps_the_hyperparameters_it_carried_out(start_cluster) -> None:
    """A round refused for a non-finite update changes nothing, the hyperparameters it carried included:
    the next valid round is applied with the old ones (weight decay 0, not the refused round's 5)."""
    _, client, (a,), m, _ = start(start_cluster, sgd)
    before = snapshot(client)
    bad = ['{"lr": 1e38, "momentum": 0.9, "weight_decay": 5.0, "dampening": 0.0, "nesterov": false, '
           '"maximize": false}']
    with pytest.raises(ShardRpcError, match="would make the parameters non-finite"):
        a.push(0, fill=10.0, lrs=[1e38], trailer={"group_hyperparams_json": bad})
    assert snapshot(client) == before
    assert a.push(0, fill=0.5, lrs=[0.1]).version == 1
    assert_matches(pulled(a, 1), torch_step(m, sgd, 0.5))
    assert client.stats().version == 1


@pytest.mark.parametrize("make, bad_fill, bad_lr, message, good_fill, good_lr", [
    # SGD lr 1e38 x gradient 10: finite inputs, the new parameters overflow
    (lambda params: torch.optim.SGD(params, lr=1.0), 10.0, 1e38,
     "would make the parameters non-finite at key 'weight'", 10.0, 1.0),
    # Adam with a 1e22 gradient: the parameters stay finite but exp_avg_sq (the squared gradient) overflows
    (lambda params: torch.optim.Adam(params, lr=0.01), 1e22, 0.01,
     "would make the optimizer state non-finite", 0.5, 0.01),
], ids=["sgd-parameters", "adam-state"])
def test_update_that_would_not_be_finite_is_refused(start_cluster, make, bad_fill, bad_lr, message, good_fill,
                                                    good_lr) -> None:
    """Item 4: a round whose update overflows (parameters or optimizer state) is refused; nothing is kept."""
    _, client, (a,), m, _ = start(start_cluster, make)
    before = snapshot(client)
    with pytest.raises(ShardRpcError, match=message):
        a.push(0, fill=bad_fill, lrs=[bad_lr])
    assert snapshot(client) == before
    assert a.push(0, fill=good_fill, lrs=[good_lr]).version == 1
    assert_matches(pulled(a, 1), torch_step(m, make, good_fill))


def test_init_with_nan_or_inf_is_refused(start_cluster) -> None:
    """Item 5: initial parameters holding NaN/Inf are refused like NaN gradients; the shard stays uninitialised."""
    cluster = start_cluster(1)
    m = model()
    plan, spec = plan_and_spec(m, sgd(m.parameters()))
    client = ShardClient(cluster.addresses[0], index=0, rpc_timeout=20.0)
    a = RawWorker(client, "a", plan, spec)
    assert a.join().initialise
    before = snapshot(client)
    assert before == {"version": 0, "members": ["a"], "pushed": [], "digest": "", "initialised": False,
                      "job_id": before["job_id"]}
    for bad in (float("nan"), float("inf")):
        params = {k: v.detach().clone() for k, v in m.named_parameters()}
        params["bias"][3] = bad
        with pytest.raises(ShardRpcError, match="key 'bias' .* hold NaN or Inf") as err:
            a.init(0, params)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert snapshot(client) == before  # still uninitialised, same job, same member
        assert a.join().initialise  # and a is still the initialiser
    a.init(0, dict(m.named_parameters()))
    assert snapshot(client)["initialised"] and pulled(a, 0)["bias"].equal(m.bias.detach())


def test_push_pull_with_an_invalid_pull_dtype_applies_nothing(start_cluster) -> None:
    """Item 6: every field of the round header is checked before the push is accepted."""
    cluster, client, (a,), m, _ = start(start_cluster, sgd)
    before = snapshot(client)
    frames = list(a.frames(a.header(0, pull_dtype=7), a.chunks(0, 0.5), trailer=a.trailer()))
    code, details = raw_stream(cluster.addresses[0], "PushPull", frames)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "pull_dtype 7 is not a wire dtype" in details
    assert snapshot(client) == before
    frames = list(a.frames(a.header(0, pull_dtype=pb.BFLOAT16), a.chunks(0, 0.5), trailer=a.trailer()))
    assert raw_stream(cluster.addresses[0], "PushPull", frames)[0] == grpc.StatusCode.OK
    assert snapshot(client)["version"] == 1


@pytest.mark.parametrize("hyperparams, message", [
    ('{"lr": 0.1, "betas": [0.9]}', "trial step of torch.optim.Adam failed"),
    ('{"lr": 0.1, "eps": "x"}', "is the string 'x'"),
    ('{"lr": NaN}', "not a finite number"),
    ('{"lr": 0.1, "weight_decay": {"a": 1}}', "has type dict"),
    ('{"lr": 0.1, "weight_decay": 1' + "0" * 400 + "}", "integer of 401 digits"),
    ('{"lr": 0.1, "eps": 0.0, "betas": [0.9, 0.999]}', None),  # eps 0 is valid: the trial step is finite
], ids=["one-beta", "string-eps", "nan-lr", "dict", "bigint", "eps0-ok"])
def test_optimizer_settings_are_tried_at_join(start_cluster, hyperparams: str, message: str | None) -> None:
    """Item 8: settings torch accepts at construction but refuses at step() are refused at Join."""
    cluster = start_cluster(1)
    m = model()
    plan, _ = plan_and_spec(m, sgd(m.parameters()))
    client = ShardClient(cluster.addresses[0], index=0, rpc_timeout=20.0)
    spec = pb.OptimizerSpec(class_name="Adam", group_hyperparams_json=[hyperparams])
    w = RawWorker(client, "a", plan, spec)
    if message is None:
        assert w.join().initialise
        return
    with pytest.raises(ShardRpcError, match=message) as err:
        w.join()
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    stats = client.stats()
    assert stats.plan_fingerprint == "" and list(stats.members) == []  # no job was fixed
    good = pb.OptimizerSpec(class_name="Adam", group_hyperparams_json=['{"lr": 0.1}'])
    assert RawWorker(client, "a", plan, good).join().initialise


class TwoKeys(nn.Module):
    """``a`` and ``b`` land on different shards (one chunk each)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.ones(8))
        self.b = nn.Parameter(torch.ones(8))


def test_worker_raises_on_refused_rounds_and_on_diverged_shards(start_cluster) -> None:
    """What DistributedOptimizer does with refused rounds: a round every shard refused can be pushed again;
    a round that one shard refused and another applied makes every later step raise."""
    from shardps.worker.config import WireOptions
    from shardps.worker.optimizer import DistributedOptimizer

    cluster = start_cluster(2)
    m = TwoKeys()
    opt = torch.optim.SGD(m.parameters(), lr=1e38)
    with DistributedOptimizer(opt, m.named_parameters(), servers=cluster.addresses,
                              wire=WireOptions(chunk_bytes=64)) as dist:
        assert {c.key: c.shard for c in dist.plan.chunks} == {"a": 0, "b": 1}
        dist.zero_grad()
        (-(m.a.sum() + m.b.sum()) * 1e30).backward()  # both shards' updates overflow
        with pytest.raises(ShardRpcError, match="round 0 was refused"):
            dist.step()
        assert dist.versions == [0, 0] and torch.equal(m.a.detach(), torch.ones(8))
        opt.param_groups[0]["lr"] = 0.1  # the caller skips the bad batch and carries on
        dist.zero_grad()
        (-(m.a.sum() + m.b.sum())).backward()
        dist.step()
        assert dist.versions == [1, 1] and torch.allclose(m.a.detach(), torch.full((8,), 1.1))

        opt.param_groups[0]["lr"] = 1e38
        dist.zero_grad()
        (-m.b.sum() * 1e30).backward()  # only b (shard 1) overflows; a's gradient is zero
        with pytest.raises(ShardRpcError, match="round 1 was refused"):
            dist.step()
        assert dist.versions == [2, 1]
        dist.zero_grad()
        with pytest.raises(RuntimeError, match=r"shard\(s\) \[0\] applied round 1 but shard 1 failed it"):
            (-m.b.sum()).backward()
            dist.step()

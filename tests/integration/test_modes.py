"""Consistency modes: async and ssp against real shards, a slowed worker, the mode fixed by the first joiner.

Workers are threads of this test process (each with its own model replica
and DistributedOptimizer); shards are real processes. One worker sleeps
before every ``step()`` (a straggler); the others record when each of their
steps begins (``time.monotonic()``, one clock for every thread).
"""

from __future__ import annotations

import time

import grpc
import pytest
import torch
from torch import nn

from shardps.worker.config import ConsistencyOptions, WireOptions
from shardps.worker.optimizer import DistributedOptimizer
from shardps.worker.session.client import ShardClient, ShardRpcError
from tests.support.threads import run_workers

STEPS = 12
SLOW_SECONDS = 0.25


def make_model() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def batch(step: int, worker: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * worker + step)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def train(servers: str, worker: int, mode: str, staleness: int | None = None, steps: int = STEPS,
          slow: int | None = None, optimizer: str = "sgd") -> dict:
    """Run ``steps`` steps; returns the start time of each, the versions received and the model."""
    model = make_model()
    opt = (torch.optim.AdamW(model.parameters(), lr=0.01) if optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    starts, versions = [], []
    with DistributedOptimizer(opt, model.named_parameters(), servers=servers, worker_id=f"w{worker}",
                              consistency=ConsistencyOptions(mode=mode, staleness=staleness),
                              wire=WireOptions(chunk_bytes=256, rpc_timeout=60)) as dist:
        for step in range(steps):
            starts.append(time.monotonic())
            x, y = batch(step, worker)
            nn.functional.cross_entropy(model(x), y).backward()
            if worker == slow:
                time.sleep(SLOW_SECONDS)
            dist.step()
            dist.zero_grad()
            versions.append(list(dist.versions))
        stats = dist.stats()
    return {"starts": starts, "versions": versions, "model": model, "stats": stats, "end": time.monotonic()}


def ssp_violations(starts: list[list[float]], s: int) -> list[tuple[int, int, int]]:
    """``(fast, slow, clock)`` where worker ``fast`` began step ``clock`` before ``slow`` began step ``clock - s - 1``.

    A worker that begins step ``c`` has completed ``c`` steps; ssp lets it go
    only once every live worker has completed ``c - s``, i.e. each has pushed
    (so begun) step ``c - s - 1`` before then. The check never blames a
    correct run: a step's push is applied after the step began.
    """
    bad = []
    for a, mine in enumerate(starts):
        for b, theirs in enumerate(starts):
            for c in range(s + 1, len(mine)):
                if a != b and c - s - 1 < len(theirs) and theirs[c - s - 1] >= mine[c]:
                    bad.append((a, b, c))
    return bad


def test_first_joiner_fixes_the_mode(start_cluster) -> None:
    cluster = start_cluster(2)
    model = make_model()
    with DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                              servers=cluster.servers, worker_id="first",
                              consistency=ConsistencyOptions(mode="ssp", staleness=2)):
        other = make_model()
        with pytest.raises(ShardRpcError) as info:
            DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1), other.named_parameters(),
                                 servers=cluster.servers, worker_id="second",
                                 consistency=ConsistencyOptions(mode="async"))
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "'async'" in str(info.value) and "'ssp s=2'" in str(info.value)
        with pytest.raises(ShardRpcError, match="'ssp s=3'.*'ssp s=2'"):
            DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1), other.named_parameters(),
                                 servers=cluster.servers, worker_id="third",
                                 consistency=ConsistencyOptions(mode="ssp", staleness=3))
        stats = cluster_stats(cluster)
        assert [list(s.members) for s in stats] == [["first"], ["first"]]  # the refused joins changed nothing
        assert stats[0].mode.mode == "ssp" and stats[0].mode.staleness == 2


def cluster_stats(cluster) -> list:
    from shardps.worker.session.client import ShardClient

    out = []
    for i, address in enumerate(cluster.addresses):
        client = ShardClient(address, index=i)
        out.append(client.stats())
        client.close()
    return out


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_async_with_one_worker_is_plain_training(start_cluster, optimizer: str) -> None:
    """One async worker: every push is applied at staleness 0, exactly single-process training."""
    cluster = start_cluster(2)
    result = train(cluster.servers, 0, "async", steps=10, optimizer=optimizer)
    model = make_model()
    opt = (torch.optim.AdamW(model.parameters(), lr=0.01) if optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    for step in range(10):
        x, y = batch(step, 0)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    for (name, p), q in zip(model.named_parameters(), result["model"].parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6, msg=name)
    assert result["versions"] == [[v, v] for v in range(1, 11)]
    assert [list(s.staleness_histogram)[:2] for s in result["stats"]] == [[10, 0], [10, 0]]


def test_slowed_worker_ssp_keeps_the_bound_and_async_never_waits(start_cluster) -> None:
    """3 workers, worker 2 sleeps 0.25 s before every step()."""
    cluster = start_cluster(2)
    s = 2
    ssp = run_workers(3, lambda w: train(cluster.servers, w, "ssp", staleness=s, slow=2), timeout=120)
    starts = [r["starts"] for r in ssp]
    assert ssp_violations(starts, s) == []
    # it did bind: the fast workers could not finish long before the slow one
    assert min(r["end"] for r in ssp[:2]) > starts[2][STEPS - s - 1]
    stats = ssp[2]["stats"]
    assert all(sum(st.staleness_histogram) == 3 * STEPS for st in stats)

    cluster = start_cluster(2)
    asp = run_workers(3, lambda w: train(cluster.servers, w, "async", slow=2), timeout=120)
    starts = [r["starts"] for r in asp]
    # the fast workers finished all their steps before the slow one was half-way: nobody waited for it
    assert max(r["end"] for r in asp[:2]) < starts[2][STEPS // 2]
    assert ssp_violations(starts, s)  # the same check catches a run that ignores the bound
    hist = [list(st.staleness_histogram) for st in asp[2]["stats"]]
    assert all(sum(h) == 3 * STEPS for h in hist)
    assert all(sum(h[3:]) > 0 for h in hist)  # the slow worker's gradients were applied stale
    for r in asp:
        assert all(b[0] > a[0] for a, b in zip(r["versions"], r["versions"][1:]))  # newest version, always ahead


@pytest.mark.parametrize("mode,staleness", [("async", None), ("ssp", 0)])
def test_overlap_accumulation_and_scheduler_work_in_every_mode(start_cluster, mode: str, staleness) -> None:
    """One worker with model= (overlapped pulls), 2 backward passes per step and a StepLR schedule.

    With one worker every push is applied at staleness 0, so the result is
    exactly a single process doing the same.
    """
    cluster = start_cluster(2)

    def recipe(model: nn.Module):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)

    model = make_model()
    opt, sched = recipe(model)
    with DistributedOptimizer(opt, model.named_parameters(), servers=cluster.servers, worker_id="w0", model=model,
                              backward_passes_per_step=2,
                              consistency=ConsistencyOptions(mode=mode, staleness=staleness),
                              wire=WireOptions(chunk_bytes=256)) as dist:
        for step in range(8):
            for micro in range(2):
                x, y = batch(step, micro)
                (nn.functional.cross_entropy(model(x), y) / 2).backward()
            dist.step()
            dist.zero_grad()
            sched.step()
        dist.synchronize()
        assert dist.versions == [8, 8]
    expected = make_model()
    opt, sched = recipe(expected)
    for step in range(8):
        opt.zero_grad()
        for micro in range(2):
            x, y = batch(step, micro)
            (nn.functional.cross_entropy(expected(x), y) / 2).backward()
        opt.step()
        sched.step()
    for (name, want), got in zip(expected.named_parameters(), model.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)


def test_async_push_of_a_future_version_is_refused_and_changes_nothing(start_cluster) -> None:
    """async: a push that claims to come from a version the shard has not reached yet is FAILED_PRECONDITION."""
    from tests.support.raw import RawWorker, snapshot

    cluster = start_cluster(1)
    model = make_model()
    with DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(),
                              servers=cluster.servers, worker_id="w0", consistency=ConsistencyOptions(mode="async"),
                              wire=WireOptions(chunk_bytes=256)) as dist:
        x, y = batch(0, 0)
        nn.functional.cross_entropy(model(x), y).backward()
        dist.step()
        dist.synchronize()
        assert dist.versions == [1]
        client = ShardClient(cluster.addresses[0], index=0, rpc_timeout=10.0)
        try:
            before = snapshot(client)
            raw = RawWorker(client, "w0", dist.plan, dist._spec, session=dist.session)
            with pytest.raises(ShardRpcError) as info:
                raw.push(0, fill=0.5, round_=5, lrs=[0.05])
            assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "version 5" in str(info.value) and "at version 1" in str(info.value)
            assert snapshot(client) == before  # version, members, open pushes and parameters unchanged
        finally:
            client.close()
        dist.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        dist.step()  # the member goes on normally
        dist.synchronize()
        assert dist.versions == [2]


def test_ssp_wait_past_its_limit_names_the_slowest_workers(start_cluster) -> None:
    """ssp s=0: a worker whose clock runs ahead of a member that never steps gets DEADLINE_EXCEEDED naming it."""
    cluster = start_cluster(1, extra_args=("--max-wait-seconds", "1.5"))
    models = [make_model(), make_model()]
    opts = [DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05), m.named_parameters(),
                                 servers=cluster.servers, worker_id=f"w{i}",
                                 consistency=ConsistencyOptions(mode="ssp", staleness=0),
                                 wire=WireOptions(chunk_bytes=256, rpc_timeout=20))
            for i, m in enumerate(models)]
    try:
        x, y = batch(0, 0)
        nn.functional.cross_entropy(models[0](x), y).backward()
        began = time.monotonic()
        with pytest.raises(ShardRpcError) as info:
            opts[0].step()
            opts[0].synchronize()
        waited = time.monotonic() - began
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        message = str(info.value)
        assert "slowest workers" in message and "'w1'" in message and "ssp bound 0" in message, message
        assert 1.0 < waited < 15, waited  # the shard's limit, not the client's rpc_timeout
    finally:
        for opt in opts:
            opt.close()


def test_async_workers_push_their_shards_one_after_another_each_from_its_own(start_cluster) -> None:
    """async: a worker hands its push to the second shard of its order only once the first shard's push is all
    sent; the first worker starts at shard 0, the second (joined next) at shard 1."""
    cluster = start_cluster(2)
    models = [make_model(), make_model()]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    dists = []
    try:
        for w, (model, opt) in enumerate(zip(models, opts)):  # joined one after the other: members 1 and 2
            dists.append(DistributedOptimizer(opt, model.named_parameters(), servers=cluster.servers,
                                              worker_id=f"w{w}", consistency=ConsistencyOptions(mode="async"),
                                              wire=WireOptions(chunk_bytes=256, rpc_timeout=60)))
        for step in range(3):
            for w, (model, dist) in enumerate(zip(models, dists)):
                x, y = batch(step, w)
                nn.functional.cross_entropy(model(x), y).backward()
                dist.step()
                dist.zero_grad()
                first, second = (0, 1) if w == 0 else (1, 0)
                shards = dist.last_shard_timeline
                assert shards[first]["push_start"] is not None and shards[second]["push_start"] is not None
                assert shards[second]["push_start"] >= shards[first]["push_end"], (w, step, shards)
                assert all(s["last_pull"] is not None for s in shards)
    finally:
        for dist in dists:
            dist.close()
    assert [list(v) for v in (dists[0].versions, dists[1].versions)] == [[5, 5], [6, 6]]


def test_a_staggered_push_does_not_wait_for_a_killed_shards_stream(start_cluster) -> None:
    """async, 2 shards: the worker pushes shard 0, then shard 1. Shard 0 is SIGKILLed: shard 1's stream stops
    waiting for shard 0's as soon as that call fails, and the step fails naming shard 0 within the retry time,
    not after the 60 s call deadline."""
    cluster = start_cluster(2)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with DistributedOptimizer(opt, model.named_parameters(), servers=cluster.servers, worker_id="w0",
                              consistency=ConsistencyOptions(mode="async"),
                              wire=WireOptions(chunk_bytes=256, rpc_timeout=60, retry_seconds=2)) as dist:
        for step in range(2):
            x, y = batch(step, 0)
            nn.functional.cross_entropy(model(x), y).backward()
            dist.step()
            dist.zero_grad()
        cluster.processes[0].kill()
        cluster.processes[0].wait()
        started = time.monotonic()
        with pytest.raises(ShardRpcError, match=r"shard 0 \(127\.0\.0\.1:\d+\)") as err:
            x, y = batch(2, 0)
            nn.functional.cross_entropy(model(x), y).backward()
            dist.step()
        assert time.monotonic() - started < 30, err.value


def test_three_shards_are_pushed_in_turn(start_cluster) -> None:
    """async, 3 shards, one worker (order 0, 1, 2), about 4 MiB of weights per shard: each shard's push starts
    only once the one before it in the order has been handed over, every step."""
    cluster = start_cluster(3)
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(1024, 3072), nn.Linear(3072, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with DistributedOptimizer(opt, model.named_parameters(), servers=cluster.servers, worker_id="w0",
                              consistency=ConsistencyOptions(mode="async"),
                              wire=WireOptions(chunk_bytes=256 << 10, rpc_timeout=60)) as dist:
        for step in range(4):
            x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(step))
            model(x).square().mean().backward()
            dist.step()
            dist.zero_grad()
            shards = dist.last_shard_timeline
            for first, second in ((0, 1), (1, 2)):
                assert shards[second]["push_start"] >= shards[first]["push_end"], (step, shards)

"""Continuing a job is visible and can be refused.

A script run again against the same shards continues the job they hold
(its parameters, optimizer state and version). The worker says so at
WARNING, ``continuing job J at version V; `shardps reset` starts over``, and
``shardps train`` shows it on the terminal; ``resume="refuse"`` (``shardps
train ... --fresh-job``) refuses instead, leaving no member behind. A worker
joining a job that another worker of the same run started (version 0) is
not continuing anything and says nothing.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
from torch import nn

from shardps.worker.config import WireOptions
from shardps.worker.job import RunningJobError, continuation_line
from shardps.worker.optimizer import DistributedOptimizer
from tests.support.procs import run_module, shard_stats

WIRE = WireOptions(chunk_bytes=256, rpc_timeout=30.0, connect_timeout=10.0)


def make() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train(dist: DistributedOptimizer, model: nn.Module, steps: int) -> None:
    x, y = torch.randn(16, 6, generator=torch.Generator().manual_seed(1)), torch.randn(16, 2)
    for _ in range(steps):
        dist.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        dist.step()


def joined(servers: str, worker_id: str, **kwargs) -> tuple[DistributedOptimizer, nn.Module]:
    model, optimizer = make()
    return DistributedOptimizer(optimizer, model.named_parameters(), servers=servers, worker_id=worker_id,
                                wire=WIRE, **kwargs), model


def warnings_of(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "shardps.worker.job" and r.levelno >= logging.WARNING]


def test_a_second_run_continues_with_a_warning_and_refuse_leaves_no_member(start_cluster, caplog) -> None:
    # a long lease: an empty membership can only come from a Leave
    cluster = start_cluster(2, extra_args=("--lease-seconds", "120"))
    caplog.set_level(logging.INFO, logger="shardps.worker.job")

    # the first run: two workers join the new job at version 0 (one with resume="refuse"): nobody continues anything
    first, model = joined(cluster.servers, "first")
    second, _ = joined(cluster.servers, "second", resume="refuse")
    assert first.version == second.version == 0 and first.job_id and second.job_id == first.job_id
    second.close()
    train(first, model, 3)
    job_id = first.job_id
    first.close()
    assert warnings_of(caplog) == []

    # the script run again against the same shards: it continues job_id at version 3, and says so at WARNING
    caplog.clear()
    again, _ = joined(cluster.servers, "first")
    try:
        assert again.version == 3 and again.resumed and again.job_id == job_id
    finally:
        again.close()
    [record] = warnings_of(caplog)
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith(f"continuing job {job_id} at version 3; `shardps reset` starts over")
    assert record.getMessage().startswith(continuation_line(job_id, 3))

    # resume="refuse": a clear error, and the worker is not a member afterwards
    caplog.clear()
    model, optimizer = make()
    with pytest.raises(RunningJobError) as refused:
        DistributedOptimizer(optimizer, model.named_parameters(), servers=cluster.servers, worker_id="fresh",
                             wire=WIRE, resume="refuse")
    message = str(refused.value)
    assert f"refusing to continue job {job_id} at version 3" in message
    assert f"`shardps reset --servers {cluster.servers}`" in message and 'resume="allow"' in message
    assert isinstance(refused.value, RuntimeError) and refused.value.version == 3 and refused.value.job_id == job_id
    assert warnings_of(caplog) == []
    stats = shard_stats(cluster.addresses)
    assert [list(s.members) for s in stats] == [[], []] and [s.version for s in stats] == [3, 3]

    with pytest.raises(ValueError, match='resume must be "allow"'):
        DistributedOptimizer(optimizer, model.named_parameters(), servers=cluster.servers, resume="never")


def test_shardps_train_digits_shows_the_continuation_and_fresh_job_refuses(start_cluster) -> None:
    cluster = start_cluster(2)
    command = ("shardps.cli.main", "train", "digits", "--servers", cluster.servers, "--worker-index", "0",
               "--workers", "1", "--epochs", "1", "--batch-size", "64", "--wait-for-workers", "0", "--log-every", "0",
               "--connect-timeout", "10")
    first = run_module(*command, timeout=120)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "continuing job" not in first.stderr
    version = int(re.search(r"^done .*version=(\d+)", first.stdout, re.M).group(1))
    assert version > 0
    job_id = shard_stats(cluster.addresses)[0].job_id

    said = f"WARNING shardps.worker.job: continuing job {job_id} at version {version}; `shardps reset` starts over"
    again = run_module(*command, timeout=120)  # the same command again: it continues the job, and says so
    assert again.returncode == 0 and said in again.stderr, again.stderr[-3000:]
    # without --worker-index the command spawns its worker processes: they say it on the terminal too
    spawned = run_module(*command[:5], "--workers", "1", "--epochs", "1", "--batch-size", "64", "--no-progress",
                         timeout=120)
    assert spawned.returncode == 0 and said in spawned.stderr, spawned.stderr[-3000:]

    for fresh in (command + ("--fresh-job",),  # one worker in this process: the optimizer refuses
                  command[:5] + ("--workers", "1", "--no-progress", "--fresh-job")):  # checked before any spawn
        refused = run_module(*fresh, timeout=120)
        assert refused.returncode == 1, refused.stdout + refused.stderr[-3000:]
        assert f"shardps: error: refusing to continue job {job_id} at version {version}" in refused.stderr
        assert f"shardps reset --servers {cluster.servers}" in refused.stderr
    assert [list(s.members) for s in shard_stats(cluster.addresses)] == [[], []]

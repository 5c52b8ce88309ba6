"""Rounds that clip or scale (a report from every shard, then a commit) when a shard dies or restarts.

Such a round cannot be decided without every shard's report. Two real
workers (threads, each with its own replica) train ``tests/support/recipe_net``
on two real shard processes that checkpoint every round; shard 1 is
SIGKILLed between two steps and started again on its port during the next
one. That step's round is lost: shard 1 never reported it, so the workers
send shard 0 a skip, shard 0 ends the round changing nothing, and the
workers rejoin shard 1 at its checkpoint. The step returns as skipped
(``last_step_skipped``, a NaN ``last_grad_norm``, a warning), and the rest
of the run, with the two shards now at different versions, equals
single-process training that skipped that one step.

A shard that stays down makes the step raise naming that shard, after the
retry budget, not a deadline on the shard that is still up.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.nn.utils import clip_grad_norm_

from shardps.worker.config import WireOptions
from shardps.worker.optimizer import DistributedOptimizer
from shardps.worker.session.client import ShardRpcError
from tests.support.procs import shard_stats, wait_until
from tests.support.recipe_net import WORKERS, Net, loss_of, part
from tests.support.threads import run_workers

STEPS, LOST = 8, 4
MAX_NORM = 0.05
TOL = 1e-5
#: longer than the whole test takes: a round that waited for it (the old behaviour) fails the test
RPC_TIMEOUT = 120.0


def reference(recipe: str) -> tuple[Net, list[float]]:
    """Single-process training on the whole batch, step ``LOST`` left out; the total norm of each step."""
    model, norms = Net(), []
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(model, step).backward()
        if step == LOST:
            norms.append(math.nan)
            continue
        norms.append(clip_grad_norm_(model.parameters(), MAX_NORM if recipe == "clip" else math.inf).item())
        opt.step()
    return model, norms


@pytest.mark.parametrize("recipe", ["clip", "scaler"])
def test_a_round_lost_to_a_shard_restart_is_skipped_everywhere(start_cluster, tmp_path: Path, caplog,
                                                                recipe: str) -> None:
    args = ("--checkpoint-dir", str(tmp_path), "--checkpoint-every-rounds", "1")
    cluster = start_cluster(2, min_workers=WORKERS, extra_args=args)
    want, norms = reference(recipe)
    restarted = threading.Event()

    def kill_shard_1() -> None:  # both workers finished step LOST - 1; shard 1 checkpointed it
        wait_until(lambda: shard_stats(cluster.addresses[1:])[0].checkpoint_version == LOST, 30,
                   "shard 1's checkpoint of the last step")
        cluster.processes[1].kill()
        cluster.processes[1].wait()

        def restart() -> None:
            time.sleep(2.0)  # the workers' step has begun against a dead shard 1
            cluster.restart(1, same_port=True)
            restarted.set()

        threading.Thread(target=restart, daemon=True).start()

    barrier = threading.Barrier(WORKERS, action=kill_shard_1)

    def work(i: int):
        model, seen, skipped = Net(), [], []
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
        options = {"max_grad_norm": MAX_NORM} if recipe == "clip" else \
            {"grad_scaler": torch.amp.GradScaler("cpu", init_scale=2.0**16)}
        with DistributedOptimizer(opt, model.named_parameters(), servers=cluster.addresses, worker_id=f"w{i}",
                                  wire=WireOptions(chunk_bytes=256, rpc_timeout=RPC_TIMEOUT), **options) as dist:
            for step in range(STEPS):
                if step == LOST:
                    barrier.wait(60)
                dist.zero_grad()
                loss = loss_of(model, step, part(i))
                if recipe == "scaler":
                    options["grad_scaler"].scale(loss).backward()
                    dist.step()
                    options["grad_scaler"].update()  # needs the found-inf that step() recorded, lost round or not
                else:
                    loss.backward()
                    dist.step()
                seen.append(dist.last_grad_norm)
                skipped.append(dist.last_step_skipped)
            versions = list(dist.versions)
        return model, seen, skipped, versions

    with caplog.at_level(logging.WARNING, logger="shardps.worker.pipeline.commit"):
        results = run_workers(WORKERS, work, timeout=RPC_TIMEOUT)
    assert restarted.is_set()
    for model, seen, skipped, versions in results:
        assert skipped == [step == LOST for step in range(STEPS)]
        assert math.isnan(seen[LOST])
        if recipe == "clip":
            assert seen == pytest.approx(norms, rel=1e-5, nan_ok=True)
        # shard 0 counted the skipped round; shard 1 came back at its checkpoint (version LOST) and went on
        assert versions == [STEPS, STEPS - 1]
        for (key, a), b in zip(want.state_dict().items(), model.state_dict().values()):
            diff = (a - b).abs().max().item()
            assert diff <= TOL, f"{key}: max |reference - shardps| = {diff}"
    assert [s.rounds_skipped for s in shard_stats(cluster.addresses)] == [1, 0]
    assert sum("the round of this step was lost" in r.getMessage() for r in caplog.records) == WORKERS


def test_a_shard_that_stays_down_is_named_not_the_one_still_up(start_cluster) -> None:
    cluster = start_cluster(2)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    with DistributedOptimizer(opt, model.named_parameters(), servers=cluster.addresses, max_grad_norm=MAX_NORM,
                              wire=WireOptions(chunk_bytes=256, rpc_timeout=RPC_TIMEOUT, retry_seconds=2.0)) as dist:
        for step in range(2):
            dist.zero_grad()
            loss_of(model, step).backward()
            dist.step()
        cluster.processes[1].kill()
        cluster.processes[1].wait()
        dist.zero_grad()
        loss_of(model, 2).backward()
        with pytest.raises(ShardRpcError) as raised:
            dist.step()
        assert raised.value.shard == 1, raised.value
        assert raised.value.code.name == "UNAVAILABLE", raised.value
        # shard 0 skipped the round it could not have decided: nothing changed there
        stats = shard_stats(cluster.addresses[:1])[0]
        assert (stats.version, stats.rounds_skipped) == (3, 1)

"""The documented restart pattern under real ``torchrun --max-restarts 1``: exactly N rounds, the same result.

Every rank of a 2-rank job raises at step N/2 on its first attempt (an
injected fault, before pushing anything); torchrun restarts both. With the
pattern (worker id from ``RANK``, the loop from ``dist.version``, a batch
that is a function of the step, a wait for the world after joining), the
shards end at exactly N rounds and the parameters equal those of the same
job run without the fault.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from tests.support.procs import REPO, shard_stats

STEPS = 12


def _torchrun(servers: str, out: Path, fault_at: int, job: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", "--monitor-interval", "0.5", "-m", "tests.support.restart_script",
           "--servers", servers, "--steps", str(STEPS), "--fault-at", str(fault_at), "--out", str(out), "--job", job]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)


def test_a_restarted_job_ends_at_exactly_n_rounds_with_the_uninterrupted_result(start_cluster, tmp_path) -> None:
    results = {}
    for name, fault_at in (("clean", -1), ("faulted", STEPS // 2)):
        cluster = start_cluster(2, extra_args=("--lease-seconds", "3"))
        out = tmp_path / name
        out.mkdir()
        run = _torchrun(cluster.servers, out, fault_at, job=name)
        assert run.returncode == 0, f"{name}: torchrun exited {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
        assert [s.version for s in shard_stats(cluster.addresses)] == [STEPS, STEPS], name
        results[name] = (torch.load(out / "final.pt"), run.stdout)
    joined = [line for line in results["faulted"][1].splitlines() if line.startswith("joined")]
    assert sorted(line.split(" version=")[1] for line in joined) == [
        "0 resumed=False", "0 resumed=False", f"{STEPS // 2} resumed=True", f"{STEPS // 2} resumed=True"], joined
    clean, faulted = results["clean"][0], results["faulted"][0]
    for key in clean:
        torch.testing.assert_close(faulted[key], clean[key], rtol=0, atol=1e-6, msg=key)

"""Job lifecycle: the same job resumes (and the worker is told), another job is refused until `shardps reset`."""

from __future__ import annotations

import subprocess
import sys

from tests.support.procs import REPO, run_module, shard_stats, start_worker
from tests.support.procs import run_worker as run_process


def run_worker(servers: str, worker_id: str, steps: int, *extra: str) -> subprocess.CompletedProcess:
    return run_process(servers, worker_id, "--steps", str(steps), "--connect-timeout", "2", *extra)


def reset(servers: str) -> subprocess.CompletedProcess:
    return run_module("shardps.cli.main", "reset", "--servers", servers, timeout=60)


def versions(cluster) -> list[int]:
    return [s.version for s in shard_stats(cluster.addresses)]


def test_resume_refuse_reset(start_cluster) -> None:
    cluster = start_cluster(2)
    first = run_worker(cluster.servers, "w0", 3)
    assert first.returncode == 0 and "joined version=0 resumed=False" in first.stdout, first.stderr[-2000:]

    again = run_worker(cluster.servers, "w0", 2, "--log-info")  # the same job, run again: it resumes, and says so
    assert again.returncode == 0, again.stderr[-2000:]
    assert "joined version=3 resumed=True" in again.stdout and "done version=5" in again.stdout
    assert "INFO worker w0 joined a running job" in again.stderr and "at version 3 (sync mode, resumed)" in again.stderr

    other = run_worker(cluster.servers, "w0", 2, "--width", "30")  # another model on busy shards
    assert other.returncode == 3 and "shardps reset --servers" in other.stderr, other.stderr[-2000:]
    assert versions(cluster) == [5, 5], "a refused job changes nothing"

    held = start_worker(cluster.servers, "w9", "--hold", stdin=True)
    try:
        assert held.stdout.readline().startswith("joined version=5")  # blocking: the worker joined
        busy = reset(cluster.servers)
        assert busy.returncode == 1 and "reset only idle shards" in busy.stderr, busy.stderr
        assert versions(cluster) == [5, 5]
    finally:
        held.communicate("\n", timeout=60)

    wrong = subprocess.run([sys.executable, "-m", "shardps.cli.main", "reset", "--servers", cluster.servers,
                            "--job-id", "not-this-job"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 1 and "not 'not-this-job'" in wrong.stderr, wrong.stderr
    assert versions(cluster) == [5, 5]

    done = reset(cluster.servers)
    assert done.returncode == 0 and done.stdout.count("dropped at version 5") == 2, done.stdout + done.stderr
    assert versions(cluster) == [0, 0]
    fresh = run_worker(cluster.servers, "w0", 2, "--width", "30")  # after the reset the new job runs
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert "joined version=0 resumed=False" in fresh.stdout and "done version=2" in fresh.stdout

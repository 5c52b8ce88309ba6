"""Real worker processes (``tests.worker_proc``) and the shards' Stats, for tests that use processes and signals."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from shardps.proto import shardps_pb2 as pb
from shardps.worker.client import ShardClient

REPO = Path(__file__).resolve().parents[1]


def worker_command(servers: str, worker_id: str, *args: str) -> list[str]:
    """The command line of one worker process (``args``: more ``tests.worker_proc`` options)."""
    return [sys.executable, "-m", "tests.worker_proc", "--servers", servers, "--worker-id", worker_id, *args]


def run_worker(servers: str, worker_id: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run a worker process to its end (bounded by ``timeout`` seconds); stdout and stderr captured."""
    return subprocess.run(worker_command(servers, worker_id, *args), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def start_worker(servers: str, worker_id: str, *args: str, stdin: bool = False) -> subprocess.Popen:
    """Start a worker process (text pipes for stdout and stderr, and stdin when asked); the caller stops it."""
    return subprocess.Popen(worker_command(servers, worker_id, *args), cwd=REPO, text=True,
                            stdin=subprocess.PIPE if stdin else None, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def shard_stats(addresses: list[str], digest: bool = False) -> list[pb.StatsReply]:
    """Every shard's Stats, in shard order (``digest``: also hash parameters and optimizer state)."""
    out = []
    for i, address in enumerate(addresses):
        client = ShardClient(address, index=i)
        try:
            out.append(client.stats(digest=digest))
        finally:
            client.close()
    return out


def wait_until(predicate, timeout: float, what: str):
    """Poll ``predicate()`` every 0.1 s until it is truthy (returned) or ``timeout`` seconds pass (AssertionError)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")

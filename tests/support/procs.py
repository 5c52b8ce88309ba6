"""Real worker processes (``tests.support.worker_proc``) and the shards' Stats, for tests that use processes and signals."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from shardps.proto import shardps_pb2 as pb
from shardps.worker.session.client import ShardClient
from tests.support.forked import ForkedPopen

REPO = Path(__file__).resolve().parents[2]


def benchmark_module(name: str):
    """Import ``benchmarks/<name>.py`` (the benchmarks import each other by file name); ``sys.path`` is put back."""
    import importlib

    saved = list(sys.path)
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path[:] = saved  # some benchmarks add their folder too


def run_benchmark(name: str, *args: str, out: Path, timeout: float) -> tuple[dict, str]:
    """Run ``benchmarks/<name>.py *args --json out`` from the repository root (a process of its own, at most
    ``timeout`` seconds) and assert it exited 0 (the tails of its output in the message).

    Returns:
        ``(its JSON, what it printed on stdout)``.
    """
    import json

    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / f"{name}.py"), *args, "--json", str(out)],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


#: ``SHARDPS_TEST_EXEC=1``: worker processes start cold (``python -m``) instead of forked from the forkserver.
EXEC = os.environ.get("SHARDPS_TEST_EXEC") == "1"


def worker_command(servers: str, worker_id: str, *args: str) -> list[str]:
    """The command line of one worker process (``args``: more ``tests.support.worker_proc`` options)."""
    return [sys.executable, "-m", "tests.support.worker_proc", "--servers", servers, "--worker-id", worker_id, *args]


def start_module(module: str, *args: str, **pipes) -> subprocess.Popen:
    """``python -m module args`` (text mode, in the repository), forked from the preloaded forkserver of
    ``tests.support.forked`` (no torch import: ~3 s of CPU less per process), or started cold with ``SHARDPS_TEST_EXEC=1``.

    ``pipes``: ``stdin``, ``stdout``, ``stderr`` as ``subprocess.Popen`` takes them.
    """
    if EXEC:
        return subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, text=True, **pipes)
    return ForkedPopen(module, list(args), cwd=REPO, text=True, **pipes)


def run_module(module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``python -m module args`` to its end (see :func:`start_module`), bounded by ``timeout`` seconds."""
    return _finish(start_module(module, *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE), timeout)


def run_worker(servers: str, worker_id: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run a worker process to its end (bounded by ``timeout`` seconds); stdout and stderr captured."""
    return _finish(start_worker(servers, worker_id, *args), timeout)


def _finish(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def start_worker(servers: str, worker_id: str, *args: str, stdin: bool = False) -> subprocess.Popen:
    """Start a worker process (text pipes for stdout and stderr, and stdin when asked; see :func:`start_module`);
    the caller stops it."""
    return start_module("tests.support.worker_proc", *worker_command(servers, worker_id, *args)[3:],
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


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False

"""A failing script exits: with its own exit code, promptly, having left the shards; its LocalCluster goes with it.

Real scripts (written to ``tmp_path``, run cold with ``sys.executable``)
against real shards. Before ``shardps.worker.session.exit``, a script that
raised between ``backward()`` and ``step()`` without ``close()`` never exited
(its pull threads, non-daemon ``ThreadPoolExecutor`` threads, waited for a
round that could not close, and the interpreter joins them at exit), and the
shard processes of a ``LocalCluster`` outlived the script that started them.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from shardps.worker.session.exit import DaemonPool
from tests.support.procs import REPO, alive, shard_stats, wait_until

#: Seconds a script may take to exit once it raised or called sys.exit.
EXIT_SECONDS = 10.0
#: Seconds for a script to get to the line it prints before it fails (a cold interpreter imports torch).
START_SECONDS = 90.0

TRAIN_SCRIPT = '''
import sys
import torch
from torch import nn
from shardps import DistributedOptimizer, ShardedEmbeddingBag

servers, how = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
torch.manual_seed(0)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.items = ShardedEmbeddingBag(None, 8, mode="sum")  # rows on the shards
        self.head = nn.Linear(8, 1)  # dense

    def forward(self, ids, offsets):
        return self.head(self.items(ids, offsets)).squeeze(1)


model = Model()
dense = torch.optim.Adam(model.head.parameters(), lr=1e-3)
sparse = torch.optim.Adagrad([model.items.handle], lr=0.05)
dist = DistributedOptimizer(dense, model.named_parameters(), servers=servers, model=model,
                            sparse_optimizer=sparse, worker_id="script")  # no with-block, no close()
ids, offsets = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 2])
if how == "exit-after-step":
    dist.zero_grad()
    model(ids, offsets).pow(2).sum().backward()
    dist.step()
    print("failing now", flush=True)
    sys.exit(7)
dist.zero_grad()
model(ids, offsets).pow(2).sum().backward()  # the hooks push this step's gradients; step() never comes
print("failing now", flush=True)
if how == "system-exit":
    raise SystemExit(3)
raise RuntimeError("the script failed between backward() and step()")
'''

CLUSTER_SCRIPT = '''
import sys
import time
from shardps.worker.cluster import LocalCluster

cluster = LocalCluster(2).start()  # no with-block, no stop()
print("pids", *[p.pid for p in cluster.processes], flush=True)
if sys.argv[1] == "raise":
    raise RuntimeError("the script failed")
time.sleep(120)  # killed by the test meanwhile
'''


def start_script(tmp_path: Path, text: str, *args: str) -> subprocess.Popen:
    path = tmp_path / "script.py"
    path.write_text(text)
    return subprocess.Popen([sys.executable, str(path), *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def first_line(proc: subprocess.Popen, timeout: float) -> str:
    """The script's first stdout line, waiting at most ``timeout`` seconds (AssertionError with its stderr)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)  # blocking, bounded
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        _, err = proc.communicate(timeout=30)
        raise AssertionError(f"the script printed nothing within {timeout:.0f}s (exit {proc.returncode}):\n"
                             f"{err[-3000:]}")
    return line


def finish(proc: subprocess.Popen, timeout: float) -> tuple[float, str]:
    """Wait at most ``timeout`` seconds for ``proc`` to exit: (seconds it took, its stderr); killed if it did not."""
    start = time.monotonic()
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate(timeout=30)
        raise AssertionError(f"the script did not exit within {timeout:.0f}s of failing:\n{err[-3000:]}") from None
    return time.monotonic() - start, err


@pytest.mark.parametrize(("how", "code"), [("system-exit", 3), ("uncaught", 1), ("exit-after-step", 7)])
def test_a_script_that_fails_without_close_exits_with_its_code_and_leaves_the_shards(start_cluster, tmp_path,
                                                                                     how: str, code: int) -> None:
    # a long lease: an empty membership after the script can only come from its Leave at exit
    cluster = start_cluster(2, extra_args=("--lease-seconds", "120"))
    proc = start_script(tmp_path, TRAIN_SCRIPT, cluster.servers, how)
    try:
        assert first_line(proc, START_SECONDS).strip() == "failing now"
        seconds, err = finish(proc, EXIT_SECONDS)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == code, f"exit code {proc.returncode}, not {code}:\n{err[-3000:]}"
    assert seconds < EXIT_SECONDS
    if how == "uncaught":
        assert "RuntimeError: the script failed between backward() and step()" in err
    assert [list(s.members) for s in shard_stats(cluster.addresses)] == [[], []], \
        "the script did not leave the shards at exit"


@pytest.mark.parametrize("how", ["raise", "sigterm", "sigkill"])
def test_a_local_cluster_outside_a_with_block_ends_with_its_script(tmp_path, how: str) -> None:
    proc = start_script(tmp_path, CLUSTER_SCRIPT, how)
    pids: list[int] = []
    try:
        words = first_line(proc, START_SECONDS).split()
        assert words[0] == "pids", words
        pids = [int(w) for w in words[1:]]
        assert len(pids) == 2 and all(alive(pid) for pid in pids)
        if how != "raise":
            proc.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
        finish(proc, EXIT_SECONDS)
        expected = {"raise": 1, "sigterm": -signal.SIGTERM, "sigkill": -signal.SIGKILL}[how]
        assert proc.returncode == expected
        wait_until(lambda: not any(alive(pid) for pid in pids), 15, f"the shard processes {pids} to end")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_the_daemon_pool_runs_like_a_thread_pool_and_never_holds_the_exit() -> None:
    pool = DaemonPool(2, thread_name_prefix="shardps-test")
    assert list(pool.map(lambda x: x * x, range(5))) == [0, 1, 4, 9, 16]
    threads = [t for t in threading.enumerate() if t.name.startswith("shardps-test_")]
    assert threads and len(threads) <= 2 and all(t.daemon for t in threads)
    failing = pool.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.result(timeout=10)
    gate = threading.Event()
    blocked = [pool.submit(gate.wait, 30) for _ in range(2)]
    wait_until(lambda: all(f.running() for f in blocked), 10, "both threads to be busy")
    queued = pool.submit(lambda: "ran")
    pool.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(print)
    threads = [t for t in threading.enumerate() if t.name.startswith("shardps-test_")]
    assert len(threads) == 2 and all(t.daemon for t in threads)
    gate.set()
    assert [f.result(timeout=10) for f in blocked] == [True, True]
    wait_until(lambda: not any(t.is_alive() for t in threads), 10, "the pool's threads to end")

"""A lean worker process for the churn soak test (``tests/integration/test_soak.py``).

``python -m tests.support.soak_worker --servers A,B,C --worker-id w0 --target-version 200 [--max-steps N]``

Trains a tiny fixed model with ``DistributedOptimizer`` until the shards
reach ``--target-version`` (or it ran ``--max-steps`` steps, then it leaves:
a clean leave mid-job), bounded by ``--time-limit`` seconds. Each line goes
out in one ``write`` call, so a process killed with SIGKILL leaves only
whole lines behind:

    joined versions=V0,V1,V2 t=T          (after joining every shard)
    step S version=V versions=V0,V1,V2 t=T  (after every step; V is the lowest)
    done steps=N version=V t=T            (after leaving every shard)

``t`` is ``time.monotonic()`` (one clock for every process of the machine).
Exit codes: 0 done; 3 a shard refused (message on stderr); 4 the time limit
ran out first.

The test forks it from the preloaded forkserver of ``tests.support.forked``
(:func:`forked_main`: no torch import per process), or runs it with
``python -m`` (``SHARDPS_SOAK_EXEC=1``); either way it is a process of its
own that a real SIGKILL ends.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import zlib

import torch
from torch import nn

BATCH = 8
CHUNK_BYTES = 64  # the tiny model below makes 8 chunks: every shard holds some of each step


def model() -> nn.Module:
    g = torch.Generator().manual_seed(1234)  # every worker builds the same initial values
    m = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


def emit(text: str) -> None:
    os.write(1, (text + "\n").encode())  # one write: a SIGKILL never leaves half a line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--servers", required=True)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--target-version", type=int, required=True, help="stop once every shard reached this version")
    p.add_argument("--max-steps", type=int, default=0, help="leave after this many steps (0: no limit)")
    p.add_argument("--time-limit", type=float, default=300.0, help="give up (exit 4) after this many seconds")
    p.add_argument("--connect-timeout", type=float, default=30.0)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    from shardps.worker.session.client import ShardRpcError
    from shardps.worker.config import WireOptions
    from shardps.worker.optimizer import DistributedOptimizer

    deadline = time.monotonic() + a.time_limit
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(zlib.crc32(a.worker_id.encode()))
    step = 0
    try:
        with DistributedOptimizer(opt, m.named_parameters(), servers=a.servers, worker_id=a.worker_id,
                                  wire=WireOptions(chunk_bytes=CHUNK_BYTES, rpc_timeout=60.0,
                                                   connect_timeout=a.connect_timeout, retry_seconds=10.0)) as dist:
            emit(f"joined versions={','.join(map(str, dist.versions))} t={time.monotonic():.4f}")
            while min(dist.versions) < a.target_version and (a.max_steps <= 0 or step < a.max_steps):
                if time.monotonic() > deadline:
                    print(f"time limit: {a.time_limit}s ran out at version {dist.versions}", file=sys.stderr,
                          flush=True)
                    return 4
                x, y = torch.randn(BATCH, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g)
                dist.zero_grad()
                nn.functional.cross_entropy(m(x), y).backward()
                dist.step()
                emit(f"step {step} version={min(dist.versions)} versions={','.join(map(str, dist.versions))} "
                     f"t={time.monotonic():.4f}")
                step += 1
            version = min(dist.versions)
        emit(f"done steps={step} version={version} t={time.monotonic():.4f}")
    except ShardRpcError as exc:
        print(f"refused: {exc}", file=sys.stderr, flush=True)
        return 3
    return 0


def forked_main(argv: list[str], out_path: str, err_path: str) -> None:
    """Entry point of a worker forked by ``tests.support.forked.start_process``: stdout and stderr to files, then main."""
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    sys.exit(main(argv))


if __name__ == "__main__":
    sys.exit(main())

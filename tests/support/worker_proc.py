"""A real worker process for tests: ``python -m tests.support.worker_proc --servers A,B --worker-id w0 [--steps N]``.

Trains a small fixed model on fixed data (worker ``i`` of ``n`` takes its
slice of every global batch) with ``DistributedOptimizer``, printing
``joined version=V`` and ``step S version=V loss=L versions=V0,V1`` after each step and ``done version=V``; ``--sleep`` slows each step; ``--hold`` waits for a line on
stdin after joining (so a test can start two processes and hold them both
joined); ``--out PATH`` saves the final parameters with ``torch.save``.
Exit code 0 on success, 3 when the shards refused (the message on stderr).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch
from torch import nn

from shardps.worker.session.client import ShardRpcError
from shardps.worker.config import WireOptions
from shardps.worker.optimizer import DistributedOptimizer

BATCH = 12


def model(width: int = 40) -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, 5))


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 16, generator=g), torch.randint(0, 5, (BATCH,), generator=g)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--servers", required=True)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--index", type=int, default=0, help="this worker's slice of each batch")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--hold", action="store_true")
    p.add_argument("--out")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep after every step")
    p.add_argument("--connect-timeout", type=float, default=30.0)
    p.add_argument("--width", type=int, default=40, help="hidden width (another width is another model)")
    p.add_argument("--fixed-data", action="store_true", help="the same batch every step (the loss must go down)")
    p.add_argument("--retry-seconds", type=float, default=60.0)
    p.add_argument("--log-info", action="store_true", help="shardps' INFO log lines on stderr")
    a = p.parse_args()
    if a.log_info:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    m = model(a.width)
    opt = torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.05)
    try:
        with DistributedOptimizer(opt, m.named_parameters(), servers=a.servers, worker_id=a.worker_id,
                                  wire=WireOptions(chunk_bytes=256, rpc_timeout=60.0, connect_timeout=a.connect_timeout,
                                                   retry_seconds=a.retry_seconds)) as dist:
            print(f"joined version={dist.version} resumed={dist.resumed}", flush=True)
            if a.hold:
                sys.stdin.readline()
            per = BATCH // a.workers
            for step in range(a.steps):
                x, y = data(0 if a.fixed_data else step)
                part = slice(a.index * per, (a.index + 1) * per)
                dist.zero_grad()
                loss = nn.functional.cross_entropy(m(x[part]), y[part])
                loss.backward()
                dist.step()
                versions = ",".join(map(str, dist.versions))
                print(f"step {step} version={dist.version} loss={loss.item():.6f} versions={versions}", flush=True)
                time.sleep(a.sleep)
            print(f"done version={dist.version}", flush=True)
    except ShardRpcError as exc:
        print(f"refused: {exc}", file=sys.stderr, flush=True)
        return 3
    if a.out:
        torch.save({k: v.detach() for k, v in m.state_dict().items()}, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

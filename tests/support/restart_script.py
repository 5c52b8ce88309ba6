"""A training script with the documented restart pattern, for ``torchrun --max-restarts 1`` tests.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 -m tests.support.restart_script \\
        --servers A,B --steps 12 --fault-at 6 --out DIR

The pattern (docs/guide.md, "Restarts"): the worker id comes from torchrun's
``RANK``, so a restarted process is the same member; the loop starts at
``dist.version`` (in sync mode the shards' version is the job's step
counter); everything a step needs (its batch) is a function of the step.
On its first attempt (``TORCHELASTIC_RESTART_COUNT`` 0) every rank raises at
the start of step ``--fault-at``, before pushing anything; torchrun restarts
them. After joining, each rank waits until all ``WORLD_SIZE`` ranks are
members, so that no round runs with part of the world. Each process prints ``joined version=V resumed=R`` and, at the end,
``done version=V``; rank 0 writes the final parameters to ``DIR/final.pt``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from torch import nn

from shardps import DistributedOptimizer, WireOptions

BATCH = 8


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s slice for ``rank``: a function of the step only, so a restart sees the same data."""
    g = torch.Generator().manual_seed(500 + step)
    x, y = torch.randn(BATCH * world, 6, generator=g), torch.randn(BATCH * world, 1, generator=g)
    return x[rank * BATCH:(rank + 1) * BATCH], y[rank * BATCH:(rank + 1) * BATCH]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--servers", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--fault-at", type=int, default=-1, help="every rank raises at this step on its first attempt")
    p.add_argument("--out", required=True)
    p.add_argument("--job", default="restart")
    a = p.parse_args()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    with DistributedOptimizer(opt, model.named_parameters(), servers=a.servers, worker_id=f"{a.job}-rank{rank}",
                              wire=WireOptions(connect_timeout=60.0)) as dist:
        print(f"joined rank={rank} attempt={attempt} version={dist.version} resumed={dist.resumed}", flush=True)
        dist.wait_for_members(world, timeout=60.0)  # ranks restarted together take up the job together
        for step in range(dist.version, a.steps):  # the documented pattern: the shards' version is the step
            if step == a.fault_at and attempt == 0:
                raise RuntimeError(f"injected fault at step {step}")
            x, y = batch(step, rank, world)
            dist.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            dist.step()
        dist.synchronize()
        print(f"done rank={rank} version={dist.version}", flush=True)
        if rank == 0:
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, Path(a.out) / "final.pt")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The everyday recipes with shardps: clipping, AMP, OneCycleLR, a frozen layer, BatchNorm, checkpoints.

Start two shards, then run this script once per worker (``--rank 0`` and
``--rank 1``, each on its half of every batch)::

    shardps-server --shard-index 0 --num-shards 2 --port 50051 --min-workers 2 &
    shardps-server --shard-index 1 --num-shards 2 --port 50052 --min-workers 2 &
    python examples/everyday_recipes.py --servers 127.0.0.1:50051,127.0.0.1:50052 --rank 0 --world 2 &
    python examples/everyday_recipes.py --servers 127.0.0.1:50051,127.0.0.1:50052 --rank 1 --world 2

Rank 0 writes ``checkpoint.pt`` (model and optimizer state) at the end; a
plain ``torch.optim.AdamW`` can load its ``"optimizer"`` entry.
"""

import argparse

import torch
from torch import nn

from shardps import DistributedOptimizer

parser = argparse.ArgumentParser()
parser.add_argument("--servers", required=True, help="host:port,... of the shards, in shard order")
parser.add_argument("--rank", type=int, default=0)
parser.add_argument("--world", type=int, default=1)
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--checkpoint", default="checkpoint.pt")
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                      nn.Linear(64, 1)).to(device)
model[3].requires_grad_(False)  # a frozen layer: never sent, never stepped
trainable = [p for p in model.parameters() if p.requires_grad]
optimizer = torch.optim.AdamW(trainable, lr=1e-3, weight_decay=0.1)  # the fine-tuning pattern
scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=args.steps)  # cycles beta1 too
scaler = torch.amp.GradScaler(device, enabled=device == "cuda")

g = torch.Generator().manual_seed(1)
x = torch.randn(512, 16, generator=g).to(device)
y = x[:, :4].sum(dim=1, keepdim=True)
rows = slice(args.rank * len(x) // args.world, (args.rank + 1) * len(x) // args.world)

with DistributedOptimizer(optimizer, model.named_parameters(), servers=args.servers, worker_id=f"rank{args.rank}",
                          model=model,              # overlapped pulls, BatchNorm buffers as DDP broadcasts them
                          max_grad_norm=1.0,        # instead of clip_grad_norm_
                          grad_scaler=scaler) as dist:  # instead of scaler.unscale_ / scaler.step
    for step in range(args.steps):
        dist.zero_grad()
        with torch.autocast(device_type=device, dtype=torch.float16, enabled=device == "cuda"):
            loss = nn.functional.mse_loss(model(x[rows]), y[rows])
        scaler.scale(loss).backward()
        dist.step()
        scaler.update()
        scheduler.step()
        if step % 20 == 0:
            print(f"step {step} loss {loss.item():.4f} grad norm {dist.last_grad_norm:.3f} "
                  f"skipped {dist.last_step_skipped}", flush=True)
    dist.synchronize()
    if args.rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": dist.state_dict()}, args.checkpoint)
        print(f"wrote {args.checkpoint} at version {dist.version}")

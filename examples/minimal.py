"""Minimal shardps training script: point any torch training loop at running shards.

Start two shards (each in its own terminal, or as pods)::

    shardps-server --shard-index 0 --num-shards 2 --port 50051 &
    shardps-server --shard-index 1 --num-shards 2 --port 50052 &

then run this script once per worker::

    python examples/minimal.py --servers 127.0.0.1:50051,127.0.0.1:50052
"""

import argparse

import torch
from torch import nn

from shardps import DistributedOptimizer

parser = argparse.ArgumentParser()
parser.add_argument("--servers", required=True, help="host:port,... of the shards, in shard order")
parser.add_argument("--steps", type=int, default=100)
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # its state lives on the shards
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
x = torch.randn(256, 10)
y = x.sum(dim=1, keepdim=True)
with DistributedOptimizer(optimizer, model.named_parameters(), servers=args.servers) as dist:
    for step in range(args.steps):
        dist.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # gradient hooks push chunks to the shards while backward runs
        dist.step()  # wait for the round, pull the new parameters into the model
        scheduler.step()
    print(f"final loss {loss.item():.4f} at version {dist.version}")

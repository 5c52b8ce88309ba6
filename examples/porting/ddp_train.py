"""One small training script in two versions, alike line for line: ddp_train.py (DDP) and shardps_train.py (shardps).

A synthetic dataset in a DataLoader with a DistributedSampler, an MLP,
AdamW, an LR scheduler, gradient clipping, AMP (fp16 on CUDA, bf16 on CPU)
with a GradScaler, and a checkpoint that a rerun resumes from (the second
command of each pair resumes at step 20). The DDP version, Gloo on CPU and NCCL on CUDA::

    torchrun --standalone --nproc-per-node 2 examples/porting/ddp_train.py --steps 20 --checkpoint /tmp/ddp.pt
    torchrun --standalone --nproc-per-node 2 examples/porting/ddp_train.py --steps 40 --checkpoint /tmp/ddp.pt

The shardps version: the shards first (``--min-workers``: torchrun's world size), then the same torchrun lines::

    shardps-server --shard-index 0 --num-shards 2 --port 50051 --min-workers 2 &
    shardps-server --shard-index 1 --num-shards 2 --port 50052 --min-workers 2 &
    export SERVERS=127.0.0.1:50051,127.0.0.1:50052
    torchrun --standalone --nproc-per-node 2 examples/porting/shardps_train.py --steps 20 --checkpoint /tmp/ps.pt \\
        --servers $SERVERS
    torchrun --standalone --nproc-per-node 2 examples/porting/shardps_train.py --steps 40 --checkpoint /tmp/ps.pt \\
        --servers $SERVERS

or, to try it in one command, ``python examples/porting/shardps_train.py --steps 20``: without torchrun and
``--servers`` it starts two shards of its own and trains as one worker.

Rank 0 prints ``step S loss L grad_norm G`` after every step and ``final loss L at step S`` at the end.
docs/porting-from-ddp.md shows the diff between the two versions and explains every changed line.
"""

import argparse
import itertools
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20, help="train until this global step")
parser.add_argument("--batch-size", type=int, default=16, help="per rank")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--max-grad-norm", type=float, default=0.5)
parser.add_argument("--no-amp", dest="amp", action="store_false", help="train in fp32")
parser.add_argument("--checkpoint", help="save here every --save-every steps and at the end; resume from it")
parser.add_argument("--save-every", type=int, default=10)
args = parser.parse_args()

rank, world, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16


def log(line: str) -> None:
    if rank == 0:
        print(line, flush=True)


torch.manual_seed(0)
features = torch.randn(1024, 32)
labels = (features @ torch.randn(32, 10)).argmax(dim=1)  # a random linear teacher: 10 classes
dataset = TensorDataset(features, labels)
sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10)).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.7)
scaler = torch.amp.GradScaler(device.type, enabled=args.amp)

step, checkpoint = 0, None
if args.checkpoint and os.path.exists(args.checkpoint):
    checkpoint = torch.load(args.checkpoint, map_location=device)
    model.load_state_dict(checkpoint["model"])  # first: these are the weights the job starts from
    scaler.load_state_dict(checkpoint["scaler"])
    scheduler.load_state_dict(checkpoint["scheduler"])
    step = checkpoint["step"]
    log(f"resumed from {args.checkpoint} at step {step}")
model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
if checkpoint is not None:
    optimizer.load_state_dict(checkpoint["optimizer"])


def save(path: str) -> None:
    state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
             "scaler": scaler.state_dict(), "scheduler": scheduler.state_dict(), "step": step}
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)  # a crash while saving leaves the previous checkpoint whole


model.train()
loss = torch.tensor(float("nan"))  # what the last line prints if the checkpoint is at --steps already
epoch = step // len(loader)
while step < args.steps:
    sampler.set_epoch(epoch)
    for x, y in itertools.islice(loader, step % len(loader), None):  # after a resume: the rest of the epoch
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=args.amp):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        step += 1
        log(f"step {step} loss {loss.item():.6f} grad_norm {grad_norm:.6f}")
        if args.checkpoint and rank == 0 and (step % args.save_every == 0 or step == args.steps):
            save(args.checkpoint)
        if step == args.steps:
            break
    epoch += 1
log(f"final loss {loss.item():.6f} at step {step}")
dist.barrier()  # every rank is done (rank 0 may still be saving) before the group is torn down
dist.destroy_process_group()
os._exit(0)  # no interpreter teardown: torch 2.13's Gloo threads can still be releasing DDP's last all-reduce
# then and abort the rank (SIGABRT, "terminate called without an active exception"); all is printed and saved

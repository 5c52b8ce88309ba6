"""Elastic training under torchrun: a restarted rank rejoins the shards as the same member.

The shards run on their own and outlive the workers (a short lease makes a
dead worker's place free sooner)::

    shardps-server --shard-index 0 --num-shards 2 --port 50051 --min-workers 2 --lease-seconds 5 &
    shardps-server --shard-index 1 --num-shards 2 --port 50052 --min-workers 2 --lease-seconds 5 &

torchrun starts one worker per rank and restarts them when one dies::

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/torchrun_digits.py \\
        --servers 127.0.0.1:50051,127.0.0.1:50052

(on several nodes: ``--nnodes N --rdzv-backend c10d --rdzv-endpoint HOST:29400
--rdzv-id JOB`` instead of ``--standalone``). ``kill -9`` one rank's
process mid-training: torchrun stops the other ranks of its node (SIGTERM,
so they die without leaving) and starts them again. Each new process joins
with the id ``<job>-rank<RANK>``, the id its predecessor held, so the
shards see the same member coming back: its Join waits (up to
``--connect-timeout``) until the dead process's lease expires, then it
pulls the shards' current parameters (``dist.resumed`` is True). The
shards' version is the step counter, so the restarted ranks take up the job
at the round the shards are at, with that round's data and learning rate,
and the job ends when the shards reach the last round. The job never holds
more than WORLD_SIZE members.

Four things make this work, all at the edge of the program:

1. the worker id comes from the launcher's rank, never from the process
   (``RANK`` under torchrun; ``JOB_COMPLETION_INDEX`` in a Kubernetes
   indexed Job);
2. the training loop counts rounds with ``dist.version``, not with a local
   step counter;
3. everything a round needs (batch, learning rate) is a function of that
   version;
4. after joining, a rank waits (a bounded time) until every rank is a
   member, so a group restarted together takes up the job together
   (shards gate only the first round on ``--min-workers``).

The same job from the command line: ``torchrun --standalone --nproc-per-node 2
--max-restarts 1 -m shardps.cli.main train digits --servers ... --worker-index env``.

Prints one ``key=value`` line when it starts, when it joined, after every
``--log-every`` steps and when it is done (the format of ``shardps train
digits --worker-index``).
"""

import argparse
import os
import sys
import time

import torch
from torch import nn

from shardps import DistributedOptimizer, WireOptions
from shardps.apps.digits import DigitsConfig, learning_rate, load_split, make_model, steps_per_epoch, total_steps


def say(line: str) -> None:
    """Print a line with one write (the ranks share torchrun's stdout: lines must not mix)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


parser = argparse.ArgumentParser()
parser.add_argument("--servers", required=True, help="host:port,... of the shards, in shard order")
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--job-name", default="digits", help="worker ids are <job-name>-rank<RANK>")
parser.add_argument("--connect-timeout", type=float, default=30.0,
                    help="seconds to wait for the shards and for a crashed predecessor's lease")
parser.add_argument("--log-every", type=int, default=10, help="print a step line every N steps (0: never)")
parser.add_argument("--wait-for-workers", type=float, default=30.0,
                    help="after joining, wait up to S seconds for every rank to be a member")
args = parser.parse_args()

# 1. A stable worker id from the launcher's rank (torchrun sets RANK and WORLD_SIZE).
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
worker_id = f"{args.job_name}-rank{rank}"
pid = os.getpid()
say(f"start pid={pid} worker_id={worker_id} rank={rank} workers={world} restart={restart} t={time.time():.3f}")

torch.set_num_threads(1)
config = DigitsConfig(workers=world, servers=tuple(args.servers.split(",")), epochs=args.epochs)
x_train, y_train, x_test, y_test = load_split(config.seed)
model = make_model(config.hidden, config.seed)  # every rank builds the same model; the shards keep the first one's
optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=1e-4)
per_epoch, total = steps_per_epoch(config), total_steps(config)
global_batch = world * config.batch_size

with DistributedOptimizer(optimizer, model.named_parameters(), servers=args.servers, worker_id=worker_id,
                          wire=WireOptions(connect_timeout=args.connect_timeout)) as dist:
    version = dist.version  # 0 for a new job; the shards' version for a restarted rank
    say(f"joined pid={pid} worker_id={worker_id} version={version} resumed={dist.resumed} "
        f"members={','.join(dist.members)} t={time.time():.3f}")
    # Ranks restarted together start together: wait (bounded) until every rank is a member again, or the
    # first one back would run rounds alone.
    deadline = time.monotonic() + args.wait_for_workers
    while time.monotonic() < deadline and len(dist.stats()[0].members) < world:
        time.sleep(0.2)
    local_step = 0
    # 2. The shards' version is the step counter: the job ends when the shards reach the last round.
    while version < total:
        # 3. The round's data and learning rate are functions of the version.
        epoch, step = divmod(version, per_epoch)
        order = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(config.seed * 1000 + epoch))
        mine = order[step * global_batch + rank * config.batch_size :][: config.batch_size]
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, version)
        dist.zero_grad()
        loss = nn.functional.cross_entropy(model(x_train[mine]), y_train[mine])
        loss.backward()
        dist.step()
        version = dist.version
        local_step += 1
        if args.log_every and local_step % args.log_every == 0:
            say(f"step local_step={local_step} version={version} loss={loss.item():.4f} t={time.time():.3f} "
                f"pid={pid} worker_id={worker_id}")
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        final_loss = nn.functional.cross_entropy(model(x_train), y_train).item()
say(f"done pid={pid} worker_id={worker_id} version={version} local_steps={local_step} "
    f"test_accuracy={accuracy:.4f} final_loss={final_loss:.4f}")

"""One emulated worker host of ``benchmarks/cluster.py``: trains the train benchmark's MLP when told to.

Started once per worker host, inside its network namespace
(``ip netns exec NS python benchmarks/cluster_job.py --rank R --world N``),
and kept for every system of the run (torch is imported once). It reads
commands as JSON lines on stdin and answers JSON lines on stdout, each
prefixed with ``@@`` (anything else on stdout is someone's log):

- ``{"cmd": "run", "system": ..., ...}``: build the model (seed 0, the
  same on every host) and the system's optimizer, train ``warmup`` steps,
  wait for the network to go quiet, answer ``{"event": "ready"}``;
- ``"go"``: train the timed steps, wait for the last pull, answer
  ``{"event": "timed", "start": s, "end": s, "steps": k, "cpu": s}``
  (wall clock, seconds since the epoch, shared by every namespace of the
  machine; CPU seconds of this process);
- ``"finish"``: compute the loss of the fixed held-out batch with the
  final parameters (async: exported from the shards, rank 0 only), close,
  answer ``{"event": "done", "final_loss": x}``;
- ``{"cmd": "exit"}`` or end of input: exit.

Systems: ``sync``, ``sync_bf16`` (bf16 gradients and parameters on the
wire) (both streamed), ``sync_plain`` (unstreamed), ``sync_clip``
(``max_grad_norm``), ``async`` (shardps), ``ddp`` (DistributedDataParallel over Gloo)
and ``ddp_fp16`` (the same with torch's ``fp16_compress_hook``). Each
sync/DDP host trains ``steps`` steps on its 64 rows of every global batch;
async hosts share a budget of ``world x steps`` timed steps through a
locked counter file (the file system is shared by every namespace), so a
fast host takes more of them than a slow one.
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from train import LR, batch, loss_of, make_model  # noqa: E402

SHARDPS = ("sync", "sync_bf16", "sync_plain", "sync_clip", "async")
#: rows whose rounds are streamed (WireOptions(streamed=True)); sync_clip asks for it too, but clipping needs the
#: whole gradient's norm before any chunk is applied, so its rounds go the plain way
STREAMED = ("sync", "sync_bf16", "sync_clip")
#: max_grad_norm of the sync_clip row
CLIP = 1.0
DDP = ("ddp", "ddp_fp16")


def say(**event) -> None:
    print("@@" + json.dumps(event), flush=True)


def listen() -> dict | str | None:
    """The next command on stdin: a dict, a bare word, or None at end of input."""
    line = sys.stdin.readline()
    if not line:
        return None
    line = line.strip()
    return json.loads(line) if line.startswith("{") else line


def take_ticket(path: str, budget: int) -> int | None:
    """The next timed step of the shared budget (0, 1, ...), or None when it is spent (``flock``-ed file)."""
    with open(path, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        taken = int(f.read() or 0)
        if taken >= budget:
            return None
        f.seek(0)
        f.write(str(taken + 1))
        f.truncate()
        return taken


def build(task: dict, rank: int, world: int):
    """``(model, net, optimizer)`` of ``task['system']``: shardps's DistributedOptimizer or a DDP module."""
    model = make_model("mlp")
    system = task["system"]
    if system in SHARDPS:
        from shardps import ConsistencyOptions, DistributedOptimizer, WireOptions

        dtype = "bf16" if system == "sync_bf16" else "fp32"
        opt = DistributedOptimizer(
            torch.optim.AdamW(model.parameters(), lr=LR, fused=True), model.named_parameters(),
            servers=task["servers"], worker_id=f"host-{rank}", model=model,
            max_grad_norm=CLIP if system == "sync_clip" else None,
            consistency=ConsistencyOptions(mode="async" if system == "async" else "sync"),
            wire=WireOptions(push_dtype=dtype, pull_dtype=dtype, chunk_bytes=task["chunk_bytes"],
                             push_credit_bytes=task.get("push_credit_bytes", 0),
                             rpc_timeout=600.0, connect_timeout=60.0, streamed=system in STREAMED))
        return model, model, opt
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"tcp://{task['master']}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    net = DistributedDataParallel(model, gradient_as_bucket_view=True)
    if system == "ddp_fp16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        net.register_comm_hook(state=None, hook=fp16_compress_hook)
    return model, net, torch.optim.AdamW(net.parameters(), lr=LR, fused=True)


def train_step(net, opt, rows: tuple[torch.Tensor, torch.Tensor]) -> None:
    opt.zero_grad()
    loss_of("mlp", net, *rows).backward()
    opt.step()


def settle(system: str, opt) -> None:
    """Wait until this host's last step is complete on the network (its pull landed; DDP: a barrier)."""
    if system in SHARDPS:
        opt.synchronize()
    else:
        dist.barrier()


def run(task: dict, rank: int, world: int) -> None:
    """One system, from the ``run`` command to ``done`` (see the module docstring)."""
    system, per_worker = task["system"], task["per_worker"]
    model, net, opt = build(task, rank, world)
    mine = slice(rank * per_worker, (rank + 1) * per_worker)
    for step in range(task["warmup"]):
        x, y = batch("mlp", step, world * per_worker)
        train_step(net, opt, (x[mine], y[mine]))
    settle(system, opt)
    say(event="ready")
    if listen() != "go":
        raise RuntimeError("expected go")
    start, cpu, done, timelines = time.time(), time.process_time(), 0, []
    if system == "async":
        while (ticket := take_ticket(task["budget_file"], world * task["steps"])) is not None:
            train_step(net, opt, batch("mlp", 1_000_000 + ticket, per_worker))
            done += 1
    else:
        for step in range(task["warmup"], task["warmup"] + task["steps"]):
            x, y = batch("mlp", step, world * per_worker)
            train_step(net, opt, (x[mine], y[mine]))
            done += 1
            if system in SHARDPS and (timeline := opt.last_timeline) is not None:
                timelines.append(timeline)  # the previous step's round (its pull landed in this forward)
    if system in SHARDPS:  # DDP's last step already waited for its allreduce
        opt.synchronize()
    end = time.time()
    if system in SHARDPS and opt.last_timeline is not None:
        timelines.append(opt.last_timeline)
    timeline = {k: sorted(t[k] for t in timelines)[len(timelines) // 2] for k in timelines[0]} if timelines else None
    say(event="timed", start=start, end=end, steps=done, cpu=time.process_time() - cpu, timeline=timeline)
    if listen() != "finish":
        raise RuntimeError("expected finish")
    final_loss = None
    eval_x, eval_y = batch("mlp", 10_000, 2 * per_worker)
    if system == "async":
        opt.close()
        if rank == 0:  # the shards' final parameters (each host's copy is from its own last pull)
            from shardps.worker.export import from_servers

            model.load_state_dict(from_servers(task["servers"], wait_seconds=60.0).state_dict, strict=True)
    if system != "async" or rank == 0:
        with torch.no_grad():
            final_loss = loss_of("mlp", model, eval_x, eval_y).item()
    if system in DDP:
        dist.destroy_process_group()
    elif system != "async":
        opt.close()
    say(event="done", final_loss=final_loss)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    say(event="started")
    while (task := listen()) is not None and task.get("cmd") == "run":
        try:
            run(task, args.rank, args.world)
        except BaseException:
            say(event="error", traceback=traceback.format_exc())
            raise
    os._exit(0)  # gRPC and Gloo threads must not hold the exit


if __name__ == "__main__":
    main()

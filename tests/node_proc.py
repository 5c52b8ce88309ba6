"""One local rank of a 2 nodes x 2 local ranks job for the node-reduction oracle (run with torch.multiprocessing).

Process ``i`` is local rank ``i % 2`` of node ``i // 2``; each node has its
own process group (Gloo on CPU, NCCL on CUDA) and joins the shards as one
contributor ``node<n>``. Each rank trains on its quarter of the global batch
and saves its final parameters to ``<out>/<optimizer>-<i>.pt``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardps.worker.node import NodeOptimizer
from tests.integration.test_sync_oracle import BATCH, CHUNK_BYTES, STEPS, data, make_model, make_optimizer


def run(i: int, servers: dict[str, str], out: str, device: str) -> None:
    node, local = divmod(i, 2)
    torch.set_num_threads(1)
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(local)
    dist.init_process_group(backend, init_method=f"file://{out}/node{node}.rendezvous", rank=local, world_size=2)
    try:
        x, y = data()
        per = BATCH // 4
        part = slice(i * per, (i + 1) * per)
        for name, address in servers.items():
            model = make_model().to(device)
            opt, sched = make_optimizer(name, model)
            with NodeOptimizer(opt, model.named_parameters(), servers=address, node_id=f"node{node}",
                               chunk_bytes=CHUNK_BYTES, rpc_timeout=60.0) as node_opt:
                for step in range(STEPS):
                    node_opt.zero_grad()
                    xb, yb = x[step, part].to(device), y[step, part].to(device)
                    nn.functional.cross_entropy(model(xb), yb).backward()
                    node_opt.step()
                    sched.step()
                assert node_opt.version == STEPS, node_opt.version
                assert not opt.state, "the local optimizer must never allocate state"
            torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, f"{out}/{name}-{i}.pt")
    finally:
        dist.destroy_process_group()


def leader_fails(i: int, dead_server: str, out: str) -> None:
    """Local rank ``i`` of one node whose leader cannot reach the shards: every rank must raise, none wait."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/failing.rendezvous", rank=i, world_size=2)
    try:
        model = make_model()
        opt, _ = make_optimizer("adamw", model)
        try:
            NodeOptimizer(opt, model.named_parameters(), servers=dead_server, node_id="node0", connect_timeout=1.0,
                          retry_seconds=1.0)
            outcome = "constructed"
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        with open(f"{out}/failing-{i}.txt", "w") as f:
            f.write(outcome)
    finally:
        dist.destroy_process_group()

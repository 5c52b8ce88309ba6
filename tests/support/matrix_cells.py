"""One cell of the mode x recipe matrix (``docs/mode-recipe-matrix.md``): a few steps of one recipe in one mode.

Used by ``tests/integration/test_mode_matrix.py``: a worker thread runs
:func:`run_cell` with a ``DistributedOptimizer``; a local rank of a one-node,
two-rank Gloo group runs :func:`node_column` (every recipe of one mode, with a
``NodeOptimizer``). Every worker (or local rank) trains on its half of one
fixed batch (``recipe_net.batch(0)``), so its own loss falls in every mode.
"""

from __future__ import annotations

import datetime
import json
import math
import time
import traceback

import torch
from torch import nn

from shardps.worker.config import ConsistencyOptions, WireOptions
from tests.support.recipe_net import Net, batch, part

#: The rows of the table, in order.
RECIPES = ("plain loop", "max_grad_norm", "grad_scaler", "max_grad_norm + grad_scaler",
           "backward_passes_per_step=2", "OneCycleLR cycling betas (AdamW)", "OneCycleLR cycling momentum (SGD)",
           "bf16 wire", "frozen parameters", "BatchNorm buffers")
STEPS = 6
#: A scale whose first step overflows (the test's spike), then backs off to ~2e5 at once.
INIT_SCALE, BACKOFF = 3e38, 2.0 ** -110


def _options(recipe: str, mode: str) -> dict:
    kw: dict = {"consistency": ConsistencyOptions(mode=mode, staleness=1 if mode == "ssp" else None)}
    wire = {"chunk_bytes": 512, "rpc_timeout": 20.0}
    if "max_grad_norm" in recipe:
        kw["max_grad_norm"] = 0.5
    if "grad_scaler" in recipe:
        kw["grad_scaler"] = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, backoff_factor=BACKOFF)
    if recipe.startswith("backward_passes"):
        kw["backward_passes_per_step"] = 2
    if recipe == "bf16 wire":
        wire["push_dtype"] = "bf16"
    kw["wire"] = WireOptions(**wire)
    return kw


def run_cell(recipe: str, mode: str, servers: str, worker: int, workers: int = 2, node: bool = False) -> dict:
    """Train ``STEPS`` steps of ``recipe`` in ``mode``; never raises.

    Returns:
        ``{"outcome": "trained" | "refused: <message>" | "failed: <error>", "losses": [float],
        "problems": [str], "seconds": float}``: ``refused`` when construction raised, ``failed``
        when a step did; ``problems`` lists the recipe's own checks that failed.
    """
    began = time.monotonic()
    result = {"outcome": "", "losses": [], "problems": [], "seconds": 0.0}
    model = Net(batch_norm=recipe == "BatchNorm buffers")
    if recipe == "frozen parameters":
        model.frozen.requires_grad_(False)
    frozen = [p.detach().clone() for p in model.frozen.parameters()]
    params = [p for p in model.parameters() if p.requires_grad]
    if "SGD" in recipe:
        opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.AdamW(params, lr=0.02)
    sched = (torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS, cycle_momentum=True)
             if recipe.startswith("OneCycleLR") else None)
    kw = _options(recipe, mode)
    scaler = kw.get("grad_scaler")
    try:
        if node:
            from shardps.worker.node.optimizer import NodeOptimizer

            wrapper = NodeOptimizer(opt, model.named_parameters(), servers=servers, node_id="node0",
                                    named_buffers=model.named_buffers(), **kw)
        else:
            from shardps.worker.optimizer import DistributedOptimizer

            wrapper = DistributedOptimizer(opt, model.named_parameters(), servers=servers,
                                           worker_id=f"w{worker}", model=model, **kw)
    except Exception as exc:
        result["outcome"] = f"refused: {type(exc).__name__}: {exc}"
        result["seconds"] = time.monotonic() - began
        return result
    x, y = batch(0)
    x, y = x[part(worker, workers)], y[part(worker, workers)]
    problems = result["problems"]
    try:
        with wrapper:
            for step in range(STEPS):
                wrapper.zero_grad()
                halves = ([slice(0, len(x) // 2), slice(len(x) // 2, None)]
                          if recipe.startswith("backward_passes") else [slice(None)])
                total = 0.0
                for rows in halves:
                    loss = nn.functional.cross_entropy(model(x[rows]), y[rows]) / len(halves)
                    total += loss.item()
                    if scaler is not None:  # step 0: a spike that overflows the scaled gradient
                        scaler.scale(loss * (1e4 if step == 0 else 1.0)).backward()
                    else:
                        loss.backward()
                result["losses"].append(total)
                wrapper.step()
                if not node:
                    if scaler is not None and wrapper.last_step_skipped != (step == 0):
                        problems.append(f"step {step}: last_step_skipped is {wrapper.last_step_skipped}")
                    if "max_grad_norm" in kw and step > 0 and not math.isfinite(wrapper.last_grad_norm):
                        problems.append(f"step {step}: last_grad_norm {wrapper.last_grad_norm}")
                if scaler is not None:
                    scaler.update()
                if sched is not None:
                    sched.step()
            if not node:
                wrapper.synchronize()
        result["outcome"] = "trained"
    except Exception as exc:
        result["outcome"] = f"failed: {type(exc).__name__}: {exc}"
        result["trace"] = traceback.format_exc()[-3000:]
    if scaler is not None and not scaler.get_scale() < INIT_SCALE:
        problems.append(f"the scale did not back off after the overflow: {scaler.get_scale()}")
    if not all(torch.equal(a, b) for a, b in zip(frozen, model.frozen.parameters())) and recipe == "frozen parameters":
        problems.append("a frozen parameter changed")
    if recipe == "BatchNorm buffers":
        mean = model.norm.running_mean
        if not (torch.isfinite(mean).all() and mean.abs().sum() > 0):
            problems.append(f"running_mean {mean.tolist()}")
    result["seconds"] = time.monotonic() - began
    return result


def reset(servers: str) -> None:
    """Drop the job on every shard (between cells: a fresh job, any mode)."""
    from shardps.worker.session.client import ShardClient

    for index, address in enumerate(servers.split(",")):
        client = ShardClient(address, index=index)
        try:
            client.reset()
        finally:
            client.close()


def node_column(rank: int, servers: str, out: str, mode: str, recipes: list[str]) -> None:
    """Local rank ``rank`` of one node of 2 Gloo ranks: every recipe of ``recipes`` in ``mode``, one after another.

    Before each cell the leader resets the shards (a fresh job); each rank writes
    ``<out>/<mode>-<index>-<rank>.json`` (:func:`run_cell`'s result) after its cell.
    """
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/{mode}.rendezvous", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        for index, recipe in enumerate(recipes):
            if rank == 0:
                reset(servers)
            dist.barrier()
            result = run_cell(recipe, mode, servers, rank, node=True)
            with open(f"{out}/{mode}-{index}-{rank}.json", "w") as f:
                json.dump(result, f)
            dist.barrier()
    finally:
        dist.destroy_process_group()

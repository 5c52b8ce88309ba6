"""What one more chunk costs a step: the same number of dense parameters as 1, 2 or 6 keys, 1 worker x 1 shard.

    python benchmarks/chunk_cost.py [--json PATH] [--steps 300] [--warmup 20] [--repeats 2]

A chunk is the plan's unit on the wire (``common/plan.py``): one frame, so one gRPC message, per push and per
pull, and one piece of the shard's streamed apply. A key smaller than ``chunk_bytes`` is one chunk, so a model
of many small tensors (the MLP of a recommender model) pays this cost once per tensor. The models here hold
9,409 float32 parameters (the DeepFM MLP's count, ``shardps.apps.deepfm``) and do almost no compute (a sum),
so that the step is the parameter server's own work:

- ``1 key``: one tensor of 9,409;
- ``2 keys``: 7,168 + 2,241;
- ``6 keys``: the sizes of the DeepFM MLP's tensors (7,168, 64, 2,048, 32, 32, 65).

Each runs ``--warmup`` untimed then ``--steps`` timed steps of ``DistributedOptimizer(Adam)`` with
``model=`` (pull overlapped with the next forward), a fresh shard process (``LocalCluster``, ``--threads 1``)
per run, the runs interleaved ``--repeats`` times; plain torch (``torch.optim.Adam`` in this process, the same
6-key model) is measured in each repeat as the reference. Printed per run: ms per step (wall), and CPU ms per
step of the worker process (every thread) and of the shard process; the figures are medians over the repeats.
No speed is asserted anywhere.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cpu_seconds, emit, parser, table  # noqa: E402 - benchmarks/common.py

SIZES = {"1 key": (9409,), "2 keys": (7168, 2241), "6 keys": (7168, 64, 2048, 32, 32, 65)}


class Keys(nn.Module):
    """Parameters of ``sizes`` (float32 vectors); ``forward(x)`` is ``x.sum()`` times the sum of every parameter."""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.ps = nn.ParameterList([nn.Parameter(0.01 * torch.randn(n, generator=g)) for n in sizes])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum() * sum(p.sum() for p in self.ps)


def run_torch(steps: int, warmup: int) -> dict:
    model, x = Keys(SIZES["6 keys"]), torch.ones(64, 112)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for k in range(warmup + steps):
        if k == warmup:
            t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad()
        model(x).backward()
        opt.step()
    return {"step_ms": 1e3 * (time.perf_counter() - t0) / steps,
            "worker_cpu_ms": 1e3 * (time.process_time() - c0) / steps, "shard_cpu_ms": 0.0}


def run_shardps(sizes: tuple[int, ...], steps: int, warmup: int) -> dict:
    from shardps.worker import DistributedOptimizer, LocalCluster

    model, x = Keys(sizes), torch.ones(64, 112)
    with LocalCluster(1, min_workers=1, extra_args=("--threads", "1")) as cluster:
        pid = cluster.processes[0].pid
        dist = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), model.named_parameters(),
                                    servers=cluster.servers, model=model, worker_id="w0")
        try:
            for k in range(warmup + steps):
                if k == warmup:
                    dist.synchronize()
                    t0, c0, s0 = time.perf_counter(), time.process_time(), cpu_seconds(pid)
                dist.zero_grad()
                model(x).backward()
                dist.step()
            dist.synchronize()
            wall, cpu, shard = time.perf_counter() - t0, time.process_time() - c0, cpu_seconds(pid) - s0
        finally:
            dist.close()
    return {"step_ms": 1e3 * wall / steps, "worker_cpu_ms": 1e3 * cpu / steps, "shard_cpu_ms": 1e3 * shard / steps}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="timed steps per run (default 300)")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps first (default 20)")
    p.add_argument("--repeats", type=int, default=2, help="interleaved repeats (default 2)")
    args = p.parse_args()
    torch.set_num_threads(1)
    runs: dict[str, list[dict]] = {"torch (6 keys)": [], **{k: [] for k in SIZES}}
    for repeat in range(args.repeats):
        runs["torch (6 keys)"].append(run_torch(args.steps, args.warmup))
        for name, sizes in SIZES.items():
            runs[name].append(run_shardps(sizes, args.steps, args.warmup))
            print(f"repeat {repeat + 1} {name}: {runs[name][-1]['step_ms']:.2f} ms/step", flush=True)
    median = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    print(table([[name, f"{m['step_ms']:.2f}", f"{m['worker_cpu_ms']:.2f}", f"{m['shard_cpu_ms']:.2f}"]
                 for name, m in median.items()], ["run", "ms/step", "worker CPU ms/step", "shard CPU ms/step"]))
    extra = (median["6 keys"]["step_ms"] - median["1 key"]["step_ms"]) / 5
    print(f"each key beyond the first: {extra:.2f} ms more per step (the same 9,409 parameters)")
    emit({"steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "runs": runs, "median": median,
          "ms_per_extra_key": extra}, args.json)


if __name__ == "__main__":
    main()

"""Training benchmark: shardps sync vs torch DDP (Gloo) vs DDP + ZeroRedundancyOptimizer, one run.

    python benchmarks/train.py [--json PATH] [--steps 50] [--batch-size 64]

2 worker processes train the same MLP (1024 -> 2048 -> 2048 -> 2048 -> 10,
10.5 M parameters) with AdamW on the same synthetic batches (each worker
its half of every global batch), one torch thread per worker:

- shardps: sync (BSP), 2 shard processes on 127.0.0.1 holding the weights
  and the AdamW moments;
- ddp: DistributedDataParallel over Gloo, AdamW on every worker;
- zero: DDP + ZeroRedundancyOptimizer(AdamW) (ZeRO stage 1, Rajbhandari et
  al., SC 2020).

Figures per system: samples/s over the timed steps (all but the first 5),
``final_loss`` (cross-entropy of a fixed 256-sample batch with the final
parameters), each worker's peak resident memory (``peak_rss_bytes``, the
larger of the two) and ``model_state_bytes``: the peak RSS minus the RSS
just before the model was built (params, grads, DDP buckets, optimizer
state and communication buffers), the larger of the two workers.
"""

from __future__ import annotations

import datetime
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from common import current_rss_bytes, emit, parser, peak_rss_bytes, table  # noqa: E402
from torch import nn  # noqa: E402

WORKERS = 2
WARMUP = 5
D_IN, HIDDEN, CLASSES = 1024, 2048, 10
LR = 1e-3


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES),
    )


def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(rows, D_IN, generator=g), torch.randint(0, CLASSES, (rows,), generator=g)


def _worker(rank: int, system: str, endpoint: str, steps: int, per_worker: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    if system in ("ddp", "zero"):
        dist.init_process_group("gloo", init_method=f"tcp://{endpoint}", rank=rank, world_size=WORKERS,
                                timeout=datetime.timedelta(seconds=120))
    eval_x, eval_y = batch(10_000, 256)
    baseline = current_rss_bytes()
    model = make_model()
    if system == "shardps":
        from shardps.worker import DistributedOptimizer

        opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR, fused=True), model.named_parameters(),
                                   servers=endpoint, worker_id=f"bench-{rank}")
        net = model
    else:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model)
        if system == "ddp":
            opt = torch.optim.AdamW(net.parameters(), lr=LR, fused=True)
        else:
            opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW, lr=LR, fused=True)
    loss_fn = nn.CrossEntropyLoss()
    start = 0.0
    for step in range(steps):
        if step == WARMUP:
            start = time.perf_counter()
        x, y = batch(step, WORKERS * per_worker)
        mine = slice(rank * per_worker, (rank + 1) * per_worker)
        opt.zero_grad()
        loss_fn(net(x[mine]), y[mine]).backward()
        opt.step()
    seconds = time.perf_counter() - start
    with torch.no_grad():
        final_loss = loss_fn(model(eval_x), eval_y).item()
    peak = peak_rss_bytes()
    if system == "shardps":
        opt.close()
    else:
        dist.destroy_process_group()
    Path(out_dir, f"{rank}.txt").write_text(f"{seconds} {final_loss!r} {peak} {peak - baseline}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(system: str, steps: int, per_worker: int) -> dict:
    from shardps.worker import LocalCluster

    with tempfile.TemporaryDirectory() as out:
        cluster = LocalCluster(2, min_workers=WORKERS).start() if system == "shardps" else None
        endpoint = cluster.servers if cluster else f"127.0.0.1:{free_port()}"
        try:
            mp.start_processes(_worker, args=(system, endpoint, steps, per_worker, out), nprocs=WORKERS,
                               start_method="spawn")
        finally:
            if cluster:
                cluster.stop()
        rows = [Path(out, f"{r}.txt").read_text().split() for r in range(WORKERS)]
    seconds = max(float(r[0]) for r in rows)
    losses = [float(r[1]) for r in rows]
    assert losses[0] == losses[1], f"{system}: workers disagree on the final parameters"
    return {
        "samples_per_s": WORKERS * per_worker * (steps - WARMUP) / seconds,
        "final_loss": losses[0],
        "peak_rss_bytes": max(int(r[2]) for r in rows),
        "model_state_bytes": max(int(r[3]) for r in rows),
    }


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=64, help="samples per worker per step")
    p.add_argument("--systems", default="shardps,ddp,zero")
    args = p.parse_args()
    if args.steps <= WARMUP:
        p.error(f"--steps must exceed the {WARMUP} warm-up steps")
    params = sum(q.numel() for q in make_model().parameters())
    results = {}
    for system in args.systems.split(","):
        print(f"running {system} ...", flush=True)
        results[system] = run(system, args.steps, args.batch_size)
    mib = 1 << 20
    print(table(
        [[s, f"{r['samples_per_s']:.0f}", f"{r['final_loss']:.6f}", f"{r['peak_rss_bytes'] / mib:.0f}",
          f"{r['model_state_bytes'] / mib:.0f}"] for s, r in results.items()],
        ["system", "samples/s", "final loss", "peak RSS MiB", "model state MiB"],
    ))
    out = {"params": params, "steps": args.steps, "timed_steps": args.steps - WARMUP,
           "per_worker_batch": args.batch_size, "workers": WORKERS, **results}
    if "shardps" in results and "ddp" in results:
        s, d = results["shardps"], results["ddp"]
        out["ratio_samples_per_s"] = s["samples_per_s"] / d["samples_per_s"]
        out["ratio_model_state_bytes"] = s["model_state_bytes"] / d["model_state_bytes"]
        out["final_loss_abs_diff"] = abs(s["final_loss"] - d["final_loss"])
        print(f"shardps / ddp: samples/s {out['ratio_samples_per_s']:.2f}, model state memory "
              f"{out['ratio_model_state_bytes']:.2f}, |final loss diff| {out['final_loss_abs_diff']:.2e}")
    emit(out, args.json)


if __name__ == "__main__":
    main()

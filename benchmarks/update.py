"""Update benchmark: a shard's optimizer update over 64 M parameters vs a bare fused AdamW step.

    python benchmarks/update.py [--json PATH] [--repeats 10] [--threads 1]

Both run in this process on the same thread count: the shard's round
update ``ShardOptimizer.apply`` (the code a shard runs every round, built
from the same OptimizerSpec a worker sends, over the flat fp32 buffers of a
partition plan of 4 keys x 16 M elements), its parts (the dry run that
proves the update finite before anything changes, and the fused step), and
``torch.optim.AdamW(fused=True)`` on one flat 64 M-element tensor. The
round's gradient averaging over W workers is reported beside it
(``average_2_workers_seconds``). Figures are medians over ``--repeats``
steps after 2 warm-up steps.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import emit, parser, table  # noqa: E402

from shardps.common.optim import optimizer_spec  # noqa: E402
from shardps.common.plan import KeyInfo, PartitionPlan  # noqa: E402
from shardps.server.dense.chunks import ChunkTable  # noqa: E402
from shardps.server.dense.optimizer import ShardOptimizer  # noqa: E402

NUMEL = 64 * 1024 * 1024


def median_seconds(fn, repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch threads (a shard runs with 1)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    hp = dict(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01)

    # bare fused AdamW on one flat tensor
    flat = torch.zeros(NUMEL)
    flat.grad = torch.randn(NUMEL)
    bare = torch.optim.AdamW([flat], fused=True, **hp)
    bare_s = median_seconds(bare.step, args.repeats)
    del bare, flat

    # the shard's update: the OptimizerSpec a worker would send, over a plan's flat buffers
    keys = [KeyInfo(f"layer{i}.weight", (4096, 4096), 0) for i in range(4)]
    plan = PartitionPlan.build(keys, num_shards=1, chunk_bytes=4 << 20)
    table_ = ChunkTable(plan, 0)
    spec = optimizer_spec(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], **hp))
    params = table_.allocate()
    shard = ShardOptimizer(spec, params, table_.key_slices)
    grads = {g: torch.randn_like(t) for g, t in params.items()}
    lrs, present = [1e-3], set(range(len(keys)))
    shard_s = median_seconds(lambda: shard.apply(grads, present, lrs), args.repeats)  # 1 worker: no averaging
    step_s = median_seconds(lambda: shard.apply(grads, present, lrs, check=False), args.repeats)
    dry_s = shard_s - step_s  # the dry run (finite check)

    other = {g: torch.randn_like(t) for g, t in params.items()}

    def average() -> None:
        for g, grad in grads.items():
            grad.add_(other[g]).mul_(0.5)

    avg_s = median_seconds(average, args.repeats)
    result = {
        "numel": NUMEL,
        "threads": args.threads,
        "shard_update_seconds": shard_s,
        "shard_step_seconds": step_s,
        "shard_dry_run_seconds": dry_s,
        "bare_adamw_seconds": bare_s,
        "ratio": shard_s / bare_s,
        "average_2_workers_seconds": avg_s,
    }
    print(table(
        [
            ["shard round update (ShardOptimizer.apply, AdamW)", f"{shard_s * 1e3:.1f}", f"{shard_s / bare_s:.2f}"],
            ["  of which the dry run (finite check)", f"{dry_s * 1e3:.1f}", f"{dry_s / bare_s:.2f}"],
            ["  of which the fused step", f"{step_s * 1e3:.1f}", f"{step_s / bare_s:.2f}"],
            ["bare torch.optim.AdamW(fused=True)", f"{bare_s * 1e3:.1f}", "1.00"],
            ["gradient averaging of 2 workers (per round)", f"{avg_s * 1e3:.1f}", f"{avg_s / bare_s:.2f}"],
        ],
        [f"64 M fp32 parameters, {args.threads} thread(s)", "ms", "x bare"],
    ))
    emit(result, args.json)


if __name__ == "__main__":
    main()

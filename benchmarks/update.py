"""Update benchmark: a shard's optimizer update over 64 M parameters vs a bare fused AdamW step.

    python benchmarks/update.py [--json PATH] [--repeats 15] [--threads 1 N]

Run at 1 thread and at a shard's default thread count (``usable_cores()``:
the CPU affinity capped by the cgroup CPU quota), both in this process:
the shard's round update ``ShardOptimizer.apply`` (the code a shard runs
every round, built from the same OptimizerSpec a worker sends, over the
flat fp32 buffers of a partition plan of 4 keys x 16 M elements), its parts
(the gradient pass and proof that show the update finite before anything
changes, and the fused step), and ``torch.optim.AdamW(fused=True)`` on one
flat 64 M-element tensor. The round update is the update as a shard runs
it: its caller passes the gradient's bound (``apply(grad_bound=...)``),
which the shard's receiver measures as each pushed chunk arrives (in
place of the NaN check it ran there before), so the update itself reads
the gradient only in the step; ``bound measured in apply`` is the update
when no bound is given (one more pass over the gradient). The exact path a round takes when the bounds
prove nothing (the dry run, then the step) is measured on a shard whose
optimizer has ``eps=1e-45``, below what a proof accepts. The round's gradient
averaging over 2 workers is reported beside it. Each figure is a median
over ``--repeats`` rounds after 2 warm-up rounds; the update and the bare
step alternate, and ``x bare`` is the median of the paired ratios.
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
from shardps.common.cores import usable_cores  # noqa: E402
from shardps.server.dense import bounds  # noqa: E402
from shardps.server.dense.chunks import ChunkTable  # noqa: E402
from shardps.server.dense.optimizer import ShardOptimizer  # noqa: E402

NUMEL = 64 * 1024 * 1024
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01)


def timed(fns: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds of each call of each function, the functions alternating, after 2 warm-up rounds."""
    for fn in fns.values():
        fn()
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return times


def shard_optimizer(**hyper) -> tuple[ShardOptimizer, dict[int, torch.Tensor]]:
    """The OptimizerSpec a worker would send, over a plan's flat buffers (4 keys x 16 M elements)."""
    keys = [KeyInfo(f"layer{i}.weight", (4096, 4096), 0) for i in range(4)]
    plan = PartitionPlan.build(keys, num_shards=1, chunk_bytes=4 << 20)
    chunks = ChunkTable(plan, 0)
    spec = optimizer_spec(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], **{**HYPER, **hyper}))
    params = chunks.allocate()
    for t in params.values():
        t.normal_(0.0, 0.02)  # what Init would send (allocate() leaves the buffers uninitialised)
    return ShardOptimizer(spec, params, chunks.key_slices), params


def run(threads: int, repeats: int) -> dict:
    torch.set_num_threads(threads)
    flat = torch.zeros(NUMEL)
    flat.grad = torch.randn(NUMEL)
    bare = torch.optim.AdamW([flat], fused=True, **HYPER)
    shard, params = shard_optimizer()
    grads = {g: torch.randn_like(t) for g, t in params.items()}
    lrs, present = [1e-3], set(range(4))  # 1 worker: no averaging

    def paired(name: str, fn) -> tuple[float, float, float]:
        t = timed({"bare": bare.step, name: fn}, repeats)
        ratios = [a / b for a, b in zip(t[name], t["bare"])]
        return statistics.median(t[name]), statistics.median(t["bare"]), statistics.median(ratios)

    update_s, bare_s, ratio = paired("update", lambda: shard.apply(grads, present, lrs))
    assert shard.dry_runs == 0, "the benchmark's rounds should be proved finite"
    # the bound made where the gradient is made (the receiver's per-chunk check, while the chunk is in cache)
    given = bounds.average_bound([bounds.grad_bound(grads.values())])
    given_s, _, given_ratio = paired("given", lambda: shard.apply(grads, present, lrs, grad_bound=given))
    step_s, bare2_s, step_ratio = paired("step", lambda: shard.apply(grads, present, lrs, check=False))
    del shard, params
    exact, exact_params = shard_optimizer(eps=1e-45)
    exact_grads = {g: torch.randn_like(t) for g, t in exact_params.items()}
    exact_s, bare3_s, exact_ratio = paired("exact", lambda: exact.apply(exact_grads, present, lrs))
    assert exact.proved == 0
    del exact, exact_params, exact_grads, bare, flat

    other = {g: torch.randn_like(t) for g, t in grads.items()}

    def average() -> None:
        for g, grad in grads.items():
            grad.add_(other[g]).mul_(0.5)

    avg_s = statistics.median(timed({"average": average}, repeats)["average"])
    bare_all = statistics.median([bare_s, bare2_s, bare3_s])
    return {
        "threads": threads,
        "shard_update_seconds": given_s,  # as a shard runs it: the bound comes from its receiver
        "ratio": given_ratio,
        "shard_update_bound_in_apply_seconds": update_s,
        "bound_in_apply_ratio": ratio,
        "shard_check_seconds": max(0.0, (ratio - step_ratio) * bare_s),  # the gradient pass and the proof
        "shard_step_seconds": step_s,
        "bare_adamw_seconds": bare_s,
        "step_ratio": step_ratio,
        "shard_update_given_bound_seconds": given_s,
        "given_bound_ratio": given_ratio,
        "exact_path_seconds": exact_s,
        "exact_path_ratio": exact_ratio,
        "average_2_workers_seconds": avg_s,
        "average_2_workers_ratio": avg_s / bare_all,
    }


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=15)
    default = usable_cores()
    p.add_argument("--threads", type=int, nargs="+", default=sorted({1, default}),
                   help=f"torch thread counts to run at (default: 1 and a shard's default here, {default})")
    args = p.parse_args()
    runs = [run(t, args.repeats) for t in args.threads]
    rows = [[f"{r['threads']}" + (" (default)" if r["threads"] == default else ""),
             f"{r['shard_update_seconds'] * 1e3:.1f}", f"{r['ratio']:.2f}",
             f"{r['shard_check_seconds'] * 1e3:.1f}", f"{r['shard_step_seconds'] * 1e3:.1f}",
             f"{r['bare_adamw_seconds'] * 1e3:.1f}", f"{r['bound_in_apply_ratio']:.2f}", f"{r['exact_path_ratio']:.2f}",
             f"{r['average_2_workers_seconds'] * 1e3:.1f}"] for r in runs]
    print(table(rows, ["threads", "round update ms", "x bare", "gradient pass ms", "step ms", "bare AdamW ms",
                       "x bare, bound measured in apply", "x bare, exact path", "averaging 2 workers ms"]))
    print("64 M fp32 parameters, AdamW. round update: ShardOptimizer.apply as a shard runs it (the |g| bound from the "
          "receiver, the proof, the fused step); bare: torch.optim.AdamW(fused=True); bound measured in apply: one "
          "more pass over the gradient; exact path: dry run + step (rounds the bounds do not prove)")
    emit({"numel": NUMEL, "default_threads": default, "runs": runs,
          "ratio_by_threads": {str(r["threads"]): r["ratio"] for r in runs}}, args.json)


if __name__ == "__main__":
    main()

"""A worker and one shard moving a 16 MiB model: minor page faults per round in each process, as JSON on stdout.

    python -m tests.support.page_faults [--no-retain]

``--no-retain``: the worker passes ``WireOptions(retain_freed_memory=False)``
(the shard always retains). Prints ``{"pages": P, "worker": F, "shard": F, ...}``:
``P`` pages of 4 KiB the model fills once, ``F`` the median of the faults of
each of 7 rounds after three rounds of warm-up (a round moves the model
twice: out and back). The median, not the mean: a round in which more
chunks happen to be in flight at once than ever before (a loaded machine
delays one thread) grows the heap to a new high-water mark and faults those
pages once (``perf record -e minor-faults``: the faults of such rounds lie
in the heap above its earlier top, from ``bytes`` made for chunks); the
rounds after it reuse them. Without reuse every round faults the model in.
``worker_mean``/``shard_mean``: the mean over the 7 rounds, which a fault
in every other round would raise past half the model's pages.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics

import torch

from shardps.common.memory import GLIBC_ENV
from shardps.worker import DistributedOptimizer, LocalCluster, WireOptions

MODEL_BYTES = 16 << 20
ROUNDS = 7


def environment_without_malloc_settings() -> dict[str, str]:
    """This process's environment less the malloc variables that make ``retain_freed_memory`` stand aside."""
    return {k: v for k, v in os.environ.items() if k not in GLIBC_ENV}


def process_faults(pid: int) -> int:
    """Minor page faults of process ``pid`` so far (``/proc/PID/stat`` field 10)."""
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[7])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--no-retain", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    params = [torch.nn.Parameter(torch.randn(MODEL_BYTES // 8)) for _ in range(2)]
    grads = [torch.ones_like(q) for q in params]  # made once: only the data plane allocates per round
    with LocalCluster(1) as cluster:
        dist = DistributedOptimizer(torch.optim.SGD(params, lr=1e-3), [(f"w{i}", q) for i, q in enumerate(params)],
                                    servers=cluster.addresses,
                                    wire=WireOptions(chunk_bytes=1 << 20, retain_freed_memory=not args.no_retain))
        try:
            def step() -> None:
                for q, g in zip(params, grads):
                    q.grad = g
                dist.step()

            for _ in range(3):
                step()
            shard = cluster.processes[0].pid
            counts = [(resource.getrusage(resource.RUSAGE_SELF).ru_minflt, process_faults(shard))]
            for _ in range(ROUNDS):
                step()
                counts.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt, process_faults(shard)))
        finally:
            dist.close()
    per_round = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(counts, counts[1:])]
    worker, shard = (statistics.median(faults) for faults in zip(*per_round))
    means = [statistics.mean(faults) for faults in zip(*per_round)]
    print(json.dumps({"pages": MODEL_BYTES // 4096, "worker": worker, "shard": shard, "worker_mean": means[0],
                      "shard_mean": means[1], "rounds": per_round}))


if __name__ == "__main__":
    main()

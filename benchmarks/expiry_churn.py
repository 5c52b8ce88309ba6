"""Expiry by event time on a churning stream: the rows held plateau instead of growing with the stream.

    python benchmarks/expiry_churn.py [--seconds 60] [--ttl 10] [--json PATH] [--plot PATH]

Each second of event time brings 20 new ids and 5 returning ones (ids first seen 3 seconds before), one
step a second, 2 shards, a hashed table with and without ``ttl_seconds``: without expiry the rows grow by 20 a
second; with it they settle where the last ``ttl`` seconds' ids are (Monolith's expiry of ids unseen for a
configured time). Prints the rows held after each second and the plateau's spread (the issue's goal: within
+-10%), writes the series (``--json``) and the plot (``--plot``, matplotlib). The same stream is the test
``tests/integration/test_event_time_expiry.py::test_a_churning_stream_holds_a_plateau_of_rows``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import emit, machine, parser  # noqa: E402 - benchmarks/common.py


def run(servers: str, seconds: int, ttl: float, name: str) -> list[int]:
    """Rows held after each second of the churning stream (``ttl`` 0: no expiry)."""
    from shardps.worker import DistributedOptimizer, ShardedEmbedding

    model = nn.ModuleDict({"emb": ShardedEmbedding(None, 4, name=name, ttl_seconds=ttl)})
    x = nn.Parameter(torch.zeros(1))
    dist = DistributedOptimizer(torch.optim.SGD([x], lr=0.1), [("x", x)], servers=servers, model=model,
                                worker_id=f"w-{name}", sparse_optimizer=torch.optim.SGD([model["emb"].handle], lr=0.5))
    held = []
    try:
        for t in range(seconds):
            ids = sorted(set(range(20 * t, 20 * t + 20)) | {20 * max(0, t - 3) + k for k in range(5)})
            dist.zero_grad()
            model["emb"](torch.tensor(ids)).sum().backward()
            dist.set_event_time(5_000.0 + t)
            dist.step()
            held.append(int(dist.tables.export(name).ids.numel()))
    finally:
        dist.close()
    return held


def main() -> None:
    """Run the stream with and without expiry, print, plot and write the series."""
    from shardps.worker.cluster import LocalCluster

    p = parser(__doc__.splitlines()[0])
    p.add_argument("--seconds", type=int, default=60, help="seconds of event time streamed (default 60)")
    p.add_argument("--ttl", type=float, default=10.0, help="ttl_seconds of the expiring table (default 10)")
    p.add_argument("--plot", default="", help="draw the rows held to this PNG file")
    args = p.parse_args()
    with LocalCluster(2, min_workers=1, extra_args=("--threads", "1")) as cluster:
        expiring = run(cluster.servers, args.seconds, args.ttl, "churn_ttl")
    with LocalCluster(2, min_workers=1, extra_args=("--threads", "1")) as cluster:  # a fresh job
        growing = run(cluster.servers, args.seconds, 0.0, "churn_none")
    plateau = expiring[args.seconds // 2:]
    spread = max(plateau) / min(plateau) - 1
    mean = sum(plateau) / len(plateau)
    within = max(abs(v - mean) / mean for v in plateau)
    for t in range(0, args.seconds, 5):
        print(f"t={t:3d} s: {expiring[t]:5d} rows with ttl {args.ttl:g} s, {growing[t]:5d} without")
    print(f"plateau (second half): {min(plateau)} to {max(plateau)} rows, mean {mean:.0f}, every value within "
          f"{100 * within:.1f}% of the mean (goal: 10%); without expiry {growing[-1]} rows at the end")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.plot(range(args.seconds), growing, label="no expiry")
        ax.plot(range(args.seconds), expiring, label=f"ttl_seconds={args.ttl:g}")
        ax.set_xlabel("event time (s)")
        ax.set_ylabel("rows held")
        ax.set_title("a churning stream: 20 new ids a second")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
    emit({"seconds": args.seconds, "ttl": args.ttl, "expiring": expiring, "growing": growing,
          "plateau_min": min(plateau), "plateau_max": max(plateau), "plateau_mean": mean,
          "within_of_mean": within, "spread": spread, "machine": machine()}, args.json)


if __name__ == "__main__":
    main()

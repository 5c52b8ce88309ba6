"""A serving replica under training load: query latency, and what the replica costs training.

    python benchmarks/serving.py [--json PATH] [--data-dir DIR] [--seconds 20] [--repeats 2] [--qps 200]
                                 [--rate 2000] [--limit 0] [--warm-epochs 5] [--part both] [--serve-realtime 10]
                                 [--client-realtime 10] [--serve-nice -10] [--client-nice 0]
                                 [--client-api unary|stream|both]

Part 1, what the replica costs training.

A training process steps the MovieLens matrix factorisation (``shardps.apps.movielens.MF``: the tables
``user``, ``item``, ``user_bias``, ``item_bias`` on 2 shards, the dense ``global_bias``) over ``u.data``'s
ratings in random batches of 256 for ``--seconds`` seconds, as fast as it can, with 1 torch thread. Two runs,
interleaved ``--repeats`` times:

- ``alone``: training only (its steps/s);
- ``served``: the same training with ``shardps serve`` subscribed (``--period 0.5``, dense every 5 s,
  ``--realtime`` ``--serve-realtime``: SCHED_FIFO priority 10 by default, so that a query's threads take a core
  from training's work at once; ``--serve-realtime 0`` runs it at ``--nice`` ``--serve-nice`` instead, -10 by
  default) and a client process of its own sending, at ``--qps`` queries per second in total, one ``Lookup`` of
  2,000 user ids and one ``Score`` of a user against 100 items alternately, each timed from send to answer. The
  client runs at the real-time priority ``--client-realtime`` (default 10: its own wait for a core on the
  saturated machine stays out of what it measures, as for callers on other hosts; ``0``: at ``--client-nice``
  instead, default 0, where that wait counts). A user who may not take a real-time priority (CAP_SYS_NICE) gets
  the nice values instead, said at the start. ``--client-api``: a ``Lookup`` or ``Score`` call per query
  (``unary``, the default), every query on one ``Query`` stream (``stream``), or, in part 1, a served run of
  each in every repeat (``both``: the figures per API under ``by_api``, the headline ones unary's; part 2 then
  on a stream).

Reported per run: training steps/s; per query kind p50/p99 latency (ms) and the answers' count (every query must
be answered: a failed one is counted); for ``served`` also the replica's delta bytes and states. The issue's
goals (2 cores): a 2,000-id lookup p99 <= 5 ms, scoring one user against 100 items p99 <= 10 ms at 200 queries/s,
training slowed by at most 20% with the replica subscribed. No speed is asserted anywhere; the figures are
printed and written (``--json``). Processes here: 2 shards, the trainer, the replica and the client share the
machine's cores.

Part 2, freshness during the online MovieLens job (``shardps train movielens --online --serve``, at ``--rate``
events per second, ``apps/online_serving.py``): the replica refreshes every 0.5 s while the client queries it at
``--qps`` (at the priorities above); per streamed event, the seconds from its entry into the broker to the first replica state holding it
(p50, p99, histogram; goals p50 <= 1 s, p99 <= 2 s); the deltas' bytes on the wire against the least bytes of
the rows they moved (goal <= 1.1x); whether, once the stream is trained, the replica equals the export exactly.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import emit, machine, parser, table  # noqa: E402 - benchmarks/common.py

DEFAULT_DATA = Path(os.environ.get("SHARDPS_MOVIELENS_DIR", Path(__file__).resolve().parents[2] / "shared" / "data" /
                                   "ml-100k"))


def _train(servers: str, data_dir: str, seconds: float, out: str) -> None:
    """The trainer (a spawned process): MF steps for ``seconds`` seconds; its steps/s to ``out``."""
    import torch

    from shardps.apps.movielens import MF
    from shardps.worker import DistributedOptimizer

    torch.set_num_threads(1)
    rows = [line.split("\t") for line in (Path(data_dir) / "u.data").read_text().splitlines() if line]
    users = torch.tensor([int(r[0]) for r in rows])
    items = torch.tensor([int(r[1]) for r in rows])
    ratings = torch.tensor([float(r[2]) for r in rows])
    model = MF(32, 0.01, float(ratings.mean()))
    dist = DistributedOptimizer(torch.optim.Adam([model.global_bias], lr=1e-3), model.named_parameters(),
                                servers=servers, model=model, worker_id="trainer",
                                sparse_optimizer=torch.optim.Adagrad([model.user.handle, model.item.handle,
                                                                      model.user_bias.handle, model.item_bias.handle],
                                                                     lr=0.02))
    g = torch.Generator().manual_seed(0)
    steps, started = 0, time.monotonic()
    try:
        while time.monotonic() - started < seconds:
            batch = torch.randint(0, users.numel(), (256,), generator=g)
            dist.zero_grad()
            (model(users[batch], items[batch])[0] - ratings[batch]).pow(2).mean().backward()
            dist.step()
            steps += 1
        dist.synchronize()
        elapsed = time.monotonic() - started
    finally:
        dist.close()
    Path(out).write_text(json.dumps({"steps": steps, "seconds": elapsed, "steps_per_s": steps / elapsed}))


def _warm(servers: str, data_dir: str) -> None:
    """A few steps first, so that every table exists on the shards before the replica starts."""
    _train(servers, data_dir, 1.0, os.devnull)


def run(kind: str, args, out_dir: str, api: str = "unary") -> dict:
    """One run: training alone, or served (with ``shardps serve`` and the client sending its queries by ``api``:
    ``"unary"``, a call each, or ``"stream"``, on one ``Query`` stream)."""
    from shardps.apps.online_serving import QueryLoad, start_serve
    from shardps.worker.cluster import LocalCluster

    ctx = mp.get_context("spawn")
    with LocalCluster(2, min_workers=1, extra_args=("--threads", "1")) as cluster:
        _warm(cluster.servers, str(args.data_dir))
        serve = None
        try:
            if kind == "served":
                serve, address, _ = start_serve(cluster.servers, period=0.5, realtime=args.serve_realtime,
                                                nice=0 if args.serve_realtime else args.serve_nice)
            out = os.path.join(out_dir, f"{kind}.json")
            trainer = ctx.Process(target=_train, args=(cluster.servers, str(args.data_dir), args.seconds, out))
            trainer.start()
            queries = None
            if serve is not None:
                load = QueryLoad(address, args.qps, nice=args.client_nice, realtime=args.client_realtime,
                                 api=api).start()
                trainer.join(args.seconds + 120)
                queries = load.stop()
            trainer.join(args.seconds + 120)
            if trainer.exitcode != 0:
                raise RuntimeError(f"the trainer failed (exit {trainer.exitcode})")
            result = {"kind": kind, **json.loads(Path(out).read_text())}
            if queries is not None:
                result.update(queries=queries, api=api)
        finally:
            if serve is not None:
                serve.terminate()
                serve.wait(30)
    return result


def online(args) -> dict:
    """The online MovieLens job (``shardps train movielens --online --serve``): its replica's freshness per event,
    delta bytes, equality with the export and query latency, while the stream trains."""
    from shardps.apps.movielens_online import OnlineConfig, run_online

    config = OnlineConfig(data_dir=str(args.data_dir), rate=args.rate, limit=args.limit, serve=True,
                          serve_qps=args.qps, warm_epochs=args.warm_epochs,
                          serve_nice=0 if args.serve_realtime else args.serve_nice, serve_client_nice=args.client_nice,
                          serve_realtime=args.serve_realtime, serve_client_realtime=args.client_realtime,
                          serve_client_api="unary" if args.client_api == "unary" else "stream")
    report = run_online(config, say=lambda text: print(text, flush=True))
    return {k: report[k] for k in ("events", "events_per_s", "latency_p50_s", "latency_p99_s", "progressive_rmse",
                                   "gain_vs_baseline", "serving")} | {"rate": args.rate}


def part_one(args) -> dict:
    """Part 1: the interleaved (alone, served) runs; prints their table and the goals, returns their figures
    (with ``--client-api both``, a served run per API in each repeat; the headline figures are unary's)."""
    apis = ["unary", "stream"] if args.client_api == "both" else [args.client_api]
    runs = []
    with tempfile.TemporaryDirectory(prefix="shardps-serving-") as tmp:
        for repeat in range(args.repeats):
            for kind, api in [("alone", "")] + [("served", api) for api in apis]:
                runs.append({**run(kind, args, tmp, api), "repeat": repeat})
                print(f"repeat {repeat + 1} {kind} {api}: {runs[-1]['steps_per_s']:.1f} steps/s"
                      + (f", queries {runs[-1]['queries']}" if "queries" in runs[-1] else ""), flush=True)
    alone = statistics.median(r["steps_per_s"] for r in runs if r["kind"] == "alone")
    rows = [[r["repeat"] + 1, f"{r['kind']} {r.get('api', '')}".strip(), f"{r['steps_per_s']:.1f}",
             f"{r['queries']['lookup']['p50_ms']:.2f} / {r['queries']['lookup']['p99_ms']:.2f}" if "queries" in r
             else "", f"{r['queries']['score']['p50_ms']:.2f} / {r['queries']['score']['p99_ms']:.2f}"
             if "queries" in r else ""] for r in runs]
    print(table(rows, ["repeat", "run", "training steps/s", "lookup 2,000 ids p50 / p99 ms",
                       "score 100 items p50 / p99 ms"]))
    by_api = {}
    for api in apis:
        served = [r for r in runs if r["kind"] == "served" and r["api"] == api]
        trained = statistics.median(r["steps_per_s"] for r in served)
        by_api[api] = figures = {
            "served_steps_per_s": trained, "slowdown": 1 - trained / alone,
            "lookup_p99_ms": statistics.median(r["queries"]["lookup"]["p99_ms"] for r in served),
            "score_p99_ms": statistics.median(r["queries"]["score"]["p99_ms"] for r in served),
            "failed": sum(r["queries"][k]["failed"] for r in served for k in ("lookup", "score"))}
        print(f"training with the replica subscribed ({api} queries): {trained:.1f} steps/s against {alone:.1f} "
              f"alone ({100 * figures['slowdown']:.0f}% slower; goal at most 20%); lookup p99 "
              f"{figures['lookup_p99_ms']:.2f} ms (goal 5), score p99 {figures['score_p99_ms']:.2f} ms (goal 10) at "
              f"{args.qps:g} queries/s; {figures['failed']} queries failed")
    return {"runs": runs, "alone_steps_per_s": alone, **by_api[apis[0]], "by_api": by_api}


def may_lower_nice(nice: int) -> bool:
    """Whether a process of this user may set its nice value to ``nice`` (tried in a child process)."""
    return _may(f"os.setpriority(os.PRIO_PROCESS, 0, {nice})")


def may_take_realtime(priority: int) -> bool:
    """Whether a process of this user may run under ``SCHED_FIFO`` at ``priority`` (tried in a child process)."""
    return _may(f"os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param({priority}))")


def _may(statement: str) -> bool:
    import subprocess

    return subprocess.run([sys.executable, "-c", f"import os; {statement}"], capture_output=True).returncode == 0


def main() -> None:
    """Interleave the runs, print the table and the goals, write the JSON."""
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA, help=f"the ml-100k folder (default {DEFAULT_DATA})")
    p.add_argument("--seconds", type=float, default=20.0, help="seconds of training per run (default 20)")
    p.add_argument("--repeats", type=int, default=2, help="interleaved (alone, served) pairs (default 2)")
    p.add_argument("--qps", type=float, default=200.0, help="queries per second in total (default 200)")
    p.add_argument("--rate", type=float, default=2000.0, help="part 2: events per second of the online job (default 2000)")
    p.add_argument("--limit", type=int, default=0, help="part 2: streamed events at most (default 0: all 50,000)")
    p.add_argument("--warm-epochs", type=int, default=5, help="part 2: epochs of the warm start (default 5)")
    p.add_argument("--part", choices=("1", "2", "both"), default="both", help="the parts to run (default both)")
    p.add_argument("--serve-nice", type=int, default=-10,
                   help="the replica's `shardps serve --nice` (default -10: queries before training's work; 0 where "
                        "this user may not lower a nice value)")
    p.add_argument("--client-nice", type=int, default=0,
                   help="the query client's nice value (default 0; the replica's keeps the client's own wait for a "
                        "core out of the latency it measures)")
    p.add_argument("--serve-realtime", type=int, default=10,
                   help="the replica's `shardps serve --realtime` (default 10: its queries take a core from training "
                        "at once; 0: off, --serve-nice instead; 0 where this user may not take a real-time priority)")
    p.add_argument("--client-realtime", type=int, default=10,
                   help="the query client's SCHED_FIFO priority (default 10: its own wait for a core stays out of "
                        "what it measures, as for a caller on another host; 0: off, --client-nice instead)")
    p.add_argument("--client-api", choices=("unary", "stream", "both"), default="unary",
                   help="how the client sends its queries: unary (default), a Lookup or Score call each; stream, "
                        "all on one Query stream; both: part 1 runs a served run of each in every repeat "
                        "(part 2 then on a stream)")
    args = p.parse_args()
    for flag in ("serve_realtime", "client_realtime"):
        if getattr(args, flag) and not may_take_realtime(getattr(args, flag)):
            print(f"this user may not take a real-time priority (CAP_SYS_NICE): --{flag.replace('_', '-')} 0, not "
                  f"{getattr(args, flag)}", flush=True)
            setattr(args, flag, 0)
    for flag in ("serve_nice", "client_nice"):
        if getattr(args, flag) < 0 and not may_lower_nice(getattr(args, flag)):
            print(f"this user may not lower a nice value (CAP_SYS_NICE): --{flag.replace('_', '-')} 0, not "
                  f"{getattr(args, flag)}", flush=True)
            setattr(args, flag, 0)
    if not (args.data_dir / "u.data").is_file():
        raise SystemExit(f"{args.data_dir / 'u.data'} not found: pass --data-dir PATH/ml-100k")
    figures = {}
    if args.part in ("1", "both"):
        figures.update(part_one(args))
    if args.part in ("2", "both"):
        figures["online"] = part2 = online(args)
        fresh = part2["serving"]
        print(f"part 2, the online job at {args.rate:g} events/s: event-to-visible p50 {fresh['p50_s']:.2f} s, p99 "
              f"{fresh['p99_s']:.2f} s (goals 1 and 2) over {fresh['events']} events; delta bytes "
              f"{fresh['delta_overhead']:.3f}x the touched rows' (goal 1.1); replica equals the export: "
              f"{fresh['equals_export']['tables'] and fresh['equals_export']['score']}; lookup p99 "
              f"{fresh['queries']['lookup']['p99_ms']:.2f} ms, score p99 {fresh['queries']['score']['p99_ms']:.2f} ms")
    emit({"seconds": args.seconds, "repeats": args.repeats, "qps": args.qps, "serve_nice": args.serve_nice,
          "client_nice": args.client_nice, "serve_realtime": args.serve_realtime,
          "client_realtime": args.client_realtime, "client_api": args.client_api, **figures, "machine": machine()}, args.json)


if __name__ == "__main__":
    main()

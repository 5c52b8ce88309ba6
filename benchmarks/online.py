"""Online MovieLens with 2 trainers: hybrid consistency (sync dense, async tables) against fully sync.

    python benchmarks/online.py [--json PATH] [--data-dir DIR] [--repeats 3] [--limit 0] [--warm 50000]
                                [--warm-epochs 5] [--batch-size 256] [--quick]

**Part 1, against one process**: ``shardps train movielens --online`` itself (one trainer, 2 shards, the stream
through a Redis broker the run starts, read exactly once) and its one-process zero-lag baseline (the same model,
optimizers, warm start and batches trained in event order by plain torch), side by side in one run: events/s,
event-to-trained latency p50/p99, progressive RMSE of both and the share of the baseline's gain shardps
recovers (``one_trainer`` in the JSON).

**Part 2, hybrid against fully sync with 2 trainers**: the setting of ``shardps train movielens --online``
(``apps/movielens_online.py``) without its broker:
MovieLens-100K's ``u.data`` in event-time order (``FileReplay(..., "time", sort=True)``, read in place from
``--data-dir``, never copied); the first ``--warm`` (50,000) ratings train the model offline for
``--warm-epochs`` epochs (global batches of 512 in a random order, as the app's); the rest (at most
``--limit``, 0: all, 50,000) are the stream, trained in event order in global steps of ``--batch-size``
(256) events. Each step is first **scored by the current model** (progressive validation: the app's
``squared_errors``, eval mode, before the model trains on the step's events) and then trained with one
``dist.step()``. Model and optimizers are the app's: ``MF(dim, init_scale, mean of the warm ratings, 0.0)``
(its four tables on the shards), Adam on ``global_bias``, Adagrad on the four table handles (the bias
tables with ``bias_lr``), ``eps=1e-10``; the settings are ``OnlineConfig``'s defaults.

Trainers: 2 spawned processes (``torch.set_num_threads(1)`` each) over 2 shard processes (``LocalCluster(2,
min_workers=2, extra_args=("--threads", "1"))``, fresh for every run, so the first round waits for both
trainers). Trainer k takes the ratings of the users with ``user % 2 == k``, in time order, for the warm start
and for the stream alike (users are disjoint between trainers, items are shared). In sync dense mode every
trainer must push in every round, so both take **the same number of steps**: per warm epoch
``ceil(warm / 512)`` batches, each trainer splitting a random permutation of its own warm ratings into that
many batches; in the stream ``ceil(streamed / batch_size)`` steps, each trainer splitting its own streamed
ratings, in time order, into that many contiguous batches (``tensor_split``: a trainer's batches differ by
one event at most, about ``batch_size / 2`` each). No trainer leaves early and none pads.

Modes (``shardps.worker.ConsistencyOptions``):

- ``sync``: ``ConsistencyOptions(mode="sync")``: dense parameters and table rows in sync rounds, the rows'
  gradients averaged over the trainers;
- ``hybrid``: ``ConsistencyOptions(mode="sync", tables="async")``: the dense parameters stay sync (averaged
  over the trainers each round) while the embedding tables are async, each trainer's rows applied on their
  own as its push arrives. Sync dense with async embeddings is the hybrid of Persia (Lian et al., "Persia:
  An Open, Hybrid System Scaling Deep Learning-based Recommenders up to 100 Trillion Parameters", 2021).

Between the warm start and the stream the trainers meet at a barrier (after ``dist.synchronize()``), score
their streamed ratings with the warm-started model (the frozen RMSE), meet again, and start the stream's clock.

Figures per run: ``progressive_rmse`` = sqrt(sum over the trainers of the squared errors of the streamed
ratings, each predicted before it was trained on (clipped to [1, 5]) / their count); ``frozen_rmse``: the same
for the warm-started model without updates; ``samples_per_s`` = streamed events / the slowest trainer's stream
seconds (its first step to ``dist.synchronize()`` after its last); ``warm_seconds``: the slowest trainer's
warm start; ``events``: events each trainer trained (their sum must be the streamed count);
``trainer_stream_cpu_seconds``: the trainers' CPU seconds over the stream, summed; ``shard_cpu_seconds``: the
shards' CPU seconds over the whole run (start, warm start, stream), summed; the load average as the run ended.

Runs are interleaved, ``--repeats`` times: sync, hybrid, sync, hybrid, ... (this machine's speed drifts).
Per mode: the median samples/s and each run's progressive RMSE; across modes: the median over the repeats
of |hybrid - sync| progressive RMSE (the issue's must-show: within 0.005) and of the hybrid/sync samples/s
ratio. The figures are reported, printed and written; no speed is asserted anywhere (the test,
``tests/distributed/test_online_benchmark.py``, checks only that every run trained every event and that the
RMSEs are sane). ``--quick``: warm 4,000 ratings, 1 epoch, 2,000 streamed, 1 repeat: a smoke run.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from common import cpu_seconds, emit, parser, table  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = Path(os.environ.get("SHARDPS_MOVIELENS_DIR") or REPO.parent / "shared" / "data" / "ml-100k")
TRAINERS, SHARDS = 2, 2
WARM_BATCH = 512  # global warm-start batch, as apps/movielens_online.py's
MODES = ("sync", "hybrid")
GOAL = 0.005  # |hybrid - sync| progressive RMSE at most this (median over the repeats)


# ---------------------------------------------------------------------------------------------------- data
def load(data_dir: Path, warm: int, limit: int) -> tuple[list, list]:
    """The ratings of ``u.data`` in event-time order, as ``(warm start, stream)`` event lists.

    Raises:
        FileNotFoundError: no ``u.data`` in ``data_dir``. ValueError: fewer ratings than ``warm`` + 1.
    """
    from shardps.apps.movielens_online import COLUMNS
    from shardps.worker.stream.replay import FileReplay

    path = data_dir / "u.data"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: download ml-100k.zip from https://grouplens.org/datasets/"
                                "movielens/100k/ and pass --data-dir PATH/ml-100k")
    replay = FileReplay(path, COLUMNS, "time", sort=True)
    try:
        events = replay.read(10 ** 9, 0)
    finally:
        replay.close()
    if len(events) <= warm:
        raise ValueError(f"{path} holds {len(events)} ratings: --warm {warm} leaves none to stream")
    streamed = events[warm:]
    return events[:warm], streamed[:limit] if limit else streamed


def partition(events: list, trainer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Trainer ``trainer``'s ratings (users with ``user % TRAINERS == trainer``), in time order: ``(users,
    items, ratings)`` tensors."""
    from shardps.apps.movielens_online import rating_tensors

    return rating_tensors([e for e in events if int(e.fields["user"]) % TRAINERS == trainer])


# ---------------------------------------------------------------------------------------------------- trainer
def _step(dist, model, users: torch.Tensor, items: torch.Tensor, ratings: torch.Tensor) -> None:
    """One training step of the app's (mean squared error of the unclipped predictions)."""
    dist.zero_grad()
    predicted, _, _ = model(users, items)
    (predicted - ratings).pow(2).mean().backward()
    dist.step()


def _trainer(k: int, cfg: dict, servers: str, data: dict, barrier, out_dir: str) -> None:
    """Trainer ``k`` (a spawned process): warm start, frozen scoring, stream; its figures to ``out_dir/k.json``."""
    torch.set_num_threads(1)
    from shardps.apps.movielens import MF
    from shardps.apps.movielens_online import squared_errors
    from shardps.worker import ConsistencyOptions, DistributedOptimizer

    torch.manual_seed(cfg["seed"])
    (wu, wi, wr), (su, si, sr) = data["warm"], data["stream"]
    model = MF(cfg["dim"], cfg["init_scale"], cfg["mean"], 0.0)
    dense = torch.optim.Adam([model.global_bias], lr=cfg["global_lr"])
    sparse = torch.optim.Adagrad([{"params": [model.user.handle, model.item.handle]},
                                  {"params": [model.user_bias.handle, model.item_bias.handle], "lr": cfg["bias_lr"]}],
                                 lr=cfg["lr"], eps=1e-10)
    consistency = ConsistencyOptions(mode="sync", tables="async" if cfg["mode"] == "hybrid" else "sync")
    dist = DistributedOptimizer(dense, model.named_parameters(), servers=servers, model=model, worker_id=f"t{k}",
                                sparse_optimizer=sparse, consistency=consistency)
    try:
        generator = torch.Generator().manual_seed(cfg["seed"] + k)
        began = time.perf_counter()
        for _ in range(cfg["warm_epochs"]):
            for batch in torch.randperm(wu.numel(), generator=generator).tensor_split(cfg["warm_steps"]):
                _step(dist, model, wu[batch], wi[batch], wr[batch])
        dist.synchronize()
        warm_seconds = time.perf_counter() - began
        barrier.wait()  # every trainer's warm-start rows are on the shards before the frozen model is scored
        frozen = float(squared_errors(model, su, si, sr).sum())
        barrier.wait()  # the stream starts together
        squared, events, began, cpu = 0.0, 0, time.perf_counter(), time.process_time()
        for u, i, r in zip(*(t.tensor_split(cfg["stream_steps"]) for t in (su, si, sr)), strict=True):
            squared += float(squared_errors(model, u, i, r).sum())  # scored before the model learns from them
            _step(dist, model, u, i, r)
            events += u.numel()
        dist.synchronize()
        seconds, cpu = time.perf_counter() - began, time.process_time() - cpu
    finally:
        dist.close()
    out = {"trainer": k, "warm_seconds": warm_seconds, "stream_seconds": seconds, "stream_cpu_seconds": cpu,
           "events": events,
           "scored": su.numel(), "squared_error": squared, "frozen_squared_error": frozen,
           "warm_steps": cfg["warm_steps"] * cfg["warm_epochs"], "stream_steps": cfg["stream_steps"]}
    Path(out_dir, f"{k}.json").write_text(json.dumps(out))


# ---------------------------------------------------------------------------------------------------- runs
def run(mode: str, cfg: dict, parts: list[dict], timeout: float) -> dict:
    """One run of ``mode`` (``"sync"`` or ``"hybrid"``): 2 trainer processes over 2 fresh shards.

    Returns its figures: ``samples_per_s`` (events/s), ``stream_seconds`` and ``warm_seconds`` (seconds, the
    slowest trainer's), ``progressive_rmse``, ``frozen_rmse``, ``events`` (trained, all trainers), ``trainers``.

    Raises:
        RuntimeError: a trainer failed or ran past ``timeout`` seconds (the message holds the shards' logs).
    """
    from shardps.worker.cluster import LocalCluster

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="shardps-online-bench-") as out, \
            LocalCluster(SHARDS, min_workers=TRAINERS, extra_args=("--threads", "1")) as cluster:
        barrier = ctx.Barrier(TRAINERS, timeout=timeout)
        procs = [ctx.Process(target=_trainer, args=(k, {**cfg, "mode": mode}, cluster.servers, parts[k], barrier, out),
                             name=f"online-{mode}-t{k}") for k in range(TRAINERS)]
        try:
            for proc in procs:
                proc.start()
            deadline = time.monotonic() + timeout
            for proc in procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                    proc.join(10)
        codes = [proc.exitcode for proc in procs]
        if any(code != 0 for code in codes):
            logs = "\n".join(f"--- shard {i}:\n{cluster.log_tail(i)}" for i in range(SHARDS))
            raise RuntimeError(f"{mode}: trainer exit codes {codes} (None: killed after {timeout:.0f} s)\n{logs}")
        rows = [json.loads(Path(out, f"{k}.json").read_text()) for k in range(TRAINERS)]
        shard_cpu = sum(cpu_seconds(proc.pid) or math.nan for proc in cluster.processes)  # the whole run's
    if len({(r["warm_steps"], r["stream_steps"]) for r in rows}) != 1:
        raise RuntimeError(f"{mode}: the trainers took different numbers of steps: {rows}")
    scored = sum(r["scored"] for r in rows)
    stream_seconds = max(r["stream_seconds"] for r in rows)
    events = sum(r["events"] for r in rows)
    return {"mode": mode, "events": events, "trainer_events": [r["events"] for r in rows],
            "samples_per_s": events / stream_seconds, "stream_seconds": stream_seconds,
            "warm_seconds": max(r["warm_seconds"] for r in rows),
            "progressive_rmse": math.sqrt(sum(r["squared_error"] for r in rows) / scored),
            "frozen_rmse": math.sqrt(sum(r["frozen_squared_error"] for r in rows) / scored),
            "trainer_stream_cpu_seconds": sum(r["stream_cpu_seconds"] for r in rows), "shard_cpu_seconds": shard_cpu,
            "load_average": os.getloadavg()[0], "trainers": rows}


def summarise(runs: list[dict], repeats: int) -> dict:
    """Per mode: the median samples/s (events/s), warm seconds and RMSEs, each run's progressive RMSE; across
    modes: the medians over the repeats of |hybrid - sync| progressive RMSE and of hybrid/sync samples/s."""
    by_mode = {m: [r for r in runs if r["mode"] == m] for m in MODES}
    modes = {}
    for mode, rs in by_mode.items():
        modes[mode] = {"samples_per_s": statistics.median(r["samples_per_s"] for r in rs),
                       "samples_per_s_runs": [r["samples_per_s"] for r in rs],
                       "warm_seconds": statistics.median(r["warm_seconds"] for r in rs),
                       "progressive_rmse": statistics.median(r["progressive_rmse"] for r in rs),
                       "progressive_rmse_runs": [r["progressive_rmse"] for r in rs],
                       "frozen_rmse": statistics.median(r["frozen_rmse"] for r in rs),
                       "frozen_rmse_runs": [r["frozen_rmse"] for r in rs]}
    pairs = list(zip(by_mode["sync"], by_mode["hybrid"], strict=True))[:repeats]
    differences = [abs(h["progressive_rmse"] - s["progressive_rmse"]) for s, h in pairs]
    ratios = [h["samples_per_s"] / s["samples_per_s"] for s, h in pairs]
    difference = statistics.median(differences)
    return {"modes": modes, "rmse_differences": differences, "rmse_difference": difference,
            "ratios": ratios, "ratio": statistics.median(ratios),
            "goal": {"goal": f"hybrid, {TRAINERS} trainers: progressive RMSE within {GOAL} of fully sync "
                             "(median over the repeats of |hybrid - sync|)",
                     "bound": GOAL, "value": difference, "met": bool(difference <= GOAL)}}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def against_one_process(config) -> dict:
    """Part 1: ``shardps train movielens --online`` (``run_online``: the stream through a Redis broker to one
    trainer over 2 shards, read exactly once) and, in the same run, its one-process zero-lag baseline (the
    same model, optimizers, warm start and batches in event order, plain torch). Returns their figures.

    Raises:
        RuntimeError, BrokerUnavailable: as ``run_online``.
    """
    from dataclasses import replace

    from shardps.apps.movielens_online import run_online

    report = run_online(replace(config), say=_log)
    keys = ("events", "events_per_s", "latency_p50_s", "latency_p99_s", "frozen_rmse", "progressive_rmse", "gain",
            "gain_vs_baseline", "replays", "rows_held")
    out = {k: report[k] for k in keys} | {"baseline": report["baseline"]}
    print(f"one trainer through the broker: {out['events_per_s']:,.0f} events/s, latency p50 "
          f"{out['latency_p50_s'] * 1e3:.0f} ms, p99 {out['latency_p99_s'] * 1e3:.0f} ms, progressive RMSE "
          f"{out['progressive_rmse']:.4f} (frozen {out['frozen_rmse']:.4f}); one process: "
          f"{out['baseline']['progressive_rmse']:.4f} (frozen {out['baseline']['frozen_rmse']:.4f}); shardps "
          f"recovers {out['gain_vs_baseline']:.2f}x its gain")
    return out


def main() -> None:
    """Parse the options, run the interleaved modes, print the table and write the JSON (``--json``)."""
    from shardps.apps.movielens_online import OnlineConfig

    defaults = OnlineConfig(data_dir="")
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA,
                   help=f"the ml-100k folder (default {DEFAULT_DATA}; $SHARDPS_MOVIELENS_DIR)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved (sync, hybrid) rounds (default 3)")
    p.add_argument("--limit", type=int, default=defaults.limit, help="streamed events at most (default 0: all)")
    p.add_argument("--warm", type=int, default=defaults.warm, help=f"warm-start ratings (default {defaults.warm})")
    p.add_argument("--warm-epochs", type=int, default=defaults.warm_epochs,
                   help=f"warm-start epochs (default {defaults.warm_epochs})")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size,
                   help=f"streamed events per global step, both trainers (default {defaults.batch_size})")
    p.add_argument("--run-timeout", type=float, default=600.0, help="seconds one run may take (default 600)")
    p.add_argument("--quick", action="store_true", help="warm 4,000, 1 epoch, 2,000 streamed, 1 repeat (a smoke run)")
    args = p.parse_args()
    if args.quick:
        args.warm, args.warm_epochs, args.limit, args.repeats = 4_000, 1, 2_000, 1
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    config = OnlineConfig(data_dir=str(args.data_dir), warm=args.warm, warm_epochs=args.warm_epochs,
                          limit=args.limit, batch_size=args.batch_size)  # validates the settings
    warm, streamed = load(args.data_dir, config.warm, config.limit)
    parts = [{"warm": partition(warm, k), "stream": partition(streamed, k)} for k in range(TRAINERS)]
    warm_steps = math.ceil(len(warm) / WARM_BATCH)
    stream_steps = math.ceil(len(streamed) / config.batch_size)
    for k, part in enumerate(parts):
        if part["warm"][0].numel() < warm_steps or part["stream"][0].numel() < stream_steps:
            raise SystemExit(f"trainer {k} has too few ratings for {warm_steps} warm and {stream_steps} stream steps")
    cfg = {"dim": config.dim, "init_scale": config.init_scale, "lr": config.lr, "bias_lr": config.bias_lr,
           "global_lr": config.global_lr, "seed": config.seed, "warm_epochs": config.warm_epochs,
           "mean": float(torch.tensor([float(e.fields["rating"]) for e in warm]).mean()),
           "warm_steps": warm_steps, "stream_steps": stream_steps}
    single = against_one_process(config)
    load_start = os.getloadavg()
    _log(f"online MovieLens-100K, {TRAINERS} trainers x {SHARDS} shards: warm {len(warm)} ratings x "
         f"{config.warm_epochs} epochs ({warm_steps} steps/epoch), stream {len(streamed)} ratings in {stream_steps} "
         f"steps; {args.repeats} interleaved repeat(s); load average at start {load_start[0]:.2f}")
    began, runs = time.monotonic(), []
    for repeat in range(args.repeats):
        for mode in MODES:
            result = {**run(mode, cfg, parts, args.run_timeout), "repeat": repeat}
            if result["events"] != len(streamed):
                raise RuntimeError(f"{mode}: trained {result['events']} of {len(streamed)} streamed events")
            runs.append(result)
            _log(f"repeat {repeat + 1}/{args.repeats} {mode}: {result['samples_per_s']:,.0f} events/s, stream "
                 f"{result['stream_seconds']:.2f} s, warm start {result['warm_seconds']:.2f} s, progressive RMSE "
                 f"{result['progressive_rmse']:.4f} (frozen {result['frozen_rmse']:.4f}), load average "
                 f"{result['load_average']:.2f}")
    wall = time.monotonic() - began
    summary = summarise(runs, args.repeats)
    lines = [[r["repeat"] + 1, r["mode"], f"{r['warm_seconds']:.2f}", f"{r['stream_seconds']:.2f}",
              f"{r['samples_per_s']:,.0f}", f"{r['frozen_rmse']:.4f}", f"{r['progressive_rmse']:.4f}",
              f"{r['trainer_stream_cpu_seconds']:.2f}", f"{r['shard_cpu_seconds']:.1f}", f"{r['load_average']:.2f}"]
             for r in runs]
    lines += [["median", mode, f"{m['warm_seconds']:.2f}", "", f"{m['samples_per_s']:,.0f}", f"{m['frozen_rmse']:.4f}",
               f"{m['progressive_rmse']:.4f}", "", "", ""] for mode, m in summary["modes"].items()]
    print(table(lines, ["repeat", "mode", "warm start s", "stream s", "samples/s", "frozen RMSE", "progressive RMSE",
                        "trainers' stream CPU s", "shards' CPU s", "load avg"]))
    goal = summary["goal"]
    print(f"hybrid / sync samples/s: {summary['ratio']:.3f} (median of {args.repeats} repeat(s): "
          f"{', '.join(f'{x:.3f}' for x in summary['ratios'])})")
    print(f"|hybrid - sync| progressive RMSE: {summary['rmse_difference']:.4f} (median; each repeat: "
          f"{', '.join(f'{x:.4f}' for x in summary['rmse_differences'])})")
    print(f"goal: {goal['goal']}: {'met' if goal['met'] else 'NOT met'} ({goal['value']:.4f} vs {GOAL})")
    emit({"warm": len(warm), "warm_epochs": config.warm_epochs, "streamed": len(streamed),
          "batch_size": config.batch_size, "warm_batch": WARM_BATCH, "warm_steps_per_epoch": warm_steps,
          "stream_steps": stream_steps, "trainers": TRAINERS, "shards": SHARDS, "repeats": args.repeats,
          "quick": args.quick, "data_dir": str(args.data_dir), "model": cfg, "load_average_at_start": load_start,
          "load_average_at_end": os.getloadavg(), "wall_seconds": wall, "runs": runs, **summary,
          "one_trainer": single}, args.json)


if __name__ == "__main__":
    main()

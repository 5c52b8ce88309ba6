"""Straggler benchmark: torch DDP vs shardps sync, ssp and async with a slow worker, in one invocation.

    python benchmarks/straggler.py [--json PATH] [--steps 60] [--model mlp|wide] [--batch-size 32]
        [--base-seconds 0.1] [--slow-factor 2.5] [--persistent-factor 2.0] [--staleness 3]
        [--no-scale-lr-by-staleness] [--optimizer adamw|sgd] [--lr LR] [--async-lr LR] [--ssp-lr LR]
        [--schedule constant|cosine] [--shards 1] [--repeats 3]

What it measures: how much a slow worker costs each way of training with 3
worker processes (one torch thread each) on one machine. Every step of a
worker is its real forward/backward on a batch of ``--batch-size`` samples
plus simulated compute, ``time.sleep(base_seconds * factor)`` before the
forward, where ``factor`` is 1 for a normal step and larger for a straggler:

- **transient**: at each step one worker, drawn by ``random.Random(seed)``
  (the same sequence for every mode, known to every worker), is slow by
  ``--slow-factor`` (2.5); a worker's k-th step is slow when the k-th draw
  names it (in async/ssp a worker's k-th step is its own k-th step);
- **persistent**: worker 2 is slow by ``--persistent-factor`` (2.0) at every step.

Modes, each from the same initial parameters (shardps on a fresh
``LocalCluster`` of ``--shards`` shards, default 1, ``min_workers=3``), with
the same optimizer and lr (see "Optimizer" below):

- ``ddp``: DistributedDataParallel over Gloo (allreduce), 3 ranks;
- ``sync``: shardps bulk synchronous rounds (averages one push of every worker);
- ``ssp``: shardps stale synchronous parallel, bound ``--staleness`` (a worker
  runs at most s clocks ahead of the slowest);
- ``async``: shardps asynchronous: each push applied on arrival, no waiting.

Equal work in every mode: the job has a budget of ``3 * steps`` batches
(``3 * steps * batch_size`` samples), numbered 0 .. 3·steps-1 and generated
deterministically from their number, so every mode trains on exactly the
same samples. ``ddp`` and ``sync`` run in lockstep: worker w takes batch
``3k + w`` at its step k, ``steps`` steps each. ``ssp`` and ``async`` workers
do not run in lockstep, so they draw from the budget the way an
asynchronous job with a sample budget runs: before each step a worker takes
the next batch number from a shared counter (a ``multiprocessing.Value``)
and stops once the budget is exhausted, so a fast worker does more steps
than a slow one and the total is exactly the same. (With "every worker
runs exactly ``steps`` steps" the wall time would be set by the slowest
worker in every mode and async could never show its advantage.)

Figures per (scenario, mode):

- ``samples_per_s``: ``3 * steps * batch_size`` / wall seconds, from the
  moment the 3 workers, all set up (joined / DDP built), are told to start
  together to the moment the last worker's last ``step()`` returned (shardps
  steps block until the new parameters are in: no overlap with the next
  step, so no mode hides communication behind the simulated compute);
- ``other_ms_per_step``: per worker, the time per step outside the simulated
  compute: real forward/backward, communication and waiting for others;
- ``worker_cpu_ms_per_step`` (per worker) and ``shards_cpu_ms_per_step`` (all
  shard processes together, per applied push): CPU time (user + system) the
  timed steps cost. On a machine with few cores this, not the simulated
  compute, can set the pace: 3 workers and the shards share the cores;
- ``final_loss``: cross-entropy of the final model on a fixed held-out set
  of 4096 samples (ddp: rank 0's model; shardps: the parameters exported
  from the shards after every worker finished, ``shardps.worker.export``);
- ``steps_per_worker``, ``wall_seconds``; for shardps modes the shards'
  staleness histogram (``StatsReply.staleness_histogram`` of shard 0, entry i
  counting applied gradients of staleness i) and its mean and max; for ssp
  ``staleness_bound``.

The data: inputs ~ N(0, 1); labels are the argmax of a fixed random
"teacher" network (learnable, seeded); the model is an MLP (``mlp``:
32 -> 256 -> 256 -> 10, ``wide``: 256 -> 1024 -> 1024 -> 10, more compute).

Optimizer: AdamW (torch defaults, lr 3e-3; 1e-3 for ``wide``) by default,
as in ``benchmarks/train.py``; ``--optimizer sgd`` is SGD with momentum 0.9
(lr 0.05). Each default lr is the one of a small grid (AdamW 1e-4 .. 5e-3,
SGD 0.01 .. 0.1) that gave ddp/sync the lowest final loss (chosen with 20 ms
of simulated compute; the losses do not depend on it). async and ssp get
their own lr, as one tunes each method when comparing them (``--async-lr``,
``--ssp-lr``): with AdamW on the MLP, async 3e-3 (the same as ddp's), the
best mean final loss of its grid in the transient scenario at the default
sizes (with 2 shards), and ssp 2e-3 (its 2e-3 to 3e-3 are equal within the
noise). An async or ssp loss moves by up to 0.06-0.09 from run to run with
the order in which pushes land, so each lr was run 3 times or more: async 1.5e-3: 0.833, 2e-3: 0.777,
2.5e-3: 0.790, 3e-3: 0.762, 4e-3: 0.789 (5 runs, 0.761-0.825); ssp 1.5e-3:
0.768, 2e-3: 0.750 (7 runs, 0.722-0.766), 2.5e-3: 0.739, 3e-3: 0.751 (ddp:
0.737). ``--repeats N`` (default 3) runs every mode N times and reports the means. Other
optimizers and models use ``--lr``. That lr is divided by each push's
staleness on the shards (``scale_lr_by_staleness``, Zhang et al.,
"Staleness-aware Async-SGD", IJCAI 2016; ``--no-scale-lr-by-staleness``
turns it off: final losses 1.08-1.09x ddp's instead of 0.98-1.06x in runs at
20 ms). Each async/ssp push is one optimizer step on 32 samples (sync: one step on
the 96 averaged), and it is computed from parameters ~2 updates old; with
SGD + momentum 0.9 that staleness acts as extra momentum (Mitliagkas et
al., "Asynchrony begets momentum", 2016): in a serial simulation of this
job with staleness 2, async ends at loss 1.43 against sync's 0.87, while
with AdamW (whose step size does not depend on the gradient's scale) it
ends at 0.77 against 0.74.

The lr is constant by default. ``--schedule cosine`` decays it over the
sample budget, from the lr towards 0, by the batch's number, so every mode
trains each batch with the same factor. It does not close the gap. In
transient runs at 20 ms, with each mode's best lr on a grid (ddp 3e-3 ..
2e-2, async and ssp 3e-3 .. 1e-2, async and ssp twice at 6e-3 and 8e-3),
ddp reached 0.672 (lr 1e-2), async 0.698-0.739 (lr 7e-3 and 8e-3:
1.04-1.10x) and ssp 0.705-0.711 (lr 8e-3: 1.05-1.06x). The constant-lr
figures in the same sense: 1.02-1.06x.

Goals (``goals`` in the JSON, printed at the end):

- transient: ssp and async samples/s >= 1.3x ddp's, and their final loss
  <= 1.05x ddp's;
- persistent: async samples/s >= 1.3x ddp's;
- persistent ssp / ddp is reported without a goal: SSP cannot beat a
  persistent straggler by design (its fast workers wait for it every s
  clocks, so the job runs at the straggler's pace).

Reading the figures: async and ssp can only beat ddp when the time a step
waits for a straggler is larger than what a shardps step costs more than a
ddp step. On a machine with few cores that cost is CPU time: compare
``CPU ms/step`` (shardps worker plus shards, ddp worker) with
``--base-seconds``. The default 100 ms of simulated compute is a short
step for a real model on an accelerator (whose compute takes no host CPU,
like the sleep); at ``--base-seconds 0.02 --shards 2`` the ~25 ms of CPU
that a shardps step costs on a 2-core machine (worker plus 2 shards, 5
processes on 2 cores) outweighs what a straggler delays and DDP wins. Each
shard adds a push-pull stream per worker per step: with ``--shards 2`` a
step costs ~25 ms of CPU (async workers' non-sleep time ~24 ms) against ~17
ms (~16 ms) with 1, and transient ssp measured 1.28x-1.30x DDP's samples/s
(means of 3 runs) against 1.35x (``straggler_sim.py`` reproduces both with
an overhead fitted to each: 30 ms and 18 ms). The async/ssp losses vary
from run to run (the order in which pushes arrive is not deterministic);
ddp and sync are exactly reproducible and equal.

Worker processes are spawned once (torch.multiprocessing, ``spawn``) and run
every (scenario, mode) in turn; every wait is bounded (``--run-timeout``) and
every process and cluster is stopped on exit and on error. The job (model,
data, stragglers, each worker's loop) is in ``straggler_job.py``, the worker
processes and clusters of one run in ``straggler_runs.py``;
``straggler_sim.py`` simulates the same job to show what the stragglers
allow each mode.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import emit, parser, table  # noqa: E402
from straggler_job import MODELS, MOMENTUM, PERSISTENT_STRAGGLER, SEED, WORKERS, eval_loss, make_model  # noqa: E402
from straggler_runs import SHARDS, Clusters, Workers, run_one  # noqa: E402

#: default lr of each (--optimizer, --model): the best for ddp/sync of a small grid (see the module docstring)
DEFAULT_LR = {("adamw", "mlp"): 3e-3, ("adamw", "wide"): 1e-3, ("sgd", "mlp"): 0.05, ("sgd", "wide"): 0.05}
#: async and ssp lr of (--optimizer, --model) where tuned on a grid (see the module docstring); else --lr
DEFAULT_STALE_LR = {("adamw", "mlp"): {"async": 3e-3, "ssp": 2e-3}}
OPTIMIZERS = ("adamw", "sgd")
SCENARIOS = ("transient", "persistent")
MODES = ("ddp", "sync", "ssp", "async")
SPEEDUP_GOAL = 1.3
#: figures averaged over repeated runs (--repeats)
MEANS = ("samples_per_s", "final_loss", "wall_seconds")
LOSS_GOAL = 1.05
SSP_PERSISTENT_NOTE = ("no goal: SSP cannot beat a persistent straggler by design (its fast workers wait for it every "
                       "s clocks, so the job runs at the straggler's pace)")


def combine(runs: list[dict]) -> dict:
    """One (scenario, mode)'s figures over its repeated runs (``--repeats``).

    ``samples_per_s``, ``final_loss`` and ``wall_seconds`` are the means over
    the runs (of each run's rate, for samples/s), with their sample standard
    deviations (``*_sd``); every other
    figure is the first run's; ``runs`` holds each run's figures. One run is
    returned as it is.
    """
    if len(runs) == 1:
        return runs[0]
    out = dict(runs[0])
    for key in MEANS:
        values = [r[key] for r in runs]
        out[key], out[f"{key}_sd"] = statistics.fmean(values), statistics.stdev(values)
    out["runs"] = runs
    return out


def goals(results: dict) -> dict:
    """The goal ratios against ddp (see the module docstring)."""
    def ratio(scenario: str, mode: str, key: str) -> float:
        return results[scenario][mode][key] / results[scenario]["ddp"][key]

    out: dict[str, dict] = {}
    for scenario in SCENARIOS:
        for mode in ("ssp", "async"):
            speed = ratio(scenario, mode, "samples_per_s")
            loss = ratio(scenario, mode, "final_loss")
            if scenario == "persistent" and mode == "ssp":
                out[f"{scenario}_{mode}_samples_per_s_vs_ddp"] = {"value": speed, "goal": None, "met": None,
                                                                  "note": SSP_PERSISTENT_NOTE}
            else:
                out[f"{scenario}_{mode}_samples_per_s_vs_ddp"] = {"value": speed, "goal": f">= {SPEEDUP_GOAL}",
                                                                  "met": speed >= SPEEDUP_GOAL}
            if scenario == "transient":
                out[f"{scenario}_{mode}_final_loss_vs_ddp"] = {"value": loss, "goal": f"<= {LOSS_GOAL}",
                                                               "met": loss <= LOSS_GOAL}
            else:
                out[f"{scenario}_{mode}_final_loss_vs_ddp"] = {"value": loss, "goal": None, "met": None}
    return out


def cpu_ms_per_step(r: dict) -> float:
    """CPU milliseconds one step costs: the mean worker's, plus the shards' (shardps modes)."""
    return sum(r["worker_cpu_ms_per_step"]) / WORKERS + r.get("shards_cpu_ms_per_step", 0.0)


def _spread(r: dict, key: str, fmt: str) -> str:
    """``r[key]``, with ``±`` its standard deviation over repeated runs where there were some."""
    sd = r.get(f"{key}_sd")
    return fmt.format(r[key]) + ("" if sd is None else " ±" + fmt.format(sd))


def report(results: dict, goal_figures: dict) -> str:
    """The figures and the goal ratios as text tables."""
    rows = []
    for scenario in SCENARIOS:
        ddp = results[scenario]["ddp"]
        for mode in MODES:
            r = results[scenario][mode]
            st = r.get("staleness")
            rows.append([scenario, mode + (f" s={r['staleness_bound']}" if mode == "ssp" else ""),
                         _spread(r, "samples_per_s", "{:.0f}"), f"{r['samples_per_s'] / ddp['samples_per_s']:.2f}",
                         _spread(r, "final_loss", "{:.4f}"), f"{r['final_loss'] / ddp['final_loss']:.3f}",
                         f"{r['wall_seconds']:.2f}", "/".join(map(str, r["steps_per_worker"])),
                         f"{st['mean']:.2f}/{st['max']}" if st else "-",
                         f"{sum(r['other_ms_per_step']) / WORKERS:.1f}", f"{cpu_ms_per_step(r):.1f}"])
    text = table(rows, ["scenario", "mode", "samples/s", "vs ddp", "final loss", "vs ddp", "wall s",
                        "steps/worker", "staleness mean/max", "non-sleep ms/step", "CPU ms/step"])
    text += ("\n(non-sleep ms/step: a worker's time per step outside the simulated compute, mean over workers; "
             "CPU ms/step:\n a worker process's CPU time per step, mean over workers, plus the shard processes' per "
             "step)")
    if any("runs" in r for figures in results.values() for r in figures.values()):
        text += ("\n(samples/s and final loss: mean ± standard deviation over the repeated runs; steps/worker, "
                 "staleness and ms/step: the first run's)")
    notes = [g["note"] for g in goal_figures.values() if g.get("note")]
    goal_rows = [[name, f"{g['value']:.3f}", g["goal"] or "-",
                  "-" if g["met"] is None else ("yes" if g["met"] else "NO"),
                  f"[{notes.index(g['note']) + 1}]" if g.get("note") else ""]
                 for name, g in goal_figures.items()]
    footnotes = "".join("\n" + textwrap.fill(f"[{i + 1}] {note}", 118, subsequent_indent="    ")
                        for i, note in enumerate(notes))
    return text + "\n\n" + table(goal_rows, ["ratio", "value", "goal", "met", "note"]) + "\n" + footnotes


def main() -> None:
    """Parse the arguments, run every (scenario, mode), print the tables, write the JSON."""
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="steps per worker in lockstep modes; the job's budget is "
                   "3 x steps batches in every mode (default 60)")
    p.add_argument("--model", choices=sorted(MODELS), default="mlp")
    p.add_argument("--batch-size", type=int, default=32, help="samples per worker per step (default 32)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="adamw (default) or sgd (momentum 0.9), the same in every mode")
    p.add_argument("--lr", type=float, help="learning rate of every mode (default: adamw 3e-3, 1e-3 with "
                   "--model wide; sgd 0.05)")
    p.add_argument("--async-lr", type=float, help="learning rate of async (default: adamw mlp 3e-3, else --lr; "
                   "see the module docstring)")
    p.add_argument("--ssp-lr", type=float, help="learning rate of ssp (default: adamw mlp 2e-3, else --lr)")
    p.add_argument("--base-seconds", type=float, default=0.1, help="simulated compute per step (default 0.1)")
    p.add_argument("--slow-factor", type=float, default=2.5, help="transient straggler's slowdown (default 2.5)")
    p.add_argument("--persistent-factor", type=float, default=2.0,
                   help="persistent straggler's (worker 2) slowdown (default 2.0)")
    p.add_argument("--staleness", type=int, default=3, help="ssp bound s (default 3)")
    p.add_argument("--scale-lr-by-staleness", action=argparse.BooleanOptionalAction, default=True,
                   help="async/ssp: the shards divide each push's lr by max(1, staleness) (Zhang et al., IJCAI "
                   "2016; default on)")
    p.add_argument("--schedule", choices=("constant", "cosine"), default="constant",
                   help="learning rate over the sample budget, the same in every mode (default constant)")
    p.add_argument("--shards", type=int, default=SHARDS,
                   help=f"shard processes of every shardps run (default {SHARDS}; fewer: less CPU per round)")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of every (scenario, mode), interleaved; samples/s, final loss and wall time are their "
                   "means (default 3, about 6.5 minutes: async/ssp losses and ssp's speed vary from run to run, so "
                   "the goals are judged on means)")
    p.add_argument("--run-timeout", type=float, default=180.0,
                   help="seconds one (scenario, mode) may take before the benchmark gives up (default 180)")
    args = p.parse_args()
    if args.lr is None:
        args.lr = DEFAULT_LR[args.optimizer, args.model]
    tuned = args.lr == DEFAULT_LR[args.optimizer, args.model] and (args.optimizer, args.model) in DEFAULT_STALE_LR
    if args.async_lr is None:
        args.async_lr = DEFAULT_STALE_LR[args.optimizer, args.model]["async"] if tuned else args.lr
    if args.ssp_lr is None:
        args.ssp_lr = DEFAULT_STALE_LR[args.optimizer, args.model]["ssp"] if tuned else args.lr
    if min(args.steps, args.batch_size, args.repeats, args.shards) < 1 or args.staleness < 0 or args.base_seconds < 0:
        p.error("--steps, --batch-size, --repeats and --shards must be >= 1, --staleness and --base-seconds >= 0")
    params = sum(q.numel() for q in make_model(args.model).parameters())
    initial_loss = eval_loss(args.model, make_model(args.model))
    print(f"{args.model}: {params / 1e3:.0f} k parameters, {WORKERS} workers, {args.shards} shard{'s' * (args.shards != 1)}, "
          f"{args.steps} steps x {args.batch_size} samples per worker ({WORKERS * args.steps * args.batch_size} samples per mode), "
          f"base {args.base_seconds * 1e3:.0f} ms/step, transient x{args.slow_factor}, "
          f"persistent worker {PERSISTENT_STRAGGLER} x{args.persistent_factor}, ssp s={args.staleness}, "
          f"{args.optimizer} lr {args.lr} (ssp {args.ssp_lr}, async {args.async_lr}), "
          f"initial loss {initial_loss:.4f}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # clean up below on SIGTERM too
    began = time.monotonic()
    results: dict[str, dict] = {}
    workers = Workers(args.run_timeout)
    clusters = Clusters(args.shards)
    try:
        clusters.prepare()  # the first shardps run's cluster starts while the workers do
        workers.start()
        # repeats interleaved (every mode once, then again), so that drift of the machine reaches every mode alike
        plan = [(scenario, mode) for scenario in SCENARIOS for _ in range(args.repeats) for mode in MODES]
        runs: dict[tuple[str, str], list[dict]] = {}
        for i, (scenario, mode) in enumerate(plan):
            shardps_later = any(m != "ddp" for _, m in plan[i + 1:])
            r = run_one(workers, clusters, args, scenario, mode, shardps_later)
            runs.setdefault((scenario, mode), []).append(r)
            st = r.get("staleness")
            print(f"[{time.monotonic() - began:6.1f} s] {scenario:<10} {mode:<5} {r['samples_per_s']:7.0f} samples/s  "
                  f"final loss {r['final_loss']:.4f}  wall {r['wall_seconds']:.2f} s  steps {r['steps_per_worker']}  "
                  f"non-sleep ms/step {r['other_ms_per_step']}  CPU ms/step {cpu_ms_per_step(r):.1f}"
                  + (f"  staleness mean {st['mean']:.2f} max {st['max']}" if st else "")
                  + f"  (setup {r['untimed_seconds']['before']:.1f} s)", flush=True)
    finally:
        workers.stop()
        clusters.stop_all()
    for (scenario, mode), done in runs.items():
        results.setdefault(scenario, {})[mode] = combine(done)
    goal_figures = goals(results)
    print()
    print(report(results, goal_figures))
    total = time.monotonic() - began
    print(f"\nbenchmark wall time {total:.1f} s", flush=True)
    out = {
        "config": {"model": args.model, "params": params, "workers": WORKERS, "shards": args.shards,
                   "steps": args.steps, "batch_size": args.batch_size, "budget_batches": WORKERS * args.steps,
                   "optimizer": args.optimizer, "lr": args.lr, "async_lr": args.async_lr, "ssp_lr": args.ssp_lr,
                   "momentum": MOMENTUM if args.optimizer == "sgd" else None,
                   "base_seconds": args.base_seconds, "slow_factor": args.slow_factor,
                   "persistent_factor": args.persistent_factor, "persistent_straggler": PERSISTENT_STRAGGLER,
                   "staleness_bound": args.staleness, "scale_lr_by_staleness": args.scale_lr_by_staleness,
                   "schedule": args.schedule, "repeats": args.repeats,
                   "seed": SEED, "initial_loss": initial_loss},
        **results["transient"],
        "persistent": results["persistent"],
        "goals": goal_figures,
        "benchmark_wall_seconds": total,
    }
    emit(out, args.json)


if __name__ == "__main__":
    main()

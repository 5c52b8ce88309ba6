"""GPU data plane: one shardps worker on CUDA against plain single-GPU PyTorch, and where each step's time goes.

    python benchmarks/gpu.py [--json PATH] [--device auto|cuda|cpu] [--steps N] [--warmup N]
                             [--workloads transformer:32,transformer:256,mlp:64] [--shards 2,4]
                             [--wire fp32,bf16] [--streamed on|off|on,off] [--repeats 1]
                             [--stream-processes off|on|off,on] [--shard-threads N]
                             [--switch-interval SECONDS]

One worker process (this one) trains on the device; its shards are
``--shards`` processes on the same host (2 and 4 by default; started once,
and reset between rows, as ``shardps reset`` does); the baseline is plain PyTorch on the same device with
``torch.optim.AdamW(fused=True)``, run in the same process, on the same
batches, from the same initial weights. Workloads (``--workloads``,
``model:samples per step``): the transformer LM of ``benchmarks/train.py``
(6 layers, d_model 384, 17.0 M parameters) at 32 and 256 sequences of 64
tokens per step, and its MLP (1024-2048-2048-2048-10, 10.5 M parameters)
at 64 samples per step. shardps runs sync, AdamW (fused, lr 1e-3) on the
shards, 4 MiB chunks, pulls overlapped with the next forward (``model=``).
Without CUDA (or with ``--device cpu``) the same job runs on the CPU, so
that CI can smoke it; ``--tiny`` shrinks both models for that.

A second baseline, ``torch_cpu_adamw``, runs the same loop with the same
AdamW stepping fp32 copies of the parameters in host memory, copied back
each step, as the shards do: the exact oracle of the shardps rows' final
loss on any device (plain PyTorch on CUDA runs CUDA's fused AdamW, whose
last-bit rounding Adam's normalized update can amplify).

``--streamed on,off`` also runs every shardps row push then pull
(``WireOptions(streamed=False)``, rows named ``..._plain``). A streamed
round's parameters reach the model only once the whole round is in (all or
nothing: a round the shards refuse halfway changes nothing), so the next
forward waits for all of it, while the push and the pull share the links;
an unstreamed round's reach the model layer by layer as they arrive, and
each layer's forward waits for its own. Which is faster where the links do
not bind is what these rows measure.

``--stream-processes off,on`` also runs every shardps row with each
shard's PushPull streams carried by a helper process
(``WireOptions(stream_processes=True)``, rows named ``..._procs``): gRPC's
copies and per-message work leave this process's GIL, beside the training
loop. ``--shard-threads N`` sets each shard's optimizer threads (default:
``LocalCluster``'s split of the cores among the shards and this process).

Figures per row: samples/s over the timed steps (all but the first
``--warmup``), its ratio to plain PyTorch's, the final loss (a fixed
held-out batch, final parameters) and its difference to plain PyTorch's
and to ``torch_cpu_adamw``'s (``final_loss_abs_diff_vs_cpu_adamw``),
and where each step's time goes, in ms per step (means over the timed
steps; medians over ``--repeats``). On CUDA every host-side mark is taken
after ``torch.cuda.synchronize()``; on CPU ``time.perf_counter()`` alone.

shardps phases (``phases_ms``):

- ``forward``: the forward pass, less the time its pre-hooks waited for
  the previous round's parameters (``forward_wait_for_pull``);
- ``backward``: the backward pass (gradient hooks enqueue chunks, the
  pushes run meanwhile on gRPC's threads);
- ``step_call``: ``step()`` closing the round (trailer, the rest of the chunks);
- ``grad_copy_off_device``: the gradient chunks' copies to host memory on
  the push threads (summed over chunks; on CUDA from the push thread asking
  until the pinned copy is done, which includes waiting for the backward
  kernels that produce the chunk; on CPU only the narrowing to the wire type);
- ``push``: the push window, from the first gradient chunk a push stream
  takes to the last frame of the round handed to gRPC (over all shards;
  it overlaps the backward pass), and ``push_after_backward`` its part
  after the backward pass ended;
- ``round_wait``: per shard, from its push's end to its first parameter
  chunk back (the shard's update and the reply's latency), mean over shards;
  0 where the first chunk came back before the push ended (streamed rounds,
  ``WireOptions(streamed=True)``, the default);
- ``pull``: from the first parameter chunk back to the last (all shards);
- ``push_pull_overlap``: how long chunks were pulled while the push was
  still going (streamed rounds);
- ``copy_onto_device``: decoding the pulled frames and copying them into
  the model (summed over chunks; on CUDA the host-to-device copy);
- ``pull_after_step``: from ``step()`` returning to the last chunk in the
  model: the part of the pull the next forward overlaps.

``timeline_ms``: the same marks as offsets from the step's start (forward
end, backward end, ``step()`` returned, push start and end, first and last
chunk pulled, and the next step's start), so that the overlap shows.
``metrics_ms``: the worker's own ``shardps_worker_push_seconds`` and
``shardps_worker_pull_seconds`` histograms (from ``step()`` closing the
round), means over the timed rounds, as a cross-check. Plain PyTorch's
phases: ``forward``, ``backward``, ``optimizer_step``.

The shardps marks are read from outside the worker's code, in this process
(``gpu_probe.py``): the push streams' request iterators
(``steps.push_requests``) and their chunk queues, the pulled-frame iterator
of ``ParameterSink.receive`` and ``ForwardWaits._wait`` are wrapped;
nothing in ``shardps`` changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import emit, parser, table  # noqa: E402
from gpu_probe import Probe, StepRecord  # noqa: E402
from torch import nn  # noqa: E402

LR = 1e-3
EVAL_STEP = 10_000
now = time.perf_counter


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Model sizes: the transformer LM's and the MLP's (``benchmarks/train.py``'s by default)."""

    vocab: int = 8192
    d_model: int = 384
    layers: int = 6
    heads: int = 6
    context: int = 64
    d_in: int = 1024
    hidden: int = 2048
    classes: int = 10


#: ``--tiny``: for CI's smoke test.
TINY = Sizes(vocab=256, d_model=32, layers=2, heads=2, context=16, d_in=64, hidden=64)


class LM(nn.Module):
    """``benchmarks/train.py``'s causal Transformer LM at ``sizes``: tokens ``[B, T]`` -> logits ``[B, T, vocab]``."""

    def __init__(self, s: Sizes) -> None:
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.d_model)
        self.pos = nn.Parameter(torch.randn(s.context, s.d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(s.d_model, s.heads, 4 * s.d_model, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, s.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(s.d_model)
        self.head = nn.Linear(s.d_model, s.vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(s.context), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:t]
        x = self.blocks(x, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(x))


def make_model(kind: str, s: Sizes, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    if kind == "transformer":
        model = LM(s)
    else:
        model = nn.Sequential(nn.Linear(s.d_in, s.hidden), nn.ReLU(), nn.Linear(s.hidden, s.hidden), nn.ReLU(),
                              nn.Linear(s.hidden, s.hidden), nn.ReLU(), nn.Linear(s.hidden, s.classes))
    return model.to(device)


def batch(kind: str, s: Sizes, step: int, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of batch ``step`` (deterministic, made on CPU), on ``device``."""
    g = torch.Generator().manual_seed(step)
    if kind == "transformer":
        tokens = torch.randint(0, s.vocab, (rows, s.context + 1), generator=g)
        return tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    return (torch.randn(rows, s.d_in, generator=g).to(device),
            torch.randint(0, s.classes, (rows,), generator=g).to(device))


def loss_of(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = net(x)
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


# ---------------------------------------------------------------- the runs


def _mean(values) -> float:
    values = list(values)
    return 1e3 * statistics.fmean(values) if values else 0.0


def run_torch(kind: str, s: Sizes, rows: int, steps: int, warmup: int, device: torch.device, sync,
              optimizer_on_cpu: bool = False) -> dict:
    """Plain PyTorch on ``device``: AdamW(fused=True); samples/s, final loss, phases.

    ``optimizer_on_cpu``: the same AdamW steps fp32 copies of the parameters in host memory, and the
    parameters are copied back each step, as shardps' shards do. Its final loss is the exact oracle of the
    shardps rows on any device; plain PyTorch's on CUDA runs CUDA's fused AdamW, whose last-bit rounding
    differs from the CPU's, which Adam's normalized update can amplify (docs/performance.md).
    """
    model = make_model(kind, s, device)
    params = list(model.parameters())
    masters = [p.detach().to("cpu", torch.float32, copy=True).requires_grad_() for p in params]
    opt = torch.optim.AdamW(masters if optimizer_on_cpu else params, lr=LR, fused=True)
    batches = [batch(kind, s, i, rows, device) for i in range(steps)]
    marks = []
    sync()
    for i, (x, y) in enumerate(batches):
        t0 = now()
        model.zero_grad()
        loss = loss_of(model, x, y)
        sync()
        t1 = now()
        loss.backward()
        sync()
        t2 = now()
        if optimizer_on_cpu:
            for m, p in zip(masters, params):
                m.grad = p.grad.to("cpu", torch.float32)
            opt.step()
            with torch.no_grad():
                for m, p in zip(masters, params):
                    p.copy_(m)
        else:
            opt.step()
        sync()
        marks.append((t0, t1, t2, now()))
    timed = marks[warmup:]
    seconds = marks[-1][3] - timed[0][0]
    with torch.no_grad():
        final = loss_of(model, *batch(kind, s, EVAL_STEP, rows, device)).item()
    return {
        "samples_per_s": rows * len(timed) / seconds,
        "final_loss": final,
        "phases_ms": {"forward": _mean(t1 - t0 for t0, t1, _, _ in timed),
                      "backward": _mean(t2 - t1 for _, t1, t2, _ in timed),
                      "optimizer_step": _mean(t3 - t2 for _, _, t2, t3 in timed)},
        "step_ms": 1e3 * seconds / len(timed),
    }


def _histogram(registry, name: str) -> tuple[float, float]:
    return (registry.get_sample_value(f"{name}_sum") or 0.0, registry.get_sample_value(f"{name}_count") or 0.0)


def reset_shards(addresses: list[str]) -> None:
    """Drop the job the shards hold (every worker left), so that the next row starts a job of its own."""
    from shardps.worker.session.client import ShardClient, ShardRpcError

    for i, address in enumerate(addresses):
        client = ShardClient(address, index=i, connect_timeout=10.0, rpc_timeout=10.0)
        try:
            for attempt in range(50):
                try:
                    client.reset()
                    break
                except ShardRpcError:  # a leave still being processed: the shard is not idle yet
                    if attempt == 49:
                        raise
                    time.sleep(0.1)
        finally:
            client.close()


def run_shardps(kind: str, s: Sizes, rows: int, steps: int, warmup: int, device: torch.device, sync,
                addresses: list[str], chunk_bytes: int, push_dtype: str = "fp32", streamed: bool = True,
                stream_processes: bool = False) -> dict:
    """One shardps worker on ``device`` with the idle shards at ``addresses``; samples/s, final loss, phases.

    ``push_dtype``: the gradients' wire type (``WireOptions.push_dtype``); ``streamed``: ``WireOptions.streamed``
    (False: the whole push, then the whole pull, each layer's parameters copied in as they arrive);
    ``stream_processes``: ``WireOptions.stream_processes`` (each shard's streams through a helper process)."""
    from shardps.worker import DistributedOptimizer, WireOptions

    model = make_model(kind, s, device)
    batches = [batch(kind, s, i, rows, device) for i in range(steps)]
    probe = Probe().install()
    try:
        dist = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR, fused=True),
                                    model.named_parameters(), servers=addresses, model=model,
                                    wire=WireOptions(chunk_bytes=chunk_bytes, push_dtype=push_dtype,
                                                     streamed=streamed, stream_processes=stream_processes))
        registry = dist.metrics.registry
        marks, before = [], None
        sync()
        for i, (x, y) in enumerate(batches):
            if i == warmup:
                before = {m: _histogram(registry, m) for m in ("shardps_worker_push_seconds",
                                                                "shardps_worker_pull_seconds")}
            probe.step = i
            t0 = now()
            dist.zero_grad()
            loss = loss_of(model, x, y)
            sync()
            t1 = now()
            loss.backward()
            sync()
            t2 = now()
            dist.step()
            marks.append((t0, t1, t2, now()))
        probe.step = steps
        dist.synchronize()  # the last pull lands
        sync()
        end = now()
        metrics = {}
        for m, (total, count) in before.items():
            t, c = _histogram(registry, m)
            metrics[m.removeprefix("shardps_worker_").removesuffix("_seconds")] = (
                1e3 * (t - total) / (c - count) if c > count else 0.0)
        pushed = registry.get_sample_value("shardps_worker_pushed_bytes_total") or 0.0
        with torch.no_grad():
            final = loss_of(model, *batch(kind, s, EVAL_STEP, rows, device)).item()
        dist.close()
    finally:
        probe.remove()
    reset_shards(addresses)
    starts = [m[0] for m in marks] + [end]
    per_step, timeline = [], []
    for i in range(warmup, steps):
        t0, t1, t2, t3 = marks[i]
        r = probe.records.get(i, StepRecord())
        sums = r.sums
        fw = sums.get("forward_wait_for_pull", 0.0)
        push_start, push_end = min(r.push_start.values(), default=t2), max(r.push_end.values(), default=t3)
        first, last = min(r.first_pulled.values(), default=t3), max(r.last_pulled.values(), default=t3)
        waits = [max(0.0, r.first_pulled[sh] - r.push_end[sh]) for sh in r.push_end if sh in r.first_pulled]
        per_step.append({
            "forward": t1 - t0 - fw, "forward_wait_for_pull": fw, "backward": t2 - t1, "step_call": t3 - t2,
            "grad_copy_off_device": sums.get("grad_copy_off_device", 0.0),
            "push": push_end - push_start, "push_after_backward": max(0.0, push_end - t2),
            "round_wait": statistics.fmean(waits) if waits else 0.0,
            "pull": last - first, "push_pull_overlap": max(0.0, min(push_end, last) - first),
            "copy_onto_device": sums.get("copy_onto_device", 0.0),
            "pull_after_step": max(0.0, last - t3),
        })
        timeline.append({"forward_end": t1 - t0, "backward_end": t2 - t0, "step_returned": t3 - t0,
                         "push_start": push_start - t0, "push_end": push_end - t0, "first_chunk_pulled": first - t0,
                         "last_chunk_pulled": last - t0, "next_step_start": starts[i + 1] - t0})
    seconds = end - marks[warmup][0]
    timed = steps - warmup
    return {
        "samples_per_s": rows * timed / seconds,
        "final_loss": final,
        "phases_ms": {k: _mean(p[k] for p in per_step) for k in per_step[0]},
        "timeline_ms": {k: _mean(p[k] for p in timeline) for k in timeline[0]},
        "metrics_ms": metrics,
        "pushed_bytes_per_step": pushed / steps,
        "step_ms": 1e3 * seconds / timed,
    }


def _median_rows(runs: list[dict]) -> dict:
    """Medians over repeats of every figure (final losses agree across repeats: the job is deterministic)."""
    out = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            out[key] = {k: statistics.median(r[key][k] for r in runs) for k in value}
        else:
            out[key] = statistics.median(r[key] for r in runs)
    out["final_loss"] = runs[0]["final_loss"]
    if len(runs) > 1:
        out["samples_per_s_runs"] = [r["samples_per_s"] for r in runs]
    return out


def device_of(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available on this machine")
    return torch.device(choice)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from common import machine

    return f"{machine()['cpu']} (CPU, {torch.get_num_threads()} torch thread(s))"


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="cuda when available (auto), else the CPU")
    p.add_argument("--steps", type=int, help="steps per row, warm-up included (default 30 on CUDA, 6 on CPU)")
    p.add_argument("--warmup", type=int, help="untimed first steps (default 5 on CUDA, 2 on CPU)")
    p.add_argument("--workloads", default="transformer:32,transformer:256,mlp:64",
                   help="model:samples per step, comma-separated (models: transformer, mlp)")
    p.add_argument("--shards", default="2,4", help="shard processes of the shardps rows, comma-separated")
    p.add_argument("--wire", default="fp32,bf16",
                   help="gradient wire types of the shardps rows, comma-separated (fp32, bf16, fp16); "
                        "parameters always come back in fp32")
    p.add_argument("--streamed", default="on",
                   help="on, off or on,off: shardps rows with streamed rounds (the default), push then pull "
                        "(WireOptions(streamed=False): rows named ..._plain), or both")
    p.add_argument("--stream-processes", default="off",
                   help="off, on or off,on: shardps rows with each shard's streams in this process (the default), "
                        "through a helper process per shard (WireOptions(stream_processes=True): rows named "
                        "..._procs), or both")
    p.add_argument("--repeats", type=int, default=1, help="runs of every row, interleaved; figures are medians")
    p.add_argument("--threads", type=int, default=1, help="torch threads of this process (default 1)")
    p.add_argument("--chunk-bytes", type=int, default=4 << 20, help="shardps chunk size in bytes (default 4 MiB)")
    p.add_argument("--tiny", action="store_true", help="tiny models (CI's smoke test)")
    p.add_argument("--shard-threads", type=int, default=0,
                   help="torch threads of each shard's optimizer step (shardps-server --threads; default 0: "
                        "LocalCluster's, the usable cores split evenly among the shards and this process)")
    p.add_argument("--switch-interval", type=float,
                   help="sys.setswitchinterval for this process, seconds (Python's default: 0.005)")
    args = p.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    device = device_of(args.device)
    cuda = device.type == "cuda"
    steps = args.steps or (30 if cuda else 6)
    warmup = args.warmup if args.warmup is not None else (5 if cuda else 2)
    if args.shard_threads < 0:
        p.error("--shard-threads must be >= 0 (0: the shard's own default)")
    if not 0 <= warmup < steps:
        p.error("--warmup must be >= 0 and below --steps")
    workloads = []
    for w in args.workloads.split(","):
        kind, _, rows = w.partition(":")
        if kind not in ("transformer", "mlp") or not rows.isdigit() or int(rows) < 1:
            p.error(f"bad workload {w!r}: model:samples, model transformer or mlp")
        workloads.append((kind, int(rows)))
    shard_counts = [int(n) for n in args.shards.split(",")]
    torch.set_num_threads(args.threads)
    sizes = TINY if args.tiny else Sizes()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    name = device_name(device)
    print(f"device: {device.type} ({name}); {steps} steps per row, {warmup} untimed; {args.repeats} repeat(s)",
          flush=True)
    wires = args.wire.split(",")
    if any(w not in ("fp32", "bf16", "fp16") for w in wires):
        p.error(f"bad --wire {args.wire!r}: fp32, bf16 or fp16, comma-separated")
    modes = args.streamed.split(",")
    if not modes or any(m not in ("on", "off") for m in modes) or len(set(modes)) != len(modes):
        p.error(f"bad --streamed {args.streamed!r}: on, off or on,off")
    relays = args.stream_processes.split(",")
    if not relays or any(m not in ("on", "off") for m in relays) or len(set(relays)) != len(relays):
        p.error(f"bad --stream-processes {args.stream_processes!r}: off, on or off,on")
    systems = ["torch", "torch_cpu_adamw",
               *[f"shardps_{n}" + ("" if w == "fp32" else f"_{w}") + ("" if m == "on" else "_plain")
                 + ("_procs" if r == "on" else "") for n in shard_counts for w in wires for m in modes for r in relays]]
    rows_out = []
    from shardps.worker import LocalCluster

    with contextlib.ExitStack() as stack:
        started = {n: stack.enter_context(LocalCluster(n, threads=args.shard_threads or None)) for n in shard_counts}
        clusters = {n: cluster.addresses for n, cluster in started.items()}
        rows_out = measure(workloads, systems, clusters, sizes, steps, warmup, device, sync, args)
    print_tables(rows_out)
    emit({"device": device.type, "device_name": name, "cuda_available": torch.cuda.is_available(),
          "torch_threads": args.threads, "shard_threads": {n: c.threads for n, c in started.items()},
          "switch_interval_s": sys.getswitchinterval(),
          "steps": steps, "warmup": warmup, "timed_steps": steps - warmup,
          "repeats": args.repeats, "chunk_bytes": args.chunk_bytes, "tiny": args.tiny,
          "sizes": dataclasses.asdict(sizes), "rows": rows_out}, args.json)


def measure(workloads, systems, clusters, sizes, steps, warmup, device, sync, args) -> list[dict]:
    """Every row: each workload's systems, ``args.repeats`` times interleaved; medians."""
    rows_out = []
    for kind, rows in workloads:
        params = sum(q.numel() for q in make_model(kind, sizes, torch.device("cpu")).parameters())
        runs: dict[str, list[dict]] = {sy: [] for sy in systems}
        for _ in range(args.repeats):
            for system in systems:
                print(f"{kind} x {rows}: {system} ...", flush=True)
                if system.startswith("torch"):
                    runs[system].append(run_torch(kind, sizes, rows, steps, warmup, device, sync,
                                                  optimizer_on_cpu=system == "torch_cpu_adamw"))
                else:
                    n, push_dtype, streamed, procs = shardps_system(system)
                    runs[system].append(run_shardps(kind, sizes, rows, steps, warmup, device, sync,
                                                    clusters[n], args.chunk_bytes, push_dtype, streamed, procs))
        base, oracle = _median_rows(runs["torch"]), _median_rows(runs["torch_cpu_adamw"])
        for system in systems:
            r = base if system == "torch" else _median_rows(runs[system])
            shards, push_dtype, streamed, procs = (shardps_system(system) if system.startswith("shardps")
                                                   else (0, "fp32", None, None))
            rows_out.append({
                "workload": kind, "samples_per_step": rows, "params": params, "system": system,
                "shards": shards, "push_dtype": push_dtype, "streamed": streamed, "stream_processes": procs, **r,
                "ratio_samples_per_s_vs_torch": r["samples_per_s"] / base["samples_per_s"],
                "final_loss_abs_diff": abs(r["final_loss"] - base["final_loss"]),
                # the exact oracle: the same AdamW on the CPU, as the shards run it
                "final_loss_abs_diff_vs_cpu_adamw": abs(r["final_loss"] - oracle["final_loss"]),
            })
    return rows_out


def shardps_system(system: str) -> tuple[int, str, bool, bool]:
    """``(shards, push dtype, streamed, stream processes)`` of a shardps row's name:
    ``shardps_<shards>[_<dtype>][_plain][_procs]``."""
    _, n, *rest = system.split("_")
    procs = rest[-1:] == ["procs"]
    rest = rest[:-1] if procs else rest
    streamed = rest[-1:] != ["plain"]
    return int(n), (rest[:1] if rest and rest[0] != "plain" else ["fp32"])[0], streamed, procs


def print_tables(rows_out: list[dict]) -> None:
    print(table(
        [[f"{r['workload']} x {r['samples_per_step']}", r["system"], f"{r['samples_per_s']:.1f}",
          f"{r['ratio_samples_per_s_vs_torch']:.2f}", f"{r['final_loss']:.6f}", f"{r['final_loss_abs_diff']:.1e}",
          f"{r['final_loss_abs_diff_vs_cpu_adamw']:.1e}"]
         for r in rows_out],
        ["workload", "system", "samples/s", "x torch", "final loss", "|diff|", "|diff| vs AdamW on CPU"],
    ))
    phase_names = ["forward", "forward_wait_for_pull", "backward", "step_call", "grad_copy_off_device", "push",
                   "push_after_backward", "round_wait", "pull", "push_pull_overlap", "copy_onto_device",
                   "pull_after_step"]
    print("\nms per step (shardps rows; plain torch: forward / backward / optimizer step)")
    print(table(
        [[f"{r['workload']} x {r['samples_per_step']}", r["system"], f"{r['step_ms']:.1f}",
          *([f"{r['phases_ms'][k]:.1f}" for k in phase_names] if r["system"].startswith("shardps") else
            [f"{r['phases_ms']['forward']:.1f}", "-", f"{r['phases_ms']['backward']:.1f}",
             f"{r['phases_ms']['optimizer_step']:.1f}", *["-"] * (len(phase_names) - 4)])]
         for r in rows_out],
        ["workload", "system", "step", *phase_names],
    ))
    marks = ["forward_end", "backward_end", "step_returned", "push_start", "push_end", "first_chunk_pulled",
             "last_chunk_pulled", "next_step_start"]
    print("\ntimeline, ms from the step's start (shardps rows)")
    print(table(
        [[f"{r['workload']} x {r['samples_per_step']}", r["system"], *[f"{r['timeline_ms'][k]:.1f}" for k in marks]]
         for r in rows_out if r["system"].startswith("shardps")],
        ["workload", "system", *marks],
    ))


if __name__ == "__main__":
    main()

"""Training benchmark: shardps sync (per worker and reduced within the node) vs torch DDP (Gloo) vs DDP + ZeRO.

    python benchmarks/train.py [--json PATH] [--model transformer|mlp] [--steps 50] [--batch-size N]

2 processes train the same model with AdamW (fused, lr 1e-3) on the same
synthetic batches (each process its half of every global batch), one torch
thread per process:

- transformer (default): a 6-layer pre-norm causal Transformer LM, d_model
  384, 6 heads, vocabulary 8192, context 64 (17.0 M parameters), 32
  sequences per process per step;
- mlp: 1024 -> 2048 -> 2048 -> 2048 -> 10 (10.5 M parameters), 64 samples
  per process per step: far less compute per parameter, so it shows the
  communication-bound end.

Systems (``--systems``, all by default):
- shardps (2 workers): sync (BSP), 2 shard processes on 127.0.0.1 holding
  the weights and the AdamW moments; each process is a worker of its own
  (2 contributors per round); pulls overlap the next forward (``model=``);
- shardps_node (1 node x 2 local ranks, reduction within the node): the same
  2 shards, but both processes are local ranks of one node in one Gloo
  process group (``shardps.worker.node.optimizer.NodeOptimizer``), by chunk
  ownership: each shard's range is averaged on the local rank that owns
  the shard (point-to-point sends, ``shares.reduce_scatter``), each rank
  pushes and pulls its own shard as the single contributor ``node0``
  (shards started with ``min_workers=1``), then one ``dist.broadcast`` per range gives every rank the whole model;
  no overlapped pull;
- ddp: DistributedDataParallel over Gloo (``gradient_as_bucket_view=True``),
  AdamW on every process;
- zero: the same DDP + ZeroRedundancyOptimizer(AdamW) (ZeRO stage 1,
  Rajbhandari et al., SC 2020).

Figures per system: samples/s over the timed steps (all but the first 5;
a sample is one sequence or one image) and its ratio to DDP's, ``final_loss``
(loss of a fixed held-out batch with the final parameters),
``model_state_bytes`` (bytes of the distinct tensor storages a process holds
for parameters, gradients and optimizer state, counted from the live
objects after the last step), ``peak_rss_bytes`` (peak resident memory) and
``rss_growth_bytes`` (peak RSS minus RSS just before the model was built:
model state plus communication buffers and allocator slack), the larger of
the two processes for each. The shardps rows also give
``push_bytes_per_step``: the growth of the shards' own ``push_bytes_total``
counters (Stats, summed over shards) over the timed steps, divided by the
timed steps; reduction within the node should halve it. ``cpu_ms_per_step``:
CPU time (user + system, every thread) per timed step of the 2 training
processes and, for shardps, the 2 shard processes (read from
``/proc/<pid>/stat`` on Linux, else absent), and ``cpu_bound_samples_per_s``:
the samples/s the system could reach at best if that work kept every core
of this machine busy (cores x samples per step / CPU per step). When the
processes share few cores (2 here) the work done per step, not waiting,
caps the speed. The goal printed for the MLP: shardps_node at least 0.75x
DDP's samples/s. ``node_phase_ms`` (shardps_node): the mean wall time per
timed step of each phase of the node's step on its leader, read from its
``shardps_worker_node_phase_seconds`` histogram (``reduce_scatter``,
``push_pull``, ``all_gather``); the rest of a step is forward, backward and
the small collectives that agree on the round.
"""

from __future__ import annotations

import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from common import cpu_seconds, current_rss_bytes, emit, free_port, parser, peak_rss_bytes, table  # noqa: E402
from torch import nn  # noqa: E402

WORKERS = 2
WARMUP = 5
LR = 1e-3
VOCAB, D_MODEL, LAYERS, HEADS, CONTEXT = 8192, 384, 6, 6, 64
D_IN, HIDDEN, CLASSES = 1024, 2048, 10
DEFAULT_BATCH = {"transformer": 32, "mlp": 64}
#: Systems whose weights live on shardps shards (they report ``push_bytes_per_step``).
SHARDPS = ("shardps", "shardps_node")
LABELS = {
    "shardps": "shardps (2 workers)",
    "shardps_node": "shardps with reduction within the node (1 node x 2 local ranks)",
    "ddp": "ddp",
    "zero": "zero",
}
#: MLP goal: shardps_node samples/s at least this fraction of DDP's.
NODE_GOAL = 0.75


class TinyLM(nn.Module):
    """Causal Transformer LM: tokens ``[B, T]`` int64 -> logits ``[B, T, VOCAB]`` float32."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Parameter(torch.randn(CONTEXT, D_MODEL) * 0.02)
        layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, 4 * D_MODEL, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(CONTEXT), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:t]
        x = self.blocks(x, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(x))


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "transformer":
        return TinyLM()
    return nn.Sequential(
        nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES),
    )


def batch(kind: str, step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of global batch ``step`` (deterministic)."""
    g = torch.Generator().manual_seed(step)
    if kind == "transformer":
        tokens = torch.randint(0, VOCAB, (rows, CONTEXT + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    return torch.randn(rows, D_IN, generator=g), torch.randint(0, CLASSES, (rows,), generator=g)


def loss_of(kind: str, net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = net(x)
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def state_bytes(tensors) -> int:
    """Bytes of the distinct storages among ``tensors`` (views of one buffer count once)."""
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def _optimizer_tensors(opt) -> list:
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps the local shard's optimizer in .optim
    # DistributedOptimizer and NodeOptimizer wrap the user's optimizer
    inner = getattr(inner, "_optimizer", inner)
    return [v for st in inner.state.values() for v in st.values()]


def cores() -> int:
    """CPU cores this process may use (its CPU affinity, capped by its cgroup's quota), as a shard counts them."""
    from shardps.common.cores import usable_cores

    return usable_cores()


def _shards_cpu(shard_pids: list[int]) -> float | None:
    readings = [cpu_seconds(pid) for pid in shard_pids]
    return None if None in readings else sum(readings)


def _shard_push_bytes(system: str, opt, rank: int, barrier) -> int:
    """Bytes the shards have received in pushes so far (Stats ``push_bytes_total`` summed over shards).

    Read on rank 0 between two steps, exactly: every process first waits
    for its own last round to finish (for the 2-worker row,
    ``synchronize()``; a PushPull's pull starts only after its push is
    counted), all meet at ``barrier``, rank 0 reads, and all meet again
    before anyone pushes more. 0 on other ranks and for the non-shardps
    systems.
    """
    if system not in SHARDPS:
        return 0
    if system == "shardps":
        opt.synchronize()
    barrier.wait()
    total = 0
    if rank == 0:
        inner = opt if system == "shardps" else opt.inner  # the node leader's DistributedOptimizer
        total = sum(reply.push_bytes_total for reply in inner.stats())
    barrier.wait()
    return total


def _node_phases(opt) -> dict[str, tuple[float, float]]:
    """The node leader's ``shardps_worker_node_phase_seconds`` so far: ``{phase: (seconds summed, count)}``."""
    from shardps.worker.metrics import NODE_PHASES

    registry = opt.metrics.registry
    return {phase: (registry.get_sample_value("shardps_worker_node_phase_seconds_sum", {"phase": phase}),
                    registry.get_sample_value("shardps_worker_node_phase_seconds_count", {"phase": phase}))
            for phase in NODE_PHASES}


def _worker(
    rank: int, kind: str, system: str, servers: str, rendezvous: str, steps: int, per_worker: int,
    chunk_bytes: int, barrier, out_dir: str, shard_pids: list[int],
) -> None:
    """One process of ``system``: train ``steps`` steps on its half of each batch, write its figures to ``out_dir``."""
    torch.set_num_threads(1)
    if system != "shardps":  # ddp, zero, and the node's process group of shardps_node
        dist.init_process_group("gloo", init_method=f"tcp://{rendezvous}", rank=rank, world_size=WORKERS,
                                timeout=datetime.timedelta(seconds=300))
    eval_x, eval_y = batch(kind, 10_000, 2 * per_worker)
    baseline = current_rss_bytes()
    model = make_model(kind)
    net = model
    if system == "shardps":
        from shardps.worker import DistributedOptimizer, WireOptions

        opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR, fused=True), model.named_parameters(),
                                   servers=servers, worker_id=f"bench-{rank}", model=model,
                                   wire=WireOptions(chunk_bytes=chunk_bytes))
    elif system == "shardps_node":
        from shardps.worker.config import WireOptions
        from shardps.worker.node.optimizer import NodeOptimizer

        opt = NodeOptimizer(torch.optim.AdamW(model.parameters(), lr=LR, fused=True), model.named_parameters(),
                            servers=servers, node_id="node0", named_buffers=model.named_buffers(),
                            wire=WireOptions(chunk_bytes=chunk_bytes))
    else:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model, gradient_as_bucket_view=True)
        if system == "ddp":
            opt = torch.optim.AdamW(net.parameters(), lr=LR, fused=True)
        else:
            opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW, lr=LR, fused=True)
    start, pushed, cpu, shards_cpu, phases = 0.0, 0, 0.0, None, None
    for step in range(steps):
        if step == WARMUP:
            pushed = -_shard_push_bytes(system, opt, rank, barrier)
            start, cpu = time.perf_counter(), time.process_time()
            shards_cpu = _shards_cpu(shard_pids) if rank == 0 else None
            phases = _node_phases(opt) if system == "shardps_node" and rank == 0 else None
        x, y = batch(kind, step, WORKERS * per_worker)
        mine = slice(rank * per_worker, (rank + 1) * per_worker)
        opt.zero_grad()
        loss_of(kind, net, x[mine], y[mine]).backward()
        opt.step()
    if system == "shardps":
        opt.synchronize()  # the last pull may still be landing
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    if shards_cpu is not None:
        shards_cpu = _shards_cpu(shard_pids) - shards_cpu
    if phases is not None:
        Path(out_dir, "phases.json").write_text(json.dumps({
            phase: 1e3 * (total - phases[phase][0]) / max(1.0, count - phases[phase][1])
            for phase, (total, count) in _node_phases(opt).items()}))
    pushed += _shard_push_bytes(system, opt, rank, barrier)
    held = state_bytes([*model.parameters(), *(p.grad for p in model.parameters()), *_optimizer_tensors(opt)])
    with torch.no_grad():
        final_loss = loss_of(kind, model, eval_x, eval_y).item()
    peak = peak_rss_bytes()
    if system in SHARDPS:
        opt.close()
    if system != "shardps":
        dist.destroy_process_group()
    Path(out_dir, f"{rank}.txt").write_text(f"{seconds} {final_loss!r} {peak} {peak - baseline} {held} {pushed} {cpu} "
                                            f"{-1.0 if shards_cpu is None else shards_cpu}")


def run(kind: str, system: str, steps: int, per_worker: int, chunk_bytes: int) -> dict:
    """Train with ``system`` in :data:`WORKERS` spawned processes; its figures (see the module docstring)."""
    from shardps.worker import LocalCluster

    with tempfile.TemporaryDirectory() as out:
        cluster = None
        if system in SHARDPS:  # the node is one contributor: its shards must not wait for a second one
            cluster = LocalCluster(2, min_workers=WORKERS if system == "shardps" else 1).start()
        servers = cluster.servers if cluster else ""
        rendezvous = f"127.0.0.1:{free_port()}"
        barrier = mp.get_context("spawn").Barrier(WORKERS)
        try:
            pids = [p.pid for p in cluster.processes] if cluster else []
            mp.start_processes(_worker, args=(kind, system, servers, rendezvous, steps, per_worker, chunk_bytes,
                                              barrier, out, pids), nprocs=WORKERS, start_method="spawn")
        finally:
            if cluster:
                cluster.stop()
        rows = [Path(out, f"{r}.txt").read_text().split() for r in range(WORKERS)]
        phase_file = Path(out, "phases.json")  # shardps_node: its leader's phases
        phase_ms = json.loads(phase_file.read_text()) if phase_file.exists() else None
    seconds = max(float(r[0]) for r in rows)
    losses = [float(r[1]) for r in rows]
    assert losses[0] == losses[1], f"{system}: workers disagree on the final parameters"
    result = {
        "samples_per_s": WORKERS * per_worker * (steps - WARMUP) / seconds,
        "final_loss": losses[0],
        "peak_rss_bytes": max(int(r[2]) for r in rows),
        "rss_growth_bytes": max(int(r[3]) for r in rows),
        "model_state_bytes": max(int(r[4]) for r in rows),
    }
    if phase_ms is not None:
        result["node_phase_ms"] = phase_ms
    if system in SHARDPS:
        result["push_bytes_per_step"] = int(rows[0][5]) / (steps - WARMUP)  # read on rank 0
    shards_cpu = float(rows[0][7])  # read on rank 0; -1: no /proc
    if shards_cpu >= 0:
        per_step = (sum(float(r[6]) for r in rows) + shards_cpu) / (steps - WARMUP)
        result["cpu_ms_per_step"] = 1e3 * per_step
        result["cpu_bound_samples_per_s"] = cores() * WORKERS * per_worker / per_step
    return result


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--model", choices=["transformer", "mlp"], default="transformer")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, help="samples per process per step (default 32 sequences / 64 images)")
    p.add_argument("--systems", default="shardps,shardps_node,ddp,zero")
    p.add_argument("--chunk-bytes", type=int, default=4 << 20, help="shardps chunk size in bytes (default 4 MiB)")
    args = p.parse_args()
    if args.steps <= WARMUP:
        p.error(f"--steps must exceed the {WARMUP} warm-up steps")
    systems = args.systems.split(",")
    if unknown := [s for s in systems if s not in LABELS]:
        p.error(f"unknown systems {unknown}; choose from {list(LABELS)}")
    per_worker = args.batch_size or DEFAULT_BATCH[args.model]
    params = sum(q.numel() for q in make_model(args.model).parameters())
    print(f"{args.model}: {params / 1e6:.1f} M parameters, {per_worker} samples per process per step, "
          f"{WORKERS} processes, {args.steps} steps", flush=True)
    results = {}
    for system in systems:
        print(f"running {system} ...", flush=True)
        results[system] = run(args.model, system, args.steps, per_worker, args.chunk_bytes)
    if "ddp" in results:
        for r in results.values():
            r["ratio_samples_per_s_vs_ddp"] = r["samples_per_s"] / results["ddp"]["samples_per_s"]
    mib = 1 << 20
    print(table(
        [[LABELS[s], f"{r['samples_per_s']:.1f}",
          f"{r['ratio_samples_per_s_vs_ddp']:.2f}" if "ratio_samples_per_s_vs_ddp" in r else "-",
          f"{r['push_bytes_per_step'] / mib:.1f}" if "push_bytes_per_step" in r else "-",
          f"{r['final_loss']:.6f}", f"{r['model_state_bytes'] / mib:.0f}",
          f"{r['peak_rss_bytes'] / mib:.0f}", f"{r['rss_growth_bytes'] / mib:.0f}",
          f"{r['cpu_ms_per_step']:.0f}" if "cpu_ms_per_step" in r else "-"] for s, r in results.items()],
        ["system", "samples/s", "x DDP", "pushed to shards MiB/step", "final loss", "model state MiB",
         "peak RSS MiB", "RSS growth MiB", "CPU ms/step"],
    ))
    out = {"model": args.model, "chunk_bytes": args.chunk_bytes, "params": params, "steps": args.steps,
           "timed_steps": args.steps - WARMUP, "per_worker_batch": per_worker, "workers": WORKERS, **results}
    if "shardps" in results and "ddp" in results:
        s, d = results["shardps"], results["ddp"]
        out["ratio_samples_per_s"] = s["samples_per_s"] / d["samples_per_s"]
        out["ratio_model_state_bytes"] = s["model_state_bytes"] / d["model_state_bytes"]
        out["ratio_rss_growth_bytes"] = s["rss_growth_bytes"] / d["rss_growth_bytes"]
        out["final_loss_abs_diff"] = abs(s["final_loss"] - d["final_loss"])
        print(f"shardps / ddp: samples/s {out['ratio_samples_per_s']:.2f}, model state memory "
              f"{out['ratio_model_state_bytes']:.2f}, |final loss diff| {out['final_loss_abs_diff']:.2e}")
    if "shardps_node" in results and "ddp" in results:
        n, d = results["shardps_node"], results["ddp"]
        out["node_final_loss_abs_diff"] = abs(n["final_loss"] - d["final_loss"])
        print(f"shardps_node / ddp: samples/s {n['ratio_samples_per_s_vs_ddp']:.2f}, "
              f"|final loss diff| {out['node_final_loss_abs_diff']:.2e}")
        if args.model == "mlp":
            met = n["ratio_samples_per_s_vs_ddp"] >= NODE_GOAL
            out["node_goal"] = {"min_ratio_samples_per_s_vs_ddp": NODE_GOAL,
                                "ratio_samples_per_s_vs_ddp": n["ratio_samples_per_s_vs_ddp"], "met": met}
            print(f"goal (MLP): shardps_node >= {NODE_GOAL:.2f}x DDP samples/s: "
                  f"{'met' if met else 'NOT met'} ({n['ratio_samples_per_s_vs_ddp']:.2f}x)")
        if "node_phase_ms" in n:
            print("shardps_node phases on the leader, ms per step: "
                  + ", ".join(f"{phase} {ms:.1f}" for phase, ms in n["node_phase_ms"].items()))
        if "cpu_bound_samples_per_s" in n:
            bound = n["cpu_bound_samples_per_s"] / d["samples_per_s"]
            out["node_cpu_bound_ratio_vs_ddp"] = bound
            print(f"shardps_node used {n['cpu_ms_per_step']:.0f} ms of CPU per step (DDP "
                  f"{d.get('cpu_ms_per_step', float('nan')):.0f} ms): on {cores()} cores it could reach at most "
                  f"{n['cpu_bound_samples_per_s']:.0f} samples/s, {bound:.2f}x DDP's measured samples/s")
    if "shardps" in results and "shardps_node" in results:
        w, n = results["shardps"]["push_bytes_per_step"], results["shardps_node"]["push_bytes_per_step"]
        out["ratio_push_bytes_node_vs_workers"] = n / w
        print(f"bytes pushed to the shards per step: 1 node x 2 local ranks {n / mib:.1f} MiB, "
              f"2 workers {w / mib:.1f} MiB (ratio {n / w:.2f})")
    emit(out, args.json)


if __name__ == "__main__":
    main()

"""Cluster in one box: shardps vs DDP when every host sits behind a rate-limited link.

    python benchmarks/cluster.py [--workers 4] [--shards 4] [--rate-mbit 50] [--delay-ms 0] [--steps 6]
                                 [--systems sync,sync_bf16,sync_plain,sync_clip,async,ddp,ddp_fp16]
                                 [--straggler] [--chunk-bytes 65536] [--push-credit-bytes 262144]
                                 [--host-qdisc fifo|fair] [--tcp-cc reno|cubic|bbr] [--json PATH]

N worker hosts and S shard hosts are emulated with Linux network
namespaces, one per host, each wired by a veth pair to a bridge in a switch
namespace; every host's link is limited to ``--rate-mbit`` in both
directions by token buckets (``benchmarks/cluster_net.py`` describes the
topology, the ``tc`` setup and the byte counters). One process runs per
host: shards are ``python -m shardps.cli.server --host <its address>``,
workers ``benchmarks/cluster_job.py``. Each worker trains the train
benchmark's MLP (1024-2048-2048-2048-10, 10.5 M parameters) on 64 samples
per step with fused AdamW (lr 1e-3), one torch thread, as:

- ``sync``: shardps, bulk synchronous rounds, fp32 on the wire, streamed
  (``WireOptions(streamed=True)``: each chunk applied and sent back as soon
  as every worker pushed it, so every link sends and receives at once),
  with ``--push-credit-bytes`` of credit (``WireOptions.push_credit_bytes``,
  default 256 KiB here, 4 chunks: a worker's stream to a shard keeps at
  most that much unanswered);
- ``sync_bf16``: the same with bf16 gradients and parameters on the wire;
- ``sync_plain``: sync rounds unstreamed (the whole push, then the whole pull);
- ``sync_clip``: sync with ``max_grad_norm=1.0``, which needs every shard's
  part of the norm before any chunk is applied, so its rounds are not streamed;
- ``async``: shardps async (each worker pushes its shards one after another,
  from a shard of its own, so answers come back while it still pushes); the
  hosts share a budget of N x steps timed steps;
- ``ddp``: DistributedDataParallel over Gloo (``GLOO_SOCKET_IFNAME=eth0``);
- ``ddp_fp16``: the same with ``fp16_compress_hook``.

Figures per row: samples/s over the timed steps (all hosts' samples over the
wall time from the first host's start to the last host's end, after
``--warmup`` untimed steps); the final loss of a fixed held-out batch; bytes
per link per step (from the veth counters: headers included; "per step" is
per ``steps`` rounds, i.e. per step of one host); the link bound: the
fastest the links allow, from M = model bytes on the wire (fp32: 4 bytes a
parameter; bf16/fp16: 2) and R = link rate (bytes/s):

- parameter server step time: max(M/R per worker link, N x M/(S x R) per
  shard link); async: samples/s at most B x min(sum of R_w / M, S x R / M);
- ring all-reduce step time: 2(N-1)/N x M/R (slowest worker link).

"of bound" is the measured samples/s over the link-bound samples/s (1.00:
the links are saturated with payload; headers alone keep it a few % below);
"theory x DDP" is the row's link-bound samples/s over fp32 ring all-reduce's.
CPU busy: the share of all cores' time not idle during the timed steps
(``/proc/stat``, everything on the machine), and in brackets this run's
share (CPU seconds of its worker and shard processes over cores x wall
time; kernel work done outside them, such as softirqs, is not in it);
above 80% busy a warning says that the CPUs, not the links, may set the pace.
Timeline (shardps sync rows): the median over a worker's timed rounds, then
the mean over workers, of when ``step()`` was called, the last push frame
left, and the first and last pulled frame arrived, in ms from the round's
first push (``DistributedOptimizer.last_timeline``): a first pull before the
push end is the overlap (async rows too: a shard answers once the worker's
part for it has arrived). ``--straggler``: the last worker
host's link runs at half the rate (default systems: async, ddp).
``--host-qdisc fair`` shares each host's egress evenly among the hosts it
sends to; ``--tcp-cc`` sets the hosts' TCP congestion control (default: a
new namespace's, the root namespace's); the JSON names the one that ran.
The shards run with their default lease (10 s; ``--lease-seconds``), and
each row counts the workers they dropped at lease expiry
(``lease_expiries``, from the shards' logs: 0 in a healthy run).

Needs CAP_NET_ADMIN (root): without it, exits with status 77 and says why.
Every namespace, veth, bridge and process it makes is removed at exit, on
Ctrl-C, SIGTERM and on errors. Addresses (10.200.0.0/16) exist only inside
the run's namespaces; names carry the pid.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster_net import HOST_QDISCS, Network, probe  # noqa: E402
from common import cpu_seconds, emit, parser, table  # noqa: E402

from shardps.server.config import ShardConfig  # noqa: E402

HERE = Path(__file__).resolve().parent
SYSTEMS = ("sync", "sync_bf16", "sync_plain", "sync_clip", "async", "ddp", "ddp_fp16")
LABELS = {"sync": "shardps sync (streamed)", "sync_bf16": "shardps sync, bf16 wire (streamed)",
          "sync_plain": "shardps sync, push then pull", "sync_clip": "shardps sync, max_grad_norm (push then pull)",
          "async": "shardps async", "ddp": "DDP (Gloo)", "ddp_fp16": "DDP + fp16_compress_hook"}
HALF = ("sync_bf16", "ddp_fp16")
PER_WORKER = 64
PARAMS = 1024 * 2048 + 2048 + 2 * (2048 * 2048 + 2048) + 2048 * 10 + 10  # the MLP of benchmarks/train.py
SHARD_PORT = 50051
BUSY_WARNING = 0.80
EXIT_NO_NAMESPACES = 77


class Host:
    """One process in a host namespace: JSON events (``@@`` lines) on its stdout, stderr kept in a log file."""

    def __init__(self, name: str, args: list[str], log_dir: str, env: dict[str, str]) -> None:
        self.name = name
        self.log = Path(log_dir, f"{name}.log")
        self.events: queue.Queue = queue.Queue()
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                         env=env, cwd=HERE.parent, start_new_session=True)
        threading.Thread(target=self._read, daemon=True, name=f"read-{name}").start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("@@"):
                self.events.put(json.loads(line[2:]))
            elif "listening on" in line:
                self.events.put({"event": "listening", "line": line.strip()})
        self.events.put({"event": "exited"})

    def send(self, message) -> None:
        self.proc.stdin.write((json.dumps(message) if isinstance(message, dict) else message) + "\n")
        self.proc.stdin.flush()

    def expect(self, event: str, deadline: float) -> dict:
        """The next event, which must be ``event``, before ``deadline`` (``time.monotonic``)."""
        try:
            got = self.events.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise RuntimeError(f"{self.name}: no {event!r} in time\n{self.tail()}") from None
        if got["event"] != event:
            raise RuntimeError(f"{self.name}: expected {event!r}, got {got}\n{got.get('traceback', '')}{self.tail()}")
        return got

    def tail(self, chars: int = 3000) -> str:
        return f"--- {self.name} stderr ---\n{self.log.read_text()[-chars:]}"

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM its process group, SIGKILL after ``grace`` seconds."""
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            if self.proc.poll() is not None:
                return
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass


class Cleanup:
    """Everything a run made, removed once: at the end of ``main``, by atexit, or on SIGTERM / SIGHUP."""

    def __init__(self) -> None:
        self.hosts: list[Host] = []
        self.network: Network | None = None
        self.done = False
        atexit.register(self)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # also where a shell started it with SIGINT ignored

    def _on_signal(self, signum, frame) -> None:
        raise SystemExit(128 + signum)  # unwinds through main's finally

    def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        for host in self.hosts:
            host.stop(grace=2.0)
        if self.network is not None:
            self.network.destroy()


def cpu_times() -> tuple[int, int]:
    """``(busy, total)`` jiffies of all cores so far (``/proc/stat``; idle and iowait are not busy)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    total = sum(fields[:8])  # guest time is already counted in user
    return total - fields[3] - fields[4], total


def link_bound(system: str, workers: int, shards: int, rates: dict[str, float]) -> dict:
    """The link-bound figures of ``system``: step time (s, a round of every host) and samples/s.

    ``rates``: bytes/s of each host's link (``w<i>``, ``s<j>``), both directions.
    """
    wire = PARAMS * (2 if system in HALF else 4)
    worker_rates = [rates[f"w{i}"] for i in range(workers)]
    shard_rates = [rates[f"s{j}"] for j in range(shards)]
    if system in ("ddp", "ddp_fp16"):
        step = 2 * (workers - 1) / workers * wire / min(worker_rates)
        return {"wire_model_bytes": wire, "step_s": step, "samples_per_s": workers * PER_WORKER / step}
    if system == "async":  # host-steps/s: each link for itself, each shard gets M/S per host-step
        host_steps = min(sum(r / wire for r in worker_rates), min(shard_rates) * shards / wire)
        return {"wire_model_bytes": wire, "step_s": workers / host_steps, "samples_per_s": PER_WORKER * host_steps}
    step = max(wire / min(worker_rates), workers * wire / (shards * min(shard_rates)))
    return {"wire_model_bytes": wire, "step_s": step, "samples_per_s": workers * PER_WORKER / step}


def run_system(system: str, index: int, args, net: Network, workers: list[Host], cleanup: Cleanup,
               log_dir: str, env: dict[str, str]) -> dict:
    """Start the shards (shardps), run ``system`` on every worker host, and return its row."""
    n, s = args.workers, args.shards
    bound = link_bound(system, n, s, {h: r / 8 for h, r in net.rates_bit.items()})
    deadline_for = lambda steps: time.monotonic() + args.timeout + 3 * steps * bound["step_s"]  # noqa: E731
    shards: list[Host] = []
    try:
        if system not in ("ddp", "ddp_fp16"):
            mode = "async" if system == "async" else "sync"
            for j in range(s):
                host = f"s{j}"
                shards.append(Host(f"{host}-{system}", net.exec_args(host) + [
                    sys.executable, "-m", "shardps.cli.server", "--shard-index", str(j), "--num-shards", str(s),
                    "--host", net.address[host], "--port", str(SHARD_PORT), "--min-workers", str(n), "--mode", mode,
                    "--threads", "1", *(["--lease-seconds", str(args.lease_seconds)] if args.lease_seconds else []),
                    "--log-level", "WARNING"],
                    log_dir, env))
                cleanup.hosts.append(shards[-1])
            for shard in shards:
                shard.expect("listening", time.monotonic() + args.timeout)
        budget = Path(log_dir, f"budget-{system}")
        budget.write_text("0")
        task = {"cmd": "run", "system": system, "steps": args.steps, "warmup": args.warmup, "per_worker": PER_WORKER,
                "chunk_bytes": args.chunk_bytes, "push_credit_bytes": args.push_credit_bytes,
                "budget_file": str(budget),
                "servers": ",".join(f"{net.address[f's{j}']}:{SHARD_PORT}" for j in range(s)),
                "master": f"{net.address['w0']}:{29500 + index}"}
        for w in workers:
            w.send(task)
        deadline = deadline_for(args.warmup + 2)
        for w in workers:
            w.expect("ready", deadline)
        before, cpu_before = net.counters(), cpu_times()
        shards_cpu = sum(cpu_seconds(x.proc.pid) or 0.0 for x in shards)
        for w in workers:
            w.send("go")
        deadline = deadline_for(args.steps)
        timed = [w.expect("timed", deadline) for w in workers]
        after, cpu_after = net.counters(), cpu_times()
        shards_cpu = sum(cpu_seconds(x.proc.pid) or 0.0 for x in shards) - shards_cpu
        for w in workers:
            w.send("finish")
        deadline = time.monotonic() + args.timeout
        losses = [w.expect("done", deadline)["final_loss"] for w in workers]
    except BaseException:
        for host in shards + [w for w in workers if w.proc.poll() is not None]:
            print(host.tail(1500), file=sys.stderr)
        raise
    finally:
        for shard in shards:
            shard.stop()
            cleanup.hosts.remove(shard)
    # every worker a shard dropped at lease expiry (its WARNING line); sync rounds would then have failed
    dropped = sum(shard.log.read_text().count("(its lease expired)") for shard in shards)
    wall = max(t["end"] for t in timed) - min(t["start"] for t in timed)
    host_steps = sum(t["steps"] for t in timed)
    rounds = host_steps / n  # steps of one host
    moved = {h: ((after[h][0] - before[h][0]) / rounds, (after[h][1] - before[h][1]) / rounds) for h in net.hosts}
    busy = (cpu_after[0] - cpu_before[0]) / max(1, cpu_after[1] - cpu_before[1])
    own = (sum(t["cpu"] for t in timed) + shards_cpu) / (wall * (os.cpu_count() or 1))

    def mean_link(prefix: str) -> dict | None:
        links = [v for h, v in moved.items() if h.startswith(prefix)]
        return {"sent": sum(v[0] for v in links) / len(links), "received": sum(v[1] for v in links) / len(links)} \
            if links and not (prefix == "s" and system in ("ddp", "ddp_fp16")) else None

    row = {
        "samples_per_s": host_steps * PER_WORKER / wall,
        "step_ms": 1e3 * wall / rounds,
        "final_loss": losses[0],
        "steps_per_worker": [t["steps"] for t in timed],
        "worker_link_bytes_per_step": mean_link("w"),
        "shard_link_bytes_per_step": mean_link("s"),
        "bytes_per_step_per_host": {h: {"sent": round(v[0]), "received": round(v[1])} for h, v in moved.items()},
        "link_bound": bound,
        "fraction_of_link_bound": host_steps * PER_WORKER / wall / bound["samples_per_s"],
        "cpu_busy": busy,
        "own_cpu_share": own,
        "shards_cpu_s_per_step": shards_cpu / rounds,
        "worker_cpu_s_per_step": [t["cpu"] / max(1, t["steps"]) for t in timed],
        "lease_expiries": dropped,
    }
    lines = [t["timeline"] for t in timed if t.get("timeline")]
    if lines:
        row["timeline_ms"] = {k: 1e3 * sum(t[k] for t in lines) / len(lines) for k in lines[0]}
    if system not in ("async",) and len({x for x in losses if x is not None}) > 1:
        raise RuntimeError(f"{system}: workers disagree on the final parameters: {losses}")
    return row


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4, help="worker hosts (>= 2)")
    p.add_argument("--shards", type=int, default=4, help="shard hosts (>= 1)")
    p.add_argument("--rate-mbit", type=float, default=50.0,
                   help="each host's link, Mbit/s, each direction (default 50: at 4 x 4 on 2 cores the shardps rows "
                        "keep the CPUs 70-85%% busy; at 100 they bind)")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay of each link, ms (needs netem)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per worker host")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (the shards' Init is in the first)")
    p.add_argument("--systems", help=f"comma-separated, of {','.join(SYSTEMS)} (default: all; --straggler: async,ddp)")
    p.add_argument("--host-qdisc", choices=HOST_QDISCS, default="fifo",
                   help="a host's egress queue: one FIFO (default), or shared evenly among the hosts it sends to")
    p.add_argument("--tcp-cc", help="the hosts' TCP congestion control (reno, cubic, bbr; default: what a new "
                   "namespace gets, the root namespace's)")
    p.add_argument("--straggler", action="store_true", help="the last worker host's link at half the rate")
    p.add_argument("--chunk-bytes", type=int, default=64 << 10,
                   help="shardps chunk size, bytes (default 64 KiB: a shard sends a chunk of a streamed round back "
                        "once every worker pushed it, so smaller chunks keep the links busier; at 4 x 4 and 50 "
                        "Mbit/s sync ran 0.75 of its link bound with 256 KiB, 0.82 with 128 KiB, 0.86-0.87 with "
                        "64 KiB, 0.81 with 32 KiB, where the CPUs bind)")
    p.add_argument("--push-credit-bytes", type=int, default=256 << 10,
                   help="streamed rounds: WireOptions(push_credit_bytes=...), bytes of chunks a worker's stream to a "
                        "shard may have unanswered (default 256 KiB, 4 chunks of 64 KiB: at 4 x 4 and 50 Mbit/s "
                        "sync ran 0.87 of its link bound, 0.86 with 2 or 8 chunks, 0.67 without credit; 0: no limit)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a phase may take beyond 3x its link bound")
    p.add_argument("--lease-seconds", type=float,
                   help="shards' worker lease, s (default: the shards' own, 10 s); the rows count the workers "
                        "a shard dropped at lease expiry (lease_expiries)")
    p.add_argument("--probe", action="store_true", help="only check that namespaces can be made (exit 0 or 77)")
    args = p.parse_args()
    systems = (args.systems or ("async,ddp" if args.straggler else ",".join(SYSTEMS))).split(",")
    if unknown := [x for x in systems if x not in SYSTEMS]:
        p.error(f"unknown systems {unknown}; choose from {list(SYSTEMS)}")
    if (args.workers < 2 or args.shards < 1 or args.steps < 1 or args.warmup < 1 or args.rate_mbit <= 0
            or args.push_credit_bytes < 0):
        p.error("needs --workers >= 2, --shards >= 1, --steps >= 1, --warmup >= 1, --rate-mbit > 0, "
                "--push-credit-bytes >= 0")
    if (reason := probe()) is not None:
        print(f"cluster.py cannot emulate hosts here: {reason}", file=sys.stderr)
        return EXIT_NO_NAMESPACES
    if args.probe:
        print("network namespaces, veths, bridges and tbf qdiscs can be made here")
        return 0
    rate = args.rate_mbit * 1e6
    hosts = [f"w{i}" for i in range(args.workers)] + [f"s{j}" for j in range(args.shards)]
    rates = {h: rate for h in hosts}
    if args.straggler:
        rates[f"w{args.workers - 1}"] = rate / 2
    print(f"{args.workers} worker hosts x {args.shards} shard hosts, links {args.rate_mbit:g} Mbit/s each direction"
          + (f" (straggler w{args.workers - 1}: {args.rate_mbit / 2:g} Mbit/s)" if args.straggler else "")
          + (f", {args.delay_ms:g} ms one-way delay" if args.delay_ms else "")
          + f"; MLP {PARAMS / 1e6:.1f} M parameters ({PARAMS * 4 / 1e6:.1f} MB fp32), {PER_WORKER} samples per "
          f"worker per step, {args.warmup} + {args.steps} steps", flush=True)
    cleanup = Cleanup()
    rows: dict[str, dict] = {}
    congestion = None
    try:
        with tempfile.TemporaryDirectory(prefix="shardps-cluster-") as log_dir:
            cleanup.network = net = Network(hosts, rates, args.delay_ms, host_qdisc=args.host_qdisc,
                                            congestion=args.tcp_cc)
            net.create()
            congestion = net.congestion_in_use
            print(f"TCP congestion control of the hosts: {congestion}", flush=True)
            env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))}
            workers = []
            for i in range(args.workers):
                host = f"w{i}"
                workers.append(Host(host, net.exec_args(host) + [
                    sys.executable, str(HERE / "cluster_job.py"), "--rank", str(i), "--world", str(args.workers)],
                    log_dir, {**env, "MASTER_ADDR": net.address["w0"]}))
                cleanup.hosts.append(workers[-1])
            for w in workers:
                w.expect("started", time.monotonic() + args.timeout)
            for index, system in enumerate(systems):
                print(f"running {system} ...", flush=True)
                rows[system] = row = run_system(system, index, args, net, workers, cleanup, log_dir, env)
                print(f"  {row['samples_per_s']:.1f} samples/s, {row['fraction_of_link_bound']:.2f} of the link "
                      f"bound, CPUs {100 * row['cpu_busy']:.0f}% busy ({100 * row['own_cpu_share']:.0f}% this run), "
                      f"{row['lease_expiries']} workers dropped at lease expiry", flush=True)
                if "timeline_ms" in row:
                    t = row["timeline_ms"]
                    print(f"  timeline (ms from the first push): step() {t['step_called']:.0f}, push end "
                          f"{t['push_end']:.0f}, first pull {t['first_pull']:.0f}, last pull {t['last_pull']:.0f}",
                          flush=True)
            for w in workers:
                w.send({"cmd": "exit"})
    finally:
        cleanup()
    report(rows, args, rates, congestion)
    return 0


def report(rows: dict[str, dict], args, rates: dict[str, float], congestion: str | None) -> None:
    """Print the table and the warnings; write the JSON (``--json``; ``congestion``: the hosts' TCP congestion
    control)."""
    ring = link_bound("ddp", args.workers, args.shards, {h: r / 8 for h, r in rates.items()})["samples_per_s"]
    ddp = rows.get("ddp", {}).get("samples_per_s")
    mb = 1e6
    for row in rows.values():
        row["theory_ratio_vs_ddp"] = row["link_bound"]["samples_per_s"] / ring
        if ddp:
            row["ratio_samples_per_s_vs_ddp"] = row["samples_per_s"] / ddp

    def link(v: dict | None) -> str:
        return "-" if v is None else f"{v['sent'] / mb:.1f} / {v['received'] / mb:.1f}"

    print(table(
        [[LABELS[s], f"{r['samples_per_s']:.1f}",
          f"{r['ratio_samples_per_s_vs_ddp']:.2f}" if "ratio_samples_per_s_vs_ddp" in r else "-",
          f"{r['theory_ratio_vs_ddp']:.2f}", f"{r['step_ms']:.0f}", f"{1e3 * r['link_bound']['step_s']:.0f}",
          f"{r['fraction_of_link_bound']:.2f}", link(r["worker_link_bytes_per_step"]),
          link(r["shard_link_bytes_per_step"]), f"{r['final_loss']:.6f}",
          f"{100 * r['cpu_busy']:.0f}% ({100 * r['own_cpu_share']:.0f}%)"]
         for s, r in rows.items()],
        ["system", "samples/s", "x DDP", "theory x DDP", "step ms", "link-bound step ms", "of bound",
         "worker link MB/step sent/recv", "shard link MB/step sent/recv", "final loss", "CPU busy (this run)"]))
    for s, r in rows.items():
        if r["cpu_busy"] > BUSY_WARNING:
            print(f"WARNING: the CPUs were {100 * r['cpu_busy']:.0f}% busy during {s}: the CPUs, not the links, may "
                  "set its pace; lower --rate-mbit or measure on a quieter machine")
    if dropped := {s: r["lease_expiries"] for s, r in rows.items() if r["lease_expiries"]}:
        print(f"WARNING: shards dropped workers at lease expiry: {dropped}")
    bad = [s for s, r in rows.items() if not (r["samples_per_s"] > 0 and math.isfinite(r["final_loss"]))]
    if bad:
        print(f"WARNING: rows without a positive samples/s or a finite loss: {bad}")
    out = {"workers": args.workers, "shards": args.shards, "rate_mbit": args.rate_mbit, "delay_ms": args.delay_ms,
           "host_qdisc": args.host_qdisc, "tcp_congestion_control": congestion,
           "straggler": f"w{args.workers - 1}" if args.straggler else None,
           "rates_mbit": {h: r / 1e6 for h, r in rates.items()}, "steps": args.steps, "warmup": args.warmup,
           "per_worker_batch": PER_WORKER, "params": PARAMS, "model_bytes_fp32": 4 * PARAMS,
           "chunk_bytes": args.chunk_bytes, "push_credit_bytes": args.push_credit_bytes,
           "lease_seconds": args.lease_seconds or ShardConfig.lease_seconds, "ring_bound_samples_per_s": ring,
           "rows": rows}
    emit(out, args.json)


if __name__ == "__main__":
    sys.exit(main())

"""Wire benchmark: a sync push+pull round trip against the raw ceilings, measured in one run.

    python benchmarks/wire.py [--json PATH] [--repeats 9] [--channels 1,2,4,8]

1 worker, 2 shards (real processes on 127.0.0.1), a 64 MiB fp32 model (4
parameters of 4 M elements), SGD. The shardps figure is the effective
rate 2 x model bytes / round time (gradients go out, parameters come back).
Ceilings, measured in the same run against a separate process:
- gRPC: a raw-bytes client stream of the same 64 MiB, in messages of the same size
  as shardps' chunks (``--chunk-bytes``, default 4 MiB), to a
  do-nothing server (python grpcio, identity serializers);
- multi-channel gRPC, the per-process ceiling: the same 64 MiB split evenly
  over N raw-bytes client streams (``--channels``, default 1, 2, 4 and 8),
  each on its own ``grpc.Channel`` (its own TCP connection: a local
  subchannel pool), all N in flight at once from this one client process,
  to the same do-nothing server process; the best N is the ceiling shardps
  push+pull is held to (goal: at least 0.9x, ``goal`` in the JSON);
- push+pull gRPC, the ceiling of what shardps does: the same 64 MiB split
  over N bidirectional raw-bytes streams (N = ``--channels`` again), each on
  a channel of its own, alternating between two do-nothing server
  processes (as shardps' two shards) that send every message back as it
  arrives; the rate counts both directions (2 x 64 MiB / time), as the
  shardps figure does. One process sending and receiving at once does
  more work than one that only sends, so this is the like-for-like
  ceiling; the goal stays the one above;
- TCP: the same bytes over a plain loopback socket.
All are measured interleaved (TCP, gRPC at each channel count, shardps,
TCP, ...) so that they see the same machine; each figure is the median of
``--repeats`` runs after one warm-up. Interleaved with them, on 2 shards
of its own, the same round unstreamed (``WireOptions(streamed=False)``:
the whole push, then the whole pull; the goal is judged on the default,
streamed); where the CPUs, not the links, bind, it does less work per
round (no undo copies, one apply); and, on 2 more shards, the default
round with each shard's streams carried by a helper process of the
worker's (``WireOptions(stream_processes=True)``; the helpers' CPU time is
charged with the shards', and reported apart as ``stream_processes``).
bf16 on the wire is measured after,
on fresh shards. Every process of the run keeps freed buffers for reuse
(``shardps.common.memory``, as workers and shards do by default), and the
gradients are made once, as the ceilings' payload is: what is timed is the
round trip.

Every timed call is also charged with the CPU time it cost, this process's
and that of the server processes it talks to (``cpu_seconds_per_round`` in
the JSON, a table in the output): where the CPUs, not the links, bind (a
host with fewer cores than processes), a round can take no less than its
total CPU time over the cores, whatever it overlaps.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import statistics
import sys
import time
from concurrent import futures
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc  # noqa: E402
import torch  # noqa: E402
from common import cpu_seconds, emit, parser, table  # noqa: E402

from shardps.common.memory import retain_freed_memory  # noqa: E402
from shardps.common.transport import channel_options  # noqa: E402
from shardps.common.cores import usable_cores  # noqa: E402
from shardps.worker import DistributedOptimizer, LocalCluster, WireOptions  # noqa: E402

MODEL_BYTES = 64 << 20
#: shardps push+pull per worker process must reach this fraction of the best multi-channel raw-gRPC ceiling.
GOAL = 0.9
#: The cores this run's processes may use (CPU affinity and cgroup quota, as a shard counts them).
CORES = usable_cores()


def _grpc_sink(conn) -> None:
    retain_freed_memory()  # as the shards do: the ceiling's buffers are reused too

    def sink(request_iterator, context):
        n = 0
        for message in request_iterator:
            n += len(message)
        return n.to_bytes(8, "little")

    def echo(request_iterator, context):
        yield from request_iterator

    server = grpc.server(futures.ThreadPoolExecutor(16), options=channel_options())  # 8 streams at once
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("bench.Sink", {"Push": grpc.stream_unary_rpc_method_handler(sink),
                                                             "Echo": grpc.stream_stream_rpc_method_handler(echo)}),)
    )
    conn.send(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    conn.recv()  # blocks until the parent is done
    server.stop(0)


def _tcp_sink(conn) -> None:
    retain_freed_memory()
    listener = socket.create_server(("127.0.0.1", 0))
    conn.send(listener.getsockname()[1])
    while True:
        sock, _ = listener.accept()
        with sock:
            n = 0
            while chunk := sock.recv(1 << 20):
                n += len(chunk)
            if n == 0:
                return


def _seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class _Sink:
    """A do-nothing server in a separate process: ``kind`` is "grpc" or "tcp"."""

    def __init__(self, kind: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.kind = kind
        self.proc = ctx.Process(target=_grpc_sink if kind == "grpc" else _tcp_sink, args=(child,))
        self.proc.start()
        self.port = self.conn.recv()

    def close(self) -> None:
        if self.kind == "grpc":
            self.conn.send("stop")
        else:
            socket.create_connection(("127.0.0.1", self.port)).close()  # an empty connection stops it
        self.proc.join(10)


def grpc_sender(port: int, chunk: int, payload, channels: int = 1) -> callable:
    """Send ``payload`` (MODEL_BYTES) split evenly over ``channels`` client streams in flight at once.

    Each stream has a ``grpc.Channel`` of its own, with a local subchannel
    pool so that no two share a TCP connection; every stream sends its share
    in messages of at most ``chunk`` bytes. The call returns once every
    stream's reply is in.
    """
    options = [*channel_options(), ("grpc.use_local_subchannel_pool", 1)]
    opened = [grpc.insecure_channel(f"127.0.0.1:{port}", options=options) for _ in range(channels)]
    pushes = [channel.stream_unary("/bench.Sink/Push") for channel in opened]
    share = -(-MODEL_BYTES // channels)
    spans = [(lo, min(lo + share, MODEL_BYTES)) for lo in range(0, MODEL_BYTES, share)]

    def messages(lo: int, hi: int):
        return (payload[i : min(i + chunk, hi)].tobytes() for i in range(lo, hi, chunk))

    def send() -> None:
        calls = [push.future(messages(lo, hi), timeout=60) for push, (lo, hi) in zip(pushes, spans)]
        received = sum(int.from_bytes(call.result(), "little") for call in calls)
        assert received == MODEL_BYTES, received

    send.close = lambda: [channel.close() for channel in opened]
    return send


def grpc_echo(ports: list[int], chunk: int, payload, channels: int = 1) -> callable:
    """Send ``payload`` (MODEL_BYTES) over ``channels`` bidirectional streams and read every message back.

    Stream ``i`` goes to ``ports[i % len(ports)]`` on a channel of its own
    (local subchannel pool); each sends its share in messages of at most
    ``chunk`` bytes while a thread of this process reads the echoes (only
    their lengths: nothing is copied). Returns once every byte came back.
    """
    options = [*channel_options(), ("grpc.use_local_subchannel_pool", 1)]
    opened = [grpc.insecure_channel(f"127.0.0.1:{ports[i % len(ports)]}", options=options) for i in range(channels)]
    echoes = [channel.stream_stream("/bench.Sink/Echo") for channel in opened]
    share = -(-MODEL_BYTES // channels)
    spans = [(lo, min(lo + share, MODEL_BYTES)) for lo in range(0, MODEL_BYTES, share)]
    pool = futures.ThreadPoolExecutor(channels)

    def one(echo, lo: int, hi: int) -> int:
        messages = (payload[i : min(i + chunk, hi)].tobytes() for i in range(lo, hi, chunk))
        return sum(len(reply) for reply in echo(messages, timeout=60))

    def send() -> None:
        received = sum(pool.map(one, echoes, *zip(*spans)))
        assert received == MODEL_BYTES, received

    send.close = lambda: ([channel.close() for channel in opened], pool.shutdown())
    return send


def tcp_sender(port: int, payload) -> callable:
    def send() -> None:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(memoryview(payload))
            sock.shutdown(socket.SHUT_WR)
            sock.recv(1)

    return send


def shardps_rounds(cluster: LocalCluster, chunk: int, push_dtype: str, pull_dtype: str, streamed: bool = True,
                   stream_processes: bool = False):
    """A DistributedOptimizer over a 64 MiB model and a function running one sync round trip."""
    params = [torch.nn.Parameter(torch.randn(MODEL_BYTES // 16)) for _ in range(4)]
    named = [(f"layer{i}.weight", p) for i, p in enumerate(params)]
    dist = DistributedOptimizer(torch.optim.SGD(params, lr=1e-6), named, servers=cluster.addresses,
                                wire=WireOptions(chunk_bytes=chunk, push_dtype=push_dtype, pull_dtype=pull_dtype,
                                                 streamed=streamed, stream_processes=stream_processes))

    grads = [torch.ones_like(p) for p in params]  # made once: the ceilings' payloads are made before timing too

    def round_trip() -> None:
        for p, g in zip(params, grads):
            p.grad = g
        dist.step()

    return dist, round_trip


def cpu_accounting(calls: list[list[float]], seconds: list[float]) -> dict:
    """Mean CPU seconds per call of one sender: ``client`` (this process), ``servers`` (each server process),
    their ``total``; ``wall``, the mean call time, s; ``cores_busy`` = total / wall.

    ``calls``: per call, ``[this process, server 1, ...]`` CPU seconds; ``seconds``: the calls' wall times.
    Server processes are read in clock ticks, so the means are good to about 10 ms / sqrt(calls) each.
    None where a process's CPU time could not be read (no Linux /proc).
    """
    n = len(calls)
    if any(None in c for c in calls):
        return None
    client = sum(c[0] for c in calls) / n
    servers = [sum(c[i] for c in calls) / n for i in range(1, len(calls[0]))]
    wall = sum(seconds) / n
    return {"client": client, "servers": servers, "servers_total": sum(servers), "total": client + sum(servers),
            "wall": wall, "cores_busy": (client + sum(servers)) / wall}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--chunk-bytes", type=int, default=4 << 20,
                   help="shardps chunk size and the ceiling's message size, bytes (default 4 MiB)")
    p.add_argument("--channels", default="1,2,4,8",
                   help="channel counts of the multi-channel gRPC ceiling, comma-separated (default 1,2,4,8)")
    args = p.parse_args()
    counts = sorted({int(n) for n in args.channels.split(",")} | {1})
    torch.set_num_threads(1)
    retain_freed_memory()  # every process of the run (shards, sinks, this one) reuses freed buffers alike
    payload = torch.randn(MODEL_BYTES // 4).view(torch.uint8).numpy()
    sinks = [_Sink("grpc"), _Sink("tcp"), _Sink("grpc")]
    try:
        with LocalCluster(2) as cluster, LocalCluster(2) as plain_cluster, LocalCluster(2) as relay_cluster:
            senders = {"tcp": tcp_sender(sinks[1].port, payload)}
            for n in counts:  # "grpc" is the single stream; "grpc_N" N channels at once
                senders["grpc" if n == 1 else f"grpc_{n}"] = grpc_sender(sinks[0].port, args.chunk_bytes, payload, n)
            for n in counts:  # both directions at once, over both echo servers (as shardps' 2 shards)
                senders[f"echo_{n}"] = grpc_echo([sinks[0].port, sinks[2].port], args.chunk_bytes, payload, n)
            dist, senders["shardps"] = shardps_rounds(cluster, args.chunk_bytes, "fp32", "fp32")
            plain, senders["shardps_plain"] = shardps_rounds(plain_cluster, args.chunk_bytes, "fp32", "fp32",
                                                             streamed=False)
            relay, senders["shardps_procs"] = shardps_rounds(relay_cluster, args.chunk_bytes, "fp32", "fp32",
                                                             stream_processes=True)
            senders["shardps_procs"]()  # its stream processes start with the first round
            helpers = relay.stream_process_pids
            # the server processes each sender talks to, whose CPU time its calls are charged with
            servers = {name: [sinks[1].proc.pid] if name == "tcp" else
                       [sinks[0].proc.pid, sinks[2].proc.pid] if name.startswith("echo_") else
                       [p.pid for p in cluster.processes] if name == "shardps" else
                       [p.pid for p in plain_cluster.processes] if name == "shardps_plain" else
                       [*(p.pid for p in relay_cluster.processes), *helpers] if name == "shardps_procs" else
                       [sinks[0].proc.pid]
                       for name in senders}
            times: dict[str, list[float]] = {k: [] for k in senders}
            cpu: dict[str, list[list[float]]] = {k: [] for k in senders}  # per call: [this process, servers...]
            for _ in range(args.repeats + 1):  # interleaved, so all see the same machine; first is warm-up
                for name, fn in senders.items():
                    before = [cpu_seconds(), *map(cpu_seconds, servers[name])]
                    times[name].append(_seconds(fn))
                    after = [cpu_seconds(), *map(cpu_seconds, servers[name])]
                    cpu[name].append([None if None in (a, b) else a - b for a, b in zip(after, before)])
            dist.close()
            plain.close()
            relay.close()
            for fn in senders.values():
                getattr(fn, "close", lambda: None)()  # before the sink stops: no GOAWAY noise
        with LocalCluster(2) as cluster:
            dist, bf16 = shardps_rounds(cluster, args.chunk_bytes, "bf16", "bf16")
            bf16_times = [_seconds(bf16) for _ in range(args.repeats + 1)]
            dist.close()
    finally:
        for sink in sinks:
            sink.close()
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    ours = 2 * MODEL_BYTES / med["shardps"] / 1e9
    plain_gbps = 2 * MODEL_BYTES / med["shardps_plain"] / 1e9
    procs_gbps = 2 * MODEL_BYTES / med["shardps_procs"] / 1e9
    ceiling = MODEL_BYTES / med["grpc"] / 1e9
    tcp = MODEL_BYTES / med["tcp"] / 1e9
    bf16_gbps = 2 * MODEL_BYTES / statistics.median(bf16_times[1:]) / 1e9
    pair = statistics.median(
        (2 * MODEL_BYTES / s) / (MODEL_BYTES / g) for s, g in zip(times["shardps"][1:], times["grpc"][1:])
    )
    channel_gbps = {n: MODEL_BYTES / med["grpc" if n == 1 else f"grpc_{n}"] / 1e9 for n in counts}
    best = max(channel_gbps, key=channel_gbps.get)
    multi = channel_gbps[best]
    # paired: each repeat's shardps rate over the best of that repeat's channel counts
    multi_pair = statistics.median(
        (2 * MODEL_BYTES / times["shardps"][r]) / max(MODEL_BYTES / times["grpc" if n == 1 else f"grpc_{n}"][r]
                                                     for n in counts)
        for r in range(1, args.repeats + 1)
    )
    echo_gbps = {n: 2 * MODEL_BYTES / med[f"echo_{n}"] / 1e9 for n in counts}
    echo_best = max(echo_gbps, key=echo_gbps.get)
    echo_pair = statistics.median(
        (2 * MODEL_BYTES / times["shardps"][r]) / max(2 * MODEL_BYTES / times[f"echo_{n}"][r] for n in counts)
        for r in range(1, args.repeats + 1)
    )
    cpu_per_round = {name: cpu_accounting(cpu[name][1:], times[name][1:]) for name in senders}
    if cpu_per_round["shardps_procs"] is not None:  # its last "servers" are the worker's own stream processes
        cpu_per_round["shardps_procs"]["stream_processes"] = sum(cpu_per_round["shardps_procs"]["servers"][-2:])
    goal_round = 2 * MODEL_BYTES / (GOAL * multi * 1e9)  # seconds a round may take at the goal
    result = {
        "model_bytes": MODEL_BYTES,
        "chunk_bytes": args.chunk_bytes,
        "repeats": args.repeats,
        "shardps_gbps": ours,
        "shardps_bf16_wire_gbps": bf16_gbps,
        "shardps_push_then_pull_gbps": plain_gbps,
        "grpc_ceiling_gbps": ceiling,
        "tcp_ceiling_gbps": tcp,
        "ratio_to_grpc": ours / ceiling,
        "ratio_to_grpc_paired_median": pair,
        "ratio_to_tcp": ours / tcp,
        "grpc_channels_gbps": {str(n): g for n, g in channel_gbps.items()},
        "grpc_multi_channel_ceiling_gbps": multi,
        "grpc_multi_channel_ceiling_channels": best,
        "ratio_to_grpc_multi_channel": ours / multi,
        "ratio_to_grpc_multi_channel_paired_median": multi_pair,
        "goal": {"min_ratio_to_grpc_multi_channel": GOAL, "ratio": ours / multi, "met": ours / multi >= GOAL,
                 "round_seconds_at_goal": goal_round,
                 # the most CPU a round may cost at the goal, every core busy all the time
                 "cpu_seconds_per_round_at_goal_all_cores": goal_round * CORES},
        "ratio_push_then_pull_to_grpc_multi_channel": plain_gbps / multi,
        "shardps_stream_processes_gbps": procs_gbps,
        "ratio_stream_processes_to_grpc_multi_channel": procs_gbps / multi,
        "grpc_push_pull_channels_gbps": {str(n): g for n, g in echo_gbps.items()},
        "grpc_push_pull_ceiling_gbps": echo_gbps[echo_best],
        "grpc_push_pull_ceiling_channels": echo_best,
        "ratio_to_grpc_push_pull": ours / echo_gbps[echo_best],
        "ratio_to_grpc_push_pull_paired_median": echo_pair,
        "round_seconds": times["shardps"][1:],
        "push_then_pull_round_seconds": times["shardps_plain"][1:],
        "stream_processes_round_seconds": times["shardps_procs"][1:],
        "grpc_seconds": times["grpc"][1:],
        "grpc_channels_seconds": {str(n): times["grpc" if n == 1 else f"grpc_{n}"][1:] for n in counts},
        "grpc_push_pull_seconds": {str(n): times[f"echo_{n}"][1:] for n in counts},
        "cpu_seconds_per_round": cpu_per_round,
        "cores": CORES,
        "shard_threads": cluster.threads,  # each shard's optimizer threads (LocalCluster: the cores split)
    }
    print(table(
        [
            ["shardps sync push+pull (2 shards)", f"{ours:.2f}", f"{ours / ceiling:.2f}"],
            ["shardps, bf16 on the wire (fp32-equivalent)", f"{bf16_gbps:.2f}", f"{bf16_gbps / ceiling:.2f}"],
            ["shardps sync, push then pull (streamed=False)", f"{plain_gbps:.2f}", f"{plain_gbps / ceiling:.2f}"],
            ["shardps sync, stream processes (stream_processes=True)", f"{procs_gbps:.2f}",
             f"{procs_gbps / ceiling:.2f}"],
            ["raw-bytes gRPC client stream", f"{ceiling:.2f}", "1.00"],
            *[[f"raw-bytes gRPC, {n} channels at once", f"{g:.2f}", f"{g / ceiling:.2f}"]
              for n, g in channel_gbps.items() if n > 1],
            *[[f"raw-bytes gRPC push+pull, {n} stream(s) (both directions)", f"{g:.2f}", f"{g / ceiling:.2f}"]
              for n, g in echo_gbps.items()],
            ["raw TCP socket", f"{tcp:.2f}", f"{tcp / ceiling:.2f}"],
        ],
        [f"64 MiB fp32 model, {args.chunk_bytes >> 10} KiB chunks", "GB/s", "x gRPC"],
    ))
    grpc_best = "grpc" if best == 1 else f"grpc_{best}"
    accounted = all(cpu_per_round[name] is not None
                    for name in ("shardps", "shardps_plain", "shardps_procs", grpc_best, f"echo_{echo_best}"))
    print(table(
        [[label, *(f"{1e3 * cpu_per_round[name][k]:.1f}" for k in ("client", "servers_total", "total", "wall")),
          f"{cpu_per_round[name]['cores_busy']:.2f}"]
         for label, name in (("shardps sync push+pull (streamed)", "shardps"),
                             ("shardps push then pull (streamed=False)", "shardps_plain"),
                             ("shardps, stream processes (servers + 2 helpers)", "shardps_procs"),
                             (f"raw-bytes gRPC, {best} channel(s) (one way)", grpc_best),
                             (f"raw-bytes gRPC push+pull, {echo_best} stream(s)", f"echo_{echo_best}"))],
        ["CPU per round, ms", "this process", "servers", "total", "wall", f"cores busy (of {CORES})"],
    ) if accounted else "CPU per round: not measured (no /proc here)")
    if accounted:
        print(f"at the goal a round takes {1e3 * goal_round:.1f} ms: on {CORES} cores, at most "
              f"{1e3 * goal_round * CORES:.0f} ms of CPU per round with every core busy; shardps spends "
              f"{1e3 * cpu_per_round['shardps']['total']:.0f} (streamed), "
              f"{1e3 * cpu_per_round['shardps_plain']['total']:.0f} (push then pull)")
    print(f"paired median ratio shardps / gRPC: {pair:.2f}")
    print(f"shardps push+pull / best multi-channel gRPC ceiling ({best} channels, {multi:.2f} GB/s): "
          f"{ours / multi:.2f} (paired median {multi_pair:.2f}); goal >= {GOAL:.1f}: "
          f"{'met' if ours / multi >= GOAL else 'NOT met'}")
    print(f"shardps push+pull / raw gRPC push+pull ceiling ({echo_best} stream(s), {echo_gbps[echo_best]:.2f} GB/s): "
          f"{ours / echo_gbps[echo_best]:.2f} (paired median {echo_pair:.2f})")
    print(f"shardps push then pull (streamed=False) / best multi-channel gRPC ceiling: {plain_gbps / multi:.2f} "
          "(the goal is judged on the default, streamed)")
    emit(result, args.json)


if __name__ == "__main__":
    main()

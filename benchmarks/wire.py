"""Wire benchmark: a sync push+pull round trip against the raw ceilings, measured in one run.

    python benchmarks/wire.py [--json PATH] [--repeats 5]

1 worker, 2 shards (real processes on 127.0.0.1), a 64 MiB fp32 model (4
parameters of 4 M elements), SGD. The shardps figure is the effective
rate 2 x model bytes / round time (gradients go out, parameters come back).
Ceilings, measured in the same run against a separate process:
- gRPC: a raw-bytes client stream of the same 64 MiB in 1 MiB messages to a
  do-nothing server (python grpcio, identity serializers);
- TCP: the same bytes over a plain loopback socket.
Each figure is the median of ``--repeats`` runs after one warm-up.
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
from common import emit, parser, table  # noqa: E402

from shardps.proto.transport import channel_options  # noqa: E402
from shardps.worker import DistributedOptimizer, LocalCluster  # noqa: E402

MODEL_BYTES = 64 << 20
CHUNK = 1 << 20


def _grpc_sink(conn) -> None:
    def sink(request_iterator, context):
        n = 0
        for message in request_iterator:
            n += len(message)
        return n.to_bytes(8, "little")

    server = grpc.server(futures.ThreadPoolExecutor(4), options=channel_options())
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("bench.Sink", {"Push": grpc.stream_unary_rpc_method_handler(sink)}),)
    )
    conn.send(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    conn.recv()  # blocks until the parent is done
    server.stop(0)


def _tcp_sink(conn) -> None:
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


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def grpc_ceiling(repeats: int) -> float:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_grpc_sink, args=(child,))
    proc.start()
    try:
        port = parent.recv()
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=channel_options())
        push = channel.stream_unary("/bench.Sink/Push")
        payload = torch.randn(MODEL_BYTES // 4).view(torch.uint8).numpy()
        messages = lambda: (payload[i : i + CHUNK].tobytes() for i in range(0, MODEL_BYTES, CHUNK))  # noqa: E731
        seconds = _median_seconds(lambda: push(messages(), timeout=60), repeats)
        channel.close()
    finally:
        parent.send("stop")
        proc.join(10)
    return MODEL_BYTES / seconds / 1e9


def tcp_ceiling(repeats: int) -> float:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_tcp_sink, args=(child,))
    proc.start()
    port = parent.recv()
    payload = memoryview(torch.randn(MODEL_BYTES // 4).view(torch.uint8).numpy())

    def send() -> None:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            sock.recv(1)

    try:
        seconds = _median_seconds(send, repeats)
    finally:
        socket.create_connection(("127.0.0.1", port)).close()  # empty connection stops the sink
        proc.join(10)
    return MODEL_BYTES / seconds / 1e9


def shardps_round(repeats: int, push_dtype: str = "fp32", pull_dtype: str = "fp32") -> float:
    params = [torch.nn.Parameter(torch.randn(MODEL_BYTES // 16)) for _ in range(4)]
    named = [(f"layer{i}.weight", p) for i, p in enumerate(params)]
    with LocalCluster(2) as cluster:
        opt = torch.optim.SGD(params, lr=1e-6)
        with DistributedOptimizer(opt, named, servers=cluster.addresses, push_dtype=push_dtype,
                                  pull_dtype=pull_dtype) as dist:
            def round_trip() -> None:
                for p in params:
                    p.grad = torch.ones_like(p)
                dist.step()

            seconds = _median_seconds(round_trip, repeats)
    return 2 * MODEL_BYTES / seconds / 1e9


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    tcp = tcp_ceiling(args.repeats)
    ceiling = grpc_ceiling(args.repeats)
    ours = shardps_round(args.repeats)
    bf16 = shardps_round(args.repeats, "bf16", "bf16")
    result = {
        "model_bytes": MODEL_BYTES,
        "chunk_bytes": CHUNK,
        "shardps_gbps": ours,
        "shardps_bf16_wire_gbps": bf16,
        "grpc_ceiling_gbps": ceiling,
        "tcp_ceiling_gbps": tcp,
        "ratio_to_grpc": ours / ceiling,
        "ratio_to_tcp": ours / tcp,
    }
    print(table(
        [
            ["shardps sync push+pull (2 shards)", f"{ours:.2f}", f"{ours / ceiling:.2f}"],
            ["shardps, bf16 on the wire (fp32-equivalent)", f"{bf16:.2f}", f"{bf16 / ceiling:.2f}"],
            ["raw-bytes gRPC client stream", f"{ceiling:.2f}", "1.00"],
            ["raw TCP socket", f"{tcp:.2f}", f"{tcp / ceiling:.2f}"],
        ],
        ["64 MiB fp32 model, loopback", "GB/s", "x gRPC"],
    ))
    emit(result, args.json)


if __name__ == "__main__":
    main()

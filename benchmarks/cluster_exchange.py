"""The parameter-server exchange's own ceiling on the emulated links: raw-bytes gRPC, no shardps code.

    python benchmarks/cluster_exchange.py [--workers 4] [--shards 4] [--rate-mbit 100]
                                          [--chunk-kib 1024,256] [--repeats 3] [--host-qdisc fifo|fair]
                                          [--credit 0[,4,...]] [--rounds 4] [--tcp-cc reno|cubic|bbr]
                                          [--json PATH]

The same hosts and links as ``benchmarks/cluster.py`` (``cluster_net.py``).
Each worker host opens one bidirectional gRPC call to each shard host, with
shardps' channel options, and sends it M / S bytes (M: the cluster
benchmark's MLP in fp32, 42 MB) in chunks; the shard answers with as many
chunks of the same size:

- ``independent``: the shard answers at once, whatever the workers sent: every
  link sends and receives at once and nothing waits, the full-duplex ceiling
  of gRPC over these links;
- ``gated``: the shard answers chunk k only once every worker's chunk k has
  arrived: the dependency of a streamed sync round (a shard applies a chunk
  once every member pushed it), with no parsing, optimizer or Python work
  beyond receiving and sending bytes;
- ``gated`` with a credit of K chunks (``--credit``, one row per value; 0,
  the default, is the plain ``gated`` row): a worker also sends a shard its
  next chunk only while at most K of its chunks to that shard are
  unanswered, so no worker's stream runs more than K chunks ahead of the
  slowest worker's at that shard (what ``WireOptions.push_credit_bytes``
  does in shardps) (the credit-based flow control of ByteScheduler: Peng et al., "A
  Generic Communication Scheduler for Distributed DNN Training
  Acceleration", SOSP 2019).

Each run is ``--rounds`` rounds back to back: every worker host starts
the first at a common instant and each later one as soon as it has every
answer of the one before, on the same connections, as a shardps worker's
steps do. Figure per mode and chunk size: a round's time (the slowest
worker host's), the median over the rounds after the first of
``--repeats`` runs, and the fraction of the parameter-server link bound
max(M/R, N x M/(S x R)) it reaches; the first round (fresh connections,
common start) is reported beside it. The two differ: with BBR, rounds on
connections that have carried a few rounds already shared the links less
evenly than the first (docs/performance.md measures it), so the later
rounds are the ceiling a shardps worker's steps are held to. The gap
between the two modes is what the dependency costs on these links; the
gap between ``gated`` and shardps sync in ``cluster.py`` is what shardps
itself costs. ``--tcp-cc`` sets every host's TCP congestion control.

Needs CAP_NET_ADMIN, as ``cluster.py`` (exit 77 without it); everything it
makes is removed at exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from cluster_net import HOST_QDISCS, Network, probe  # noqa: E402

PORT = 50061
METHOD = "/exchange.Shard/PushPull"


def serve(workers: int) -> None:
    """A shard host: answer each call per its metadata (``mode``, ``round``, ``chunks``, ``chunk``)."""
    import grpc

    from shardps.common.transport import channel_options

    arrived: dict[str, dict[str, int]] = {}  # round -> worker -> chunks received
    changed: dict[str, asyncio.Condition] = {}

    async def push_pull(requests, context):
        meta = dict(context.invocation_metadata())
        rnd, worker, mode = meta["round"], meta["worker"], meta["mode"]
        chunks, size = int(meta["chunks"]), int(meta["chunk"])
        counts = arrived.setdefault(rnd, {})
        counts[worker] = 0
        cond = changed.setdefault(rnd, asyncio.Condition())

        async def read() -> None:
            async for _ in requests:
                counts[worker] += 1
                async with cond:
                    cond.notify_all()

        reader = asyncio.get_running_loop().create_task(read())
        data = b"x" * size
        for k in range(chunks):
            if mode == "gated":
                async with cond:
                    await cond.wait_for(lambda k=k: len(counts) == workers and min(counts.values()) > k)
            yield data
        await reader

    async def main() -> None:
        server = grpc.aio.server(options=channel_options())
        handler = grpc.method_handlers_generic_handler("exchange.Shard", {
            "PushPull": grpc.stream_stream_rpc_method_handler(push_pull)})
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"0.0.0.0:{PORT}")
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


def exchange(addresses: list[str], worker: int, rnd: str, mode: str, chunks: int, size: int, start_at: float,
             credit: int = 0, rounds: int = 1) -> None:
    """A worker host: ``rounds`` rounds, each one call per shard, all at once; prints each round's seconds.

    The first round starts at ``start_at`` (wall clock, common to every worker host), each later one as soon
    as this host has every answer of the one before, on the same channels (as a shardps worker's rounds).
    ``credit`` > 0: a call sends its next chunk only while at most ``credit`` of its chunks are unanswered."""
    import grpc

    from shardps.common.transport import channel_options

    channels = [grpc.insecure_channel(f"{a}:{PORT}", options=channel_options()) for a in addresses]
    for channel in channels:
        grpc.channel_ready_future(channel).result(timeout=30)
    data = b"x" * size
    if time.time() > start_at:
        raise SystemExit(f"worker host {worker} was ready {time.time() - start_at:.2f} s after the common start")
    time.sleep(start_at - time.time())

    def one(channel, meta: tuple, ends: list[float]) -> None:
        answered = [0]
        more = threading.Condition()

        def frames():
            for k in range(chunks):
                if credit:
                    with more:
                        if not more.wait_for(lambda: answered[0] >= k - credit, timeout=300):
                            raise RuntimeError(f"no answer {k - credit} from a shard within 300 s")
                yield data

        call = channel.stream_stream(METHOD)(frames(), metadata=meta, timeout=300)
        for _ in call:  # blocking reads of the answers
            with more:
                answered[0] += 1
                more.notify_all()
        ends.append(time.time())

    seconds, began = [], start_at
    for j in range(rounds):
        meta = (("round", f"{rnd}-{j}"), ("worker", str(worker)), ("mode", mode), ("chunks", str(chunks)),
                ("chunk", str(size)))
        ends: list[float] = []
        threads = [threading.Thread(target=one, args=(c, meta, ends)) for c in channels]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if len(ends) != len(channels):
            raise SystemExit(f"worker host {worker}: a call of round {j} failed")
        seconds.append(max(ends) - began)
        began = max(ends)
    print(json.dumps({"seconds": seconds}), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--rate-mbit", type=float, default=100.0, help="each host's link, Mbit/s, each direction")
    p.add_argument("--chunk-kib", default="1024,256", help="comma-separated chunk sizes, KiB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--host-qdisc", choices=HOST_QDISCS, default="fifo",
                   help="a host's egress queue: one FIFO, or shared evenly among the hosts it sends to (cluster_net.py)")
    p.add_argument("--credit", default="0", help="comma-separated credits, chunks (0: unbounded): gated runs where a "
                   "worker sends a shard its next chunk only while at most that many of its chunks are unanswered")
    p.add_argument("--rounds", type=int, default=4,
                   help="rounds per run, back to back on the same connections (as a worker's steps); the figure is "
                        "the median round after the first, the first round is reported beside it")
    p.add_argument("--tcp-cc", help="the hosts' TCP congestion control (reno, cubic, bbr; default: what a new "
                   "namespace gets, the root namespace's)")
    p.add_argument("--json", type=Path)
    p.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # internal: a shard host for N workers
    p.add_argument("--client", nargs=9, help=argparse.SUPPRESS)  # internal: a worker host
    args = p.parse_args()
    if args.serve is not None:
        serve(args.serve)
        return 0
    if args.client is not None:
        addresses, worker, rnd, mode, chunks, size, start_at, credit, rounds = args.client
        exchange(addresses.split(","), int(worker), rnd, mode, int(chunks), int(size), float(start_at), int(credit),
                 int(rounds))
        return 0
    try:
        credits = [int(x) for x in args.credit.split(",")]
    except ValueError:
        p.error(f"--credit takes comma-separated whole numbers of chunks, got {args.credit!r}")
    if (args.workers < 1 or args.shards < 1 or args.repeats < 1 or args.rounds < 1 or args.rate_mbit <= 0
            or min(credits) < 0):
        p.error("needs --workers >= 1, --shards >= 1, --repeats >= 1, --rounds >= 1, --rate-mbit > 0, --credit >= 0")
    from cluster import EXIT_NO_NAMESPACES, PARAMS, Cleanup  # the parent only: hosts start faster without torch
    from common import emit, table

    if (reason := probe()) is not None:
        print(f"cluster_exchange.py cannot emulate hosts here: {reason}", file=sys.stderr)
        return EXIT_NO_NAMESPACES
    sizes = [int(x) << 10 for x in args.chunk_kib.split(",")]
    runs_of = [("independent", 0)] + [("gated", c) for c in credits]
    n, s, rate = args.workers, args.shards, args.rate_mbit * 1e6 / 8
    hosts = [f"w{i}" for i in range(n)] + [f"s{j}" for j in range(s)]
    cleanup = Cleanup()
    servers: list[subprocess.Popen] = []
    rows = []
    try:
        cleanup.network = net = Network(hosts, {h: rate * 8 for h in hosts}, host_qdisc=args.host_qdisc,
                                        congestion=args.tcp_cc)
        net.create()
        print(f"{n} worker hosts x {s} shard hosts, {args.rate_mbit:g} Mbit/s links, TCP congestion control "
              f"{net.congestion_in_use}, {args.rounds} rounds per run", flush=True)
        me = [sys.executable, str(Path(__file__).resolve())]
        for j in range(s):
            servers.append(subprocess.Popen([*net.exec_args(f"s{j}"), *me, "--serve", str(n)], stdout=subprocess.PIPE,
                                            text=True))
        for server in servers:
            if server.stdout.readline().strip() != "ready":
                raise RuntimeError("a shard host did not start")
        addresses = ",".join(net.address[f"s{j}"] for j in range(s))
        for size in sizes:
            chunks = -(-PARAMS * 4 // s // size)
            moved = chunks * size * s  # bytes each worker sends (and receives)
            bound = max(moved / rate, n * moved / (s * rate))
            for mode, credit in runs_of:
                firsts, laters = [], []
                for r in range(args.repeats):
                    start_at = time.time() + 3.0
                    clients = [subprocess.Popen([*net.exec_args(f"w{i}"), *me, "--client", addresses, str(i),
                                                 f"{mode}-{size}-{credit}-{r}", mode, str(chunks), str(size),
                                                 str(start_at), str(credit), str(args.rounds)],
                                                stdout=subprocess.PIPE, text=True) for i in range(n)]
                    outs = [c.communicate(timeout=600)[0] for c in clients]
                    if any(c.returncode for c in clients):
                        raise RuntimeError(f"a worker host failed: {outs}")
                    per_host = [json.loads(o.strip().splitlines()[-1])["seconds"] for o in outs]
                    rounds = [max(host[j] for host in per_host) for j in range(args.rounds)]  # the slowest host's
                    firsts.append(rounds[0])
                    laters.extend(rounds[1:])
                first = statistics.median(firsts)
                seconds = statistics.median(laters) if laters else first
                rows.append({"mode": mode, "credit": credit, "chunk_bytes": size, "seconds": seconds,
                             "seconds_rounds": laters, "seconds_first_round": first, "seconds_first_rounds": firsts,
                             "bound_seconds": bound, "fraction_of_bound": bound / seconds,
                             "fraction_of_bound_first_round": bound / first})
                print(f"  {mode}{f', credit {credit}' if credit else ''}, {size >> 10} KiB chunks: {seconds:.2f} s, "
                      f"{bound / seconds:.2f} of the link bound (first round {bound / first:.2f})", flush=True)
    finally:
        for server in servers:
            server.kill()
            server.wait()
        cleanup()
    print(table([[r["mode"], str(r["credit"] or "-"), f"{r['chunk_bytes'] >> 10}", f"{r['seconds']:.2f}",
                  f"{r['bound_seconds']:.2f}", f"{r['fraction_of_bound']:.2f}",
                  f"{r['fraction_of_bound_first_round']:.2f}"] for r in rows],
                ["mode", "credit (chunks)", "chunk KiB", "round s", "link-bound s", "of bound",
                 "of bound, first round"]))
    emit({"workers": n, "shards": s, "rate_mbit": args.rate_mbit, "host_qdisc": args.host_qdisc,
          "tcp_congestion_control": net.congestion_in_use, "rounds": args.rounds, "model_bytes_fp32": PARAMS * 4,
          "repeats": args.repeats, "rows": rows}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

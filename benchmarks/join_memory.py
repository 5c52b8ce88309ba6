"""Join's memory estimate against a real shard's resident memory, at 1, 64 and 256 workers per shard.

    python benchmarks/join_memory.py [--workers 1 64 256] [--elements 1000000] [--optimizer adamw]
                                     [--chunk-bytes 1048576] [--json PATH]

For each worker count N: a fresh ``shardps-server`` process (started cold,
``--min-workers N``), N raw gRPC clients in this process (light asyncio
calls over up to 16 connections, not N worker processes) that join, one
initialises, and all push one sync round of a model of ``--elements`` fp32
elements and pull the result (PushPull) at once. The shard's peak resident
memory (``VmHWM`` of ``/proc/<pid>/status``) is read after the round, and
compared with the estimate Join admits by
(:func:`shardps.server.membership.admission.memory_estimate`, given the
shard's resident memory before the first Join, as the shard measures it
itself). The estimate must be within 20% of the measured peak
(``tests/integration/test_join_memory.py`` runs 1 and 64).
"""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc  # noqa: E402
import torch  # noqa: E402
from common import emit, parser, table  # noqa: E402

from shardps.proto import shardps_pb2 as pb  # noqa: E402
from shardps.common.codec import encode_chunk, encode_control, encode_round  # noqa: E402
from shardps.common.optim import optimizer_spec  # noqa: E402
from shardps.common.plan import KeyInfo, PartitionPlan  # noqa: E402
from shardps.server.dense.optimizer import ShardOptimizer  # noqa: E402
from shardps.server.membership.admission import memory_estimate  # noqa: E402

PATH = "/shardps.v1.Shard/"
REPO = Path(__file__).resolve().parents[1]
OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.01),
    "momentum": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
}


def status_bytes(pid: int, field: str) -> int:
    """``field`` (``VmRSS``, ``VmHWM``) of ``/proc/<pid>/status``, bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def settled_rss(pid: int, timeout: float = 30.0) -> int:
    """``VmRSS`` of ``pid`` once it stopped changing for a second (the shard's warm-up done), bytes."""
    deadline, last, since = time.monotonic() + timeout, -1, time.monotonic()
    while time.monotonic() < deadline:
        rss = status_bytes(pid, "VmRSS")
        if rss != last:
            last, since = rss, time.monotonic()
        elif time.monotonic() - since >= 1.0:
            break
        time.sleep(0.1)
    return last


def start_shard(workers: int) -> tuple[subprocess.Popen, str]:
    """A cold ``shardps-server`` for ``workers`` workers on a free port; (process, address)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardps.cli.server", "--shard-index", "0", "--num-shards", "1", "--port", "0",
         "--min-workers", str(workers), "--max-workers", str(max(workers, 1)), "--lease-seconds", "300",
         "--max-streams-per-peer", str(4 * workers + 64), "--threads", "1", "--log-level", "WARNING"],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        if "listening on" in line:
            return proc, line.rsplit(" ", 1)[1].strip()
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError("the shard did not start")


async def one_round(address: str, workers: int, plan: PartitionPlan, spec: pb.OptimizerSpec) -> None:
    """``workers`` clients join, the first initialises, all push round 0 and pull version 1 at once."""
    channels = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1),
                                                            ("grpc.max_receive_message_length", 64 << 20),
                                                            ("grpc.max_send_message_length", 64 << 20)])
                for _ in range(min(workers, 16))]
    ids = [(f"w{i:04d}", uuid.uuid4().hex, channels[i % len(channels)]) for i in range(workers)]
    chunks = list(plan.shard_chunks(0))

    def frames(version: int, fill: float) -> list[bytes]:  # shared by every worker: the payload is the same
        return [encode_chunk(c.key, c.offset, torch.full((c.numel,), fill), version) for c in chunks]

    try:
        for worker_id, session, channel in ids:  # one at a time, as the memory check runs at each Join
            request = pb.JoinRequest(worker_id=worker_id, session=session, plan=plan.to_proto(),
                                     plan_fingerprint=plan.fingerprint, optimizer=spec)
            reply = pb.JoinReply.FromString(await channel.unary_unary(PATH + "Join")(request.SerializeToString(),
                                                                                     timeout=60))
            if reply.initialise:
                header = pb.RoundHeader(worker_id=worker_id, session=session, plan_fingerprint=plan.fingerprint)
                await channel.stream_unary(PATH + "Init")(iter([encode_round(header), *frames(0, 0.5)]), timeout=120)
        gradient = frames(0, 0.01)
        trailer = encode_control(trailer=pb.RoundTrailer(lrs=[1e-3]))

        async def push_pull(worker_id: str, session: str, channel) -> int:
            header = pb.RoundHeader(worker_id=worker_id, session=session, round=0, plan_fingerprint=plan.fingerprint)
            received = 0
            async for raw in channel.stream_stream(PATH + "PushPull")(iter([encode_round(header), *gradient, trailer]),
                                                                      timeout=600):
                received += len(raw)
            return received

        got = await asyncio.gather(*(push_pull(*w) for w in ids))
        assert min(got) >= 4 * sum(c.numel for c in chunks), got
    finally:
        for channel in channels:
            await channel.close()


def measure(workers: int, elements: int, optimizer: str, chunk_bytes: int) -> dict:
    """One shard, ``workers`` workers, one round: its memory before, after, at peak, and Join's estimate."""
    plan = PartitionPlan.build([KeyInfo("w", (elements,), 0)], num_shards=1, chunk_bytes=chunk_bytes)
    spec = optimizer_spec(OPTIMIZERS[optimizer]([torch.nn.Parameter(torch.zeros(1))]))
    proc, address = start_shard(workers)
    try:
        baseline = settled_rss(proc.pid)  # what the shard measures of itself at the first Join
        asyncio.run(one_round(address, workers, plan, spec))
        peak, after = status_bytes(proc.pid, "VmHWM"), status_bytes(proc.pid, "VmRSS")
    finally:
        proc.terminate()
        proc.wait(30)
    estimate = memory_estimate(baseline, elements, ShardOptimizer.trial(spec), workers, chunk_bytes)
    return {"workers": workers, "elements": elements, "optimizer": optimizer, "chunk_bytes": chunk_bytes,
            "baseline_bytes": baseline, "peak_bytes": peak, "after_bytes": after, "estimate_bytes": estimate,
            "estimate_over_peak": estimate / peak}


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--elements", type=int, default=1_000_000, help="fp32 elements of the model (default 1 M)")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw")
    p.add_argument("--chunk-bytes", type=int, default=1 << 20)
    args = p.parse_args()
    runs = [measure(n, args.elements, args.optimizer, args.chunk_bytes) for n in args.workers]
    mib = 1 << 20
    print(table([[r["workers"], f"{r['baseline_bytes'] / mib:.0f}", f"{r['peak_bytes'] / mib:.0f}",
                  f"{r['estimate_bytes'] / mib:.0f}", f"{r['estimate_over_peak']:.2f}"] for r in runs],
                ["workers", "RSS at start MiB", "peak RSS MiB", "estimate MiB", "estimate / peak"]))
    emit({"runs": runs}, args.json)
    bad = [r["workers"] for r in runs if not math.isclose(r["estimate_bytes"], r["peak_bytes"], rel_tol=0.2)]
    if bad:
        print(f"the estimate is not within 20% of the peak at {bad} workers")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

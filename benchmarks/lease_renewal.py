"""What renewing a member's lease on every frame of its push costs the shard, per frame.

    python benchmarks/lease_renewal.py [--json PATH] [--repeats 21] [--frames 20000]

A shard renews a member's lease as each frame of its request streams
arrives (``Membership.renewing``: one float set from the monotonic clock,
on the event loop, no lock). Measured on one event loop in this process:

- ``bare``: the renewal alone, over ``--frames`` one-byte frames from an
  async generator, with and without the renewal (ns per frame added);
- ``receive``: a shard's receiving of a push as it runs it
  (``Receiver.read_push`` over the encoded chunk frames of a 64 MB
  partition and their trailer), with and without the renewal, at 64 KiB and
  1 MiB chunks (the cluster benchmark's and the default ``chunk_bytes``):
  time per frame, the time the renewal adds, and that as a share of it.

Each figure is the median of ``--repeats`` runs, the two variants alternating.
On the 2-core machine: 0.22-0.45 us added per frame (bare), against 14 us
per 64 KiB frame and 55-65 us per 1 MiB frame received; the receive rows'
difference is within their run-to-run noise (a few %)
(``benchmarks/results/lease_renewal.json``).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import emit, parser, table  # noqa: E402

from shardps.common.codec import encode_chunk, encode_control  # noqa: E402
from shardps.common.plan import KeyInfo, PartitionPlan  # noqa: E402
from shardps.proto import shardps_pb2 as pb  # noqa: E402
from shardps.server.dense.chunks import ChunkTable  # noqa: E402
from shardps.server.membership.members import Membership  # noqa: E402

ELEMENTS = 16 << 20  # 64 MB of fp32 gradient on the one shard


async def frames_of(items: list[bytes]):
    for item in items:
        yield item


async def bare(members: Membership, count: int, renew: bool) -> float:
    """Seconds per frame to iterate ``count`` one-byte frames (through the renewal if ``renew``)."""
    member = members.get("w0", "s")
    stream = frames_of([b"x"] * count)
    began = time.perf_counter()
    async for _ in (members.renewing(member, stream) if renew else stream):
        pass
    return (time.perf_counter() - began) / count


async def receive(members: Membership, table: ChunkTable, staging: dict, frames: list[bytes], renew: bool) -> float:
    """Seconds per frame for a shard's receiver to read one push into ``staging`` (through the renewal if
    ``renew``)."""
    member = members.get("w0", "s")
    rx = table.receiver(0, staging, None, what="push", keep=True, reject_nonfinite=True)
    stream = frames_of(frames)
    began = time.perf_counter()
    await rx.read_push(members.renewing(member, stream) if renew else stream)
    return (time.perf_counter() - began) / len(frames)


def paired(repeats: int, run) -> tuple[float, float]:
    """Median seconds without and with the renewal, alternating ``run(renew)``, after one warm-up of each."""
    run(False), run(True)
    without, with_ = [], []
    for _ in range(repeats):
        without.append(run(False))
        with_.append(run(True))
    return statistics.median(without), statistics.median(with_)


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--frames", type=int, default=20000)
    args = p.parse_args()
    torch.set_num_threads(1)
    members = Membership(4, lease_seconds=10.0)
    members.admit("w0", "s")
    loop = asyncio.new_event_loop()
    rows, out = [], {"repeats": args.repeats, "frames": args.frames}
    b0, b1 = paired(args.repeats, lambda renew: loop.run_until_complete(bare(members, args.frames, renew)))
    out["bare_ns_per_frame"] = {"without": 1e9 * b0, "with": 1e9 * b1, "added": 1e9 * (b1 - b0)}
    rows.append(["bare (1-byte frames)", f"{1e9 * b0:.0f}", f"{1e9 * b1:.0f}", f"{1e9 * (b1 - b0):.0f}", "-"])
    out["receive"] = {}
    for chunk_bytes in (64 << 10, 1 << 20):
        plan = PartitionPlan.build([KeyInfo("w", (ELEMENTS,), 0)], num_shards=1, chunk_bytes=chunk_bytes)
        table_ = ChunkTable(plan, 0)
        g = torch.randn(ELEMENTS)
        frames = [encode_chunk(c.key, c.offset, g[c.offset:c.offset + c.numel], 0) for c in table_.chunks]
        frames.append(encode_control(trailer=pb.RoundTrailer(lrs=[0.1])))
        staging = table_.allocate()
        r0, r1 = paired(args.repeats, lambda renew: loop.run_until_complete(
            receive(members, table_, staging, frames, renew)))
        share = (r1 - r0) / r0
        out["receive"][str(chunk_bytes)] = {"frames": len(frames), "us_per_frame_without": 1e6 * r0,
                                            "us_per_frame_with": 1e6 * r1, "ns_added": 1e9 * (r1 - r0),
                                            "share_added": share}
        rows.append([f"receive, {chunk_bytes >> 10} KiB chunks ({len(frames)} frames)", f"{1e9 * r0:.0f}",
                     f"{1e9 * r1:.0f}", f"{1e9 * (r1 - r0):.0f}", f"{100 * share:+.2f}%"])
    loop.run_until_complete(loop.shutdown_asyncgens())  # the frames after each trailer are never read
    loop.close()
    print(table(rows, ["per frame", "ns without", "ns with renewal", "ns added", "share"]))
    emit(out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

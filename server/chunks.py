"""One shard's chunk table: validates incoming chunk frames and writes them into flat buffers.

Knows the partition plan and the codec, nothing of gRPC or of rounds.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator

import torch

from shardps.proto.codec import FrameError, copy_payload, decode_frame, encode_chunk
from shardps.proto.plan import Chunk, PartitionPlan
from shardps.server.checks import shown
from shardps.server.errors import InvalidArgument


class ChunkTable:
    """The chunks of ``plan`` held by shard ``shard_index`` and their places in its flat buffers.

    Flat buffers are ``dict[group index, 1-D float32 tensor]`` with
    ``group_sizes[group]`` elements each. Built in O(chunks).
    """

    def __init__(self, plan: PartitionPlan, shard_index: int) -> None:
        self.plan = plan
        self.shard_index = shard_index
        self.chunks: list[Chunk] = plan.shard_chunks(shard_index)
        self._local = {(c.key, c.offset): i for i, c in enumerate(self.chunks)}
        self._shard_of = {(c.key, c.offset): c.shard for c in plan.chunks}
        self._keys = {k.key for k in plan.keys}
        self._by_group: dict[int, list[Chunk]] = {}
        for c in self.chunks:  # plan order: shard offsets grow within each group
            if c.numel:
                self._by_group.setdefault(c.group, []).append(c)
        self.group_sizes = {g: sum(c.numel for c in cs) for g, cs in sorted(self._by_group.items())}
        self._starts = {g: [c.shard_offset for c in cs] for g, cs in self._by_group.items()}

    @property
    def numel(self) -> int:
        return sum(self.group_sizes.values())

    def allocate(self) -> dict[int, torch.Tensor]:
        """Fresh uninitialised fp32 buffers, one per param group this shard holds elements of."""
        return {g: torch.empty(n, dtype=torch.float32) for g, n in self.group_sizes.items()}

    def view(self, buffers: dict[int, torch.Tensor], chunk: Chunk) -> torch.Tensor:
        """The 1-D slice of ``buffers`` that holds ``chunk`` (a view, no copy)."""
        return buffers[chunk.group][chunk.shard_offset : chunk.shard_offset + chunk.numel]

    def describe(self, group: int, start: int) -> str:
        """Name the parameter element at ``start`` of this shard's flat buffer of ``group``."""
        starts = self._starts.get(group)
        if not starts:
            return f"param group {group}"
        c = self._by_group[group][max(0, bisect.bisect_right(starts, start) - 1)]
        return f"key {c.key!r} (from element {c.offset + start - c.shard_offset})"

    def _locate(self, key: str, offset: int, numel: int) -> int:
        index = self._local.get((key, offset))
        if index is None:
            if key not in self._keys:
                sample = ", ".join(repr(k.key) for k in self.plan.keys[:5])
                raise InvalidArgument(
                    f"unknown key {shown(key)}: the partition plan has no such parameter (keys include {sample})"
                )
            shard = self._shard_of.get((key, offset))
            if shard is None:
                raise InvalidArgument(
                    f"key {key!r} has no chunk starting at element {offset}; chunks are "
                    f"{self.plan.chunk_bytes // 4} elements long"
                )
            raise InvalidArgument(
                f"chunk of key {key!r} at element {offset} belongs to shard {shard}, not shard {self.shard_index}"
            )
        chunk = self.chunks[index]
        if numel != chunk.numel:
            raise InvalidArgument(
                f"chunk of key {key!r} at element {offset} has {numel} elements; the partition plan says {chunk.numel}"
            )
        return index

    def receiver(
        self, version: int, into: dict[int, torch.Tensor], *, what: str, reject_nonfinite: bool = False
    ) -> "Receiver":
        """A :class:`Receiver` that writes one stream's chunks of ``version`` into ``into``."""
        return Receiver(self, version, into, what=what, reject_nonfinite=reject_nonfinite)

    def frames(
        self, buffers: dict[int, torch.Tensor], version: int, dtype: torch.dtype, check: Callable[[], None]
    ) -> Iterator[bytes]:
        """Encode every chunk of ``buffers`` as a pull frame tagged ``version``.

        ``check()`` runs before each chunk is copied into its frame and raises
        if the buffers moved on; callers run this on the one thread that
        changes the buffers' version, so every frame is a consistent copy of
        one version.
        """
        for c in self.chunks:
            check()
            src = self.view(buffers, c)
            yield encode_chunk(c.key, c.offset, src if dtype == torch.float32 else src.to(dtype), version)


class Receiver:
    """Decodes the chunk frames of one stream into flat buffers, one frame at a time.

    Each chunk of this shard must arrive exactly once, carry ``version`` and
    match the plan in key, offset, size and dtype. With ``reject_nonfinite``,
    a chunk holding NaN or Inf is rejected as it arrives (a cache-hot ``sum``
    per chunk; the exact ``isfinite`` test only when that sum is not finite).
    On error ``into`` may hold part of the stream: callers stage into
    buffers of their own and discard them on error.
    """

    def __init__(
        self, table: ChunkTable, version: int, into: dict[int, torch.Tensor], *, what: str, reject_nonfinite: bool
    ) -> None:
        self.table, self.version, self.into, self.what = table, version, into, what
        self.reject_nonfinite = reject_nonfinite
        self.seen = bytearray(len(table.chunks))
        self.received = 0

    def add(self, raw: bytes) -> None:
        """Decode one frame into its place.

        Raises:
            InvalidArgument: a malformed frame, an unknown or repeated chunk,
                a wrong version, size or dtype, or (with ``reject_nonfinite``) NaN/Inf.
        """
        what = self.what
        try:
            frame = decode_frame(raw)
            if frame.header is None:
                raise InvalidArgument(f"{what}: a round header may only be the first frame of a stream")
            h = frame.header
            index = self.table._locate(h.key, h.offset, h.numel)
            if h.version != self.version:
                raise InvalidArgument(
                    f"{what}: chunk of key {h.key!r} is tagged version {h.version}, expected {self.version}"
                )
            if self.seen[index]:
                raise InvalidArgument(f"{what}: chunk of key {h.key!r} at element {h.offset} was sent twice")
            dst = self.table.view(self.into, self.table.chunks[index])
            copy_payload(h, frame.payload, dst)
        except FrameError as exc:
            raise InvalidArgument(f"{what}: {exc}") from None
        if self.reject_nonfinite and not math.isfinite(dst.sum().item()) and not bool(torch.isfinite(dst).all()):
            raise InvalidArgument(
                f"{what}: values of key {h.key!r} (elements {h.offset}..{h.offset + h.numel}) hold NaN or Inf"
            )
        self.seen[index] = 1
        self.received += len(frame.payload)

    def finish(self) -> int:
        """Check that every chunk arrived; returns the payload bytes received.

        Raises:
            InvalidArgument: chunks are missing (the message names the first).
        """
        missing = [c for c, s in zip(self.table.chunks, self.seen) if not s]
        if missing:
            first = missing[0]
            raise InvalidArgument(
                f"{self.what}: {len(missing)} of {len(self.table.chunks)} chunks missing "
                f"(first: key {first.key!r} at element {first.offset}); send every chunk of this shard"
            )
        return self.received

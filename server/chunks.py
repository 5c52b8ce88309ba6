"""One shard's chunk table: validates incoming chunk frames and writes them into flat buffers.

Knows the partition plan and the codec, nothing of gRPC or of rounds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from threading import Condition

import torch

from shardps.proto.codec import FrameError, decode_frame, encode_chunk, payload_tensor
from shardps.proto.plan import Chunk, PartitionPlan
from shardps.server.errors import InvalidArgument

MAX_KEY_CHARS = 1024


class ChunkTable:
    """The chunks of ``plan`` held by shard ``shard_index`` and their places in its flat buffers.

    Flat buffers are ``dict[group index, 1-D float32 tensor]`` with
    ``plan.group_numel(shard_index, group)`` elements each.
    """

    def __init__(self, plan: PartitionPlan, shard_index: int) -> None:
        self.plan = plan
        self.shard_index = shard_index
        self.chunks: list[Chunk] = plan.shard_chunks(shard_index)
        self._local = {(c.key, c.offset): i for i, c in enumerate(self.chunks)}
        self._all = {(c.key, c.offset): c for c in plan.chunks}
        self._keys = {k.key for k in plan.keys}
        self.group_sizes = {
            g: n for g in range(plan.num_groups) if (n := plan.group_numel(shard_index, g)) > 0
        }

    @property
    def numel(self) -> int:
        return sum(self.group_sizes.values())

    def allocate(self) -> dict[int, torch.Tensor]:
        """Fresh zero fp32 buffers, one per param group this shard holds elements of."""
        return {g: torch.zeros(n, dtype=torch.float32) for g, n in self.group_sizes.items()}

    def view(self, buffers: dict[int, torch.Tensor], chunk: Chunk) -> torch.Tensor:
        """The 1-D slice of ``buffers`` that holds ``chunk`` (a view, no copy)."""
        return buffers[chunk.group][chunk.shard_offset : chunk.shard_offset + chunk.numel]

    def _locate(self, key: str, offset: int, numel: int) -> int:
        index = self._local.get((key, offset))
        if index is None:
            if len(key) > MAX_KEY_CHARS:
                raise InvalidArgument(f"key of {len(key)} characters is longer than {MAX_KEY_CHARS}")
            if key not in self._keys:
                sample = ", ".join(repr(k.key) for k in self.plan.keys[:5])
                raise InvalidArgument(
                    f"unknown key {key!r}: the partition plan has no such parameter (keys include {sample})"
                )
            other = self._all.get((key, offset))
            if other is None:
                raise InvalidArgument(
                    f"key {key!r} has no chunk starting at element {offset}; chunks are "
                    f"{self.plan.chunk_bytes // 4} elements long"
                )
            raise InvalidArgument(
                f"chunk of key {key!r} at element {offset} belongs to shard {other.shard}, not shard {self.shard_index}"
            )
        chunk = self.chunks[index]
        if numel != chunk.numel:
            raise InvalidArgument(
                f"chunk of key {key!r} at element {offset} has {numel} elements; the partition plan says {chunk.numel}"
            )
        return index

    def receive(
        self,
        raw_frames: Iterable[bytes],
        version: int,
        into: dict[int, torch.Tensor],
        *,
        what: str,
        reject_nonfinite: bool = False,
    ) -> int:
        """Decode every chunk frame of one stream into ``into``.

        Each chunk of this shard must arrive exactly once, carry ``version``
        and match the plan in key, offset, size and dtype. Blocks reading
        ``raw_frames`` (the network).

        Returns:
            Payload bytes received.

        With ``reject_nonfinite``, a chunk holding NaN or Inf is rejected as it
        arrives (a cache-hot ``sum`` per chunk; the exact ``isfinite`` test runs
        only when that sum is not finite).

        Raises:
            InvalidArgument: the first bad frame, or chunks missing at the end
                (``what`` names the stream in the message). ``into`` may then hold
                part of the stream; callers stage it and discard it on error.
        """
        seen = bytearray(len(self.chunks))
        received = 0
        for raw in raw_frames:
            try:
                frame = decode_frame(raw)
                if frame.header is None:
                    raise InvalidArgument(f"{what}: a round header may only be the first frame of a stream")
                h = frame.header
                index = self._locate(h.key, h.offset, h.numel)
                if h.version != version:
                    raise InvalidArgument(f"{what}: chunk of key {h.key!r} is tagged version {h.version}, expected {version}")
                values = payload_tensor(h, frame.payload)
            except FrameError as exc:
                raise InvalidArgument(f"{what}: {exc}") from exc
            if seen[index]:
                raise InvalidArgument(f"{what}: chunk of key {h.key!r} at element {h.offset} was sent twice")
            seen[index] = 1
            dst = self.view(into, self.chunks[index])
            dst.copy_(values)
            if reject_nonfinite and not math.isfinite(dst.sum().item()) and not bool(torch.isfinite(dst).all()):
                raise InvalidArgument(
                    f"{what}: gradient of key {h.key!r} (elements {h.offset}..{h.offset + h.numel}) holds NaN or Inf"
                )
            received += len(frame.payload)
        missing = [c for c, s in zip(self.chunks, seen) if not s]
        if missing:
            first = missing[0]
            raise InvalidArgument(
                f"{what}: {len(missing)} of {len(self.chunks)} chunks missing "
                f"(first: key {first.key!r} at element {first.offset}); send every chunk of this shard"
            )
        return received

    def frames(
        self, buffers: dict[int, torch.Tensor], version: int, dtype: torch.dtype, lock: Condition, check
    ) -> Iterator[bytes]:
        """Encode every chunk of ``buffers`` as a pull frame tagged ``version``.

        Each chunk is copied into its frame while holding ``lock``, after
        ``check()`` (which raises if the buffers moved on) - so every frame
        is a consistent copy of one version.
        """
        for c in self.chunks:
            with lock:
                check()
                src = self.view(buffers, c)
                frame = encode_chunk(c.key, c.offset, src if dtype == torch.float32 else src.to(dtype), version)
            yield frame

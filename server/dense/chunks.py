"""One shard's chunk table: validates incoming chunk frames and writes them into flat buffers.

Parameters and gradients live in one flat fp32 buffer per param group;
buffers (BatchNorm statistics, counters) in a byte arena, each chunk in its
own dtype. Knows the partition plan and the codec, nothing of gRPC or of
rounds.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Collection, Iterator

import torch

from shardps.proto import shardps_pb2 as pb
from shardps.common.codec import TORCH_DTYPES, DecodedFrame, FrameError, copy_payload, encode_chunk, payload_view
from shardps.common.plan import Chunk, PartitionPlan
from shardps.server.dense.bounds import grad_bound
from shardps.server.checks import decode, shown
from shardps.server.errors import InvalidArgument


class ChunkTable:
    """The chunks of ``plan`` held by shard ``shard_index`` and their places in its buffers.

    Flat buffers are ``dict[group index, 1-D float32 tensor]`` with
    ``group_sizes[group]`` elements each; the buffer arena is a 1-D uint8
    tensor of ``buffer_bytes``. Built in O(chunks).
    """

    def __init__(self, plan: PartitionPlan, shard_index: int) -> None:
        self.plan = plan
        self.shard_index = shard_index
        self.chunks: list[Chunk] = plan.shard_chunks(shard_index)
        self.buffer_chunks: list[Chunk] = plan.shard_buffer_chunks(shard_index)
        self._local = {(c.key, c.offset): i for i, c in enumerate(self.chunks)}
        self._local_buffers = {(c.key, c.offset): i for i, c in enumerate(self.buffer_chunks)}
        self._shard_of = {(c.key, c.offset): c.shard for c in (*plan.chunks, *plan.buffer_chunks)}
        self._keys = {k.key for k in (*plan.keys, *plan.buffers)}
        self._by_group: dict[int, list[Chunk]] = {}
        self.chunks_of_key: dict[int, list[int]] = {}
        for i, c in enumerate(self.chunks):  # plan order: shard offsets grow within each group
            self._by_group.setdefault(c.group, []).append(c)
            self.chunks_of_key.setdefault(c.key_index, []).append(i)
        self.group_sizes = {g: sum(c.numel for c in cs) for g, cs in sorted(self._by_group.items())}
        self.key_slices = plan.key_slices(shard_index)
        self.buffer_bytes = max((c.shard_offset + c.numel * TORCH_DTYPES[c.dtype].itemsize
                                 for c in self.buffer_chunks), default=0)

    def units(self) -> dict[int, tuple[int, int, int, int]]:
        """``{chunk index: (key index, group, start, end)}``: the optimizer's units, one per parameter chunk."""
        return {i: (c.key_index, c.group, c.shard_offset, c.shard_offset + c.numel) for i, c in enumerate(self.chunks)}

    @property
    def numel(self) -> int:
        return sum(self.group_sizes.values())

    def allocate(self) -> dict[int, torch.Tensor]:
        """Fresh uninitialised fp32 buffers, one per param group this shard holds elements of."""
        return {g: torch.empty(n, dtype=torch.float32) for g, n in self.group_sizes.items()}

    def allocate_buffers(self) -> torch.Tensor:
        """A fresh zeroed byte arena for this shard's buffer chunks."""
        return torch.zeros(self.buffer_bytes, dtype=torch.uint8)

    def view(self, buffers: dict[int, torch.Tensor], chunk: Chunk) -> torch.Tensor:
        """The 1-D slice of ``buffers`` that holds ``chunk`` (a view, no copy)."""
        return buffers[chunk.group][chunk.shard_offset : chunk.shard_offset + chunk.numel]

    def buffer_view(self, arena: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        """The elements of buffer ``chunk`` in ``arena``, in the buffer's dtype (a view, no copy)."""
        dtype = TORCH_DTYPES[chunk.dtype]
        return arena[chunk.shard_offset : chunk.shard_offset + chunk.numel * dtype.itemsize].view(dtype)

    def describe(self, key: int) -> str:
        """Name a parameter by its plan index."""
        return f"key {self.plan.keys[key].key!r}" if 0 <= key < len(self.plan.keys) else f"key index {key}"

    def locate(self, key: str, offset: int, numel: int) -> tuple[bool, int]:
        """Where the chunk of ``key`` at element ``offset`` goes: ``(is_buffer, index)``.

        ``index`` is into :attr:`buffer_chunks` if ``is_buffer`` else into :attr:`chunks`.

        Raises:
            InvalidArgument: an unknown key, an offset where no chunk starts, a chunk
                of another shard, or ``numel`` other than the plan's (the message says which).
        """
        index = self._local.get((key, offset))
        is_buffer = index is None and (key, offset) in self._local_buffers
        if is_buffer:
            index = self._local_buffers[(key, offset)]
        if index is None:
            if key not in self._keys:
                sample = ", ".join(repr(k.key) for k in self.plan.keys[:5])
                raise InvalidArgument(
                    f"unknown key {shown(key)}: the partition plan has no such parameter or buffer "
                    f"(keys include {sample})"
                )
            shard = self._shard_of.get((key, offset))
            if shard is None:
                raise InvalidArgument(f"key {key!r} has no chunk starting at element {offset}")
            raise InvalidArgument(
                f"chunk of key {key!r} at element {offset} belongs to shard {shard}, not shard {self.shard_index}"
            )
        chunk = (self.buffer_chunks if is_buffer else self.chunks)[index]
        if numel != chunk.numel:
            raise InvalidArgument(
                f"chunk of key {key!r} at element {offset} has {numel} elements; the partition plan says {chunk.numel}"
            )
        return is_buffer, index

    def receiver(
        self, version: int, into: dict[int, torch.Tensor], buffers_into: torch.Tensor | None, *, what: str,
        reject_nonfinite: bool = False, keep: bool = False,
    ) -> "Receiver":
        """A :class:`Receiver` that writes one stream's chunks of ``version`` into ``into`` (and ``buffers_into``);
        ``keep``: float32 parameter chunks stay where they arrived instead (:attr:`Receiver.kept`)."""
        return Receiver(self, version, into, buffers_into, what=what, reject_nonfinite=reject_nonfinite, keep=keep)

    def frames(
        self, buffers: dict[int, torch.Tensor], arena: torch.Tensor, version: int, dtype: torch.dtype,
        check: Callable[[], None],
    ) -> Iterator[bytes]:
        """Encode every parameter chunk (in ``dtype``), then every buffer chunk, as pull frames of ``version``.

        ``check()`` runs before each chunk is copied into its frame and raises
        if the buffers moved on; callers run this on the one thread that
        changes the buffers' version, so every frame is a consistent copy of
        one version.
        """
        for c in self.chunks:
            check()
            src = self.view(buffers, c)
            yield encode_chunk(c.key, c.offset, src if dtype == torch.float32 else src.to(dtype), version)
        for c in self.buffer_chunks:
            check()
            yield encode_chunk(c.key, c.offset, self.buffer_view(arena, c), version)


class Receiver:
    """Decodes the chunk frames of one stream into flat buffers, one frame at a time.

    Each chunk of this shard must arrive exactly once (parameters of keys
    declared absent: never), carry ``version`` and match the plan in key,
    offset, size and dtype (a buffer's chunks: exactly the buffer's dtype).
    With ``reject_nonfinite``, a parameter chunk holding NaN or Inf is
    rejected as it arrives (a cache-hot ``sum`` per chunk; the exact
    ``isfinite`` test only when that sum is not finite). On error ``into`` may
    hold part of the stream: callers stage into buffers of their own and
    discard them on error.

    With ``keep``, a float32 parameter chunk whose payload is aligned (every
    chunk of a shardps worker) is not copied into ``into``: :attr:`kept`
    holds it as a read-only tensor over the received frame, and the caller
    reads the gradient from there (one pass over the chunk less).
    """

    def __init__(
        self, table: ChunkTable, version: int, into: dict[int, torch.Tensor], buffers_into: torch.Tensor | None, *,
        what: str, reject_nonfinite: bool, keep: bool = False,
    ) -> None:
        self.table, self.version, self.into, self.buffers_into, self.what = table, version, into, buffers_into, what
        self.reject_nonfinite, self.keep = reject_nonfinite, keep
        #: with ``keep``: ``{index into table.chunks: 1-D float32 tensor over the received payload}`` (read-only;
        #: its slice of ``into`` was not written)
        self.kept: dict[int, torch.Tensor] = {}
        #: with ``reject_nonfinite``: an upper bound on |g| over every chunk received (bounds.grad_bound)
        self.grad_bound = 0.0
        self.seen = bytearray(len(table.chunks))
        self.seen_buffers = bytearray(len(table.buffer_chunks))
        self.received = 0
        #: the last chunk added: ``(is_buffer, index)`` (index into ``table.chunks`` or ``table.buffer_chunks``)
        self.last: tuple[bool, int] | None = None
        #: with ``reject_nonfinite``: the bound of each parameter chunk received (0 for the others)
        self.chunk_bounds = [0.0] * len(table.chunks)

    def add(self, raw: bytes) -> DecodedFrame:
        """Decode one frame; a chunk goes into its place, a control message is returned to the caller.

        Raises:
            InvalidArgument: a malformed frame, an unknown or repeated chunk,
                a wrong version, size or dtype, or (with ``reject_nonfinite``) NaN/Inf.
        """
        frame = decode(raw, self.what)
        if frame.header is not None:
            self.add_chunk(frame)
        return frame

    def add_chunk(self, frame: DecodedFrame) -> None:
        what, h = self.what, frame.header
        is_buffer, index = self.table.locate(h.key, h.offset, h.numel)
        if h.version != self.version:
            raise InvalidArgument(f"{what}: chunk of key {h.key!r} is tagged version {h.version}, expected {self.version}")
        seen = self.seen_buffers if is_buffer else self.seen
        if seen[index]:
            raise InvalidArgument(f"{what}: chunk of key {h.key!r} at element {h.offset} was sent twice")
        try:
            if is_buffer:
                chunk = self.table.buffer_chunks[index]
                if self.buffers_into is None:
                    raise InvalidArgument(f"{what}: buffer {h.key!r} has no place in this stream")
                if h.dtype != chunk.dtype:
                    raise InvalidArgument(f"{what}: buffer {h.key!r} is sent as dtype {h.dtype}, "
                                          f"the plan says {chunk.dtype}")
                copy_payload(h, frame.payload, self.table.buffer_view(self.buffers_into, chunk))
            else:
                if h.dtype not in (1, 2, 3):  # FLOAT32, BFLOAT16, FLOAT16
                    raise InvalidArgument(f"{what}: chunk of key {h.key!r} has dtype {h.dtype}; parameters and "
                                          "gradients travel as FLOAT32, BFLOAT16 or FLOAT16")
                dst = view = payload_view(h, frame.payload) if self.keep else None
                if view is None:
                    dst = self.table.view(self.into, self.table.chunks[index])
                    copy_payload(h, frame.payload, dst)
                # one pass while the chunk is in cache: the bound the update's finite proof starts from
                bound = grad_bound((dst,)) if self.reject_nonfinite else 0.0
                self.grad_bound = max(self.grad_bound, bound)
                self.chunk_bounds[index] = bound
                if self.reject_nonfinite and not math.isfinite(bound) and not bool(torch.isfinite(dst).all()):
                    raise InvalidArgument(
                        f"{what}: values of key {h.key!r} (elements {h.offset}..{h.offset + h.numel}) hold NaN or Inf"
                    )
                if view is not None:
                    self.kept[index] = view
        except FrameError as exc:
            raise InvalidArgument(f"{what}: {exc}") from None
        seen[index] = 1
        self.last = (is_buffer, index)
        self.received += len(frame.payload)

    async def read_push(self, frames: AsyncIterator[bytes],
                        on_chunk: Callable[[bool, int], None] | None = None) -> pb.RoundTrailer:
        """Add every chunk frame of a push stream up to its trailer; ``on_chunk(is_buffer, index)`` after each.

        Returns:
            The push's trailer (the frames after it are not read).

        Raises:
            InvalidArgument: what :meth:`add` raises; a control frame other than the trailer; a stream that
                ends without its trailer.
        """
        async for raw in frames:
            frame = self.add(raw)
            if frame.trailer is not None:
                return frame.trailer
            if frame.header is None:
                raise InvalidArgument(f"{self.what}: only chunks and then a RoundTrailer may follow the round header")
            if on_chunk is not None:
                on_chunk(*self.last)
        raise InvalidArgument(f"{self.what}: the stream ended without its RoundTrailer")

    def absent_chunks(self, absent: Collection[int]) -> set[int]:
        """Indices into ``table.chunks`` of the keys in ``absent`` (plan indices; unknown ones are ignored)."""
        return {i for k in absent for i in self.table.chunks_of_key.get(k, ())}

    def finish(self, absent: Collection[int] = ()) -> int:
        """Check that every expected chunk arrived; zero the slices of ``absent`` keys.

        Args:
            absent: plan indices of keys without a gradient in this stream: their
                chunks must not have been sent, and their slices of ``into``
                become zeros (they count as zero in the round's average).

        Returns:
            Payload bytes received.

        Raises:
            InvalidArgument: chunks missing, chunks of an absent key sent, or an absent
                index that is not a key of the plan.
        """
        chunks = self.table.chunks
        absent_local = set()
        for k in absent:
            if not 0 <= k < len(self.table.plan.keys):
                raise InvalidArgument(f"{self.what}: absent key index {k} is not a key of the plan")
            absent_local.update(self.table.chunks_of_key.get(k, ()))
        for i in absent_local:
            if self.seen[i]:
                raise InvalidArgument(f"{self.what}: key {chunks[i].key!r} was sent but the trailer says it has no "
                                      "gradient")
            self.table.view(self.into, chunks[i]).zero_()
        missing = [c for i, (c, s) in enumerate(zip(chunks, self.seen)) if not s and i not in absent_local]
        if self.buffers_into is not None:
            missing += [c for c, s in zip(self.table.buffer_chunks, self.seen_buffers) if not s]
        if missing:
            first = missing[0]
            expected = len(chunks) + (len(self.seen_buffers) if self.buffers_into is not None else 0)
            raise InvalidArgument(
                f"{self.what}: {len(missing)} of {expected} chunks missing (first: key {first.key!r} at element "
                f"{first.offset}); "
                "send every chunk of this shard (and list keys without a gradient in the trailer)"
            )
        return self.received

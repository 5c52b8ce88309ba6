"""Tensor codec: chunk frames on the wire.

A frame is the protobuf encoding of ``shardps.v1.Frame`` with field 1 (the
small ``ChunkHeader``) followed by field 2 (the raw little-endian payload),
written by hand so that the payload is copied exactly once, straight from
the tensor's memory into the frame's ``bytes``. The header is padded
(``ChunkHeader.pad``) so that the payload starts at a multiple of
:data:`PAYLOAD_ALIGN` bytes from the frame's start. Decoding slices the
payload as a ``memoryview`` of the received message; :func:`copy_payload`
then copies those bytes straight into the caller's tensor (one ``memcpy``
when the wire type is the destination's dtype), and :func:`payload_view`
gives a float32 payload as a tensor over the received bytes themselves (no
copy; shards step gradients from there). Such a tensor is read-only by
contract; torch's one warning that it cannot enforce that is filtered out
of the single call that triggers it, and no other warnings filter is
installed. Frames that do not start with field 1 (the ``RoundHeader``
frame, or a frame written by another protobuf runtime) take the ordinary
protobuf parser.
"""

from __future__ import annotations

import math
import threading
import warnings
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from shardps.proto import shardps_pb2 as pb

#: Wire types of parameters and gradients (shards convert them to fp32).
FLOAT_DTYPES: dict[int, torch.dtype] = {
    pb.FLOAT32: torch.float32,
    pb.BFLOAT16: torch.bfloat16,
    pb.FLOAT16: torch.float16,
}
#: Every wire type: buffers travel in their own.
TORCH_DTYPES: dict[int, torch.dtype] = {
    **FLOAT_DTYPES,
    pb.FLOAT64: torch.float64,
    pb.INT64: torch.int64,
    pb.INT32: torch.int32,
    pb.INT16: torch.int16,
    pb.INT8: torch.int8,
    pb.UINT8: torch.uint8,
    pb.BOOL: torch.bool,
}
WIRE_DTYPES: dict[torch.dtype, int] = {v: k for k, v in TORCH_DTYPES.items()}
WIRE_DTYPE_NAMES: dict[str, int] = {"fp32": pb.FLOAT32, "bf16": pb.BFLOAT16, "fp16": pb.FLOAT16}

_TAG_HEADER = 0x0A  # field 1, length-delimited
_TAG_PAYLOAD = 0x12  # field 2, length-delimited
#: Chunk frames put their payload at a multiple of this many bytes from the frame's start (``ChunkHeader.pad``).
PAYLOAD_ALIGN = 16


class FrameError(ValueError):
    """A frame that cannot be decoded or whose payload disagrees with its header."""


@dataclass(frozen=True, slots=True)
class DecodedFrame:
    """One decoded frame: a chunk (``header`` + ``payload``) or one control message, the rest None."""

    header: pb.ChunkHeader | None = None
    payload: memoryview | None = None
    round: pb.RoundHeader | None = None
    trailer: pb.RoundTrailer | None = None
    report: pb.RoundReport | None = None
    commit: pb.RoundCommit | None = None


def finite(t: torch.Tensor) -> bool:
    """True if every element of ``t`` is finite: a cache-hot sum (about 20x faster than ``isfinite`` on CPU),
    the exact test only if the sum is not finite (NaN or Inf, or finite values whose sum overflows)."""
    return t.numel() == 0 or math.isfinite(t.sum().item()) or bool(torch.isfinite(t).all())


def wire_dtype(name: str) -> int:
    """Map ``"fp32" | "bf16" | "fp16"`` to the ``shardps.v1.DType`` value.

    Raises:
        ValueError: unknown name (the message lists the accepted ones).
    """
    try:
        return WIRE_DTYPE_NAMES[name]
    except KeyError:
        raise ValueError(f"wire dtype must be one of {sorted(WIRE_DTYPE_NAMES)}, got {name!r}") from None


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise FrameError("truncated varint in frame")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor as a memoryview (no copy).

    Works for every dtype, bf16 included, by viewing it as uint8.
    """
    if t.device.type != "cpu":
        raise ValueError(f"tensor_bytes needs a CPU tensor, got one on {t.device}")
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())


def encode_chunk(
    key: str, offset: int, values: torch.Tensor, version: int, *, checksum: bool = False, state: str = ""
) -> bytes:
    """Encode one chunk frame.

    Args:
        key: parameter key.
        offset: element offset of ``values`` in the flattened parameter.
        values: 1-D CPU tensor (float32, bfloat16 or float16) with the chunk's elements;
            its dtype is the wire dtype.
        version: round (push) or parameter version (pull).
        checksum: also send the zlib CRC-32 of the payload.
        state: the optimizer-state entry the values belong to (GetState/SetState).

    Returns:
        ``bytes`` of length ~ ``values.numel() * itemsize + 40``.
    """
    return b"".join(encode_chunk_parts(key, offset, values, version, checksum=checksum, state=state))


def encode_chunk_parts(
    key: str, offset: int, values: torch.Tensor, version: int, *, checksum: bool = False, state: str = ""
) -> tuple[bytes, memoryview]:
    """One chunk frame in two parts, nothing copied yet: ``(prefix, payload)``.

    The frame is ``prefix + payload`` (what :func:`encode_chunk` returns); ``payload`` is a ``memoryview`` of
    ``values``' own memory (uint8, ``values.numel() * itemsize`` bytes), valid while ``values`` is unchanged.
    A transport that can write both parts (``socket.sendall`` each) skips the copy into one ``bytes``.
    Arguments as :func:`encode_chunk`.
    """
    payload = tensor_bytes(values)
    header = pb.ChunkHeader(
        key=key, offset=offset, numel=values.numel(), dtype=WIRE_DTYPES[values.dtype], version=version, state=state
    )
    if checksum:
        header.crc32 = zlib.crc32(payload)
    return _aligned_prefix(header, len(payload)), payload


def _aligned_prefix(header: pb.ChunkHeader, payload_bytes: int) -> bytes:
    """Everything of a chunk frame before its payload, padded (``ChunkHeader.pad``) to a multiple of
    :data:`PAYLOAD_ALIGN` bytes, so that a received frame's payload is aligned as the frame's buffer is."""
    tail = bytes((_TAG_PAYLOAD,)) + _varint(payload_bytes)
    hb = header.SerializeToString()
    short = -(1 + len(_varint(len(hb))) + len(hb) + len(tail)) % PAYLOAD_ALIGN
    first = (short - 2) % PAYLOAD_ALIGN or PAYLOAD_ALIGN  # a pad of k bytes adds 2 + k
    for pad in (0, *range(first, first + PAYLOAD_ALIGN + 2)) if short else (0,):  # (the header's varint may grow)
        if pad:
            header.pad = bytes(pad)
            hb = header.SerializeToString()
        prefix = b"".join((bytes((_TAG_HEADER,)), _varint(len(hb)), hb, tail))
        if len(prefix) % PAYLOAD_ALIGN == 0:
            return prefix
    raise AssertionError("no pad aligns the payload")  # unreachable: the pads tried cover every residue


def encode_round(header: pb.RoundHeader) -> bytes:
    """Encode the first frame of an Init/Push/PushPull/SetState stream."""
    return pb.Frame(round=header).SerializeToString()


def encode_control(**message) -> bytes:
    """Encode a frame holding one control message: ``trailer=``, ``report=`` or ``commit=``."""
    return pb.Frame(**message).SerializeToString()


def decode_frame(data: bytes) -> DecodedFrame:
    """Decode one frame without copying its payload.

    Raises:
        FrameError: anything that is not a well-formed ``Frame`` (truncated
            varints or fields, invalid UTF-8 in a key, unknown wire types,
            neither a chunk nor a round header). Never another exception.
    """
    try:
        buf = memoryview(data)
        if len(buf) and buf[0] == _TAG_HEADER:
            n, pos = _read_varint(buf, 1)
            if pos + n <= len(buf):
                header = pb.ChunkHeader.FromString(buf[pos : pos + n])
                pos += n
                if pos == len(buf):
                    return DecodedFrame(header, memoryview(b""))
                if buf[pos] == _TAG_PAYLOAD:
                    n, pos = _read_varint(buf, pos + 1)
                    if pos + n == len(buf):
                        return DecodedFrame(header, buf[pos : pos + n])
        frame = pb.Frame.FromString(data)  # the general path: any field order, any runtime
    except FrameError:
        raise
    except Exception as exc:  # protobuf's DecodeError, or a buffer that is not bytes
        raise FrameError(f"malformed frame ({_length(data)}): {exc}") from None
    kinds = [k for k in ("round", "trailer", "report", "commit") if frame.HasField(k)]
    if frame.HasField("header"):
        if kinds:
            raise FrameError(f"frame has a chunk header and a {kinds[0]}")
        return DecodedFrame(frame.header, memoryview(frame.payload))
    if len(kinds) != 1:
        raise FrameError("frame must hold a chunk or exactly one of round, trailer, report, commit")
    return DecodedFrame(**{kinds[0]: getattr(frame, kinds[0])})


def _length(data: object) -> str:
    try:
        return f"{len(data)} bytes"  # type: ignore[arg-type]
    except TypeError:
        return type(data).__name__


def check_payload(header: pb.ChunkHeader, payload: memoryview) -> torch.dtype:
    """The wire dtype of a chunk whose payload fits its header (as :func:`copy_payload` checks it).

    Raises:
        FrameError: unknown dtype, payload length not ``numel * itemsize``, or a CRC mismatch.
    """
    dtype = TORCH_DTYPES.get(header.dtype)
    if dtype is None:
        raise FrameError(f"chunk of key {header.key!r} has unsupported dtype {header.dtype}")
    expected = header.numel * dtype.itemsize
    if len(payload) != expected:
        raise FrameError(
            f"chunk of key {header.key!r} at offset {header.offset} declares {header.numel} "
            f"{dtype} elements ({expected} bytes) but carries {len(payload)} bytes"
        )
    if header.HasField("crc32") and zlib.crc32(payload) != header.crc32:
        raise FrameError(f"chunk of key {header.key!r} at offset {header.offset} fails its CRC-32 check")
    return dtype


def copy_payload(header: pb.ChunkHeader, payload: memoryview, dst: torch.Tensor) -> None:
    """Copy a chunk's payload into ``dst``, converting from the wire type to ``dst.dtype``.

    Args:
        header: the chunk's header (its ``dtype`` and ``numel`` describe ``payload``).
        payload: the raw little-endian bytes, as :func:`decode_frame` returns them.
        dst: a 1-D tensor of ``header.numel`` elements of a floating dtype, on
            any device. When it is a contiguous CPU tensor of the wire type the
            copy is one ``memcpy``; otherwise the bytes go through a scratch
            tensor of the wire type first.

    Raises:
        FrameError: unknown dtype, payload length not ``numel * itemsize``, or a CRC mismatch.
        ValueError: ``dst`` does not have ``header.numel`` elements.
    """
    dtype = check_payload(header, payload)
    if dst.numel() != header.numel:
        raise ValueError(f"destination has {dst.numel()} elements, the chunk {header.numel}")
    if header.numel == 0:
        return
    if dst.dtype == dtype and dst.device.type == "cpu" and dst.is_contiguous():
        _memcpy(dst, payload)  # into dst's own memory
        return
    dst.copy_(payload_tensor(header, payload, pin=dst.is_cuda))


def payload_view(header: pb.ChunkHeader, payload: memoryview) -> torch.Tensor | None:
    """The payload of a float32 chunk as a tensor over the received bytes themselves (no copy), or None.

    Returns:
        A 1-D float32 tensor of ``header.numel`` elements sharing the
        payload's memory, which is read-only: the caller must never write
        to it (torch cannot enforce that; shards only read gradients). None
        when the wire type is not float32, the chunk is empty, or the payload
        is not at a multiple of 4 bytes in memory (a frame from a sender that
        does not pad its header, ``ChunkHeader.pad``): copy it then
        (:func:`copy_payload`).

    Raises:
        FrameError: unknown dtype, payload length not ``numel * itemsize``, or a CRC mismatch.
    """
    if check_payload(header, payload) is not torch.float32 or header.numel == 0:
        return None
    view = _frombuffer(payload)
    return view if view.data_ptr() % 4 == 0 else None


_quiet = threading.Lock()
_warned = False


def _frombuffer(payload: memoryview) -> torch.Tensor:
    """``torch.frombuffer`` over read-only bytes. torch warns once per process that such a tensor is writable
    anyway; that first call runs with the warning filtered out, so that a shard's log does not suggest a
    fault (the bytes are only read)."""
    global _warned
    if not _warned:
        with _quiet:
            if not _warned:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="The given buffer is not writable")
                    view = torch.frombuffer(payload, dtype=torch.float32)
                _warned = True
                return view
    return torch.frombuffer(payload, dtype=torch.float32)


def payload_tensor(header: pb.ChunkHeader, payload: memoryview, *, pin: bool = False) -> torch.Tensor:
    """A new CPU tensor holding a chunk's payload, shape ``[header.numel]``, in its wire dtype.

    ``pin``: in pinned (page-locked) memory, from PyTorch's caching host
    allocator, so that a copy onto a CUDA device runs at the bus's rate
    instead of through the driver's pageable staging buffer.

    Raises:
        FrameError: unknown dtype, payload length not ``numel * itemsize``, or a CRC mismatch.
    """
    scratch = torch.empty(header.numel, dtype=check_payload(header, payload), pin_memory=pin)
    _memcpy(scratch, payload)
    return scratch


def _memcpy(dst: torch.Tensor, payload: memoryview) -> None:
    """Copy ``payload`` into the contiguous CPU tensor ``dst`` (same byte length) with numpy, which releases the
    GIL for large copies (a memoryview slice assignment holds it), so that other shards' frames decode meanwhile."""
    np.copyto(dst.view(torch.uint8).numpy(), np.frombuffer(payload, dtype=np.uint8))

import subprocess
import sys
import warnings

import pytest
import torch

from shardps.proto import shardps_pb2 as pb
from shardps.common.codec import PAYLOAD_ALIGN, FrameError, copy_payload, decode_frame, encode_chunk, encode_round


def decoded_values(raw: bytes, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    frame = decode_frame(raw)
    out = torch.empty(frame.header.numel, dtype=dtype)
    copy_payload(frame.header, frame.payload, out)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_hand_encoded_frame_is_valid_protobuf(dtype) -> None:
    values = torch.randn(1000).to(dtype)
    raw = encode_chunk("layer.weight", 4096, values, 7, checksum=True)
    msg = pb.Frame.FromString(raw)  # any protobuf runtime can read our frames
    assert msg.header.key == "layer.weight" and msg.header.offset == 4096 and msg.header.version == 7
    assert msg.payload == values.view(torch.uint8).numpy().tobytes()
    assert torch.equal(decoded_values(raw, dtype), values)  # same dtype: one memcpy
    assert torch.equal(decoded_values(raw, torch.float32), values.float())  # converted through a scratch tensor


def test_protobuf_encoded_frames_decode_too() -> None:
    values = torch.arange(5, dtype=torch.float32)
    raw = pb.Frame(
        header=pb.ChunkHeader(key="k", offset=0, numel=5, dtype=pb.FLOAT32), payload=values.numpy().tobytes()
    ).SerializeToString()
    assert torch.equal(decoded_values(raw), values)
    header = decode_frame(encode_round(pb.RoundHeader(worker_id="w", round=3))).round
    assert header.worker_id == "w" and header.round == 3


def test_bad_frames_raise_frame_error() -> None:
    raw = encode_chunk("k", 0, torch.ones(4), 0, checksum=True)
    frame = decode_frame(raw)
    wrong_size = pb.ChunkHeader(key="k", offset=0, numel=5, dtype=pb.FLOAT32)
    with pytest.raises(FrameError, match="declares 5"):
        copy_payload(wrong_size, frame.payload, torch.empty(5))
    corrupted = bytearray(raw)
    corrupted[-1] ^= 0xFF
    bad = decode_frame(bytes(corrupted))
    with pytest.raises(FrameError, match="CRC"):
        copy_payload(bad.header, bad.payload, torch.empty(4))


@pytest.mark.parametrize(
    "raw",
    [
        b"\xff\xff\xff",  # unknown wire type
        b"\x0a",  # header tag with no length
        b"\x0a\x05\x0a\x03ab",  # truncated chunk header (length past the end)
        b"\x0a\x02\x0a\x01",  # key field truncated inside the header
        b"\x0a\x04\x0a\x02\xff\xfe",  # key with invalid UTF-8
        b"\x0a\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01",  # varint longer than 64 bits
        encode_chunk("k", 0, torch.ones(4), 0)[:-3],  # truncated payload
        b"",  # neither a chunk nor a round header
        b"\x1a\x03\x0a\x01",  # truncated round header
    ],
)
def test_malformed_frames_raise_only_frame_error(raw: bytes) -> None:
    with pytest.raises(FrameError):
        decode_frame(raw)


def test_import_leaves_warning_filters_alone_and_decoding_warns_nothing() -> None:
    code = (  # torch installs filters of its own at import: take the baseline after it
        "import warnings, torch, grpc, grpc.aio; before = list(warnings.filters); "
        "import shardps.common.codec, shardps.worker, shardps.server.service, shardps.cli.server, shardps.cli.main; "
        "assert warnings.filters == before, 'importing shardps changed the warning filters'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    raw = encode_chunk("k", 0, torch.randn(64), 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "buffer is not writable" would raise here
        decoded_values(raw)
        decoded_values(raw, torch.bfloat16)


@pytest.mark.parametrize("key_chars", [1, 13, 40, 100, 113, 126, 127, 128, 200, 16400])
def test_payloads_start_at_an_aligned_offset_and_any_parser_reads_the_frame(key_chars: int) -> None:
    """The pad field puts every payload at a multiple of PAYLOAD_ALIGN bytes, whatever the header's length
    (the key, the offset, a CRC or a state name; the header's length varint growing at 128 and 16384 bytes)."""
    for offset in (0, 1, 1 << 20, 1 << 40):
        for numel in (0, 1, 1000):
            for extra in ({}, {"checksum": True}, {"state": "exp_avg"}):
                values = torch.arange(numel, dtype=torch.float32)
                raw = encode_chunk("k" * key_chars, offset, values, 3, **extra)
                frame = decode_frame(raw)
                assert (len(raw) - len(frame.payload)) % PAYLOAD_ALIGN == 0
                assert frame.header.key == "k" * key_chars and frame.header.offset == offset
                msg = pb.Frame.FromString(raw)
                assert msg.header.numel == numel and msg.payload == values.numpy().tobytes()


def test_a_payload_view_is_the_received_bytes_or_none_and_warns_nothing() -> None:
    """In a fresh interpreter (torch warns once per process): the first view warns nothing either."""
    code = """
import warnings, numpy as np, torch
from shardps.proto import shardps_pb2 as pb
from shardps.common.codec import decode_frame, encode_chunk, payload_view
warnings.simplefilter("error")
raw = encode_chunk("k", 0, torch.arange(10.0), 1)
frame = decode_frame(raw)
view = payload_view(frame.header, frame.payload)
start = np.frombuffer(raw, np.uint8).ctypes.data
assert torch.equal(view, torch.arange(10.0)) and start <= view.data_ptr() < start + len(raw)
half = decode_frame(encode_chunk("k", 0, torch.arange(10.0).bfloat16(), 1))
assert payload_view(half.header, half.payload) is None  # bf16 is converted, so copied
hb = pb.ChunkHeader(key="kkk", numel=10, dtype=pb.FLOAT32).SerializeToString()  # a frame with no pad
odd = bytes((0x0A, len(hb))) + hb + bytes((0x12, 40)) + torch.arange(10.0).numpy().tobytes()
assert (np.frombuffer(odd, np.uint8).ctypes.data + len(odd) - 40) % 4, "this frame's payload should be misaligned"
frame = decode_frame(odd)
assert payload_view(frame.header, frame.payload) is None
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

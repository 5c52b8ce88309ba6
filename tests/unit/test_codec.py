import pytest
import torch

from shardps.proto import shardps_pb2 as pb
from shardps.proto.codec import FrameError, decode_frame, encode_chunk, encode_round, payload_tensor


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_hand_encoded_frame_is_valid_protobuf(dtype) -> None:
    values = torch.randn(1000).to(dtype)
    raw = encode_chunk("layer.weight", 4096, values, 7, checksum=True)
    msg = pb.Frame.FromString(raw)  # any protobuf runtime can read our frames
    assert msg.header.key == "layer.weight" and msg.header.offset == 4096 and msg.header.version == 7
    assert msg.payload == values.view(torch.uint8).numpy().tobytes()
    frame = decode_frame(raw)
    assert torch.equal(payload_tensor(frame.header, frame.payload), values)


def test_protobuf_encoded_frames_decode_too() -> None:
    values = torch.arange(5, dtype=torch.float32)
    raw = pb.Frame(
        header=pb.ChunkHeader(key="k", offset=0, numel=5, dtype=pb.FLOAT32), payload=values.numpy().tobytes()
    ).SerializeToString()
    frame = decode_frame(raw)
    assert torch.equal(payload_tensor(frame.header, frame.payload), values)
    header = decode_frame(encode_round(pb.RoundHeader(worker_id="w", round=3))).round
    assert header.worker_id == "w" and header.round == 3


def test_bad_frames_raise_frame_error() -> None:
    raw = encode_chunk("k", 0, torch.ones(4), 0, checksum=True)
    frame = decode_frame(raw)
    wrong_size = pb.ChunkHeader(key="k", offset=0, numel=5, dtype=pb.FLOAT32)
    with pytest.raises(FrameError, match="declares 5"):
        payload_tensor(wrong_size, frame.payload)
    corrupted = bytearray(raw)
    corrupted[-1] ^= 0xFF
    bad = decode_frame(bytes(corrupted))
    with pytest.raises(FrameError, match="CRC"):
        payload_tensor(bad.header, bad.payload)
    with pytest.raises(FrameError):
        decode_frame(b"\xff\xff\xff")

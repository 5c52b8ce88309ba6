"""A streamed round's pull is all or nothing in the worker too: a malformed frame leaves the model as it was.

The frames are real encoded chunk frames, fed to the worker's own
``ParameterSink.receive`` as the call's answer; the last one declares more
elements than it carries. Before any chunk of a streamed round is copied
into the model, every frame is checked, so the pull fails (naming the shard
and the frame) and the parameter keeps every value it had.
"""

from __future__ import annotations

import pytest
import torch

from shardps.proto import shardps_pb2 as pb
from shardps.common.codec import encode_chunk
from shardps.common.plan import KeyInfo, PartitionPlan
from shardps.worker.pipeline.streams import ParameterSink, Round


class _Client:
    """What ``receive`` reads of a shard client: its index, and how it words a failed call."""

    index = 0

    def error(self, what, exc):  # pragma: no cover - only for gRPC errors, which these frames never raise
        return exc


def _short_frame(key: str, offset: int, numel: int, version: int) -> bytes:
    """A well-formed frame whose header declares ``numel`` fp32 elements but whose payload carries one fewer."""
    header = pb.ChunkHeader(key=key, offset=offset, numel=numel, dtype=pb.FLOAT32, version=version)
    return pb.Frame(header=header, payload=bytes(4 * (numel - 1))).SerializeToString()


@pytest.mark.parametrize("bad", ["first", "last"])
def test_a_malformed_frame_of_a_streamed_round_changes_no_parameter(bad: str) -> None:
    plan = PartitionPlan.build([KeyInfo("w", (32,), 0)], num_shards=1, chunk_bytes=64)  # 2 chunks of 16
    chunks = plan.shard_chunks(0)
    assert len(chunks) == 2
    weight = torch.arange(32, dtype=torch.float32)
    before = weight.clone()
    sink = ParameterSink(plan, {"w": weight}, {})
    good = [encode_chunk("w", c.offset, torch.full((c.numel,), -1.0), 1) for c in chunks]
    index = 0 if bad == "first" else 1
    frames = list(good)
    frames[index] = _short_frame("w", chunks[index].offset, chunks[index].numel, 1)
    rnd = Round(1, {"w": 2})
    rnd.options = pb.RoundTrailer()  # a streamed round: chunks are held until the call ends
    with pytest.raises(RuntimeError, match="shard 0 sent a malformed frame"):
        sink.receive(_Client(), frames, 1, "push_pull", rnd)
    assert torch.equal(weight, before), "a chunk reached the model before the round's frames were all checked"
    assert not rnd.ready["w"].is_set()


def test_a_well_formed_streamed_round_reaches_the_model() -> None:
    plan = PartitionPlan.build([KeyInfo("w", (32,), 0)], num_shards=1, chunk_bytes=64)
    weight = torch.zeros(32)
    sink = ParameterSink(plan, {"w": weight}, {})
    frames = [encode_chunk("w", c.offset, torch.full((c.numel,), float(c.offset)), 4) for c in plan.shard_chunks(0)]
    rnd = Round(1, {"w": 2})
    rnd.options = pb.RoundTrailer()
    assert sink.receive(_Client(), frames, 4, "push_pull", rnd) == 4
    assert torch.equal(weight, torch.tensor([0.0] * 16 + [16.0] * 16)) and rnd.ready["w"].is_set()

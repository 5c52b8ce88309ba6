"""The push and pull streams of one step: request frames out, parameter frames back into the model.

Threads: gRPC's request-consumer thread runs :func:`push_requests` for each
shard, encoding chunks from a queue the gradient hooks fill; a small thread
pool runs :func:`receive_parameters` on the parameter frames coming back.
Hooks only slice tensors and enqueue them: no host sync, no I/O.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator

import grpc
import torch

from shardps.proto import shardps_pb2 as pb
from shardps.proto.codec import FrameError, copy_payload, decode_frame, encode_chunk, encode_round
from shardps.proto.plan import Chunk, PartitionPlan
from shardps.worker.client import ShardClient


class Round:
    """State of one push/pull round trip across all shards.

    ``ready[key]`` is set once every chunk of ``key`` has been pulled;
    ``sent[shard]`` once the push stream to ``shard`` has encoded its last chunk.
    """

    def __init__(self, num_shards: int, chunks_per_key: dict[str, int]) -> None:
        self.queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(num_shards)]
        self.calls: list = []
        self.pushed: set[str] = set()
        self.sent = [threading.Event() for _ in range(num_shards)]
        self.remaining = dict(chunks_per_key)
        self.ready = {key: threading.Event() for key in chunks_per_key}
        self.lock = threading.Lock()
        self.futures: list = []

    def chunk_arrived(self, key: str) -> None:
        with self.lock:
            self.remaining[key] -= 1
            done = self.remaining[key] == 0
        if done:
            self.ready[key].set()

    def failed(self) -> BaseException | None:
        for f in self.futures:
            if f.done() and f.exception() is not None:
                return f.exception()
        return None


def push_requests(
    header: pb.RoundHeader, q: queue.SimpleQueue, sent: threading.Event, push_dtype: torch.dtype, checksum: bool
) -> Iterator[bytes]:
    """Request stream of one shard's push; runs on gRPC's request-consumer thread.

    Yields the round header, then one frame per ``(chunk, values)`` item the
    hooks put on ``q`` until they put ``None``.
    """
    yield encode_round(header)
    while (item := q.get()) is not None:  # blocking wait for the hooks
        chunk, values = item
        values = values.to("cpu", push_dtype)  # host sync for CUDA gradients, off the hook
        yield encode_chunk(chunk.key, chunk.offset, values, header.round, checksum=checksum)
    sent.set()  # every gradient byte of this shard is copied into a frame


def init_requests(
    header: pb.RoundHeader, plan: PartitionPlan, shard: int, params: dict[str, torch.Tensor]
) -> Iterator[bytes]:
    """Request stream of one shard's Init: the round header, then this shard's chunks of ``params`` in fp32."""
    yield encode_round(header)
    for c in plan.shard_chunks(shard):
        flat = params[c.key].detach().reshape(-1)
        yield encode_chunk(c.key, c.offset, flat[c.offset : c.offset + c.numel].to("cpu", torch.float32), 0)


class ParameterSink:
    """Where pulled chunks go: the model's parameters, per the partition plan.

    Args:
        plan: the job's partition plan.
        params: ``{key: parameter tensor}`` (CPU or CUDA, any floating dtype).
    """

    def __init__(self, plan: PartitionPlan, params: dict[str, torch.Tensor]) -> None:
        self.params = params
        self.chunk_at: dict[tuple[str, int], Chunk] = {(c.key, c.offset): c for c in plan.chunks}
        self.shard_sizes = [0] * plan.num_shards
        for c in plan.chunks:
            self.shard_sizes[c.shard] += 1

    def receive(
        self, client: ShardClient, call: Iterable[bytes], min_version: int, what: str, rnd: Round | None = None
    ) -> int:
        """Copy every parameter frame of ``call`` from shard ``client.index`` into the model.

        Returns:
            The version received (``min_version`` if the shard holds no chunks).

        Raises:
            ShardRpcError: the call failed (the shard's status and message).
            RuntimeError: the shard answered outside the protocol.
        """
        shard = client.index
        version, count = None, 0
        try:
            with torch.no_grad():
                for raw in call:  # blocking reads from the network
                    frame = decode_frame(raw)
                    h = frame.header
                    c = self.chunk_at.get((h.key, h.offset)) if h is not None else None
                    if c is None or c.shard != shard or c.numel != h.numel:
                        raise RuntimeError(f"shard {shard} sent a chunk that is not in the partition plan: {h}")
                    if version is None:
                        version = h.version
                    if h.version != version or version < min_version:
                        raise RuntimeError(f"shard {shard} sent version {h.version}, expected {version or min_version}")
                    flat = self.params[c.key].data.view(-1)
                    copy_payload(h, frame.payload, flat[c.offset : c.offset + c.numel])
                    count += 1
                    if rnd is not None:
                        rnd.chunk_arrived(c.key)
        except grpc.RpcError as exc:
            raise client.error(what, exc) from None
        except FrameError as exc:
            raise RuntimeError(f"shard {shard} sent a malformed frame in its {what}: {exc}") from None
        if count != self.shard_sizes[shard]:
            raise RuntimeError(f"shard {shard} sent {count} of {self.shard_sizes[shard]} chunks in its {what}")
        return min_version if version is None else version

"""Raw-gRPC helpers for tests that send what the worker library never would.

Requests are built by hand from the proto contract and sent with
:class:`~shardps.worker.session.client.ShardClient`, so the tests exercise the real
shard process over real gRPC.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shardps.proto import shardps_pb2 as pb
from shardps.common.codec import encode_chunk, encode_control, encode_round
from shardps.common.optim import optimizer_spec
from shardps.common.plan import PartitionPlan, keys_from_named_parameters
from shardps.worker.session.client import ShardClient


@dataclass
class RawWorker:
    """One hand-driven worker: an id, a session, and the plan/optimizer it joins with."""

    client: ShardClient
    worker_id: str
    plan: PartitionPlan
    spec: pb.OptimizerSpec
    session: str = field(default_factory=lambda: uuid.uuid4().hex)

    def join(self, job: pb.JobView | None = None, **overrides) -> pb.JoinReply:
        request = pb.JoinRequest(
            worker_id=self.worker_id, session=self.session, plan=self.plan.to_proto(),
            plan_fingerprint=self.plan.fingerprint, optimizer=self.spec, job=job,
        )
        for k, v in overrides.items():
            setattr(request, k, v)
        return self.client.join(request)

    def header(self, round_: int = 0, **overrides) -> pb.RoundHeader:
        h = pb.RoundHeader(worker_id=self.worker_id, session=self.session, round=round_,
                           plan_fingerprint=self.plan.fingerprint)
        for k, v in overrides.items():
            setattr(h, k, v)
        return h

    def trailer(self, lrs: list[float] | None = None, **fields) -> pb.RoundTrailer:
        """A push's trailer: ``lrs`` (0.1 for every group by default) and any other RoundTrailer field."""
        return pb.RoundTrailer(lrs=[0.1] * len(self.spec.group_hyperparams_json) if lrs is None else lrs, **fields)

    def chunks(self, shard: int, fill: float | torch.Tensor | None = None, params=None) -> list[bytes]:
        """Chunk payloads for ``shard``: ``fill`` everywhere, or slices of ``params`` ({key: tensor})."""
        out = []
        for c in self.plan.shard_chunks(shard):
            if params is not None:
                values = params[c.key].detach().reshape(-1)[c.offset : c.offset + c.numel].float()
            else:
                values = torch.full((c.numel,), float(fill))
            out.append((c.key, c.offset, values))
        return out

    def frames(self, header: pb.RoundHeader, chunks, version: int | None = None,
               trailer: pb.RoundTrailer | None = None) -> Iterator[bytes]:
        """The round header, the chunks, and (pushes) the trailer."""
        yield encode_round(header)
        for key, offset, values in chunks:
            yield encode_chunk(key, offset, values, header.round if version is None else version)
        if trailer is not None:
            yield encode_control(trailer=trailer)

    def init(self, shard: int, params) -> pb.InitReply:
        return self.client.init(self.frames(self.header(), self.chunks(shard, params=params), version=0))

    def push(self, shard: int, fill: float = 0.5, round_: int = 0, lrs: list[float] | None = None,
             trailer: dict | None = None, **header) -> pb.PushReply:
        """Push ``fill`` everywhere as the gradient of ``round_`` (then the trailer: ``lrs`` and ``trailer`` fields)."""
        return self.client.push(self.frames(self.header(round_, **header), self.chunks(shard, fill),
                                            trailer=self.trailer(lrs, **(trailer or {}))))

    def pull(self, min_version: int = 0, **overrides) -> bytes:
        request = pb.PullRequest(
            min_version=min_version, plan_fingerprint=self.plan.fingerprint, worker_id=self.worker_id,
            session=self.session,
        )
        for k, v in overrides.items():
            setattr(request, k, v)
        try:
            return b"".join(self.client.pull(request))
        except grpc.RpcError as exc:
            raise self.client.error("pull", exc) from None

    def leave(self) -> pb.LeaveReply:
        return self.client.leave(self.worker_id, self.session)


def plan_and_spec(model: torch.nn.Module, optimizer: torch.optim.Optimizer, num_shards: int = 1,
                  chunk_bytes: int = 256) -> tuple[PartitionPlan, pb.OptimizerSpec]:
    named = list(model.named_parameters())
    keys, _ = keys_from_named_parameters(named, optimizer.param_groups)
    plan = PartitionPlan.build(keys, num_shards=num_shards, chunk_bytes=chunk_bytes)
    return plan, optimizer_spec(optimizer)


def health_status(address: str, timeout: float = 1.0) -> int:
    """The shard's gRPC health status (raises grpc.RpcError if it does not answer within ``timeout`` s)."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service="shardps.v1.Shard"), timeout=timeout).status


SERVING = health_pb2.HealthCheckResponse.SERVING


def snapshot(client: ShardClient) -> dict:
    """What a regression test compares before and after a refused request: version, membership, the
    open round's pushers, and the SHA-256 of the parameters and optimizer state."""
    s = client.stats(digest=True)
    return {"version": s.version, "members": list(s.members), "pushed": list(s.pushed), "digest": s.digest,
            "initialised": s.initialised, "job_id": s.job_id}


def raw_call(address: str, method: str, request: bytes, timeout: float = 5.0, stream: bool = False):
    """Send ``request`` bytes as-is to ``/shardps.v1.Shard/<method>``; returns (status code, details)."""
    with grpc.insecure_channel(address) as channel:
        try:
            if stream:
                call = channel.unary_stream(f"/shardps.v1.Shard/{method}")(request, timeout=timeout)
                list(call)
            else:
                channel.unary_unary(f"/shardps.v1.Shard/{method}")(request, timeout=timeout)
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def raw_stream(address: str, method: str, frames: list[bytes], timeout: float = 5.0):
    """Send ``frames`` as-is on a client stream to ``method``; returns (status code, details)."""
    with grpc.insecure_channel(address) as channel:
        try:
            if method == "PushPull":
                list(channel.stream_stream(f"/shardps.v1.Shard/{method}")(iter(frames), timeout=timeout))
            else:
                channel.stream_unary(f"/shardps.v1.Shard/{method}")(iter(frames), timeout=timeout)
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""

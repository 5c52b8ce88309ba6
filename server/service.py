"""gRPC adapter over :class:`ShardStore`: one servicer for ``shardps.v1.Shard``, plus health.

Method handlers are built from the service descriptor in the generated
``shardps_pb2``: calls whose messages are ``Frame`` are registered with
identity (de)serializers so chunk payloads are never copied through
protobuf objects (see ``shardps.proto.codec``); control calls use the
generated message classes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shardps.proto import shardps_pb2 as pb
from shardps.proto.codec import FrameError, decode_frame
from shardps.proto.transport import channel_options
from shardps.server.config import ShardConfig
from shardps.server.errors import InvalidArgument, ShardError
from shardps.server.store import ShardStore

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["Shard"]


def _abort(context: grpc.ServicerContext, exc: ShardError) -> None:
    context.abort(getattr(grpc.StatusCode, exc.code), str(exc))


def _round_header(request_iterator: Iterator[bytes], what: str) -> pb.RoundHeader:
    try:
        first = next(request_iterator)
    except StopIteration:
        raise InvalidArgument(f"{what}: empty stream; the first frame must be a round header") from None
    try:
        frame = decode_frame(first)
    except FrameError as exc:
        raise InvalidArgument(f"{what}: {exc}") from exc
    if frame.round is None:
        raise InvalidArgument(f"{what}: the first frame must be a round header, got a chunk")
    return frame.round


class ShardServicer:
    """Implements ``shardps.v1.Shard`` by delegating to a :class:`ShardStore`."""

    def __init__(self, store: ShardStore) -> None:
        self.store = store

    def Join(self, request: pb.JoinRequest, context) -> pb.JoinReply:
        try:
            result = self.store.join(request.worker_id, request.plan, request.plan_fingerprint, request.optimizer)
        except ShardError as exc:
            _abort(context, exc)
        return pb.JoinReply(
            initialise=result.initialise,
            version=result.version,
            members=result.members,
            shard_index=self.store.config.shard_index,
        )

    def Init(self, request_iterator, context) -> pb.InitReply:
        try:
            header = _round_header(request_iterator, "init")
            return pb.InitReply(version=self.store.init(header, request_iterator))
        except ShardError as exc:
            _abort(context, exc)

    def Push(self, request_iterator, context) -> pb.PushReply:
        try:
            header = _round_header(request_iterator, "push")
            return pb.PushReply(version=self.store.push(header, request_iterator))
        except ShardError as exc:
            _abort(context, exc)

    def Pull(self, request: pb.PullRequest, context) -> Iterator[bytes]:
        try:
            version = self.store.wait_version(request.min_version, context.time_remaining())
            yield from self.store.pull(version, request.dtype, request.plan_fingerprint)
        except ShardError as exc:
            _abort(context, exc)

    def PushPull(self, request_iterator, context) -> Iterator[bytes]:
        try:
            header = _round_header(request_iterator, "push")
            self.store.push(header, request_iterator)
            version = self.store.wait_version(header.round + 1, context.time_remaining())
            yield from self.store.pull(version, header.pull_dtype, header.plan_fingerprint)
        except ShardError as exc:
            _abort(context, exc)

    def Leave(self, request: pb.LeaveRequest, context) -> pb.LeaveReply:
        return pb.LeaveReply(members=self.store.leave(request.worker_id))

    def Stats(self, request: pb.StatsRequest, context) -> pb.StatsReply:
        return self.store.stats()


_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def generic_handler(servicer: ShardServicer) -> grpc.GenericRpcHandler:
    """Handlers for every method of ``shardps.v1.Shard``; Frame streams stay raw bytes."""
    handlers = {}
    for method in SERVICE.methods:
        request_raw = method.input_type.name == "Frame"
        response_raw = method.output_type.name == "Frame"
        make = _KINDS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=None if request_raw else getattr(pb, method.input_type.name).FromString,
            response_serializer=None if response_raw else getattr(pb, method.output_type.name).SerializeToString,
        )
    return grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)


def create_server(
    config: ShardConfig, store: ShardStore, health_servicer: health.HealthServicer
) -> tuple[grpc.Server, int]:
    """Build (not start) the gRPC server for one shard and bind it.

    Returns:
        ``(server, port)``; ``port`` is the bound port (useful with ``config.port == 0``).

    Raises:
        RuntimeError: the address could not be bound.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.grpc_threads, thread_name_prefix="shard-rpc"),
        options=channel_options(config.max_message_bytes),
    )
    server.add_generic_rpc_handlers((generic_handler(ShardServicer(store)),))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{config.host}:{config.port}"
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise RuntimeError(f"could not bind {address}: {exc}") from exc
    if port == 0:
        raise RuntimeError(f"could not bind {address}")
    for name in ("", SERVICE.full_name):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port

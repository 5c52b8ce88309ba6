"""gRPC adapter over :class:`ShardStore`: one asyncio servicer for ``shardps.v1.Shard``, plus health.

The server is a ``grpc.aio`` server: a call that waits for a version is a
suspended coroutine, not a blocked thread, so waiting calls never starve
Stats, Join, pushes or the health check, and a cancelled call is woken and
freed at once.

Every method takes its request as raw bytes (identity deserializers) and
parses it itself, so a malformed body gets INVALID_ARGUMENT instead of
gRPC's INTERNAL; ``Frame`` streams stay raw bytes end to end so chunk
payloads are never copied through protobuf objects (see
``shardps.proto.codec``). A :class:`~shardps.server.errors.ShardError` becomes
the status of the same name; anything else is a bug: logged with its
traceback and answered INTERNAL.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shardps.proto import shardps_pb2 as pb
from shardps.proto.codec import encode_control
from shardps.proto.transport import channel_options
from shardps.server import checks
from shardps.server.config import ShardConfig
from shardps.server.errors import InvalidArgument, ShardError, stopped_with
from shardps.server.store import ShardStore

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["Shard"]


def _parse(cls, data: bytes, what: str):
    try:
        return cls.FromString(data)
    except Exception as exc:  # protobuf's DecodeError (bad wire format, invalid UTF-8)
        raise InvalidArgument(f"{what}: malformed {cls.__name__} ({len(data)} bytes): {exc}") from None


async def _round_header(request_iterator: AsyncIterator[bytes], what: str) -> pb.RoundHeader:
    try:
        first = await anext(request_iterator)
    except StopAsyncIteration:
        raise InvalidArgument(f"{what}: empty stream; the first frame must be a round header") from None
    frame = checks.decode(first, what)
    if frame.round is None:
        raise InvalidArgument(f"{what}: the first frame must be a round header, got a chunk")
    return frame.round


async def _commit(request_iterator: AsyncIterator[bytes], timeout: float) -> pb.RoundCommit:
    """The worker's RoundCommit, the next frame of a PushPull after the report, within ``timeout`` seconds."""
    try:
        raw = await asyncio.wait_for(anext(request_iterator), timeout)
    except StopAsyncIteration:
        raise InvalidArgument("push: the stream ended before its RoundCommit") from None
    except TimeoutError:
        raise InvalidArgument("push: no RoundCommit within the call's deadline") from None
    frame = checks.decode(raw, "push")
    if frame.commit is None:
        raise InvalidArgument("push: after the report, the next frame must be a RoundCommit")
    return frame.commit


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: BaseException) -> None:
    if isinstance(exc, ShardError):
        await context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
    log.error("%s failed", method, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"{method}: internal error in the shard ({type(exc).__name__}); "
                                                  "see the shard's log")


async def _stopped(context: grpc.aio.ServicerContext, method: str) -> None:
    """A cancelled handler: answer with the store's error if the store ended the call, else stay cancelled."""
    task = asyncio.current_task()
    error = stopped_with(task)
    if error is None:
        raise asyncio.CancelledError  # the client cancelled, or the server is stopping
    task.uncancel()
    await _abort(context, method, error)


async def _fail(context: grpc.aio.ServicerContext, method: str, exc: BaseException) -> None:
    """End a call whose handler raised ``exc`` with the right status (see the module docstring)."""
    if isinstance(exc, asyncio.CancelledError):
        await _stopped(context, method)
    elif isinstance(exc, grpc.aio.AbortError):
        raise exc
    else:
        await _abort(context, method, exc)


def _unary(method):
    """Map a unary-response handler's errors to statuses."""

    @functools.wraps(method)
    async def handler(self, request, context):
        try:
            return await method(self, request, context)
        except (asyncio.CancelledError, Exception) as exc:
            await _fail(context, method.__name__, exc)

    return handler


def _streaming(method):
    """The same for handlers that stream their response (async generators)."""

    @functools.wraps(method)
    async def handler(self, request, context):
        try:
            async for item in method(self, request, context):
                yield item
        except (asyncio.CancelledError, Exception) as exc:
            await _fail(context, method.__name__, exc)

    return handler


class ShardServicer:
    """Implements ``shardps.v1.Shard`` by delegating to a :class:`ShardStore`."""

    def __init__(self, store: ShardStore) -> None:
        self.store = store

    @_unary
    async def Join(self, request: bytes, context) -> pb.JoinReply:
        return await self.store.join(_parse(pb.JoinRequest, request, "join"))

    @_unary
    async def Init(self, request_iterator, context) -> pb.InitReply:
        header = await _round_header(request_iterator, "init")
        return pb.InitReply(version=await self.store.init(header, request_iterator))

    @_unary
    async def Push(self, request_iterator, context) -> pb.PushReply:
        header = await _round_header(request_iterator, "push")
        await self.store.push(header, request_iterator)
        return pb.PushReply(version=self.store.version)

    @_streaming
    async def Pull(self, request: bytes, context) -> AsyncIterator[bytes]:
        req = _parse(pb.PullRequest, request, "pull")
        self.store.check_pull(req)
        version = await self.store.wait_version(req.worker_id, req.session, req.min_version, context.time_remaining())
        async for frame in self.store.pull(version, req.dtype):
            yield frame

    @_streaming
    async def PushPull(self, request_iterator, context) -> AsyncIterator[bytes]:
        header = await _round_header(request_iterator, "push")
        if await self.store.push(header, request_iterator, can_commit=True):
            # a round that clips or scales: report this shard's part, take the worker's decision
            report = await self.store.wait_report(header.worker_id, header.session, header.round,
                                                  context.time_remaining())
            yield encode_control(report=report)
            remaining = context.time_remaining()
            timeout = min(remaining, self.store.config.max_wait_seconds) if remaining else \
                self.store.config.max_wait_seconds
            self.store.commit(header.worker_id, header.session, await _commit(request_iterator, timeout))
        if self.store.rounds.mode.synchronous:
            version = await self.store.wait_version(header.worker_id, header.session, header.round + 1,
                                                    context.time_remaining())
        else:
            await self.store.wait_turn(header.worker_id, header.session, header.round, context.time_remaining())
            version = -1  # the newest, read between two applies
        async for frame in self.store.pull(version, header.pull_dtype):
            yield frame

    @_streaming
    async def GetState(self, request: bytes, context) -> AsyncIterator[bytes]:
        for frame in await self.store.get_state(_parse(pb.StateRequest, request, "get_state")):
            yield frame

    @_unary
    async def SetState(self, request_iterator, context) -> pb.SetStateReply:
        header = await _round_header(request_iterator, "set_state")
        return pb.SetStateReply(version=await self.store.set_state(header, request_iterator))

    @_unary
    async def Leave(self, request: bytes, context) -> pb.LeaveReply:
        return pb.LeaveReply(members=self.store.leave(_parse(pb.LeaveRequest, request, "leave")))

    @_unary
    async def Reset(self, request: bytes, context) -> pb.ResetReply:
        return self.store.reset(_parse(pb.ResetRequest, request, "reset"))

    @_unary
    async def Heartbeat(self, request: bytes, context) -> pb.HeartbeatReply:
        return self.store.heartbeat(_parse(pb.HeartbeatRequest, request, "heartbeat"))

    @_unary
    async def Stats(self, request: bytes, context) -> pb.StatsReply:
        return await self.store.stats(_parse(pb.StatsRequest, request, "stats"))

    @_streaming
    async def Export(self, request: bytes, context) -> AsyncIterator[bytes]:
        req = _parse(pb.ExportRequest, request, "export")
        async for frame in await self.store.export(req, context.time_remaining()):
            yield frame

    @_unary
    async def Checkpoint(self, request: bytes, context) -> pb.CheckpointReply:
        _parse(pb.CheckpointRequest, request, "checkpoint")
        return await self.store.checkpoint()


_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def generic_handler(servicer: ShardServicer) -> grpc.GenericRpcHandler:
    """Handlers for every method of ``shardps.v1.Shard``: raw-bytes requests, Frame responses stay raw."""
    handlers = {}
    for method in SERVICE.methods:
        response_raw = method.output_type.name == "Frame"
        make = _KINDS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=None,
            response_serializer=None if response_raw else getattr(pb, method.output_type.name).SerializeToString,
        )
    return grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)


def _addresses(host: str) -> list[str]:
    """The IP addresses ``host`` names, in resolver order, without repeats.

    Raises:
        RuntimeError: the name does not resolve.
    """
    try:
        infos = socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise RuntimeError(f"could not resolve --host {host!r}: {exc}") from None
    return list(dict.fromkeys(info[4][0] for info in infos))


async def create_server(
    config: ShardConfig, store: ShardStore, health_servicer: health.aio.HealthServicer
) -> tuple[grpc.aio.Server, int]:
    """Build (not start) the gRPC server for one shard and bind it; call from the event loop.

    ``SO_REUSEPORT`` is off and every address the host name resolves to is
    bound on the same port, so a port another process listens on is an
    error here instead of two shards silently sharing it.

    Returns:
        ``(server, port)``; ``port`` is the bound port (useful with ``config.port == 0``).

    Raises:
        RuntimeError: the address could not be bound (in use, or not an address of this host).
    """
    server = grpc.aio.server(options=[*channel_options(config.max_message_bytes), ("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((generic_handler(ShardServicer(store)),))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = config.port
    for ip in _addresses(config.host):  # every address the host name resolves to, or none at all
        address = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
        try:
            bound = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise RuntimeError(f"could not bind {address} (is another process listening there?): {exc}") from None
        if bound == 0 or (port and bound != port):
            raise RuntimeError(f"could not bind {address} (is another process listening there?)")
        port = bound
    for name in ("", SERVICE.full_name):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port

"""gRPC adapter over :class:`ShardStore`: one asyncio servicer for ``shardps.v1.Shard``, plus health.

The server is a ``grpc.aio`` server: a call that waits for a version is a
suspended coroutine, not a blocked thread, so waiting calls never starve
Stats, Join, pushes or the health check, and a cancelled call is woken and
freed at once.

Every method takes its request as raw bytes (identity deserializers) and
parses it itself, so a malformed body gets INVALID_ARGUMENT instead of
gRPC's INTERNAL; ``Frame`` streams stay raw bytes end to end so chunk
payloads are never copied through protobuf objects (see
``shardps.common.codec``). A :class:`~shardps.server.errors.ShardError` becomes
the status of the same name; anything else is a bug: logged with its
traceback and answered INTERNAL.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shardps.proto import shardps_pb2 as pb
from shardps.common.codec import encode_control
from shardps.common.security import read_token_file, server_credentials
from shardps.common.transport import channel_options
from shardps.server import checks, streams
from shardps.server.auth import HANDLER_KINDS, BearerTokenInterceptor
from shardps.server.config import ShardConfig
from shardps.server.errors import InvalidArgument, ResourceExhausted, ShardError, stopped_with
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
        if header.streamed:
            async for frame in self.store.push_pull_streamed(header, request_iterator):
                yield frame
            return
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
        for frame in await self.store.between_rounds.get_state(_parse(pb.StateRequest, request, "get_state")):
            yield frame

    @_unary
    async def SetState(self, request_iterator, context) -> pb.SetStateReply:
        header = await _round_header(request_iterator, "set_state")
        return pb.SetStateReply(version=await self.store.between_rounds.set_state(header, request_iterator))

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
        req = _parse(pb.StatsRequest, request, "stats")
        _check_stats_size(self.store, req.plan)
        return await self.store.stats(req)

    @_streaming
    async def Export(self, request: bytes, context) -> AsyncIterator[bytes]:
        req = _parse(pb.ExportRequest, request, "export")
        async for frame in await self.store.between_rounds.export(req, context.time_remaining()):
            yield frame

    @_unary
    async def Checkpoint(self, request: bytes, context) -> pb.CheckpointReply:
        _parse(pb.CheckpointRequest, request, "checkpoint")
        return await self.store.checkpoints.reply()

    @_unary
    async def DeclareTables(self, request: bytes, context) -> pb.DeclareTablesReply:
        return self.store.tables.declare(_parse(pb.DeclareTablesRequest, request, "declare_tables"))

    @_unary
    async def PullRows(self, request: bytes, context) -> bytes:
        # the reply's bytes, sized and held against the memory budget until the call ends (sparse/replies.py)
        req = _parse(pb.PullRowsRequest, request, "pull_rows")
        return await self.store.tables.pull(req, context.time_remaining(), sent=context.add_done_callback)

    @_unary
    async def PushRows(self, request: bytes, context) -> pb.PushRowsReply:
        return await self.store.tables.push(_parse(pb.PushRowsRequest, request, "push_rows"), context.time_remaining())

    @_unary
    async def ExportRows(self, request: bytes, context) -> bytes:
        return await self.store.tables.export(_parse(pb.ExportRowsRequest, request, "export_rows"),
                                              sent=context.add_done_callback)


def _check_stats_size(store: ShardStore, with_plan: bool) -> None:
    """Refuse a Stats reply over the shard's send limit before it is built. What grows in it: the members' ids
    (``members``, ``pushed``, ``clocks``: at most ``--max-workers`` of ``--max-id-chars``), the members a restored
    checkpoint still waits for, the tables' specs (at most 64), and the plan when asked (as large as the Join or
    the checkpoint that brought it).

    Raises:
        ResourceExhausted: naming the sizes and ``--max-message-bytes``.
    """
    ids = store.members.ids()
    members = sum(len(w.encode()) + 6 for w in ids) + sum(len(w.encode()) + 6 for w in store.rounds.rejoining)
    tables = sum(len(t.spec.to_proto().SerializeToString()) + 6 for t in store.tables.tables.values())
    plan = len(store.job.plan_bytes) + 6 if with_plan and store.job is not None else 0
    size = 2 * members + 11 * (len(ids) + len(store.rounds.staleness.counts)) + tables + plan + (16 << 10)
    limit = store.config.max_message_bytes
    if size > limit:
        raise ResourceExhausted(
            f"the Stats reply would take up to {size} bytes ({len(ids)} members' ids: {members} bytes, "
            f"{len(store.tables.tables)} tables' specs: {tables} bytes, the plan: {plan} bytes), over the shard's "
            f"message limit of {limit} bytes (--max-message-bytes): ask without the plan, or raise "
            "--max-message-bytes")


def _serializer(cls):
    """``cls.SerializeToString``, passing ``bytes`` through: a reply its handler encoded itself (PullRows,
    ExportRows: ``sparse/replies.py``) is sent as it is, never copied into a message and out again."""

    def serialize(reply) -> bytes:
        return reply if isinstance(reply, bytes) else cls.SerializeToString(reply)

    return serialize


def generic_handler(servicer: ShardServicer) -> grpc.GenericRpcHandler:
    """Handlers for every method of ``shardps.v1.Shard``: raw-bytes requests, Frame responses stay raw, and so
    do replies a handler returns as bytes (:func:`_serializer`)."""
    handlers = {}
    for method in SERVICE.methods:
        response_raw = method.output_type.name == "Frame"
        make = HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=None,
            response_serializer=None if response_raw else _serializer(getattr(pb, method.output_type.name)),
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


def _bind(server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None,
          flag: str) -> int:
    """Bind ``server`` on every address ``host`` resolves to, all on one port (0: a free one); the port.

    Raises:
        RuntimeError: an address could not be bound (the message names ``flag``, the port's flag).
    """
    for ip in _addresses(host):  # every address the host name resolves to, or none at all
        address = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
        try:
            bound = server.add_insecure_port(address) if credentials is None else \
                server.add_secure_port(address, credentials)
        except RuntimeError as exc:
            raise RuntimeError(f"could not bind {address} ({flag}; is another process listening there?): "
                               f"{exc}") from None
        if bound == 0 or (port and bound != port):
            raise RuntimeError(f"could not bind {address} ({flag}; is another process listening there?)")
        port = bound
    return port


@dataclass
class ShardServers:
    """The gRPC servers of one shard, bound but not started.

    Attributes:
        server: the main server (``shardps.v1.Shard`` and health; TLS and token checks as configured).
        port: its bound port.
        health_server: the plaintext server holding only ``grpc.health.v1.Health`` (``--health-port``),
            or None.
        health_port: its bound port, -1 without one.
    """

    server: grpc.aio.Server
    port: int
    health_server: grpc.aio.Server | None = None
    health_port: int = -1

    async def start(self) -> None:
        """Start serving on every port."""
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()

    async def stop(self, grace: float | None) -> None:
        """Stop every server, letting in-flight calls finish for ``grace`` seconds (None: cancel them)."""
        servers = [self.server] + ([self.health_server] if self.health_server is not None else [])
        await asyncio.gather(*(s.stop(grace) for s in servers))


async def _check_credentials(credentials: grpc.ServerCredentials) -> None:
    """Make gRPC load ``credentials`` now, on a scratch server on a free loopback port.

    gRPC reads PEM contents only when a port is bound. It would report a bad certificate like a port in use.

    Raises:
        RuntimeError: gRPC cannot use the certificate, key or CA.
    """
    probe = grpc.aio.server()
    try:
        probe.add_secure_port("127.0.0.1:0", credentials)
    except RuntimeError:
        raise RuntimeError("--tls-cert/--tls-key/--tls-ca: gRPC cannot use them: a file is not a valid PEM "
                           "certificate or key, or --tls-key is not the key of --tls-cert") from None
    finally:
        await probe.stop(None)


def _security(config: ShardConfig) -> tuple[grpc.ServerCredentials | None, list[grpc.aio.ServerInterceptor]]:
    """The main port's TLS credentials (None: plaintext) and the token check (or none) that ``config`` asks for.

    Raises:
        RuntimeError: a file is missing, unreadable or not PEM, or the TLS flags do not fit together
            (the message names the flag).
    """
    try:
        credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_ca) \
            if config.tls_cert or config.tls_key else None
        auth = [BearerTokenInterceptor(read_token_file(config.auth_token_file))] if config.auth_token_file else []
    except ValueError as exc:
        raise RuntimeError(str(exc)) from None
    return credentials, auth


async def create_server(
    config: ShardConfig, store: ShardStore, health_servicer: health.aio.HealthServicer, *,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> ShardServers:
    """Build (not start) the gRPC servers of one shard and bind them; call from the event loop.

    The main server holds ``shardps.v1.Shard`` and ``grpc.health.v1.Health`` on
    ``config.port``: TLS with ``config.tls_cert``/``config.tls_key``, mutual TLS
    when ``config.tls_ca`` is set too, and a bearer-token check of every Shard
    call with ``config.auth_token_file`` (``shardps.server.auth``; health calls
    are not checked). ``interceptors`` run before the token check, so they
    see refused calls too. With ``config.health_port >= 0`` a second,
    plaintext server holds only ``health_servicer`` (the same instance: one
    status for both) on that port, for probes that cannot do TLS.

    ``SO_REUSEPORT`` is off and every address the host name resolves to is
    bound on the same port, so a port another process listens on is an
    error here instead of two shards silently sharing it.

    Returns:
        The servers and their bound ports (useful with port 0); start them with ``await servers.start()``.

    Raises:
        RuntimeError: an address could not be bound (in use, or not an address of this host); a TLS or
            token file is missing, unreadable or malformed (the message names the flag); the hard limit on
            open files is below what ``--max-connections`` needs (``streams.server_options``).
    """
    credentials, auth = _security(config)
    if credentials is not None:
        await _check_credentials(credentials)
    options = [*channel_options(config.max_message_bytes), ("grpc.so_reuseport", 0)]
    server = grpc.aio.server(options=[*options, *streams.server_options(config)],  # caps: see streams.py
                             interceptors=[*interceptors, streams.StreamLimiter(config, store.metrics), *auth])
    server.add_generic_rpc_handlers((generic_handler(ShardServicer(store)),))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    servers = ShardServers(server, _bind(server, config.host, config.port, credentials, "--port"))
    log.info("shard %d: %s, %s", config.shard_index,
             "plaintext" if credentials is None else "mutual TLS" if config.tls_ca else "TLS",
             "bearer token required" if auth else "no token required")
    if config.health_port >= 0:
        servers.health_server = grpc.aio.server(options=[*options, *streams.HEALTH_OPTIONS])
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, servers.health_server)
        servers.health_port = _bind(servers.health_server, config.host, config.health_port, None, "--health-port")
        log.info("shard %d: plaintext health service on %s:%d", config.shard_index, config.host,
                 servers.health_port)
    for name in ("", SERVICE.full_name):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return servers

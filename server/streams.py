"""Caps on the calls a shard serves at once, and the end of streams whose client stopped sending.

Every ``shardps.v1.Shard`` call is an HTTP/2 stream. A client that opens
streams and never finishes them (a Push that sends its header and then
nothing) would otherwise hold a coroutine, gRPC's buffers and a slot of
``--max-waiting`` each, for ever. :class:`StreamLimiter`, a ``grpc.aio``
server interceptor, bounds them:

- ``--max-streams-per-peer``: calls open at once from one client host (the
  peer's IP address, whatever its port or connection); one more gets
  RESOURCE_EXHAUSTED naming the flag. A worker uses a handful; a node of
  local ranks a few dozen.
- ``--max-streams``: calls open at once from everyone; one more gets
  RESOURCE_EXHAUSTED naming the flag.
- ``--stream-idle-seconds``: a call that waits this long for the next frame
  of its client's request stream ends with DEADLINE_EXCEEDED naming the flag.
  Only the time the shard spends waiting to read counts: a PushPull waiting
  for a slow round, a Pull waiting for a version (up to ``--max-wait-seconds``)
  or a response the client reads slowly are not idle streams. The wait for
  a worker's RoundCommit (rounds that clip or scale) is a read: it lasts until
  every shard reported to the worker, so the flag must exceed that.

``grpc.health.v1.Health`` is never counted nor refused, so probes answer
while the caps are reached (gRPC's own ``maximum_concurrent_rpcs`` would
refuse them too).

File descriptors grow with connections, not streams. :func:`server_options`
caps the main port's connections at ``--max-connections`` (gRPC's
``grpc.max_allowed_incoming_connections``: one more is closed as soon as it is
accepted), closes connections with no call for ``--connection-idle-seconds``
and allows one connection at most ``--max-streams-per-peer`` streams; the
``--health-port`` server takes at most :data:`HEALTH_MAX_CONNECTIONS`. So a
shard holds at most its descriptors at start + ``--max-connections`` +
``HEALTH_MAX_CONNECTIONS`` (+ the metrics endpoint's scrapes) open files;
:func:`server_options` raises the soft ``RLIMIT_NOFILE`` to fit that bound and
refuses to start when the hard limit cannot.

A unary call (Join, Pull, Stats...) is counted once gRPC has received its
request message; one whose message never comes is bounded by the streams a
connection may carry and the connections, and ends with its connection.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from urllib.parse import unquote

import grpc

from shardps.proto import shardps_pb2 as pb
from shardps.server.auth import HANDLER_KINDS
from shardps.server.config import ShardConfig
from shardps.server.errors import DeadlineExceeded, stop_call
from shardps.server.metrics import ShardMetrics

log = logging.getLogger(__name__)

_PREFIX = f"/{pb.DESCRIPTOR.services_by_name['Shard'].full_name}/"
#: Connections the plaintext ``--health-port`` server accepts at once (probes open one each).
HEALTH_MAX_CONNECTIONS = 64
#: Descriptors a shard needs besides its connections: listening sockets, the metrics endpoint,
#: checkpoint files, logs, the event loop and torch's threads.
FD_RESERVE = 256
#: gRPC options of the ``--health-port`` server.
HEALTH_OPTIONS = [("grpc.max_allowed_incoming_connections", HEALTH_MAX_CONNECTIONS)]


def fd_bound(config: ShardConfig) -> int:
    """Open files a shard with ``config`` may need: its connections plus :data:`FD_RESERVE`."""
    return config.max_connections + HEALTH_MAX_CONNECTIONS + FD_RESERVE


def server_options(config: ShardConfig) -> list[tuple[str, int]]:
    """gRPC options of the main port's server that bound its connections (see the module docstring).

    Raises the process's soft ``RLIMIT_NOFILE`` to :func:`fd_bound` when it is lower.

    Raises:
        RuntimeError: the hard limit is below :func:`fd_bound` (the message names ``--max-connections``).
    """
    need = fd_bound(config)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise RuntimeError(
                f"--max-connections {config.max_connections} needs {need} open files but this process may open "
                f"at most {hard} (ulimit -Hn): lower --max-connections or raise the limit"
            )
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    return [
        ("grpc.max_allowed_incoming_connections", config.max_connections),
        ("grpc.max_concurrent_streams", config.max_streams_per_peer),
        ("grpc.max_connection_idle_ms", int(config.connection_idle_seconds * 1000)),
    ]


def peer_host(peer: str) -> str:
    """The client host of a gRPC peer string: ``ipv4:10.0.0.5:4242`` -> ``10.0.0.5``,
    ``ipv6:[::1]:4242`` -> ``::1``; anything else (``unix:...``) as it is."""
    kind, _, rest = peer.partition(":")
    rest = unquote(rest)  # some gRPC versions write ipv6:%5B::1%5D:4242
    if kind in ("ipv4", "ipv6") and rest:
        return rest.rpartition(":")[0].strip("[]") or rest
    return peer


class _Watched:
    """A call's request stream that records since when the handler waits for its next frame."""

    __slots__ = ("frames", "since", "task", "method")

    def __init__(self, frames, task: asyncio.Task, method: str) -> None:
        self.frames = frames.__aiter__()
        self.since: float | None = None  # monotonic seconds; None: the handler is not reading
        self.task, self.method = task, method

    def __aiter__(self) -> _Watched:
        return self

    async def __anext__(self) -> bytes:
        self.since = time.monotonic()
        try:
            return await self.frames.__anext__()
        finally:
            self.since = None


class StreamLimiter(grpc.aio.ServerInterceptor):
    """Counts the ``shardps.v1.Shard`` calls open, per peer and in total, refuses those over the caps, and
    ends request streams idle for ``config.stream_idle_seconds`` (see the module docstring).

    Attributes:
        open: calls open now.
        refused: calls refused over a cap so far.

    Args:
        config: ``max_streams``, ``max_streams_per_peer`` and ``stream_idle_seconds`` are read.
        metrics: where refusals (``stream_refused``) and open calls (``streams_open``) are recorded.
    """

    #: Refusals are logged at the first one, then once per this many.
    LOG_EVERY = 1000

    def __init__(self, config: ShardConfig, metrics: ShardMetrics) -> None:
        self.config, self.metrics = config, metrics
        self.open = self.refused = 0
        self._by_peer: dict[str, int] = {}
        self._reading: set[_Watched] = set()
        self._timer: asyncio.TimerHandle | None = None

    def _refusal(self, method: str, host: str) -> str | None:
        """Why one more call of ``method`` from ``host`` is refused, or None (then it is counted)."""
        cfg = self.config
        if self._by_peer.get(host, 0) >= cfg.max_streams_per_peer:
            return self._refuse("per_peer", f"{method}: {host} already has {self._by_peer[host]} calls open on this "
                                f"shard (--max-streams-per-peer {cfg.max_streams_per_peer}); finish or cancel some, "
                                "or raise the shard's --max-streams-per-peer")
        if self.open >= cfg.max_streams:
            return self._refuse("total", f"{method}: this shard already serves {self.open} calls (--max-streams "
                                f"{cfg.max_streams}); try again later, or raise the shard's --max-streams")
        self.open += 1
        self._by_peer[host] = self._by_peer.get(host, 0) + 1
        self.metrics.streams_open(self.open)
        return None

    def _refuse(self, reason: str, message: str) -> str:
        """Count a refusal; log the first one, then one in :data:`LOG_EVERY` (a flood is not a log flood)."""
        self.metrics.stream_refused(reason)
        self.refused += 1
        if self.refused % self.LOG_EVERY == 1:
            log.warning("refused a call: %s (%d refused so far)", message, self.refused)
        return message

    def _closed(self, host: str, watched: _Watched | None) -> None:
        self.open -= 1
        left = self._by_peer[host] - 1
        if left:
            self._by_peer[host] = left
        else:
            del self._by_peer[host]
        self.metrics.streams_open(self.open)
        if watched is not None:
            self._reading.discard(watched)

    def _watch(self, frames, method: str) -> _Watched:
        watched = _Watched(frames, asyncio.current_task(), method)
        self._reading.add(watched)
        if self._timer is None:
            self._arm()
        return watched

    def _arm(self) -> None:
        interval = min(1.0, self.config.stream_idle_seconds / 4)
        self._timer = asyncio.get_running_loop().call_later(interval, self._sweep)

    def _sweep(self) -> None:
        """End the calls that have waited ``stream_idle_seconds`` for a frame; re-arm while calls read."""
        self._timer = None
        limit = self.config.stream_idle_seconds
        now = time.monotonic()
        idle = [w for w in self._reading if w.since is not None and now - w.since >= limit]
        if idle:
            log.warning("ended %d call(s) whose client sent no frame for %gs (--stream-idle-seconds): %s", len(idle),
                        limit, sorted({w.method for w in idle}))
        for watched in idle:
            self._reading.discard(watched)
            self.metrics.stream_refused("idle")
            stop_call(watched.task, DeadlineExceeded(
                f"{watched.method}: the client sent no frame for {limit:g}s while the shard waited for one "
                "(--stream-idle-seconds); the stream is ended. Send the whole request without pausing, or raise "
                "the shard's --stream-idle-seconds"))
        if self._reading:
            self._arm()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        """The handler, wrapped to be counted and refused over the caps (other services pass as they are)."""
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(_PREFIX):
            return handler
        method = handler_call_details.method[len(_PREFIX):]
        request_streaming, response_streaming = bool(handler.request_streaming), bool(handler.response_streaming)
        kind = (request_streaming, response_streaming)
        make = HANDLER_KINDS[kind]

        if response_streaming:
            behavior = handler.unary_stream or handler.stream_stream

            async def streaming(request, context: grpc.aio.ServicerContext) -> AsyncIterator:
                host = peer_host(context.peer())
                problem = self._refusal(method, host)
                if problem is not None:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, problem)
                watched = self._watch(request, method) if request_streaming else None
                try:
                    async for item in behavior(request if watched is None else watched, context):
                        yield item
                finally:
                    self._closed(host, watched)

            return make(streaming, request_deserializer=handler.request_deserializer,
                        response_serializer=handler.response_serializer)
        behavior = handler.unary_unary or handler.stream_unary

        async def unary(request, context: grpc.aio.ServicerContext):
            host = peer_host(context.peer())
            problem = self._refusal(method, host)
            if problem is not None:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, problem)
            watched = self._watch(request, method) if request_streaming else None
            try:
                return await behavior(request if watched is None else watched, context)
            finally:
                self._closed(host, watched)

        return make(unary, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)

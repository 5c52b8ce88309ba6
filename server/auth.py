"""Bearer-token check of every ``shardps.v1.Shard`` call (``shardps-server --auth-token-file``).

A call without ``authorization: Bearer <token>`` metadata, or with another
token, ends with UNAUTHENTICATED before its handler runs, so it changes
nothing on the shard. The refusal uses a handler of the same kind as the
real one (unary or streaming on each side), which neither parses nor reads
the request. ``grpc.health.v1.Health`` is never checked: load balancers and
Kubernetes probes carry no token. Tokens are compared in constant time, and
no message or log line contains the token that was sent or the expected one.

The token only protects anything when nobody else can read it: a shard with
``--auth-token-file`` and no TLS refuses to start on a host that is not
loopback unless ``--allow-token-over-plaintext`` (``ShardConfig`` checks it,
``shardps.common.security.token_over_plaintext_problem``; the shard logs a
WARNING at start when it is allowed), and clients refuse to send it there
the same way (``ChannelSecurity.channel``).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable

import grpc

from shardps.common.security import AUTH_METADATA_KEY, AUTH_SCHEME, check_token

log = logging.getLogger(__name__)

#: Method prefix of the health service, which every caller may use.
HEALTH_PREFIX = "/grpc.health.v1.Health/"

#: ``(request streaming, response streaming)`` -> the gRPC function that makes a handler of that kind.
HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}

_HOW = ("calls to this shard need the metadata 'authorization: Bearer <token>' with the token of the shard's "
        "--auth-token-file (shardps workers and commands: pass the same file with --auth-token-file)")


def _refusal(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind (unary-unary when None) that ends the call with UNAUTHENTICATED."""

    async def refuse(request_or_iterator, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request_or_iterator, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield b""  # never reached; makes this an async generator, as streaming handlers (and their wrappers) expect

    kind = (False, False) if handler is None else (bool(handler.request_streaming), bool(handler.response_streaming))
    return HANDLER_KINDS[kind](refuse_stream if kind[1] else refuse)  # no deserializer: the request is never parsed


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Let through only calls whose metadata holds ``authorization: Bearer <token>`` (health calls always pass).

    Args:
        token: the expected token (visible ASCII, no spaces), e.g. from
            ``shardps.common.security.read_token_file``.

    Raises:
        ValueError: the token is empty or malformed.
    """

    #: Refusals are logged at the first one, then once per this many (a stream of bad calls is not a log flood).
    LOG_EVERY = 1000

    def __init__(self, token: str) -> None:
        self._expected = check_token(token).encode("ascii")
        self.refused = 0  # calls refused so far

    def __repr__(self) -> str:
        return f"BearerTokenInterceptor(<hidden>, refused={self.refused})"

    def problem(self, metadata) -> str | None:
        """Why a call with invocation ``metadata`` ((key, value) pairs) is refused; None if it may go on."""
        values = [value for key, value in (metadata or ()) if key.lower() == AUTH_METADATA_KEY]
        if not values:
            return "missing bearer token"
        value = values[0].decode("latin-1") if isinstance(values[0], bytes) else str(values[0])
        scheme, _, given = value.strip().partition(" ")
        if scheme.lower() != AUTH_SCHEME.lower() or not given.strip():
            return f"the authorization metadata is not '{AUTH_SCHEME} <token>'"
        if not hmac.compare_digest(given.strip().encode("utf-8", "replace"), self._expected):
            return "wrong bearer token"
        return None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        """The real handler if the call may go on, else one that answers UNAUTHENTICATED without running it."""
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if method.startswith(HEALTH_PREFIX):
            return handler
        problem = self.problem(handler_call_details.invocation_metadata)
        if problem is None:
            return handler
        self.refused += 1
        if self.refused % self.LOG_EVERY == 1:
            log.warning("refused %s: %s (%d unauthenticated calls refused so far)", method, problem, self.refused)
        return _refusal(handler, f"{method}: {problem}; {_HOW}")

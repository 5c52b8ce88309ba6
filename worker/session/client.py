"""A connection to one shard: control calls through the generated stub, Frame streams as raw bytes.

Heartbeats go over a second channel with a TCP connection of its own (the
lease channel, opened at the first heartbeat): on one connection they would
queue behind the megabytes of chunks a push has written into HTTP/2's
window and the socket's send buffer, and on a slow link wait longer than
the lease.
"""

from __future__ import annotations

import threading

import grpc

from shardps.proto import shardps_pb2 as pb
from shardps.proto import shardps_pb2_grpc as pb_grpc
from shardps.common.security import ChannelSecurity
from shardps.common.transport import DEFAULT_MAX_MESSAGE_BYTES, channel_options
from shardps.worker.session.exit import DaemonPool
from shardps.worker.session.relay import StreamRelay
from shardps.worker.session.retry import RETRYABLE, RetryPolicy, retry

_SERVICE = pb.DESCRIPTOR.services_by_name["Shard"].full_name

#: Channel arguments of the lease channel besides the main channel's: gRPC shares one connection between the
#: channels of a process with the same target and arguments (its global subchannel pool); a pool of the channel's
#: own gives it a connection of its own.
LEASE_CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1)]


def _joined(frames):
    """Each frame as one ``bytes``, as gRPC sends it: ``(prefix, payload)`` parts joined (the one copy)."""
    for frame in frames:
        yield b"".join(frame) if type(frame) is tuple else frame


#: ``Reset`` is tried again after ABORTED too: the shard refuses it while a round or an Init is still in progress.
RESET_RETRYABLE = RETRYABLE | {grpc.StatusCode.ABORTED}

class ShardRpcError(RuntimeError):
    """A call to a shard failed; ``code`` is the ``grpc.StatusCode`` and ``details`` the shard's message."""

    def __init__(self, shard: int, address: str, what: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"shard {shard} ({address}): {what} failed: {code.name}: {details}")
        self.shard, self.address, self.code, self.details = shard, address, code, details


def _tls_hint(security: ChannelSecurity) -> str:
    """What to check when a connection does not come up: a failed TLS handshake looks like a dead shard."""
    if not security.tls:
        return "If the shard serves TLS (--tls-cert), pass --tls-ca with the CA that signed its certificate."
    client_cert = "the CA of the shard's --tls-ca must have signed the client certificate (--tls-cert)" \
        if security.cert is not None else \
        "a shard started with --tls-ca also needs a client certificate (--tls-cert/--tls-key here)"
    return ("The TLS settings may be wrong: the shard must serve TLS (--tls-cert), --tls-ca here must hold the CA "
            f"that signed the shard's certificate, that certificate must name this host, and {client_cert}.")


class ShardClient:
    """One gRPC channel to shard ``index`` at ``address`` (``host:port``).

    Every call carries a deadline of ``rpc_timeout`` seconds. Calls that are
    safe to repeat (Join, Leave, Reset, Stats, Checkpoint, Pull's start,
    Export) are retried after UNAVAILABLE or DEADLINE_EXCEEDED per ``retry``
    (``shardps.worker.session.retry``), then raise :class:`ShardRpcError`.

    ``security`` (``shardps.common.security``) turns on TLS, mutual TLS and a
    bearer token on the channel; None: plaintext, no token. A shard that
    refuses the token answers every call with UNAUTHENTICATED (not retried).

    Heartbeats use a second channel, with the same address, options and
    ``security`` and a connection of its own (:data:`LEASE_CHANNEL_OPTIONS`),
    opened at the first heartbeat and closed by :meth:`close`.

    Raises:
        ConnectionError: the shard did not answer within ``connect_timeout`` seconds (a failed TLS
            handshake looks the same: the message then points at the TLS settings).
    """

    def __init__(
        self,
        address: str,
        *,
        index: int,
        rpc_timeout: float = 120.0,
        connect_timeout: float = 30.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        retry: RetryPolicy = RetryPolicy(),
        security: ChannelSecurity | None = None,
        stream_process: bool = False,
    ) -> None:
        self.address, self.index, self.rpc_timeout, self.retry = address, index, rpc_timeout, retry
        self.security = security or ChannelSecurity()
        options = channel_options(max_message_bytes)
        self._options = options
        self._lease_lock = threading.Lock()
        self._lease_channel: grpc.Channel | None = None
        self._heartbeat = None
        self._closed = False
        self.channel = self.security.channel(address, options)
        try:
            grpc.channel_ready_future(self.channel).result(timeout=connect_timeout)  # blocking wait
        except grpc.FutureTimeoutError:
            self.channel.close()
            raise ConnectionError(
                f"shard {index} at {address} did not answer within {connect_timeout:.0f}s; "
                f"is shardps-server running there? {_tls_hint(self.security)}"
            ) from None
        self.stub = pb_grpc.ShardStub(self.channel)
        path = f"/{_SERVICE}/"
        self._init = self.channel.stream_unary(path + "Init", response_deserializer=pb.InitReply.FromString)
        self._push = self.channel.stream_unary(path + "Push", response_deserializer=pb.PushReply.FromString)
        self._pull = self.channel.unary_stream(path + "Pull", request_serializer=pb.PullRequest.SerializeToString)
        self._push_pull = self.channel.stream_stream(path + "PushPull")
        self._get_state = self.channel.unary_stream(path + "GetState", request_serializer=pb.StateRequest.SerializeToString)
        self._set_state = self.channel.stream_unary(path + "SetState", response_deserializer=pb.SetStateReply.FromString)
        self._export = self.channel.unary_stream(path + "Export", request_serializer=pb.ExportRequest.SerializeToString)
        #: ``stream_process``: PushPull streams go through a helper process with a channel of its own (relay.py)
        self.relay = StreamRelay(address, {"security": self.security, "options": options}) if stream_process else None

    @staticmethod
    def call_pool(shards: int, name: str) -> DaemonPool:
        """Threads that call up to ``shards`` shards at once, named ``<name>_<n>``: daemon threads that the
        interpreter never waits for at exit (``shardps.worker.session.exit.DaemonPool``; closing the channels
        ends the calls in flight).

        Raises:
            ValueError: ``shards < 1``.
        """
        return DaemonPool(shards, thread_name_prefix=name)

    def error(self, what: str, exc: grpc.RpcError) -> ShardRpcError:
        """Wrap a gRPC error of call ``what`` with this shard's index and address."""
        return ShardRpcError(self.index, self.address, what, exc.code(), exc.details())

    def _unary(self, what: str, fn, request, timeout: float | None = None, repeatable: bool = False,
               retry_on: frozenset = RETRYABLE):
        def attempt():
            try:
                return fn(request, timeout=self.rpc_timeout if timeout is None else timeout)
            except grpc.RpcError as exc:
                raise self.error(what, exc) from None

        if not repeatable:
            return attempt()
        return retry(attempt, self.retry, f"{what} on shard {self.index} ({self.address})",
                     lambda exc: getattr(exc, "code", None), retry_on)

    def join(self, request: pb.JoinRequest) -> pb.JoinReply:
        """Join (raises ShardRpcError, e.g. FAILED_PRECONDITION on a plan mismatch); retried."""
        return self._unary("join", self.stub.Join, request, repeatable=True)

    def leave(self, worker_id: str, session: str, timeout: float | None = None) -> pb.LeaveReply:
        """Leave the shard as member ``worker_id`` of ``session`` (not retried: closing must not linger)."""
        return self._unary("leave", self.stub.Leave, pb.LeaveRequest(worker_id=worker_id, session=session), timeout)

    def reset(self, job_id: str = "") -> pb.ResetReply:
        """Drop the shard's job if it has no members (FAILED_PRECONDITION otherwise); retried, ABORTED too (a
        round or an Init still in progress: the last members' work finishing)."""
        return self._unary("reset", self.stub.Reset, pb.ResetRequest(job_id=job_id), repeatable=True,
                           retry_on=RESET_RETRYABLE)

    def checkpoint(self) -> pb.CheckpointReply:
        """Make the shard write a checkpoint now; retried. FAILED_PRECONDITION without --checkpoint-dir."""
        return self._unary("checkpoint", self.stub.Checkpoint, pb.CheckpointRequest(), repeatable=True)

    def export(self, min_version: int = 0):
        """Start reading the shard's fp32 parameters and buffers at its current version (refused below
        ``min_version``); iterate the call for raw frames."""
        return self._export(pb.ExportRequest(min_version=min_version), timeout=self.rpc_timeout)

    def _heartbeat_call(self):
        """The Heartbeat call of the lease channel, opened at the first use.

        Raises:
            ShardRpcError: CANCELLED, the client is closed.
        """
        with self._lease_lock:
            if self._closed:
                raise ShardRpcError(self.index, self.address, "heartbeat", grpc.StatusCode.CANCELLED,
                                    "the client is closed")
            if self._heartbeat is None:
                self._lease_channel = self.security.channel(self.address, [*self._options, *LEASE_CHANNEL_OPTIONS])
                self._heartbeat = self._lease_channel.unary_unary(
                    f"/{_SERVICE}/Heartbeat", request_serializer=pb.HeartbeatRequest.SerializeToString,
                    response_deserializer=pb.HeartbeatReply.FromString)
            return self._heartbeat

    def heartbeat_future(self, worker_id: str, session: str, timeout: float) -> grpc.Future:
        """Start a Heartbeat over the lease channel without waiting: a ``grpc.Future`` whose ``result()`` is the
        reply (or raises ``grpc.RpcError``; :meth:`error` wraps it). Not retried.

        Raises:
            ShardRpcError: CANCELLED, the client is closed.
        """
        request = pb.HeartbeatRequest(worker_id=worker_id, session=session)
        return self._heartbeat_call().future(request, timeout=timeout)

    def heartbeat(self, worker_id: str, session: str, timeout: float) -> pb.HeartbeatReply:
        """Renew this worker's lease on the shard, over the lease channel; the shard's membership (not retried)."""
        call = self.heartbeat_future(worker_id, session, timeout)
        try:
            return call.result()
        except grpc.RpcError as exc:
            raise self.error("heartbeat", exc) from None

    def stats(self, digest: bool = False, plan: bool = False, timeout: float | None = None,
              retried: bool = True) -> pb.StatsReply:
        """The shard's Stats (retried unless ``retried=False``); ``digest`` also hashes its parameters and
        optimizer state (reads every byte); ``plan`` adds the job's partition plan."""
        return self._unary("stats", self.stub.Stats, pb.StatsRequest(digest=digest, plan=plan), timeout,
                           repeatable=retried)

    def init(self, frames) -> pb.InitReply:
        """Send the initial parameters (an iterator of encoded frames, round header first)."""
        return self._unary("init", self._init, frames)

    def push(self, frames) -> pb.PushReply:
        """Push one round's gradients (encoded frames, round header first)."""
        return self._unary("push", self._push, frames)

    def pull(self, request: pb.PullRequest):
        """Start a pull; iterate the returned call for raw frames (grpc.RpcError on failure)."""
        return self._pull(request, timeout=self.rpc_timeout)

    def push_pull(self, frames):
        """Start a push-then-pull round trip; iterate the returned call for the raw parameter frames (through the
        stream process with ``stream_process=True``: the same frames, the same errors).

        ``frames``: ``bytes``, or ``(prefix, payload)`` parts of one frame (``encode_chunk_parts``), each
        written before the next is taken."""
        if self.relay is not None:
            return self.relay.stream(f"/{_SERVICE}/PushPull", frames, self.rpc_timeout)
        return self._push_pull(_joined(frames), timeout=self.rpc_timeout)

    def get_state(self, request: pb.StateRequest):
        """Start reading the shard's optimizer state; iterate the call for raw frames (grpc.RpcError on failure)."""
        return self._get_state(request, timeout=self.rpc_timeout)

    def set_state(self, frames) -> pb.SetStateReply:
        """Replace the shard's optimizer state (encoded frames, round header first)."""
        return self._unary("set_state", self._set_state, frames)

    def declare_tables(self, request: pb.DeclareTablesRequest) -> pb.DeclareTablesReply:
        """Declare sparse tables (idempotent; FAILED_PRECONDITION: held with another spec); retried."""
        return self._unary("declare_tables", self.stub.DeclareTables, request, repeatable=True)

    def pull_rows(self, request: pb.PullRowsRequest) -> pb.PullRowsReply:
        """Rows of one table (a read: retried)."""
        return self._unary("pull_rows", self.stub.PullRows, request, repeatable=True)

    def pull_rows_future(self, request: pb.PullRowsRequest) -> grpc.Future:
        """Start a pull of rows without waiting (not retried): a ``grpc.Future`` (``result()`` raises
        ``grpc.RpcError``; ``cancel()`` ends it)."""
        return self.stub.PullRows.future(request, timeout=self.rpc_timeout)

    def push_rows(self, request: pb.PushRowsRequest) -> pb.PushRowsReply:
        """One step's row gradients; retried (a retry carries the same push number and is counted once)."""
        return self._unary("push_rows", self.stub.PushRows, request, repeatable=True)

    def export_rows(self, table: str, state: bool = False, timeout: float | None = None, offset: int = 0,
                    max_rows: int = 0, since_round: int = 0) -> pb.ExportRowsReply:
        """Rows ``[offset, offset + max_rows)`` (0: all) of ``table`` on this shard in id order, with optimizer
        state if ``state``; ``since_round`` > 0: of the rows last pushed in rounds ``>= since_round`` only (a
        delta; page 0 lists the ids evicted since). Read-only, retried."""
        request = pb.ExportRowsRequest(table=table, state=state, offset=offset, max_rows=max_rows,
                                       since_round=since_round)
        return self._unary("export_rows", self.stub.ExportRows, request, timeout, repeatable=True)

    def close(self) -> None:
        """Close the channels and the stream process (calls still running on them fail with CANCELLED)."""
        with self._lease_lock:
            self._closed = True
            lease, self._lease_channel, self._heartbeat = self._lease_channel, None, None
        if lease is not None:
            lease.close()
        if self.relay is not None:
            self.relay.close()
        self.channel.close()

"""A real gRPC server that pretends to be a shard and misbehaves, for the operator commands' tests.

It serves ``shardps.v1.Shard`` (every method, raw bytes in and out) and
``grpc.health.v1.Health`` on ``127.0.0.1:<free port>``, in one of three modes:

- ``"oversized"``: every reply declares more than it carries or than the
  protocol allows, with terminal escape sequences in every text: Stats lists
  far more members than its ``max_workers`` and a plan of an 8 GiB
  parameter; Export sends a chunk that declares 2^40 elements over 16
  bytes; Reset and Checkpoint answer with a job id / path of 1 MiB; Health
  answers with status 7, which no health service defines;
- ``"abort"``: every call ends with INTERNAL and details full of escapes;
- ``"stuck"``: every call is accepted and never answered (until the client
  gives up or the server stops).
"""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2

from shardps.proto import shardps_pb2 as pb

#: What a hostile reply puts in its texts: clear the screen, retitle the terminal, ring, move the cursor.
ESCAPES = "\x1b[2J\x1b]0;pwned\x07\x1b[31m\x9b1A"
MODES = ("oversized", "abort", "stuck")
_SHARD = "shardps.v1.Shard"
_METHODS = {m.name: (m.client_streaming, m.server_streaming)
            for m in pb.DESCRIPTOR.services_by_name["Shard"].methods}


def _stats() -> bytes:
    member = ESCAPES + "w" * 16
    reply = pb.StatsReply(
        shard_index=0, num_shards=1, max_workers=4, initialised=True, version=2**64 - 1,
        job_id=ESCAPES + "job", plan_fingerprint="f" * 16, optimizer=ESCAPES, num_chunks=2**32 - 1,
        param_bytes=2**64 - 1, members=[member] * ((6 << 20) // len(member.encode())),
        plan=pb.PlanSpec(keys=[pb.KeySpec(key=ESCAPES + "w", shape=[1 << 31], group=0)], num_shards=1,
                         chunk_bytes=4 << 20),
    )
    return reply.SerializeToString()


def _export_frame() -> bytes:
    header = pb.ChunkHeader(key=ESCAPES + "w", offset=0, numel=1 << 40, dtype=pb.FLOAT32, version=1)
    return pb.Frame(header=header, payload=b"\x1b" * 16).SerializeToString()


class HostileServer:
    """A started hostile server; ``address`` is ``127.0.0.1:PORT``. ``stop()`` ends it (also as a context manager)."""

    def __init__(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode, self.calls = mode, 0
        self._stop = threading.Event()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=32),
                                   options=[("grpc.max_send_message_length", 16 << 20)])
        handlers = {name: self._handler(name, *kinds) for name, kinds in _METHODS.items()}
        self._server.add_generic_rpc_handlers((
            grpc.method_handlers_generic_handler(_SHARD, handlers),
            grpc.method_handlers_generic_handler("grpc.health.v1.Health", {
                "Check": grpc.unary_unary_rpc_method_handler(self._check),
                "Watch": grpc.unary_stream_rpc_method_handler(self._watch),
            }),
        ))
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        self._server.start()

    def __enter__(self) -> "HostileServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop serving; calls still waiting in ``"stuck"`` mode end at once."""
        self._stop.set()
        self._server.stop(grace=None).wait(10)

    # ---- behaviour ----------------------------------------------------------------------------------------

    def _misbehave(self, context: grpc.ServicerContext) -> None:
        """The ``abort`` and ``stuck`` modes; returns only in ``oversized`` mode."""
        self.calls += 1
        if self.mode == "abort":
            context.abort(grpc.StatusCode.INTERNAL, ESCAPES + " shard on fire " + ESCAPES)
        if self.mode == "stuck":
            for _ in range(6000):  # at most 10 minutes; a client that gives up ends it sooner
                if self._stop.wait(0.1) or not context.is_active():
                    break
            context.abort(grpc.StatusCode.UNAVAILABLE, "stopped")

    def _reply(self, name: str) -> bytes:
        if name == "Stats":
            return _stats()
        if name == "Reset":
            return pb.ResetReply(job_id=ESCAPES + "j" * (1 << 20), version=2**64 - 1).SerializeToString()
        if name == "Checkpoint":
            return pb.CheckpointReply(version=2**64 - 1, path=ESCAPES + "/p" * (1 << 19)).SerializeToString()
        return b""

    def _handler(self, name: str, request_streaming: bool, response_streaming: bool) -> grpc.RpcMethodHandler:
        def unary(request, context):
            if request_streaming:
                for _ in request:
                    pass
            self._misbehave(context)
            return self._reply(name)

        def stream(request, context):
            if request_streaming:
                for _ in request:
                    pass
            self._misbehave(context)
            yield _export_frame()

        kind = {(False, False): grpc.unary_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}[(request_streaming, response_streaming)]
        return kind(stream if response_streaming else unary)  # raw bytes: no (de)serializers

    def _check(self, request: bytes, context) -> bytes:
        self._misbehave(context)
        return health_pb2.HealthCheckResponse(status=7).SerializeToString()

    def _watch(self, request: bytes, context):
        self._misbehave(context)
        yield health_pb2.HealthCheckResponse(status=7).SerializeToString()

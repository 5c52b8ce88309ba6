"""``ShardClient.reset`` tries again while the shard answers ABORTED ("a round or an Init is in progress; try
again": the last members' work finishing), as that answer asks; other calls do not retry ABORTED. A real gRPC
server on a free port stands in for the shard's two methods."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from shardps.proto import shardps_pb2 as pb
from shardps.worker.session.client import ShardClient, ShardRpcError


@pytest.fixture
def busy_shard():
    """A server whose Reset answers ABORTED twice, then drops job "j" at version 7; Checkpoint always ABORTED."""
    calls = {"Reset": 0, "Checkpoint": 0}

    def reset(request, context):
        calls["Reset"] += 1
        if calls["Reset"] <= 2:
            context.abort(grpc.StatusCode.ABORTED, "a round or an Init is in progress; try again")
        return pb.ResetReply(job_id="j", version=7)

    def checkpoint(request, context):
        calls["Checkpoint"] += 1
        context.abort(grpc.StatusCode.ABORTED, "busy")

    handlers = {
        "Reset": grpc.unary_unary_rpc_method_handler(reset, request_deserializer=pb.ResetRequest.FromString,
                                                     response_serializer=pb.ResetReply.SerializeToString),
        "Checkpoint": grpc.unary_unary_rpc_method_handler(
            checkpoint, request_deserializer=pb.CheckpointRequest.FromString,
            response_serializer=pb.CheckpointReply.SerializeToString),
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("shardps.v1.Shard", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = ShardClient(f"127.0.0.1:{port}", index=0)
    try:
        yield client, calls
    finally:
        client.close()
        server.stop(None)


def test_reset_is_tried_again_while_the_shard_says_a_round_is_in_progress(busy_shard):
    client, calls = busy_shard
    reply = client.reset()
    assert (reply.job_id, reply.version) == ("j", 7) and calls["Reset"] == 3


def test_other_repeatable_calls_do_not_retry_aborted(busy_shard):
    client, calls = busy_shard
    with pytest.raises(ShardRpcError) as info:
        client.checkpoint()
    assert info.value.code == grpc.StatusCode.ABORTED and calls["Checkpoint"] == 1

"""Bad input gets a clear gRPC status and leaves the shard's state untouched (real shard processes)."""

from __future__ import annotations

import grpc
import pytest
import torch
from torch import nn

from shardps.proto import shardps_pb2 as pb
from shardps.common.codec import encode_chunk, encode_round
from shardps.common.optim import optimizer_spec
from shardps.common.plan import KeyInfo, PartitionPlan
from shardps.worker.session.client import ShardClient, ShardRpcError
from shardps.worker.config import WireOptions
from shardps.worker.optimizer import DistributedOptimizer
from tests.support.raw import RawWorker

CHUNK_BYTES = 256


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(20, 10)  # weight: 200 elements = 4 chunks of 64 (last 8); bias: 1 chunk


@pytest.fixture
def joined(start_cluster):
    """One shard with one joined worker ``w0``; yields (cluster, dist, raw client)."""
    cluster = start_cluster(1)
    m = model()
    dist = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), m.named_parameters(),
                                servers=cluster.addresses, worker_id="w0", wire=WireOptions(chunk_bytes=CHUNK_BYTES))
    client = ShardClient(cluster.addresses[0], index=0, rpc_timeout=10.0)
    yield cluster, dist, m, client
    client.close()
    dist.close()


def as_w0(dist: DistributedOptimizer, client: ShardClient) -> RawWorker:
    """Hand-made calls of the joined member w0 (its own session)."""
    return RawWorker(client, "w0", dist.plan, dist._spec, session=dist.session)


def pull_params(client: ShardClient, dist: DistributedOptimizer) -> bytes:
    return as_w0(dist, client).pull()


def push_frames(dist: DistributedOptimizer, chunks: list[tuple[str, int, torch.Tensor]], round_: int = 0):
    w0 = RawWorker(None, "w0", dist.plan, dist._spec, session=dist.session)
    yield from w0.frames(w0.header(round_), chunks, trailer=w0.trailer([0.1]))


def good_chunks(dist: DistributedOptimizer) -> list[tuple[str, int, torch.Tensor]]:
    return [(c.key, c.offset, torch.full((c.numel,), 0.5)) for c in dist.plan.chunks]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda ch: [("nope.weight", 0, torch.ones(64)), *ch[1:]], "unknown key 'nope.weight'"),
        (lambda ch: [(ch[0][0], ch[0][1], torch.ones(63)), *ch[1:]], "has 63 elements; the partition plan says 64"),
        (lambda ch: [(ch[0][0], 5, ch[0][2]), *ch[1:]], "no chunk starting at element 5"),
        (lambda ch: ch[:-1], "1 of 5 chunks missing"),
        (lambda ch: [ch[0], *ch], "sent twice"),
        (lambda ch: [(ch[0][0], 0, torch.full((64,), float("nan"))), *ch[1:]], "NaN or Inf"),
    ],
)
def test_bad_push_is_rejected_and_changes_nothing(joined, mutate, message) -> None:
    _, dist, _, client = joined
    before_stats = client.stats()
    before = pull_params(client, dist)
    with pytest.raises(ShardRpcError) as err:
        client.push(push_frames(dist, mutate(good_chunks(dist))))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details
    after_stats = client.stats()
    assert after_stats.version == before_stats.version == 0
    assert list(after_stats.pushed) == []
    assert pull_params(client, dist) == before
    # the shard still works: a correct push of the same round is accepted and applied
    assert client.push(push_frames(dist, good_chunks(dist))).version == 1


def test_push_of_wrong_round_or_non_member(joined) -> None:
    _, dist, _, client = joined
    with pytest.raises(ShardRpcError, match="pushed round 3 but the shard is collecting round 0") as err:
        client.push(push_frames(dist, good_chunks(dist), round_=3))
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    frames = list(push_frames(dist, good_chunks(dist)))
    frames[0] = encode_round(pb.RoundHeader(worker_id="stranger", session="s", plan_fingerprint=dist.plan.fingerprint))
    with pytest.raises(ShardRpcError, match="not a member"):
        client.push(iter(frames))
    assert client.stats().version == 0


def test_duplicate_push_is_not_double_counted(joined) -> None:
    _, dist, m, client = joined
    for _ in range(2):
        assert client.push(push_frames(dist, good_chunks(dist))).version == 1
    assert client.stats().version == 1
    # a retry of round 0 after it was applied is still ignored
    assert client.push(push_frames(dist, good_chunks(dist))).version == 1


def test_rejected_optimizer(start_cluster) -> None:
    cluster = start_cluster(1)
    m = model()
    plan = PartitionPlan.build([KeyInfo("weight", (10, 20), 0), KeyInfo("bias", (10,), 0)], num_shards=1,
                               chunk_bytes=CHUNK_BYTES)
    client = ShardClient(cluster.addresses[0], index=0)
    try:
        for name in ("LAMB", "LBFGS"):
            spec = pb.OptimizerSpec(class_name=name, group_hyperparams_json=['{"lr": 0.1}'])
            with pytest.raises(ShardRpcError, match="only element-wise optimizers") as err:
                RawWorker(client, "w", plan, spec).join()
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        stats = client.stats()
        assert list(stats.members) == [] and stats.plan_fingerprint == ""
        # the worker API refuses before any call
        with pytest.raises(ValueError, match="element-wise"):
            DistributedOptimizer(torch.optim.LBFGS(m.parameters()), m.named_parameters(),
                                 servers=cluster.addresses)
        # and the same shard then accepts a shardable optimizer
        good = optimizer_spec(torch.optim.Adam(m.parameters()))
        assert RawWorker(client, "w", plan, good).join().initialise
    finally:
        client.close()


def test_plan_mismatch_is_rejected(joined) -> None:
    cluster, dist, _, client = joined
    other = nn.Linear(20, 11)  # different shapes -> different plan
    with pytest.raises(ShardRpcError, match="partition plan fingerprint") as err:
        DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9), other.named_parameters(),
                             servers=cluster.addresses, worker_id="w1", wire=WireOptions(chunk_bytes=CHUNK_BYTES))
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    same = model()
    with pytest.raises(ShardRpcError, match="partition plan fingerprint"):  # same model, other chunk size
        DistributedOptimizer(torch.optim.SGD(same.parameters(), lr=0.1, momentum=0.9), same.named_parameters(),
                             servers=cluster.addresses, worker_id="w2", wire=WireOptions(chunk_bytes=512))
    with pytest.raises(ShardRpcError, match="every worker must build the same optimizer"):
        DistributedOptimizer(torch.optim.Adam(same.parameters(), lr=0.1), same.named_parameters(),
                             servers=cluster.addresses, worker_id="w3", wire=WireOptions(chunk_bytes=CHUNK_BYTES))
    stats = client.stats()
    assert list(stats.members) == ["w0"] and stats.plan_fingerprint == dist.plan.fingerprint


def test_wrong_number_of_shards_is_rejected(start_cluster) -> None:
    cluster = start_cluster(2)
    m = model()
    with pytest.raises(ShardRpcError, match="pass the addresses of all 2 shards"):
        DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(),
                             servers=cluster.addresses[:1])


def test_unreachable_shard_fails_fast() -> None:
    m = model()
    with pytest.raises(ConnectionError, match="did not answer"):
        DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(), servers=["127.0.0.1:1"],
                             wire=WireOptions(connect_timeout=1.0))


def test_zero_grad_with_pushes_in_flight_raises(joined) -> None:
    _, dist, m, _ = joined
    m(torch.randn(4, 20)).sum().backward()  # hooks start the pushes
    with pytest.raises(RuntimeError, match="call step"):
        dist.zero_grad()
    dist.step()
    dist.zero_grad()
    assert dist.version == 1


def test_oversized_messages_are_refused(start_cluster) -> None:
    cluster = start_cluster(1, extra_args=("--max-message-bytes", str(256 << 10)))
    m = nn.Linear(300, 300)  # 90,000 elements
    with pytest.raises(ShardRpcError, match="exceeds the .* this shard accepts") as err:
        DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(), servers=cluster.addresses,
                             wire=WireOptions(chunk_bytes=1 << 20))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    dist = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(),
                                servers=cluster.addresses, worker_id="w0", wire=WireOptions(chunk_bytes=64 << 10))
    client = ShardClient(cluster.addresses[0], index=0)
    try:
        huge = encode_chunk("weight", 0, torch.zeros(90_000), 0)  # 360 KB frame > 256 KiB limit
        header = pb.RoundHeader(worker_id="w0", session=dist.session, plan_fingerprint=dist.plan.fingerprint)
        with pytest.raises(ShardRpcError) as err:
            client.push(iter([encode_round(header), huge]))
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert client.stats().version == 0
    finally:
        client.close()
        dist.close()


def test_later_joiner_with_malformed_optimizer_spec(joined) -> None:
    _, dist, _, client = joined
    bad = pb.OptimizerSpec(class_name="SGD", group_hyperparams_json=["{not json"])
    with pytest.raises(ShardRpcError, match="not valid JSON") as err:
        RawWorker(client, "w9", dist.plan, bad).join()
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert list(client.stats().members) == ["w0"]

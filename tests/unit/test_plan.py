import pytest
import torch

from shardps.proto.plan import KeyInfo, PartitionPlan, keys_from_named_parameters

KEYS = [KeyInfo("a.weight", (100, 10), 0), KeyInfo("a.bias", (100,), 0), KeyInfo("b.weight", (7, 3), 1)]


def test_plan_is_deterministic_and_covers_every_element() -> None:
    p1 = PartitionPlan.build(KEYS, num_shards=3, chunk_bytes=256)
    p2 = PartitionPlan.build(list(KEYS), num_shards=3, chunk_bytes=256)
    assert p1 == p2 and p1.fingerprint == p2.fingerprint
    for k in KEYS:
        chunks = [c for c in p1.chunks if c.key == k.key]
        assert [c.offset for c in chunks] == sorted(c.offset for c in chunks)
        assert sum(c.numel for c in chunks) == k.numel
        assert all(c.numel <= 64 for c in chunks)
        assert all(b.offset == a.offset + a.numel for a, b in zip(chunks, chunks[1:]))


def test_chunks_tile_each_shard_buffer_and_bytes_balance() -> None:
    plan = PartitionPlan.build(KEYS, num_shards=3, chunk_bytes=256)
    for s in range(3):
        for g in (0, 1):
            chunks = [c for c in plan.chunks if c.shard == s and c.group == g]
            offsets = [c.shard_offset for c in chunks]
            assert offsets == [sum(c.numel for c in chunks[:i]) for i in range(len(chunks))]
            assert plan.group_numel(s, g) == sum(c.numel for c in chunks)
    loads = plan.shard_bytes()
    assert max(loads) - min(loads) <= 256
    assert sum(loads) == 4 * sum(k.numel for k in KEYS)


@pytest.mark.parametrize(
    "change",
    [
        dict(num_shards=2, chunk_bytes=256),
        dict(num_shards=3, chunk_bytes=512),
    ],
)
def test_fingerprint_changes_with_inputs(change) -> None:
    base = PartitionPlan.build(KEYS, num_shards=3, chunk_bytes=256)
    assert PartitionPlan.build(KEYS, **change).fingerprint != base.fingerprint
    reshaped = [KeyInfo("a.weight", (10, 100), 0), *KEYS[1:]]
    assert PartitionPlan.build(reshaped, num_shards=3, chunk_bytes=256).fingerprint != base.fingerprint


def test_proto_round_trip() -> None:
    plan = PartitionPlan.build(KEYS, num_shards=2, chunk_bytes=1024)
    assert PartitionPlan.from_proto(plan.to_proto()) == plan


@pytest.mark.parametrize(
    "keys, kwargs, message",
    [
        (KEYS, dict(num_shards=0, chunk_bytes=256), "num_shards"),
        (KEYS, dict(num_shards=1, chunk_bytes=10), "chunk_bytes"),
        (KEYS, dict(num_shards=1, chunk_bytes=258), "chunk_bytes"),
        ([], dict(num_shards=1, chunk_bytes=256), "no parameters"),
        ([KEYS[0], KEYS[0]], dict(num_shards=1, chunk_bytes=256), "duplicate"),
    ],
)
def test_bad_plan_inputs_name_the_fix(keys, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        PartitionPlan.build(keys, **kwargs)


def test_keys_from_named_parameters_checks_groups() -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias], "lr": 0.5}], lr=0.1)
    keys, outside = keys_from_named_parameters(list(model.named_parameters()), opt.param_groups)
    assert [(k.key, k.group) for k in keys] == [("weight", 0), ("bias", 1)] and outside == []
    partial = torch.optim.SGD([model.weight], lr=0.1)
    keys, outside = keys_from_named_parameters(list(model.named_parameters()), partial.param_groups)
    assert [k.key for k in keys] == ["weight"] and outside == ["bias"]
    stranger = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match="no name in named_parameters"):
        keys_from_named_parameters(list(model.named_parameters()), stranger.param_groups)

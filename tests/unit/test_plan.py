import functools

import pytest
import torch

import shardps.common.plan as plan_module
from shardps.proto import shardps_pb2 as pb
from shardps.common.plan import (
    BUFFER_ITEMSIZE,
    PLAN_FORMAT,
    BufferInfo,
    KeyInfo,
    PartitionPlan,
    keys_from_named_parameters,
)
from shardps.apps import digits

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


# --- byte quotas per shard (PLAN_FORMAT 4) -----------------------------------------------------------------------------

KIB = 1 << 10


def small_cnn() -> torch.nn.Module:
    """The ~150 KB CNN that fixed 1 MiB chunks split 128,704 / 20,296 bytes over 2 shards (PLAN_FORMAT 2)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Conv2d(16, 32, 3), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(32 * 5 * 5, 40), torch.nn.ReLU(),
        torch.nn.Linear(40, 10),
    )


def digits_mlp() -> torch.nn.Module:
    """The digits job's MLP at its default width."""
    return digits.make_model(digits.DigitsConfig().hidden, 0)


def benchmark_transformer() -> torch.nn.Module:
    """The shapes of ``TinyLM`` in benchmarks/train.py (17.0 M parameters), on the meta device: no memory."""
    vocab, d_model, layers, heads, context = 8192, 384, 6, 6, 64
    with torch.device("meta"):
        model = torch.nn.Module()
        model.embed = torch.nn.Embedding(vocab, d_model)
        model.pos = torch.nn.Parameter(torch.zeros(context, d_model))
        layer = torch.nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True,
                                                 norm_first=True)
        model.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        model.norm = torch.nn.LayerNorm(d_model)
        model.head = torch.nn.Linear(d_model, vocab, bias=False)
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 1) == 17.0  # as benchmarks/train.py documents
    return model


MODELS = {"small_cnn": small_cnn, "digits_mlp": digits_mlp, "transformer": benchmark_transformer}


@functools.cache
def model_keys(name: str) -> tuple[KeyInfo, ...]:
    """The optimizer's keys of model ``name`` (built once per test session)."""
    model = MODELS[name]()
    keys, outside = keys_from_named_parameters(
        list(model.named_parameters()), torch.optim.SGD(model.parameters(), lr=0.1).param_groups
    )
    assert outside == []
    return tuple(keys)


def loads(plan: PartitionPlan) -> list[int]:
    """Bytes per shard: fp32 parameters plus buffers."""
    out = plan.shard_bytes()
    for c in plan.buffer_chunks:
        out[c.shard] += c.numel * BUFFER_ITEMSIZE[c.dtype]
    return out


def spread(plan: PartitionPlan) -> float:
    """(max - min) / mean of the shards' loads."""
    load = loads(plan)
    return (max(load) - min(load)) / (sum(load) / len(load))


@pytest.mark.parametrize("num_shards", [2, 3, 4])
@pytest.mark.parametrize("name", list(MODELS))
def test_shard_bytes_balanced_within_10_percent(name: str, num_shards: int) -> None:
    keys = model_keys(name)
    total = 4 * sum(k.numel for k in keys)
    plan = PartitionPlan.build(keys, num_shards=num_shards, chunk_bytes=1 << 20)
    load = loads(plan)
    assert sum(load) == total
    quotas = [total * (s + 1) // num_shards - total * s // num_shards for s in range(num_shards)]
    assert all(abs(got - want) <= 4 for got, want in zip(load, quotas)), (load, quotas)  # within one fp32 element
    assert spread(plan) <= 0.10, f"{name} on {num_shards} shards: {load}"


def test_few_chunks_one_per_key_plus_shard_boundaries() -> None:
    """Every chunk is a frame per push and per pull: a small model gets one per key plus one per boundary."""
    for name in ("small_cnn", "digits_mlp"):
        keys = model_keys(name)
        for num_shards in (1, 2, 3, 4):
            plan = PartitionPlan.build(keys, num_shards=num_shards, chunk_bytes=1 << 20)
            assert len(keys) <= len(plan.chunks) <= len(keys) + num_shards - 1, (name, num_shards)
    # a 300 KB MLP (32 -> 256 -> 256 -> 10) on 2 shards: format 3 cut it into 37 chunks
    mlp = [KeyInfo("0.weight", (256, 32), 0), KeyInfo("0.bias", (256,), 0), KeyInfo("2.weight", (256, 256), 0),
           KeyInfo("2.bias", (256,), 0), KeyInfo("4.weight", (10, 256), 0), KeyInfo("4.bias", (10,), 0)]
    plan = PartitionPlan.build(mlp, num_shards=2, chunk_bytes=1 << 20)
    assert len(plan.chunks) == 7 and plan.shard_bytes() == [153_620, 153_620]
    assert [(c.key, c.shard) for c in plan.chunks if c.key == "2.weight"] == [("2.weight", 0), ("2.weight", 1)]


def test_size_regimes_of_the_balance_models() -> None:
    """Which models the balance test covers in which regime, so that it cannot drift into trivial cases."""
    totals = {name: 4 * sum(k.numel for k in model_keys(name)) for name in MODELS}
    assert totals == {"small_cnn": 149_000, "digits_mlp": 104_488, "transformer": 67_854_336}
    assert totals["small_cnn"] > 2 * 64 * KIB and totals["transformer"] > 4 * 64 * KIB
    assert totals["transformer"] > 4 * 16 * (1 << 20)  # > 64 MiB: keeps the requested 1 MiB chunks on <= 4 shards


def test_old_imbalance_case_is_balanced() -> None:
    """The small CNN on 2 shards: 128,704 / 20,296 bytes with 1 MiB chunks (format 2); now 74,500 each."""
    plan = PartitionPlan.build(model_keys("small_cnn"), num_shards=2, chunk_bytes=1 << 20)
    assert plan.chunk_bytes == 1 << 20
    assert plan.shard_bytes() == [74_500, 74_500] and spread(plan) == 0


def test_quota_plan_is_deterministic() -> None:
    keys = model_keys("small_cnn")
    p1 = PartitionPlan.build(keys, num_shards=3, chunk_bytes=1 << 20)
    p2 = PartitionPlan.build(model_keys("small_cnn"), num_shards=3, chunk_bytes=1 << 20)
    assert p1 == p2 and p1.fingerprint == p2.fingerprint and p1.chunks == p2.chunks
    assert PartitionPlan.from_proto(p1.to_proto()) == p1  # the shard derives the same chunks
    assert [c.key_index for c in p1.chunks] == sorted(c.key_index for c in p1.chunks)  # key order kept


@pytest.mark.parametrize(
    "name, chunk_bytes",  # the transformer in 64-byte chunks would be a million chunks
    [(n, cb) for n in MODELS for cb in (64, 4 * KIB, 64 * KIB, 1 << 20) if n != "transformer" or cb >= 64 * KIB],
)
def test_chunks_never_exceed_chunk_bytes(name: str, chunk_bytes: int) -> None:
    plan = PartitionPlan.build(model_keys(name), num_shards=3, chunk_bytes=chunk_bytes)
    assert plan.chunk_bytes == plan.to_proto().chunk_bytes == chunk_bytes
    assert all(4 * c.numel <= chunk_bytes for c in plan.chunks)
    per_key = {}
    for c in plan.chunks:  # a key's chunks tile it: consecutive offsets, nothing missing, nothing twice
        assert c.offset == per_key.get(c.key, 0), c
        per_key[c.key] = c.offset + c.numel
    assert per_key == {k.key: k.numel for k in model_keys(name) if k.numel}
    assert spread(plan) <= 0.10


@pytest.mark.parametrize("num_shards", [1, 2, 4])
def test_big_model_keeps_the_requested_chunk(num_shards: int) -> None:
    keys = [KeyInfo(f"layer{i}.weight", (1024, 1024), 0) for i in range(15)] + [KeyInfo("head", (1 << 20,), 0)]
    assert 4 * sum(k.numel for k in keys) == 64 << 20
    plan = PartitionPlan.build(keys, num_shards=num_shards, chunk_bytes=1 << 20)
    assert len(plan.chunks) == 64 and all(4 * c.numel == 1 << 20 for c in plan.chunks)
    assert loads(plan) == [(64 << 20) // num_shards] * num_shards


def test_tiny_models_and_empty_shards() -> None:
    """Fewer elements than shards: every element lands somewhere once, the loads stay within one element."""
    plan = PartitionPlan.build([KeyInfo("w", (2,), 0)], num_shards=4, chunk_bytes=1 << 20)
    assert sorted((c.offset, c.numel) for c in plan.chunks) == [(0, 1), (1, 1)]
    assert max(plan.shard_bytes()) == 4 and sum(plan.shard_bytes()) == 8
    plan = PartitionPlan.build([KeyInfo("w", (0,), 0), KeyInfo("v", (5,), 0)], num_shards=2, chunk_bytes=16)
    assert [c.key for c in plan.chunks] == ["v", "v"] and plan.shard_bytes() == [12, 8]


def test_buffers_fill_the_quotas_too() -> None:
    keys = [KeyInfo("w", (50_000,), 0)]  # 200,000 bytes
    buffers = [BufferInfo("running_mean", (30_000,), pb.FLOAT64), BufferInfo("steps", (4_000,), pb.INT8)]
    plan = PartitionPlan.build(keys, num_shards=2, chunk_bytes=1 << 20, buffers=buffers)
    assert sum(c.numel for c in plan.buffer_chunks if c.key == "running_mean") == 30_000
    assert {c.shard for c in plan.chunks} == {0} and {c.shard for c in plan.buffer_chunks} == {0, 1}
    assert loads(plan) == [222_000, 222_000]
    small = PartitionPlan.build(keys, num_shards=2, chunk_bytes=4096, buffers=buffers)
    assert all(c.numel * BUFFER_ITEMSIZE[c.dtype] <= 4096 for c in small.buffer_chunks)
    arena = [c for c in small.buffer_chunks if c.shard == 1]
    assert all(c.shard_offset % 8 == 0 for c in arena)  # the arena keeps 8-byte alignment


def test_plan_format_is_in_the_fingerprint(monkeypatch) -> None:
    assert PLAN_FORMAT == 4
    new = PartitionPlan.build(KEYS, num_shards=2, chunk_bytes=1 << 20).fingerprint
    monkeypatch.setattr(plan_module, "PLAN_FORMAT", 3)
    assert PartitionPlan.build(KEYS, num_shards=2, chunk_bytes=1 << 20).fingerprint != new


def test_the_shards_chunk_limit_bounds_the_real_plan() -> None:
    """``--max-chunks`` counts the boundary chunks format 4 adds: a plan exactly at the limit passes, one over fails."""
    from shardps.server import checks
    from shardps.server.config import ShardConfig
    from shardps.server.errors import InvalidArgument

    keys = [KeyInfo("a", (10,), 0), KeyInfo("b", (10,), 0)]  # 80 bytes; 3 shards cut both keys: 4 chunks
    plan = PartitionPlan.build(keys, num_shards=3, chunk_bytes=1 << 20)
    assert len(plan.chunks) == 4 == len(keys) + 3 - 1
    at_limit = ShardConfig(shard_index=0, num_shards=3, max_chunks=len(plan.chunks))
    assert checks.check_plan_spec(plan.to_proto(), 1, at_limit) > 0
    with pytest.raises(InvalidArgument, match="more than 3 chunks"):
        checks.check_plan_spec(plan.to_proto(), 1, ShardConfig(shard_index=0, num_shards=3, max_chunks=3))

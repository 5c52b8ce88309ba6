"""Streamed sync rounds (``WireOptions(streamed=True)``): each chunk applied as soon as every worker pushed it.

Exact: the same parameters, bit for bit, as unstreamed rounds (and so as
close to single-process training as those). All or nothing: a round that
fails after some of its chunks were applied is undone on the shard, and
the workers' models keep the previous version.
"""

from __future__ import annotations

import queue
import time

import grpc
import pytest
import torch
from torch import nn

from shardps.proto import shardps_pb2 as pb
from shardps.common.codec import decode_frame, encode_chunk, encode_control, encode_round, payload_view
from shardps.worker.pipeline import streams
from shardps.worker.session.client import ShardClient
from tests.integration.test_sync_oracle import CHUNK_BYTES, train_sharded, train_single
from tests.support.raw import RawWorker, plan_and_spec, snapshot


@pytest.mark.parametrize("name", ["adamw", "sgd_nesterov"])
@pytest.mark.parametrize("num_shards, workers, overlap, credit", [(1, 1, False, 0), (2, 2, False, 0),
                                                                  (3, 3, False, 0), (2, 2, True, 0),
                                                                  (2, 3, False, CHUNK_BYTES)])
def test_streamed_rounds_match_unstreamed_bit_for_bit(start_cluster, name: str, num_shards: int, workers: int,
                                                      overlap: bool, credit: int) -> None:
    """``credit``: ``WireOptions.push_credit_bytes`` of one chunk, so every push stream waits for its shard's
    answers after each chunk."""
    expected = train_single(name)
    cluster = start_cluster(num_shards, min_workers=workers)
    plain = train_sharded(name, workers, cluster.addresses, overlap=overlap)
    cluster = start_cluster(num_shards, min_workers=workers)
    streamed = train_sharded(name, workers, cluster.addresses, overlap=overlap, streamed=True,
                             push_credit_bytes=credit)
    for a, b in zip(plain, streamed):
        for (key, want), got_plain, got in zip(expected.named_parameters(), a.parameters(), b.parameters()):
            assert torch.equal(got, got_plain), f"{key}: streamed and unstreamed rounds differ"
            assert (want - got).abs().max().item() < 1e-5, key


def test_workers_pushing_in_different_orders_do_not_wait_on_each_others_credit(start_cluster, monkeypatch) -> None:
    """With a credit of one chunk, a worker pushing from backward's hooks (last layer first) and one pushing at
    ``step()`` (first layer first) each wait for answers that need the other's unsent chunks: each stream stops
    waiting once its shard was silent for ``CREDIT_STALL_SECONDS`` and the rounds complete, bit for bit."""
    monkeypatch.setattr(streams, "CREDIT_STALL_SECONDS", 0.3)
    cluster = start_cluster(1, min_workers=2)
    plain = train_sharded("adamw", 2, cluster.addresses)
    cluster = start_cluster(1, min_workers=2)
    started = time.monotonic()
    credited = train_sharded("adamw", 2, cluster.addresses, streamed=True, push_credit_bytes=CHUNK_BYTES,
                             pushed_at_step=frozenset({1}))
    assert time.monotonic() - started < 45, "the rounds waited on each other's credit"
    for a, b in zip(plain, credited):
        for got_plain, got in zip(a.parameters(), b.parameters()):
            assert torch.equal(got, got_plain)


# ---------------------------------------------------------------- all or nothing, by hand
def _streamed(w: RawWorker, round_: int) -> tuple[queue.SimpleQueue, object]:
    """Open ``w``'s streamed PushPull of ``round_``; put frames on the queue (None ends the stream)."""
    q: queue.SimpleQueue = queue.SimpleQueue()
    header = w.header(round_, streamed=True)
    header.options.lrs.append(0.1)

    def requests():
        yield encode_round(header)
        while (frame := q.get()) is not None:
            yield frame

    return q, w.client.push_pull(requests())


def _push_all(w: RawWorker, q: queue.SimpleQueue, round_: int, fill: float) -> None:
    for key, offset, values in w.chunks(0, fill):
        q.put(encode_chunk(key, offset, values, round_))
    q.put(encode_control(trailer=w.trailer([0.1])))
    q.put(None)


def _round(workers: list[RawWorker], round_: int, fill: float) -> None:
    calls = []
    for w in workers:
        q, call = _streamed(w, round_)
        _push_all(w, q, round_, fill)
        calls.append(call)
    for call in calls:
        frames = [decode_frame(raw) for raw in call]
        assert {f.header.version for f in frames} == {round_ + 1}


def _pulled(client: ShardClient, w: RawWorker, version: int, ref: nn.Module) -> dict[str, torch.Tensor]:
    got = {}
    request = pb.PullRequest(min_version=version, plan_fingerprint=w.plan.fingerprint, worker_id=w.worker_id,
                             session=w.session)
    for raw in client.pull(request):
        f = decode_frame(raw)
        got.setdefault(f.header.key, torch.empty(dict(ref.named_parameters())[f.header.key].numel()))[
            f.header.offset : f.header.offset + f.header.numel] = torch.frombuffer(bytearray(f.payload),
                                                                                  dtype=torch.float32)
    return got


@pytest.mark.parametrize("how", ["nan-chunk", "member-leaves"])
def test_a_push_that_fails_after_chunks_were_applied_is_undone_and_the_round_starts_over(start_cluster,
                                                                                          how: str) -> None:
    """Chunks of round 1 are applied with b's push (b received one back), then b's push ends early: the shard
    undoes them (parameters and Adam state as before the round), tells a to drop what it received (REWIND),
    and applies round 1 again: with b's next push (b is still a member), or without b once b left."""
    cluster = start_cluster(1, min_workers=2)
    torch.manual_seed(0)
    m = nn.Linear(20, 10)
    # Adam: state to undo, not only parameters; fused, the kernel the shard steps with (see _adam_oracle)
    make = lambda params: torch.optim.Adam(params, lr=0.1, fused=True)  # noqa: E731
    plan, spec = plan_and_spec(m, make(m.parameters()))
    assert len(plan.chunks) >= 3
    client = ShardClient(cluster.addresses[0], index=0, rpc_timeout=20.0)
    a, b = RawWorker(client, "a", plan, spec), RawWorker(client, "b", plan, spec)
    a.join(), b.join()
    a.init(0, dict(m.named_parameters()))
    _round([a, b], 0, 0.5)  # Adam state exists now
    before = snapshot(client)

    qa, call_a = _streamed(a, 1)
    _push_all(a, qa, 1, 0.25)
    qb, call_b = _streamed(b, 1)
    first, *rest = b.chunks(0, 0.25)
    qb.put(encode_chunk(first[0], first[1], first[2], 1))
    answers_b, answers_a = iter(call_b), iter(call_a)
    applied = decode_frame(next(answers_b))  # the first chunk came back: the round is partly applied
    assert applied.header.version == 2 and (applied.header.key, applied.header.offset) == first[:2]
    assert decode_frame(next(answers_a)).header.version == 2  # a got it too
    if how == "nan-chunk":
        key, offset, values = rest[0]
        qb.put(encode_chunk(key, offset, torch.full_like(values, float("nan")), 1))
        code, message = grpc.StatusCode.INVALID_ARGUMENT, "NaN"
    else:
        b.leave()
        code, message = grpc.StatusCode.ABORTED, "left"
    qb.put(None)
    with pytest.raises(grpc.RpcError) as err:
        list(answers_b)
    assert err.value.code() == code and message in err.value.details()
    rewind = decode_frame(next(answers_a))
    assert rewind.round is not None and rewind.header is None  # a drops what it received
    if how == "nan-chunk":  # (once b left, a's push alone completes round 1 at once)
        after = snapshot(client)
        assert (after["version"], after["digest"]) == (before["version"], before["digest"])  # params, Adam state
        qb, call_b = _streamed(b, 1)  # b is still a member: round 1 waits for its push again
        _push_all(b, qb, 1, 0.25)
        assert {decode_frame(raw).header.version for raw in call_b} == {2}
    frames = [decode_frame(raw) for raw in answers_a]  # a's call of round 1 ends without error
    assert {f.header.version for f in frames} == {2} and len(frames) == len(plan.chunks)
    assert client.stats().version == 2
    ref = nn.Linear(20, 10)
    ref.load_state_dict(m.state_dict())
    opt = make(ref.parameters())
    for fill in (0.5, 0.25):  # b's push of round 1 was 0.25 too, or round 1 is a's alone
        for p in ref.parameters():
            p.grad = torch.full_like(p, fill)
        opt.step()
    got = _pulled(client, a, 2, ref)
    for key, p in ref.named_parameters():
        assert torch.equal(got[key], p.detach().reshape(-1)), key


def test_learning_rate_changed_after_backward_is_refused_and_nothing_changes(start_cluster) -> None:
    """Streamed rounds read the learning rates at the first gradient: a change before step() raises, loudly."""
    from shardps import DistributedOptimizer, WireOptions

    cluster = start_cluster(2)
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    with DistributedOptimizer(opt, model.named_parameters(), servers=cluster.addresses, worker_id="w0",
                              wire=WireOptions(chunk_bytes=64, streamed=True, rpc_timeout=30.0)) as dist:
        nn.functional.mse_loss(model(x), y).backward()
        dist.step()
        before = [p.detach().clone() for p in model.parameters()]
        dist.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.param_groups[0]["lr"] = 0.05  # after backward: the shards may have applied chunks with 0.1
        with pytest.raises(ValueError, match="changed between the step's first gradient and step"):
            dist.step()
        assert dist.version == 1 and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        dist.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()  # lr 0.05 from the start of this step: streamed as is
        dist.step()
        assert dist.version == 2
        ref = nn.Linear(8, 4)
        ref.load_state_dict({k: v for k, v in zip(("weight", "bias"), before)})
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        for want, got in zip(ref.parameters(), model.parameters()):
            assert torch.allclose(want, got, rtol=0, atol=1e-7)


def test_a_shard_that_holds_no_chunk_completes_streamed_rounds(start_cluster) -> None:
    """One scalar parameter on two shards: shard 1 holds nothing, and its round is only the workers' trailers
    (it used to wait for a first chunk that never came, and the step timed out)."""
    import threading

    from shardps.worker import DistributedOptimizer
    from shardps.worker.config import WireOptions

    cluster = start_cluster(2, min_workers=2)
    values, errors = {}, []

    def run(w: int) -> None:
        p = nn.Parameter(torch.tensor(1.0))
        try:
            dist = DistributedOptimizer(torch.optim.SGD([p], lr=0.1), [("p", p)], servers=cluster.servers,
                                        worker_id=f"w{w}", wire=WireOptions(streamed=True, rpc_timeout=30))
            try:
                for _ in range(3):
                    dist.zero_grad()
                    (p * (w + 1)).backward()
                    dist.step()
                values[w], versions = float(p.detach()), list(dist.versions)
                assert versions == [3, 3], versions
            finally:
                dist.close()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert values[0] == values[1] == pytest.approx(1.0 - 3 * 0.1 * 1.5)


# ---------------------------------------------------------------- gradients read where they arrived
def _adam_oracle(m: nn.Module, fills: list[float]) -> nn.Module:
    """``m`` after one torch Adam step per gradient fill in ``fills``, with the kernel the shard uses.

    The shard steps ``torch.optim.Adam(fused=True)`` (``shardps.common.optim.build_optimizer``). torch's
    default (single-tensor) Adam is another kernel, and its last bit differs from the fused one on some CPUs
    (an AVX-512 host: every run), so a bit-for-bit oracle runs the fused kernel too. Within the fused kernel
    a tensor's last ``numel % vector width`` elements take a scalar loop that can round differently from the
    vector loop (AVX2 and AVX-512 builds); the shard steps each chunk as a tensor of its own, and
    ``plan_and_spec``'s chunks are 64 elements, a multiple of the vector width (8 or 16 floats), so every
    element takes the same loop here as in the whole tensor.
    """
    ref = nn.Linear(20, 10)
    ref.load_state_dict(m.state_dict())
    opt = torch.optim.Adam(ref.parameters(), lr=0.1, fused=True)
    for fill in fills:
        for p in ref.parameters():
            p.grad = torch.full_like(p, fill)
        opt.step()
    return ref


def _alone(start_cluster, min_workers: int = 1) -> tuple[ShardClient, RawWorker, nn.Module]:
    cluster = start_cluster(1, min_workers=min_workers)
    torch.manual_seed(0)
    m = nn.Linear(20, 10)
    plan, spec = plan_and_spec(m, torch.optim.Adam(m.parameters(), lr=0.1))
    client = ShardClient(cluster.addresses[0], index=0, rpc_timeout=20.0)
    a = RawWorker(client, "a", plan, spec)
    a.join()
    a.init(0, dict(m.named_parameters()))
    return client, a, m


def test_a_member_alone_whose_push_fails_after_chunks_were_applied_changes_nothing(start_cluster) -> None:
    """A member alone in the job: the shard steps its chunks where they arrived (no staging copy). A NaN chunk
    after one was applied undoes it (parameters and Adam state as before), and the round pushed again gives the
    single-process values bit for bit."""
    client, a, m = _alone(start_cluster)
    _round([a], 0, 0.5)
    before = snapshot(client)
    q, call = _streamed(a, 1)
    first, second, *_ = a.chunks(0, 0.25)
    q.put(encode_chunk(*first, 1))
    answers = iter(call)
    assert decode_frame(next(answers)).header.version == 2  # applied
    q.put(encode_chunk(second[0], second[1], torch.full_like(second[2], float("nan")), 1))
    q.put(None)
    with pytest.raises(grpc.RpcError) as err:
        list(answers)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "NaN" in err.value.details()
    after = snapshot(client)
    assert (after["version"], after["digest"]) == (before["version"], before["digest"])
    _round([a], 1, 0.25)
    got, ref = _pulled(client, a, 2, m), _adam_oracle(m, [0.5, 0.25])
    for key, p in ref.named_parameters():
        assert torch.equal(got[key], p.detach().reshape(-1)), key


def test_pushes_are_averaged_from_the_frames_they_arrived_in(start_cluster) -> None:
    """a pushes round 0 while alone; round 0 waits for min_workers=2, b joins and pushes: the round's average
    reads both pushes from the frames they arrived in, bit for bit the two-worker average."""
    client, a, m = _alone(start_cluster, min_workers=2)
    qa, call_a = _streamed(a, 0)
    _push_all(a, qa, 0, 0.5)
    b = RawWorker(client, "b", a.plan, a.spec)
    b.join()
    qb, call_b = _streamed(b, 0)
    _push_all(b, qb, 0, 0.25)
    for call in (call_a, call_b):
        assert {decode_frame(raw).header.version for raw in call} == {1}
    got, ref = _pulled(client, a, 1, m), _adam_oracle(m, [0.375])
    for key, p in ref.named_parameters():
        assert torch.equal(got[key], p.detach().reshape(-1)), key


def _misaligned(key: str, offset: int, values: torch.Tensor, round_: int) -> bytes:
    """A chunk frame written by stock protobuf with a pad that leaves the payload off a 4-byte boundary."""
    for pad in range(8):
        header = pb.ChunkHeader(key=key, offset=offset, numel=values.numel(), dtype=pb.FLOAT32, version=round_,
                                pad=bytes(pad))
        raw = pb.Frame(header=header, payload=values.numpy().tobytes()).SerializeToString()
        if (len(raw) - values.numel() * 4) % 4:
            frame = decode_frame(raw)
            assert payload_view(frame.header, frame.payload) is None  # a receiver copies this one
            return raw
    raise AssertionError("no pad misaligns the payload")


@pytest.mark.parametrize("streamed", [True, False])
def test_frames_whose_payload_is_not_aligned_are_copied_and_give_the_same_round(start_cluster, streamed: bool) -> None:
    """A sender that does not align its payloads (another runtime, an odd pad): the shard copies each chunk as it
    did before reading chunks where they arrived, and the round is the single-process one, bit for bit."""
    client, a, m = _alone(start_cluster)
    if streamed:
        q, call = _streamed(a, 0)
        for key, offset, values in a.chunks(0, 0.5):
            q.put(_misaligned(key, offset, values, 0))
        q.put(encode_control(trailer=a.trailer([0.1])))
        q.put(None)
        assert {decode_frame(raw).header.version for raw in call} == {1}
    else:
        chunks = [_misaligned(key, offset, values, 0) for key, offset, values in a.chunks(0, 0.5)]
        client.push(iter([encode_round(a.header(0)), *chunks, encode_control(trailer=a.trailer([0.1]))]))
    got, ref = _pulled(client, a, 1, m), _adam_oracle(m, [0.5])
    for key, p in ref.named_parameters():
        assert torch.equal(got[key], p.detach().reshape(-1)), key

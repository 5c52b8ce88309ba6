"""Fuzzing a live shard in the middle of a training job (hypothesis).

Two workers train a small model on two real shard processes, one step at a
time, while hypothesis sends random and mutated requests to every RPC of
both shards: raw bytes, valid requests with flipped, cut or inserted bytes,
and well-formed requests with arbitrary fields and unknown or foreign
(other members') worker ids. A third member, ``zz-fuzz``, is joined in both
runs and pushes zero gradients every round; in the fuzzed run its own
session also sends mutated pushes of the open round, so the shard's frame
decoding is fuzzed on a live member's stream (each such push ends in a
frame that makes it invalid, so none is ever accepted). The job's steps are
released as the fuzzing goes, so every step runs among fuzzed calls.
Checks: no reply is UNKNOWN, INTERNAL or a deadline (a hang), no shard
crashes or logs a traceback, and the job's final parameters equal, bit for
bit, those of the same job run without fuzzing.

The shards run with ``--max-workers 3`` (the job's size): a fuzzed Join
that happens to be valid is then refused instead of joining the job, as an
operator closes a job's membership. Size: ``SHARDPS_FUZZ_EXAMPLES``
requests per RPC (default 1,200, so 15,600 over the 13 RPCs, about a minute
on 2 cores beside another test process; 5,000 or more for a longer fuzz). Hypothesis draws each
example's request kinds and seeds the ``Random`` its requests are built
from (derandomized: the same requests every run).
"""

from __future__ import annotations

import math
import os
import threading
import time
import uuid

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from shardps.proto import shardps_pb2 as pb
from shardps.common.codec import encode_chunk, encode_control, encode_round
from shardps.common.plan import PartitionPlan
from shardps.worker.session.client import ShardClient
from shardps.worker.config import WireOptions
from shardps.worker.optimizer import DistributedOptimizer
from tests.support.raw import SERVING, RawWorker, health_status, plan_and_spec
from tests.support.worker_proc import BATCH, data, model

EXAMPLES = int(os.environ.get("SHARDPS_FUZZ_EXAMPLES", 1200))
STEPS = 30
METHODS = ("Join", "Init", "Push", "Pull", "PushPull", "GetState", "SetState", "Heartbeat", "Reset", "Leave", "Stats",
           "Export", "Checkpoint")
STREAMS = ("Init", "Push", "PushPull", "SetState")
BAD_CODES = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED}
KINDS = ("raw", "mutated", "fields", "seed", "member")
IDS = ("w0", "w1", "zz-fuzz", "fuzz", "", "w0 ", "x" * 300, "\u00e9t\u00e9", "tab\t")
PER_EXAMPLE = 16  # requests per hypothesis example (fewer examples: less of hypothesis's own overhead)


def plan_and_optimizer():
    m = model()
    return plan_and_spec(m, torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.05), num_shards=2)


class FuzzMember:
    """``zz-fuzz``: a member of every shard in both runs that pushes zero gradients each round."""

    def __init__(self, addresses: list[str]) -> None:
        plan, spec = plan_and_optimizer()
        self.clients = [ShardClient(a, index=i, rpc_timeout=60.0) for i, a in enumerate(addresses)]
        session = uuid.uuid4().hex
        self.raw = [RawWorker(c, "zz-fuzz", plan, spec, session=session) for c in self.clients]
        view = self.raw[0].join().job
        for w in self.raw[1:]:
            w.join(job=view)
        self.round = 0

    def push_round(self) -> None:
        """Push the next round (zeros) to every shard, once every shard has applied the previous one."""
        for shard, w in enumerate(self.raw):
            w.pull(self.round)  # waits for version `round`
            w.push(shard, fill=0.0, round_=self.round, lrs=[0.01])  # a gradient of zeros: counts in the average
        self.round += 1

    def close(self) -> None:
        for c in self.clients:
            c.close()


class Job:
    """Two worker threads training step by step and the fuzz member; a step runs once ``release`` allows it."""

    def __init__(self, servers: list[str], gated: bool) -> None:
        self.servers, self.gated = servers, gated
        self.allowed, self.cond = 0 if gated else STEPS, threading.Condition()
        self.errors: list[BaseException] = []
        self.models = [model(), model()]
        self.joined = threading.Barrier(3)
        self.threads = [threading.Thread(target=self._worker, args=(i,), daemon=True) for i in range(2)]
        self.fuzz_member: FuzzMember | None = None

    def release(self, steps: int) -> None:
        with self.cond:
            before, self.allowed = self.allowed, min(STEPS, self.allowed + steps)
            self.cond.notify_all()
        for _ in range(self.allowed - before):
            self.fuzz_member.push_round()

    def _worker(self, i: int) -> None:
        try:
            m = self.models[i]
            opt = torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.05)
            with DistributedOptimizer(opt, m.named_parameters(), servers=self.servers, worker_id=f"w{i}",
                                      # plain rounds: the fuzz member pushes with the unary Push, and a
                                      # job's pushes are all streamed or all plain
                                      wire=WireOptions(chunk_bytes=256, rpc_timeout=60.0, streamed=False)) as dist:
                self.joined.wait(60)
                for step in range(STEPS):
                    with self.cond:
                        self.cond.wait_for(lambda: self.allowed > step, timeout=600)
                    x, y = data(step)
                    part = slice(i * BATCH // 2, (i + 1) * BATCH // 2)
                    dist.zero_grad()
                    nn.functional.cross_entropy(m(x[part]), y[part]).backward()
                    dist.step()
                assert dist.version == STEPS
        except BaseException as exc:
            self.errors.append(exc)
            self.joined.abort()

    def start(self) -> None:
        for t in self.threads:
            t.start()
        self.joined.wait(60)  # both workers are members before anything else happens
        self.fuzz_member = FuzzMember(self.servers)
        if not self.gated:
            for _ in range(STEPS):
                self.fuzz_member.push_round()

    def finish(self) -> dict[str, torch.Tensor]:
        self.release(STEPS)
        for t in self.threads:
            t.join(180)
        assert not any(t.is_alive() for t in self.threads), "a worker hung"
        self.fuzz_member.close()
        if self.errors:
            raise self.errors[0]
        return {k: v.detach().clone() for k, v in self.models[0].named_parameters()}


def templates(shard: int, plan: PartitionPlan, spec: pb.OptimizerSpec) -> dict[str, list[bytes]]:
    """One valid-looking request per RPC (with a session nobody holds), as the fuzzer's seeds."""
    session = uuid.uuid4().hex
    header = pb.RoundHeader(worker_id="w0", session=session, round=3, plan_fingerprint=plan.fingerprint)
    chunks = [encode_chunk(c.key, c.offset, torch.ones(c.numel), 3) for c in plan.shard_chunks(shard)]
    chunks.append(encode_control(trailer=pb.RoundTrailer(lrs=[0.01], absent_keys=[1])))
    view = pb.JobView(job_id="j", initialiser="w0", initialised=True, version=3) if shard else None
    return {
        "Join": [pb.JoinRequest(worker_id="fuzz", session=session, plan=plan.to_proto(),
                                plan_fingerprint=plan.fingerprint, optimizer=spec, job=view).SerializeToString()],
        "Init": [encode_round(header), *chunks],
        "Push": [encode_round(header), *chunks],
        "PushPull": [encode_round(header), *chunks],
        "Pull": [pb.PullRequest(min_version=3, plan_fingerprint=plan.fingerprint, worker_id="w1",
                                session=session).SerializeToString()],
        "GetState": [pb.StateRequest(worker_id="w1", session=session,
                                     plan_fingerprint=plan.fingerprint).SerializeToString()],
        "SetState": [encode_round(header), *(encode_chunk(c.key, c.offset, torch.ones(c.numel), 0, state="exp_avg")
                                             for c in plan.shard_chunks(shard))],
        "Heartbeat": [pb.HeartbeatRequest(worker_id="w1", session=session).SerializeToString()],
        "Reset": [pb.ResetRequest(job_id="j").SerializeToString()],  # refused: the job has members
        "Leave": [pb.LeaveRequest(worker_id="w1", session=session).SerializeToString()],
        "Stats": [pb.StatsRequest(digest=True).SerializeToString()],
        "Export": [pb.ExportRequest(min_version=3).SerializeToString()],
        "Checkpoint": [pb.CheckpointRequest().SerializeToString()],  # refused: no --checkpoint-dir
    }


def mutate(data: bytes, rng) -> bytes:
    """``data`` with 1 to 4 bytes flipped, cut, inserted or deleted."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op, at = rng.choice(("flip", "cut", "insert", "delete")), rng.randrange(max(1, len(out)))
        if op == "flip" and out:
            out[at] ^= rng.randint(1, 255)
        elif op == "cut":
            del out[at:]
        elif op == "insert":
            out[at:at] = rng.randbytes(rng.randint(1, 16))
        else:
            del out[at : at + rng.randint(1, 8)]
    return bytes(out)


def number(rng) -> float:
    return rng.choice((float("nan"), float("inf"), -float("inf"), -1e6, 0.0, 3e38, 1e-45, rng.uniform(-10, 10)))


def fields(method: str, rng, plan: PartitionPlan, spec: pb.OptimizerSpec):
    """A well-formed request of ``method`` with arbitrary fields: foreign and unknown ids, bad numbers, sizes."""
    worker, session = rng.choice(IDS), rng.choice(("", uuid.uuid4().hex, "s" * 100))
    fprint = rng.choice((plan.fingerprint, "", "0" * 16))
    if method in STREAMS:
        header = encode_round(pb.RoundHeader(
            worker_id=worker, session=session, round=rng.choice((0, 1, 3, rng.randrange(2**64))),
            plan_fingerprint=fprint, pull_dtype=rng.randrange(12), scaled=rng.random() < 0.3))
        chunk = pb.Frame(header=pb.ChunkHeader(
            key=rng.choice((plan.keys[0].key, "nope", "")), offset=rng.choice((0, 64, rng.randrange(2**64))),
            numel=rng.choice((64, 0, rng.randrange(2**40))), dtype=rng.randrange(12), version=rng.randrange(5),
            state=rng.choice(("", "exp_avg", "step", "momentum_buffer", "nope"))),
            payload=rng.randbytes(rng.choice((0, 256, 128)))).SerializeToString()
        trailer = encode_control(trailer=pb.RoundTrailer(
            lrs=[number(rng) for _ in range(rng.randint(0, 3))], inv_scale=number(rng) if rng.random() < 0.3 else 0,
            max_grad_norm=number(rng) if rng.random() < 0.3 else 0, norm_type=rng.choice((0, 2, 1, -1, math.inf)),
            absent_keys=[rng.randrange(2**rng.randint(1, 32)) for _ in range(rng.randint(0, 2))],
            group_hyperparams_json=rng.choice(([], ['{"lr": 0.1}'], ['{"lr": 0.1, "betas": [2, 0.9]}'], ["["]))))
        commit = encode_control(commit=pb.RoundCommit(round=rng.randrange(5), skip=rng.random() < 0.5,
                                                      clip_coef=number(rng)))
        return [header] + [chunk] * rng.randint(0, 2) + rng.choice(([], [trailer], [trailer, commit], [commit]))
    if method == "Join":
        keys = [pb.KeySpec(key=rng.choice(("w", "", "k" * 2000)), shape=[rng.randrange(2**rng.randint(1, 45))
                for _ in range(rng.randint(0, 3))], group=rng.randrange(2**rng.randint(1, 32))) for _ in range(3)]
        bad_plan = pb.PlanSpec(keys=keys, num_shards=rng.randrange(2**32), chunk_bytes=rng.randrange(2**30))
        bad_spec = pb.OptimizerSpec(class_name=rng.choice(("Adam", "LBFGS", "")),
                                    group_hyperparams_json=[rng.choice(('{"lr": NaN}', "[", '{"eps": "x"}'))])
        return pb.JoinRequest(worker_id=worker, session=session, plan=rng.choice((plan.to_proto(), bad_plan)),
                              plan_fingerprint=fprint, optimizer=rng.choice((spec, bad_spec)),
                              job=pb.JobView(job_id=rng.choice(("", "j")), initialiser=rng.choice(IDS),
                                             initialised=rng.random() < 0.5, version=rng.randrange(40))
                              ).SerializeToString()
    if method == "Pull":
        return pb.PullRequest(min_version=rng.randrange(2**64), plan_fingerprint=fprint, dtype=rng.randrange(10),
                              worker_id=worker, session=session).SerializeToString()
    if method == "GetState":
        return pb.StateRequest(worker_id=worker, session=session, plan_fingerprint=fprint).SerializeToString()
    if method == "Heartbeat":
        return pb.HeartbeatRequest(worker_id=worker, session=session).SerializeToString()
    if method == "Reset":
        return pb.ResetRequest(job_id=rng.choice(("", "j", "x" * 100))).SerializeToString()
    if method == "Leave":
        return pb.LeaveRequest(worker_id=worker, session=session).SerializeToString()
    if method == "Export":
        return pb.ExportRequest(min_version=rng.choice((0, 1, 5, 2**63, rng.randrange(2**64)))).SerializeToString()
    if method == "Checkpoint":
        return pb.CheckpointRequest().SerializeToString()
    return pb.StatsRequest(digest=rng.random() < 0.5, plan=rng.random() < 0.5).SerializeToString()


def member_request(method: str, rng, shard: int, fz: FuzzMember):
    """A request in the fuzz member's own session (past the identity checks, into the shard's decoding).

    Pushes are of the open round, their chunks mutated, and always end in a
    second round header, which makes them invalid: none is ever accepted;
    SetState streams (mutated optimizer state) end the same way.
    Pulls ask for a version the shard has. Never a Leave (it would change the job).
    """
    w = fz.raw[shard]
    if method in ("Init", "Push", "PushPull"):
        trailer = w.trailer([0.01], max_grad_norm=rng.choice((0.0, 1.0)), absent_keys=rng.choice(([], [0], [1])))
        frames = list(w.frames(w.header(fz.round), w.chunks(shard, rng.uniform(-1, 1)), trailer=trailer))
        body = [mutate(f, rng) if rng.random() < 0.3 else f for f in frames[1:-1]]
        rng.shuffle(body)
        # the second round header comes before the trailer: the push is always refused there
        return [frames[0], *body[: rng.randint(0, len(body))], frames[0], frames[-1]]
    if method == "SetState":  # state chunks, mutated, then a second round header: never accepted
        state = [encode_chunk(c.key, c.offset, torch.full((c.numel,), rng.uniform(-1, 1)), 0,
                              state=rng.choice(("exp_avg", "exp_avg_sq", "step")))
                 for c in w.plan.shard_chunks(shard)]
        body = [mutate(f, rng) if rng.random() < 0.3 else f for f in state]
        return [encode_round(w.header(fz.round)), *body[: rng.randint(0, len(body))], encode_round(w.header(0))]
    if method == "GetState":
        return pb.StateRequest(worker_id=w.worker_id, session=w.session,
                               plan_fingerprint=w.plan.fingerprint).SerializeToString()
    if method == "Heartbeat":
        return pb.HeartbeatRequest(worker_id=w.worker_id, session=w.session).SerializeToString()
    if method == "Pull":
        return pb.PullRequest(min_version=rng.choice((0, fz.round)), plan_fingerprint=w.plan.fingerprint,
                              worker_id=w.worker_id, session=w.session, dtype=rng.randrange(4)).SerializeToString()
    if method == "Join":
        return pb.JoinRequest(worker_id=w.worker_id, session=w.session, plan=w.plan.to_proto(),
                              plan_fingerprint=w.plan.fingerprint, optimizer=w.spec,
                              job=pb.JobView(job_id=rng.choice(("j", "")), initialiser=rng.choice(IDS),
                                             initialised=rng.random() < 0.5, version=rng.randrange(40))
                              ).SerializeToString()
    return None


def make_request(method: str, kind: str, rng, shard: int, seeds, plan, spec, fz: FuzzMember):
    """One request for ``method``: bytes for unary-request RPCs, a list of frames for streams."""
    stream = method in STREAMS
    seed = seeds[shard][method]
    if kind == "member":
        request = member_request(method, rng, shard, fz)
        if request is not None:
            return request
        kind = "seed"
    if kind == "fields":
        return fields(method, rng, plan, spec)
    if kind == "raw":
        body = [rng.randbytes(rng.randint(0, 300)) for _ in range(rng.randint(1, 3))]
    elif kind == "mutated":
        body = [mutate(f, rng) if rng.random() < 0.6 else f for f in seed]
    else:
        body = list(seed)
    return body if stream else body[0]


def send(channel: grpc.Channel, method: str, request) -> grpc.StatusCode:
    path = f"/shardps.v1.Shard/{method}"
    try:
        if method in ("Init", "Push", "SetState"):
            channel.stream_unary(path)(iter(request), timeout=5)
        elif method == "PushPull":
            list(channel.stream_stream(path)(iter(request), timeout=5))
        elif method in ("Pull", "GetState", "Export"):
            list(channel.unary_stream(path)(request, timeout=5))
        else:
            channel.unary_unary(path)(request, timeout=5)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.timeout(900)  # 26,000 requests by default; 65,000 took about 2-3 min on 2 cores
def test_fuzzing_a_live_shard_changes_nothing(start_cluster) -> None:
    # a long lease: the raw fuzz member sends no heartbeats, and the two runs must see the same membership
    args = {"min_workers": 3, "extra_args": ("--max-workers", "3", "--lease-seconds", "600")}
    fuzzed = start_cluster(2, **args)
    job = Job(fuzzed.addresses, gated=True)
    job.start()
    plan, spec = plan_and_optimizer()
    seeds = [templates(shard, plan, spec) for shard in range(2)]
    codes: dict[str, dict[str, int]] = {method: {} for method in METHODS}
    sent = [0]
    every = max(1, len(METHODS) * EXAMPLES // (STEPS + 1))
    channels = [grpc.insecure_channel(a) for a in fuzzed.addresses]
    started = time.monotonic()
    try:
        for method in METHODS:
            # hypothesis draws the kinds and shards and seeds a Random per example; requests are built from it in
            # plain Python (a composite draw per field cost ~4 ms per request, three times the call itself)
            @settings(max_examples=-(-EXAMPLES // PER_EXAMPLE), deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(st.lists(st.tuples(st.sampled_from(KINDS), st.sampled_from((0, 1))), min_size=PER_EXAMPLE,
                            max_size=PER_EXAMPLE), st.randoms(use_true_random=True))
            def fuzz(draws, rng) -> None:
                for kind, shard in draws:
                    request = make_request(method, kind, rng, shard, seeds, plan, spec, job.fuzz_member)
                    code = send(channels[shard], method, request)
                    codes[method][code.name] = codes[method].get(code.name, 0) + 1
                    assert code not in BAD_CODES, (method, kind, shard, code, request)
                    sent[0] += 1
                    if sent[0] % every == 0:
                        job.release(1)  # the job advances among the fuzzed calls

            fuzz()
        fuzzed_params = job.finish()
    finally:
        for channel in channels:
            channel.close()
    elapsed = time.monotonic() - started
    print(f"fuzzed {sent[0]} requests in {elapsed:.0f}s: {codes}")
    assert all(sum(c.values()) >= EXAMPLES for c in codes.values()), codes
    for shard, proc in enumerate(fuzzed.processes):
        assert proc.poll() is None, f"shard {shard} exited"
        assert health_status(fuzzed.addresses[shard]) == SERVING
        log = fuzzed.log_path(shard).read_text()
        assert "Traceback" not in log and "internal error" not in log

    clean = start_cluster(2, **args)
    reference = Job(clean.addresses, gated=False)
    reference.start()
    clean_params = reference.finish()
    for key, value in clean_params.items():
        assert torch.equal(fuzzed_params[key], value), f"{key} differs from the job without fuzzing"

"""A serving replica kept fresh by touched-row deltas (``shardps.worker.serving.replica``), with real shards.

- After each training step and a refresh, the replica's tables and dense parameters equal the shards' export,
  bit for bit; a refresh after the first moves only the rows the step pushed (deltas, not snapshots).
- Reads while deltas apply never see a half-applied one: every step pushes every id with the same gradient, so
  the rows of one shard hold one value, the number of rounds that shard had applied when it was read; a reader
  thread checks every answer against the rounds of the state it read.
- A training shard SIGKILLed and restarted from its checkpoint, after the replica read a step the shard then
  lost: the replica answers from its last state throughout, and its next refresh sees another incarnation
  (the restored shard numbers its rounds again from its checkpoint's), reads the tables whole and equals the
  export again.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from torch import nn

from shardps.common.rows import shard_of
from shardps.worker import DistributedOptimizer, ShardedEmbedding
from shardps.worker.embedding.export import export_table
from shardps.worker.export import from_servers
from shardps.worker.serving.replica import Replica
from shardps.worker.session.client import ShardClient
from tests.support.forked import ForkedCluster

IDS = 24


def job(servers: str, init=None):
    model = nn.ModuleDict({"user": ShardedEmbedding(None, 4, name="user", init=init),
                           "item": ShardedEmbedding(None, 4, name="item", init=init)})
    model.bias = nn.Parameter(torch.zeros(1))
    dist = DistributedOptimizer(torch.optim.SGD([model.bias], lr=0.1), [("bias", model.bias)], servers=servers,
                                model=model, worker_id="w0",
                                sparse_optimizer=torch.optim.SGD([model["user"].handle, model["item"].handle], lr=1.0))
    return model, dist


def step(model, dist, users: list[int], items: list[int]) -> None:
    dist.zero_grad()
    u, i = model["user"](torch.tensor(users)), model["item"](torch.tensor(items))
    ((u * i).sum(1) + model.bias - 3.0).pow(2).mean().backward()
    dist.step()


def equals_export(replica: Replica, dist) -> None:
    dist.tables.settle("user")
    state = replica.refresh()
    for name in ("user", "item"):
        full = export_table(dist.clients, name)
        mine = state.tables[name]
        assert torch.equal(mine.ids, full.ids) and torch.equal(mine.weights, full.weights), name
    with from_servers(replica.servers, tables=[], allow_mixed_versions=True) as export:
        assert torch.equal(state.dense["bias"], export.state_dict["bias"])


def test_a_replica_equals_the_export_after_each_delta_and_serves_through_a_shard_restart(tmp_path):
    with ForkedCluster(2, extra_args=("--checkpoint-dir", str(tmp_path))) as shards:
        model, dist = job(shards.servers)
        replica = Replica(shards.servers, ["user", "item"], dense_every=0)
        try:
            g = torch.Generator().manual_seed(0)
            for k in range(4):
                step(model, dist, torch.randint(0, 50, (8,), generator=g).tolist(),
                     torch.randint(0, 80, (8,), generator=g).tolist())
                equals_export(replica, dist)
            assert replica.snapshots == 2 and replica.deltas == 6  # one whole read per table, then deltas only
            for s in range(2):
                client = ShardClient(shards.addresses[s], index=s)
                try:
                    client.checkpoint()
                finally:
                    client.close()
            step(model, dist, [1, 2], [3, 4])  # after the checkpoint: shard 0 loses it when killed
            equals_export(replica, dist)  # the replica holds that step: the restored shard goes back before it
            asked = torch.arange(100)
            served = replica.state.lookup("user", asked)
            shards.restart(0, same_port=True)
            assert torch.equal(replica.lookup("user", asked), served)  # the last state, while the shard is down
            step(model, dist, [5, 6], [7, 8])  # the worker rejoins the restored shard and goes on
            equals_export(replica, dist)
            assert replica.snapshots == 4  # the restored shard is another process: each table read whole
        finally:
            replica.close()
            dist.close()


def test_no_read_sees_a_half_applied_delta(tmp_path):
    with ForkedCluster(2) as shards:
        model, dist = job(shards.servers, init="zeros")
        replica = Replica(shards.servers, ["user"], period=0.05, dense_every=None)
        ids = torch.arange(IDS)
        owner = shard_of("user", ids, 2)
        seen, bad, stop = [], [], threading.Event()

        def read() -> None:
            while not stop.is_set() and len(seen) < 100_000:
                state = replica.state
                if state is None:
                    time.sleep(0.001)
                    continue
                rows = state.lookup("user", ids)[:, 0]
                for s in range(2):  # every row of shard s was pushed once per round: it holds -(rounds) * lr
                    want = -float(state.rounds["user"][s])
                    if not torch.all(rows[owner == s] == want):
                        bad.append((state.number, s, want, rows[owner == s].tolist()))
                seen.append(state.number)

        reader = threading.Thread(target=read, daemon=True)
        try:
            replica.refresh()
            replica.start()
            reader.start()
            for _ in range(30):  # each step pushes every user id once with gradient 1 (lr 1)
                dist.zero_grad()
                model["user"](ids).sum().backward()
                dist.step()
                time.sleep(0.02)
            dist.tables.settle("user")
            deadline = time.monotonic() + 10
            while replica.state.rounds["user"] != [30, 30] and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            stop.set()
            reader.join(10)
            replica.close()
            dist.close()
        assert not bad, bad[:3]
        assert replica.state.rounds["user"] == [30, 30] and len(set(seen)) > 5, (replica.state.rounds, len(set(seen)))


def _start_serve(servers: str, realtime: bool = False):
    """``shardps serve`` at ``--nice 5``, or at ``--realtime 5``: every thread of it checked to run so."""
    import subprocess
    import sys

    priority = ("--realtime", "5") if realtime else ("--nice", "5")
    proc = subprocess.Popen([sys.executable, "-m", "shardps.cli.main", "serve", "--servers", servers, "--tables",
                             "user,item,user_bias,item_bias", "--period", "0.2", "--dense-every", "0", *priority],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = iter(proc.stdout.readline, "")
    from shardps.apps.processes import wait_for

    address = wait_for(lines, "serving on ")
    wait_for(lines, "serving tables ")
    stats = [open(f"/proc/{proc.pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()
             for t in os.listdir(f"/proc/{proc.pid}/task")]
    if realtime:  # proc(5): rt_priority and policy (1: SCHED_FIFO) are fields 40 and 41
        policies = {(int(f[37]), int(f[38])) for f in stats}
        assert policies == {(5, 1)}, f"shardps serve --realtime 5: its threads run at (priority, policy) {policies}"
    else:
        nice = {int(f[16]) for f in stats}
        assert nice == {5}, f"shardps serve --nice 5: its threads run at nice {nice}"
    return proc, address


def _exported(clients, servers) -> tuple[dict, torch.Tensor]:
    tables = {name: export_table(clients, name) for name in ("user", "item", "user_bias", "item_bias")}
    with from_servers(servers, tables=[], allow_mixed_versions=True) as export:
        return tables, export.state_dict["global_bias"]


def test_shardps_serve_answers_lookups_and_scores_as_the_export_and_catches_up_after_a_kill():
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from shardps.apps.movielens import MF
    from shardps.common.rows import ids_bytes
    from shardps.proto import shardps_pb2 as pb
    from shardps.proto import shardps_pb2_grpc as pb_grpc

    with ForkedCluster(2) as shards:
        model = MF(4, 0.1, 3.5)
        dist = DistributedOptimizer(torch.optim.SGD([model.global_bias], lr=0.1), model.named_parameters(),
                                    servers=shards.servers, model=model, worker_id="w0",
                                    sparse_optimizer=torch.optim.Adagrad([model.user.handle, model.item.handle,
                                                                          model.user_bias.handle,
                                                                          model.item_bias.handle], lr=0.1))
        g = torch.Generator().manual_seed(1)

        def train(steps: int) -> None:
            for _ in range(steps):
                u, i = torch.randint(0, 30, (16,), generator=g), torch.randint(0, 40, (16,), generator=g)
                dist.zero_grad()
                (model(u, i)[0] - 4.0).pow(2).mean().backward()
                dist.step()
            dist.tables.settle("user")

        proc = None
        try:
            train(3)
            proc, address = _start_serve(shards.servers)
            channel = grpc.insecure_channel(address)
            stub = pb_grpc.ServingStub(channel)
            checks = health_pb2_grpc.HealthStub(channel)
            assert checks.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING
            for round_ in range(2):
                train(4)
                want, mu = _exported(dist.clients, shards.servers)
                asked = torch.arange(60)
                deadline = time.monotonic() + 15
                while True:  # the replica refreshes every 0.2 s: wait for the rows of the last step
                    reply = stub.Lookup(pb.LookupRequest(table="user", ids=ids_bytes(asked)), timeout=10)
                    rows = torch.frombuffer(bytearray(reply.rows), dtype=torch.float32).view(60, reply.dim)
                    if torch.equal(rows, want["user"].lookup(asked)) or time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
                assert torch.equal(rows, want["user"].lookup(asked)), "the replica did not catch up within 15 s"
                held = torch.arange(30).flip(0)  # inside the table's dense range: its direct rows answer
                reply = stub.Lookup(pb.LookupRequest(table="user", ids=ids_bytes(held)), timeout=10)
                assert torch.equal(torch.frombuffer(bytearray(reply.rows), dtype=torch.float32).view(30, reply.dim),
                                   want["user"].lookup(held))
                time.sleep(0.5)  # the dense parameters came with the same refresh or the next
                items = torch.arange(40)
                scores = stub.Score(pb.ScoreRequest(user=7, items=ids_bytes(items)), timeout=10)
                got = torch.frombuffer(bytearray(scores.scores), dtype=torch.float32)
                user = torch.tensor([7])
                expect = want["item"].lookup(items) @ want["user"].lookup(user)[0] + \
                    want["item_bias"].lookup(items)[:, 0] + want["user_bias"].lookup(user)[0, 0] + mu.reshape(())
                assert torch.allclose(got, expect, atol=1e-6, rtol=0)
                with pytest.raises(grpc.RpcError) as bad:
                    stub.Lookup(pb.LookupRequest(table="user", ids=b"1234567"), timeout=10)
                assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                with pytest.raises(grpc.RpcError) as unknown:
                    stub.Lookup(pb.LookupRequest(table="nope", ids=b""), timeout=10)
                assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
                channel.close()
                if round_ == 0:  # SIGKILL the replica and start it again: it reads the tables whole and goes on
                    proc.kill()
                    proc.wait(10)
                    proc, address = _start_serve(shards.servers, realtime=True)  # at a real-time priority
                    channel = grpc.insecure_channel(address)
                    stub = pb_grpc.ServingStub(channel)
        finally:
            if proc is not None:
                proc.kill()
                proc.wait(10)
            dist.close()

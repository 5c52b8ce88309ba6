"""Sparse tables against real shard processes: placement-independent init, refusals, admission and eviction
(counted on the Prometheus endpoint), restart from a checkpoint bit for bit, export into plain torch modules."""

from __future__ import annotations

import time

import grpc
import pytest
import torch
from torch import nn

from shardps.common.rows import ids_bytes, initial_rows, rows_bytes, rows_from, shard_of
from shardps.proto import shardps_pb2 as pb
from shardps.worker import (
    DistributedOptimizer, ShardedEmbedding, ShardedEmbeddingBag, ShardedEmbeddingBagCollection, WireOptions,
)
from shardps.worker.session.client import ShardClient, ShardRpcError
from tests.support.forked import ForkedCluster
from tests.support.prom import scrape, value

INT64 = torch.tensor([-(2**63), 2**63 - 1, -1, 0, 1, 123456789012345, -987654321098765, 2**40 + 7])


class Tables(nn.Module):
    def __init__(self, **table) -> None:
        super().__init__()
        self.table = ShardedEmbedding(**table)
        self.dense = nn.Linear(1, 1)  # the same dense plan whatever the table's dimension

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.dense(self.table(ids).sum(-1, keepdim=True)).sum()


def attach(cluster, worker_id="w0", lr=0.1, kind="sgd", wire=None, **table):
    table.setdefault("num_embeddings", None)
    table.setdefault("embedding_dim", 4)
    model = Tables(**table)
    sparse = {"sgd": lambda h: torch.optim.SGD(h, lr=lr), "adagrad": lambda h: torch.optim.Adagrad(h, lr=lr),
              "adam": lambda h: torch.optim.SparseAdam(h, lr=lr)}[kind]([model.table.handle])
    dist = DistributedOptimizer(torch.optim.SGD(model.dense.parameters(), lr=0.0), model.named_parameters(),
                                servers=cluster.servers, model=model, worker_id=worker_id, sparse_optimizer=sparse,
                                wire=wire or WireOptions())
    return model, dist


def train(model, dist, batches) -> None:
    for ids in batches:
        dist.zero_grad()
        model(ids).backward()
        dist.step()
    dist.synchronize()


def on_every_shard(cluster, call: str) -> None:
    """``ShardClient.<call>()`` on every shard of ``cluster`` (``reset``, ``checkpoint``)."""
    for address in cluster.addresses:
        client = ShardClient(address, index=0)
        try:
            getattr(client, call)()
        finally:
            client.close()


def reset(cluster) -> None:
    on_every_shard(cluster, "reset")


@pytest.mark.parametrize("num_shards", [1, 2, 3])
def test_hashed_ids_from_the_whole_int64_range_initialise_the_same_for_any_shard_count(num_shards):
    with ForkedCluster(num_shards) as cluster:
        model, dist = attach(cluster, lr=0.0)
        try:
            with torch.no_grad():
                read = model.table(INT64)
            train(model, dist, [INT64])  # lr 0: the rows are created, unchanged
            export = dist.tables.export("table")
        finally:
            dist.close()
    want = initial_rows("table", INT64, 4, 0, 0.5)
    assert torch.equal(read, want)
    assert export.ids.tolist() == sorted(INT64.tolist())
    assert torch.equal(export.weights, initial_rows("table", export.ids, 4, 0, 0.5))
    assert shard_of("table", INT64, num_shards).unique().numel() == min(num_shards, 3)  # the ids spread


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sparse-ckpt")
    with ForkedCluster(2, extra_args=("--metrics-port", "0", "--checkpoint-dir", str(directory))) as cluster:
        yield cluster


def test_bounded_tables_refuse_bad_ids_and_dtypes_at_the_call_and_change_nothing(shards):
    reset(shards)
    model, dist = attach(shards, num_embeddings=10)
    try:
        train(model, dist, [torch.tensor([1, 2, 3])])
        before = dist.tables.export("table")
        with pytest.raises(ValueError, match=r"id 10 is outside \[0, 10\)"):
            model(torch.tensor([1, 10]))
        with pytest.raises(ValueError, match="id -1 is outside"):
            model(torch.tensor([-1]))
        with pytest.raises(TypeError, match="int32 or int64"):
            model(torch.tensor([1.0, 2.0]))
        with pytest.raises(TypeError, match="int32 or int64"):
            model(torch.tensor([1, 2], dtype=torch.int16))
        with pytest.raises(ValueError, match=r"id 10 is outside \[0, 10\)"):  # int32 ids are checked as int64 ones
            model(torch.tensor([1, 10], dtype=torch.int32))
        assert not model.table.pending
        after = dist.tables.export("table")
        assert torch.equal(before.ids, after.ids) and torch.equal(before.weights, after.weights)
        assert before.round == after.round
        # another worker declaring the same table with another dimension is refused at Join
        with pytest.raises(ShardRpcError, match="embedding_dim: 4 vs 8"):
            attach(shards, worker_id="w1", num_embeddings=10, embedding_dim=8)
        assert dist.tables.export("table").spec.embedding_dim == 4
        train(model, dist, [torch.tensor([4])])  # the job goes on
    finally:
        dist.close()


def test_hostile_row_pushes_are_refused_and_stage_nothing(shards):
    reset(shards)
    model, dist = attach(shards)
    client = ShardClient(shards.addresses[0], index=0)
    try:
        ids = torch.arange(200)
        mine = ids[shard_of("table", ids, 2) == 0][:3]
        theirs = ids[shard_of("table", ids, 2) == 1][:1]

        def push(ids, grads, **kw):
            request = pb.PushRowsRequest(worker_id="w0", session=dist.session, push=99, tables=[
                pb.TableRows(table=kw.get("table", "table"), ids=ids_bytes(ids), grads=rows_bytes(grads),
                             lr=kw.get("lr", 0.1))])
            with pytest.raises(ShardRpcError) as info:
                client.push_rows(request)
            return info.value

        assert push(theirs, torch.zeros(1, 4)).code == grpc.StatusCode.INVALID_ARGUMENT
        assert "does not hold" in push(theirs, torch.zeros(1, 4)).details
        assert "not finite" in push(mine, torch.full((3, 4), float("nan"))).details
        assert "repeats an id" in push(mine[[0, 0]], torch.zeros(2, 4)).details
        assert "float32 values" in push(mine, torch.zeros(3, 3)).details
        assert "learning rate" in push(mine, torch.zeros(3, 4), lr=-1.0).details
        assert "not declared" in push(mine, torch.zeros(3, 4), table="nope").details
        assert client.stats().version == 0

        def pull(**kw):
            request = pb.PullRowsRequest(worker_id="w0", session=dist.session, **kw)
            with pytest.raises(ShardRpcError) as info:
                client.pull_rows(request)
            return info.value

        part = pb.TableIds(table="table", ids=ids_bytes(mine))
        assert "twice" in pull(tables=[part, part]).details
        assert "not both" in pull(table="table", ids=ids_bytes(mine), tables=[part]).details
        assert "not declared" in pull(tables=[part, pb.TableIds(table="nope", ids=ids_bytes(mine))]).details
        assert "does not hold" in pull(tables=[pb.TableIds(table="table", ids=ids_bytes(theirs))]).details
        assert "not both" in pull(tables=[part], after_push=True, after_push_number=1).details
        reply = client.pull_rows(pb.PullRowsRequest(worker_id="w0", session=dist.session, tables=[part]))
        assert len(reply.parts) == 1 and not reply.rows
        assert torch.equal(rows_from(reply.parts[0], 3, 4), initial_rows("table", mine, 4, 0, 0.5))
        train(model, dist, [torch.tensor([1, 2])])  # nothing was staged: the round applies this worker's push
        assert dist.tables.export("table").round == 1
    finally:
        client.close()
        dist.close()


def sparse_metric(cluster, name: str) -> float:
    return sum(value(scrape(ep["metrics"]), f"shardps_shard_table_{name}", shard=i, table="table")
               for i, ep in enumerate(cluster.endpoints))


def test_admission_counts_sightings_and_drops_gradients_until_min_count(shards):
    reset(shards)
    model, dist = attach(shards, min_count=2, lr=1.0)
    try:
        train(model, dist, [torch.tensor([7, 8])])
        assert dist.tables.export("table").ids.numel() == 0  # seen once: not rows, gradients dropped
        with torch.no_grad():
            assert torch.equal(model.table(torch.tensor([7])), initial_rows("table", torch.tensor([7]), 4, 0, 0.5))
        train(model, dist, [torch.tensor([7])])  # the second sighting admits 7 and applies its gradient
        export = dist.tables.export("table")
        assert export.ids.tolist() == [7]
        assert not torch.equal(export.weights, initial_rows("table", torch.tensor([7]), 4, 0, 0.5))
        assert sparse_metric(shards, "admitted_total") == 1
        assert sparse_metric(shards, "dropped_unadmitted_total") == 2
        assert sparse_metric(shards, "rows") == 1
    finally:
        dist.close()


def test_rows_idle_for_ttl_rounds_and_beyond_capacity_are_evicted(shards):
    reset(shards)
    model, dist = attach(shards, ttl_rounds=2)
    try:
        train(model, dist, [torch.tensor([1, 2]), torch.tensor([2]), torch.tensor([2])])
        assert dist.tables.export("table").ids.tolist() == [2]  # 1 was idle for 2 rounds
        assert sparse_metric(shards, "evicted_ttl_total") == 1
    finally:
        dist.close()
    reset(shards)
    model, dist = attach(shards, capacity=1)
    try:
        ids = torch.arange(100)
        one_shard = ids[shard_of("table", ids, 2) == 0][:3]  # capacity is per shard: use one shard's ids
        train(model, dist, [one_shard[:1], one_shard[1:2], one_shard[2:3]])
        assert dist.tables.export("table").ids.tolist() == [int(one_shard[2])]  # least recently pushed go first
        assert sparse_metric(shards, "evicted_capacity_total") == 2
        assert sparse_metric(shards, "rows") == 1
    finally:
        dist.close()


def test_a_killed_shard_resumes_rows_and_optimizer_state_bit_exact_from_its_checkpoint(shards):
    reset(shards)
    model, dist = attach(shards, kind="adam", num_embeddings=64, lr=0.05)
    try:
        g = torch.Generator().manual_seed(0)
        train(model, dist, [torch.randint(0, 64, (16,), generator=g) for _ in range(5)])
        on_every_shard(shards, "checkpoint")
        before = dist.tables.export("table")
        shards.restart(0, same_port=True)  # SIGKILL, then a new process on the same directory
        client = ShardClient(shards.addresses[0], index=0)
        try:
            restored = client.export_rows("table", state=True)
        finally:
            client.close()
        after = dist.tables.export("table")
        assert torch.equal(before.ids, after.ids) and torch.equal(before.weights, after.weights)
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(before.state[name], after.state[name]), name
        assert before.steps == after.steps and restored.round == before.round
        train(model, dist, [torch.tensor([1, 2, 3])])  # the worker joins the restarted shard again and goes on
        assert dist.tables.export("table").round == before.round + 1
    finally:
        dist.close()


def test_a_shard_restarted_while_a_step_is_pushed_is_joined_again_and_takes_the_rows(shards):
    """The shard is SIGKILLed and restarted from its checkpoint between a step's backward and its step(): the
    rows' push, handed off by step(), finds a shard that forgot the worker; the next call (synchronize) joins
    it again on the training thread, declares the tables and sends the whole push, which applies once."""
    reset(shards)
    model, dist = attach(shards, num_embeddings=64, lr=0.5)
    try:
        train(model, dist, [torch.arange(10)])
        on_every_shard(shards, "checkpoint")
        before = dist.tables.export("table")
        ids = torch.arange(64)
        with torch.no_grad():
            w = float(model.dense.weight)
        dist.zero_grad()
        model(ids).backward()
        shards.restart(0, same_port=True)
        dist.step()
        dist.synchronize()
        after = dist.tables.export("table")
        assert after.round == before.round + 1
        want = initial_rows("table", ids, 4, 0, 4 ** -0.5)
        want[before.ids] = before.weights
        assert torch.allclose(after.weight(), want - 0.5 * w, rtol=0, atol=1e-6)
        train(model, dist, [torch.tensor([1, 2, 3])])  # and training goes on
    finally:
        dist.close()


def test_a_prefetch_cut_by_a_shard_restart_is_pulled_again(tmp_path):
    """A shard SIGKILLed while a prefetch waits on it: the prefetch fails (UNAVAILABLE), the next forward pulls
    the rows again (rejoining and declaring on the restarted shard) and training goes on."""
    with ForkedCluster(2, extra_args=("--checkpoint-dir", str(tmp_path))) as shards:  # its own checkpoints
        _prefetch_through_a_restart(shards)


def _prefetch_through_a_restart(shards) -> None:
    bags = ShardedEmbeddingBagCollection({"f": ShardedEmbeddingBag(64, 4, mode="sum", name="table")})
    model = nn.ModuleDict({"bags": bags, "head": nn.Linear(4, 1)})
    dist = DistributedOptimizer(torch.optim.SGD(model["head"].parameters(), lr=0.0), model.named_parameters(),
                                servers=shards.servers, model=model, worker_id="w0",
                                sparse_optimizer=torch.optim.SGD([bags.bags["f"].handle], lr=0.5))
    ids = torch.arange(32).view(16, 2)  # rows on both shards
    try:
        for restart in (False, True, False):
            if restart:  # a checkpoint between steps, for the restarted shard to resume from
                dist.synchronize()
                on_every_shard(shards, "checkpoint")
            dist.zero_grad()
            loss = model["head"](bags({"f": ids})["f"]).sum()
            bags.prefetch({"f": ids})
            loss.backward()
            if restart:
                shards.restart(0, same_port=True)  # SIGKILL while the prefetch waits for this step's push
            dist.step()
        dist.synchronize()
        assert dist.tables.prefetches["pulled_again"] >= 1 and dist.tables.prefetches["used"] >= 1
        with torch.no_grad():
            rows = bags({"f": ids.view(-1, 1)})["f"]
        assert torch.equal(rows, dist.tables.export("table").weight()[ids.view(-1)])
    finally:
        dist.close()


def test_an_exported_bounded_table_loads_into_a_plain_embedding_bag_with_the_same_outputs(shards):
    reset(shards)
    bag = ShardedEmbeddingBag(20, 4, mode="mean", name="table")

    class Bags(nn.Module):
        def __init__(self):
            super().__init__()
            self.bag, self.dense = bag, nn.Linear(4, 1)

        def forward(self, ids):
            return self.dense(self.bag(ids)).sum()

    model = Bags()
    dist = DistributedOptimizer(torch.optim.SGD(model.dense.parameters(), lr=0.0), model.named_parameters(),
                                servers=shards.servers, model=model, worker_id="w0",
                                sparse_optimizer=torch.optim.Adagrad([bag.handle], lr=0.5))
    try:
        train(model, dist, [torch.randint(0, 20, (5, 3)) for _ in range(4)])
        weight = dist.tables.export("table").weight()
        ids = torch.randint(0, 20, (6, 3))
        with torch.no_grad():
            got = bag(ids)
    finally:
        dist.close()
    plain = nn.EmbeddingBag(20, 4, mode="mean")
    plain.load_state_dict({"weight": weight})
    assert torch.equal(plain(ids), got)


def test_a_round_past_a_tables_memory_limit_is_refused_loudly_and_changes_nothing(shards):
    reset(shards)
    model, dist = attach(shards, max_bytes=2000)  # about 36 rows of 4 values on each shard
    try:
        train(model, dist, [torch.arange(10)])
        before = dist.tables.export("table")
        dist.zero_grad()
        model(torch.arange(100, 300)).backward()
        dist.step()  # staged; the shards refuse the round when they apply it
        with pytest.raises(ShardRpcError, match="RESOURCE_EXHAUSTED.*table 'table' would need"):
            model(torch.arange(10))  # the next pull says why
        after = dist.tables.export("table")
        assert torch.equal(before.ids, after.ids) and torch.equal(before.weights, after.weights)
        assert before.round == after.round
    finally:
        dist.close()


def test_new_rows_past_the_shards_memory_budget_are_refused_loudly():
    # the shard starts near 250 MiB resident and holds about 600 MiB when it checks the first round below (its
    # 32 MiB request, the pull's rows and the allocator's high-water mark), then grows by about 100 MiB a
    # round (33 MiB of rows): a budget of 800 MiB takes the first round and refuses one of the next few
    budget = 800 << 20
    args = ("--memory-budget-bytes", str(budget), "--max-message-bytes", str(64 << 20))
    with ForkedCluster(1, extra_args=args) as cluster:
        model, dist = attach(cluster, embedding_dim=1024, lr=0.0, wire=WireOptions(max_message_bytes=64 << 20))
        try:
            with pytest.raises(ShardRpcError, match=f"RESOURCE_EXHAUSTED.*memory budget of {budget} bytes"):
                for r in range(30):
                    train(model, dist, [torch.arange(r * 8000, (r + 1) * 8000)])
            rows = dist.tables.export("table").ids.numel()
            assert 0 < rows < 30 * 8000 and rows % 8000 == 0  # whole rounds only
        finally:
            dist.close()


def test_a_step_of_several_message_sizes_of_rows_is_pulled_and_pushed_in_parts(shards):
    """16,000 rows of 4 KiB (65 MB, about 8 of the shards' 8 MiB messages): the pull is split into calls under
    half the limit, and so is each shard's push (``PushRowsRequest.parts``), which the shard stages once its
    last part is in: the step applies exactly SGD's update to every row."""
    reset(shards)
    limit = 8 << 20
    model, dist = attach(shards, embedding_dim=1024, lr=0.5)
    try:
        ids = torch.arange(16_000) * 7919
        with torch.no_grad():
            model.dense.weight.fill_(0.25)
            model.dense.bias.zero_()
            start = model.table(ids)
        assert torch.equal(start, initial_rows("table", ids, 1024, 0, 1024 ** -0.5))
        assert dist.tables.pulled_bytes > 3 * limit
        train(model, dist, [ids])
        assert dist.tables.pushed_bytes > 3 * limit
        got = dist.tables.export("table")
        order = torch.argsort(ids)
        assert torch.equal(got.ids, ids[order])
        assert torch.allclose(got.weights, start[order] - 0.5 * 0.25, rtol=0, atol=1e-6)
    finally:
        dist.close()


def test_a_push_whose_parts_the_shard_lost_is_sent_again_whole(shards):
    """While the worker sends a push's parts, the shard drops those it holds (here: a part of another push number
    from the same member, as a retry of a given-up push would send). The last part is answered ABORTED and the
    worker sends the whole push again: the step applies exactly once, on every row."""
    reset(shards)
    model, dist = attach(shards, embedding_dim=1024, lr=0.5)
    clients, sent, rogue = dist.tables._clients, [], []
    try:
        originals = [c.push_rows for c in clients]

        def wrapped(s: int):
            def push_rows(request):
                sent.append((s, request.push, request.part, request.parts))
                reply = originals[s](request)
                if request.parts > 1 and request.part == 0 and not rogue:  # between this push's parts
                    rogue.append(s)  # (the shards are pushed to in parallel: note which one got it)
                    originals[s](pb.PushRowsRequest(worker_id=request.worker_id, session=request.session,
                                                    push=request.push + 1000, part=0, parts=2))
                return reply
            return push_rows

        for s, c in enumerate(clients):
            c.push_rows = wrapped(s)
        ids = torch.arange(8_000) * 7919
        with torch.no_grad():
            model.dense.weight.fill_(0.25)
            model.dense.bias.zero_()
            start = model.table(ids)
        train(model, dist, [ids])
        assert rogue, "no push came in parts"
        shard = rogue[0]
        parts = [part for s, _, part, _ in sent if s == shard]
        n = max(p for s, _, _, p in sent if s == shard)
        assert parts == list(range(n)) * 2, parts  # every part, then (after ABORTED) every part again
        got = dist.tables.export("table")
        order = torch.argsort(ids)
        assert torch.equal(got.ids, ids[order])
        assert torch.allclose(got.weights, start[order] - 0.5 * 0.25, rtol=0, atol=1e-6)  # applied once
    finally:
        for c, push_rows in zip(clients, originals):
            c.push_rows = push_rows
        dist.close()


def test_push_parts_that_do_not_add_up_are_refused_and_stage_nothing(shards):
    """Raw parts: a part index past its count, or a push whose parts disagree on their count, is refused and
    nothing is staged; the worker's next whole push goes through."""
    reset(shards)
    model, dist = attach(shards)
    client = dist._clients[0]
    try:
        train(model, dist, [torch.tensor([3])])
        before = dist.tables.export("table")

        def part(number: int, k: int, n: int) -> pb.PushRowsRequest:
            return pb.PushRowsRequest(worker_id=dist.worker_id, session=dist.session, push=number, part=k, parts=n)

        with pytest.raises(ShardRpcError, match="names part 2 of 2"):
            client.push_rows(part(100, 2, 2))
        client.push_rows(part(101, 0, 3))
        with pytest.raises(ShardRpcError, match="came in 3 parts and now in 2"):
            client.push_rows(part(101, 1, 2))
        after = dist.tables.export("table")
        assert after.round == before.round and torch.equal(after.weights, before.weights)
    finally:
        dist.close()


def test_a_non_finite_row_gradient_is_refused_before_anything_is_pushed(shards):
    """The tables' push is checked before the dense round is sent: a NaN in a row gradient raises at step()
    and neither the dense parameters nor the rows change on the shards."""
    reset(shards)
    model, dist = attach(shards, lr=0.5)
    try:
        ids = torch.arange(6)
        train(model, dist, [ids])
        before = dist.tables.export("table")
        versions = [s.version for s in dist.stats()]
        dist.zero_grad()
        (model(ids) * float("nan")).backward()
        with pytest.raises(ValueError, match="gradient of table 'table' is not finite.*nothing was pushed"):
            dist.step()
        after = dist.tables.export("table")
        assert torch.equal(before.ids, after.ids) and torch.equal(before.weights, after.weights)
        assert [s.version for s in dist.stats()] == versions
    finally:
        dist.close()


def test_a_round_left_open_by_a_step_that_raised_is_dropped_with_its_job(shards):
    """A step that raises after backward leaves the round's streamed pushes open on the shards; once the job is
    reset, the next job (another dense plan) starts its rounds afresh instead of joining that round."""
    reset(shards)
    model, dist = attach(shards)
    try:
        dist.zero_grad()
        (model(torch.arange(4)) * float("nan")).backward()  # the dense gradients stream during backward
        with pytest.raises(ValueError, match="not finite"):
            dist.step()
    finally:
        dist.close()
    reset(shards)
    head = nn.Linear(3, 2)
    dist = DistributedOptimizer(torch.optim.SGD(head.parameters(), lr=0.1), head.named_parameters(),
                                servers=shards.servers, model=head, worker_id="w0")
    try:
        for _ in range(2):
            dist.zero_grad()
            head(torch.ones(1, 3)).sum().backward()
            dist.step()
        dist.synchronize()
        assert [s.version for s in dist.stats()] == [2] * len(shards.addresses)
    finally:
        dist.close()


def test_a_prefetch_whose_step_raised_is_pulled_again_without_waiting(shards):
    """A prefetch waits on the shards for the step's push; when step() refuses the push (nothing sent), the next
    forward cancels it and pulls, at once, the rows as they are."""
    reset(shards)
    bags = ShardedEmbeddingBagCollection({"f": ShardedEmbeddingBag(None, 4, mode="sum", name="table")})
    model = nn.ModuleDict({"bags": bags, "head": nn.Linear(4, 1)})
    dist = DistributedOptimizer(torch.optim.SGD(model["head"].parameters(), lr=0.0), model.named_parameters(),
                                servers=shards.servers, model=model, worker_id="w0",
                                sparse_optimizer=torch.optim.SGD([bags.bags["f"].handle], lr=0.5))
    ids = torch.arange(6).view(3, 2)
    try:
        for scale in (1.0, float("nan")):
            dist.zero_grad()
            loss = model["head"](bags({"f": ids})["f"]).sum() * scale
            bags.prefetch({"f": ids})
            loss.backward()
            if scale == scale:
                dist.step()
        with pytest.raises(ValueError, match="not finite"):
            dist.step()
        began = time.monotonic()
        with torch.no_grad():
            rows = bags({"f": ids.view(-1, 1)})["f"]
        assert time.monotonic() - began < 10.0
        # the first prefetch was used; the second (its push refused) dropped: the forward above has other ids
        assert dist.tables.prefetches == {"used": 1, "dropped": 1, "pulled_again": 0}
        export = dist.tables.export("table")
        assert torch.equal(rows, export.lookup(ids.view(-1)))
        with torch.no_grad():
            bags.prefetch({"f": ids})
            rows = bags({"f": ids})["f"]  # no step since the prefetch: its push was never sent
        assert dist.tables.prefetches["pulled_again"] == 1
        # the bags' sums by the kernel the module runs (embedding_bag), over the exported rows in the same order
        want = nn.functional.embedding_bag(torch.arange(6).view(3, 2), export.lookup(ids.view(-1)), mode="sum")
        assert torch.equal(rows, want)
    finally:
        dist.close()


def test_a_table_larger_than_one_message_exports_in_pages(shards):
    reset(shards)
    model, dist = attach(shards, kind="adagrad", embedding_dim=1024)  # about 12 MB of rows and state per shard
    try:
        ids = torch.arange(3000)
        train(model, dist, [ids])
        export = dist.tables.export("table")
        with torch.no_grad():
            pulled = model.table(ids)
    finally:
        dist.close()
    assert export.ids.tolist() == ids.tolist()
    assert torch.equal(export.weights, pulled) and export.state["sum"].shape == (3000, 1024)
    assert bool((export.state["sum"] > 0).any())


def test_a_push_of_several_tables_is_refused_naming_the_table_at_fault_and_stages_nothing(shards):
    """The shard checks every table of a push in one pass (ids in order, finite gradients): a fault in the
    second table is refused with that table's name, and nothing of the push, first table included, is staged."""
    reset(shards)
    bags = ShardedEmbeddingBagCollection({f: ShardedEmbeddingBag(None, 4, mode="sum", name=f) for f in ("a", "b")})
    model = nn.ModuleDict({"bags": bags, "head": nn.Linear(4, 1)})
    dist = DistributedOptimizer(torch.optim.SGD(model["head"].parameters(), lr=0.0), model.named_parameters(),
                                servers=shards.servers, model=model, worker_id="w0",
                                sparse_optimizer=torch.optim.SGD([b.handle for b in bags.bags.values()], lr=0.5))
    client = ShardClient(shards.addresses[0], index=0)
    try:
        ids = torch.arange(400)
        a = ids[shard_of("a", ids, 2) == 0][-3:]  # the last ids of a are above the first of b: not a repeat
        b = ids[shard_of("b", ids, 2) == 0][:3]
        assert int(a[0]) > int(b[-1])

        def push(b_ids, b_grads):
            request = pb.PushRowsRequest(worker_id="w0", session=dist.session, push=99, tables=[
                pb.TableRows(table="a", ids=ids_bytes(a), grads=rows_bytes(torch.ones(3, 4)), lr=0.5),
                pb.TableRows(table="b", ids=ids_bytes(b_ids), grads=rows_bytes(b_grads), lr=0.5)])
            with pytest.raises(ShardRpcError) as info:
                client.push_rows(request)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
            return info.value.details

        assert "table 'b' repeats an id" in push(b[[0, 1, 1]], torch.zeros(3, 4))
        assert "gradient of table 'b' is not finite" in push(b, torch.tensor([[0.0] * 4, [1.0, float("inf"), 0, 0],
                                                                               [0.0] * 4]))
        # nothing staged: the next step of both tables is this worker's push 1, applied as the only round
        dist.zero_grad()
        out = bags({"a": a.view(-1, 1), "b": b.view(-1, 1)})
        model["head"](out["a"] + out["b"]).sum().backward()
        dist.step()
        dist.synchronize()
        assert dist.tables.export("a").round == 1 and dist.tables.export("b").round == 1
    finally:
        client.close()
        dist.close()

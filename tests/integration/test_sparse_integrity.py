"""Sparse rounds are as trustworthy as dense ones, against a real shard process over raw gRPC.

Each trigger of a silently dropped or poisoned sparse round (issue 44, items 1, 2 and 5) is refused with a
named error, on the call itself or on the next pull of every member of the round, and leaves the table
exactly as it was: rows, optimizer state, step count (ExportRows ``step``), rows and bytes (ExportRows
``total_rows`` and the shard's table metrics), admission and push counters, sparse rounds. The next good
round applies as usual. Raw requests reach the shard past the worker's own checks; the worker's checks are
tested too (``ValueError`` before anything is sent).
"""

from __future__ import annotations

import itertools
import re
import threading

import grpc
import pytest
import torch
from torch import nn

from shardps.common.rows import ids_bytes, initial_rows, rows_bytes, rows_from
from shardps.proto import shardps_pb2 as pb
from shardps.worker import DistributedOptimizer, ShardedEmbedding
from shardps.worker.session.client import ShardClient, ShardRpcError
from tests.support.forked import ForkedCluster
from tests.support.prom import scrape, value

DIM = 4
COUNTERS = ("rows", "bytes", "admitted_total", "rows_pushed_total", "dropped_unadmitted_total")


class Tables(nn.Module):
    def __init__(self, **table) -> None:
        super().__init__()
        self.table = ShardedEmbedding(None, DIM, **table)
        self.dense = nn.Linear(1, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.dense(self.table(ids).sum(-1, keepdim=True)).sum()


def attach(cluster, make, worker_id: str = "w0", **table):
    """A worker with one hashed table ``table`` (``ShardedEmbedding`` arguments ``table``) whose sparse optimizer
    is ``make([handle])``: (model, dist, sparse optimizer)."""
    model = Tables(**table)
    sparse = make([model.table.handle])
    dist = DistributedOptimizer(torch.optim.SGD(model.dense.parameters(), lr=0.0), model.named_parameters(),
                                servers=cluster.servers, model=model, worker_id=worker_id, sparse_optimizer=sparse)
    return model, dist, sparse


@pytest.fixture(scope="module")
def shard():
    with ForkedCluster(1, extra_args=("--metrics-port", "0")) as cluster:
        client = ShardClient(cluster.addresses[0], index=0)
        try:
            yield cluster, client
        finally:
            client.close()


@pytest.fixture
def fresh(shard):
    """The shard with no job (every test starts one), and a push counter for raw pushes."""
    cluster, client = shard
    client.reset()
    return cluster, client, itertools.count(100)


def push(client, dist, number: int, ids, grads, lr: float, table: str = "table") -> pb.PushRowsReply:
    return client.push_rows(pb.PushRowsRequest(
        worker_id=dist.worker_id, session=dist.session, push=number,
        tables=[pb.TableRows(table=table, ids=ids_bytes(torch.as_tensor(ids)), grads=rows_bytes(grads), lr=lr)]))


def pull(client, dist, ids) -> torch.Tensor:
    """The rows of ``ids`` once ``dist``'s last push is applied (raises the refusal of its round)."""
    ids = torch.as_tensor(ids)
    reply = client.pull_rows(pb.PullRowsRequest(worker_id=dist.worker_id, session=dist.session, after_push=True,
                                                tables=[pb.TableIds(table="table", ids=ids_bytes(ids))]))
    return rows_from(reply.parts[0], ids.numel(), DIM)


def refused(call) -> ShardRpcError:
    with pytest.raises(ShardRpcError) as info:
        call()
    return info.value


def state(cluster, client, table: str = "table") -> dict:
    """Everything a round may change about ``table`` on the shard, comparable with ``==``."""
    reply = client.export_rows(table, state=True)
    samples = scrape(cluster.endpoints[0]["metrics"])
    return {"ids": reply.ids, "weights": reply.weights, "state": dict(reply.state), "step": reply.step,
            "total_rows": reply.total_rows, "round": reply.round,
            "sparse_rounds": value(samples, "shardps_shard_sparse_rounds_total", shard=0),
            **{name: value(samples, f"shardps_shard_table_{name}", shard=0, table=table) for name in COUNTERS}}


def applied_after(before: dict, after: dict, rows: int) -> None:
    """``after`` is ``before`` plus one applied round of the table, holding ``rows`` rows."""
    assert after["step"] == before["step"] + 1 and after["round"] == before["round"] + 1
    assert after["sparse_rounds"] == before["sparse_rounds"] + 1
    assert after["total_rows"] == after["rows"] == rows


def a_round_then_an_overflowing_one(fresh, dist) -> dict:
    """``dist``'s raw push of rows 1-3 (lazy Adam, lr 0.01), applied; then one of rows 2-5 at lr 3e38, staged and
    refused when applied (Adam's step passes float32's range). Returns the table's state between the two."""
    cluster, client, numbers = fresh
    push(client, dist, next(numbers), [1, 2, 3], torch.ones(3, DIM), 0.01)
    pull(client, dist, [1, 2, 3])
    before = state(cluster, client)
    push(client, dist, next(numbers), [2, 3, 4, 5], torch.ones(4, DIM), 3e38)  # staged: checked when applied
    return before


def test_an_optimizer_step_that_raises_refuses_the_round_for_its_members_and_changes_nothing(fresh):
    """Lazy Adam at lr 3e38 (a valid float32): its step size lr / (1 - beta1) passes float32's range, and torch
    raises "value cannot be converted to type float without overflow" inside the step. The round is refused
    (its push returned OK: the next pull says why), no slot is taken for its new ids, the step count stays."""
    cluster, client, numbers = fresh
    _, dist, _ = attach(cluster, lambda h: torch.optim.Adam(h, lr=0.01))
    try:
        before = a_round_then_an_overflowing_one(fresh, dist)
        assert before["step"] == 1 and before["total_rows"] == 3
        error = refused(lambda: pull(client, dist, [4, 5]))
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT
        for part in ("sparse round 1 was refused", "adam step of table 'table'", "lr 3e+38",
                     "value cannot be converted to type float without overflow", "nothing of the round was applied"):
            assert part in error.details, error.details
        assert state(cluster, client) == before
        assert torch.equal(pull(client, dist, [4, 5]), initial_rows("table", torch.tensor([4, 5]), DIM, 0, 0.5))
        push(client, dist, next(numbers), [2, 3, 4, 5], torch.ones(4, DIM), 0.01)  # the shard is not wedged
        pull(client, dist, [2])
        after = state(cluster, client)
        applied_after(before, after, rows=5)
        assert after["admitted_total"] == before["admitted_total"] + 2
    finally:
        dist.close()


def test_a_learning_rate_past_float32_is_refused_by_the_worker_and_by_the_shard(fresh):
    """lr 1e300 is finite, but the update cannot multiply float32 rows by it: the shard refuses the push on
    receipt (nothing staged, the member's next push is its round) and the worker refuses it at step()."""
    cluster, client, numbers = fresh
    model, dist, sparse = attach(cluster, lambda h: torch.optim.SGD(h, lr=0.1))
    try:
        push(client, dist, next(numbers), [1, 2], torch.ones(2, DIM), 0.1)
        pull(client, dist, [1, 2])
        before = state(cluster, client)
        error = refused(lambda: push(client, dist, next(numbers), [2, 3], torch.ones(2, DIM), 1e300))
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "learning rate of table 'table': 1e+300 is past float32's range" in error.details
        assert "nothing was staged" in error.details
        assert state(cluster, client) == before
        push(client, dist, next(numbers), [2, 3], torch.ones(2, DIM), 0.1)
        pull(client, dist, [2, 3])
        applied_after(before, state(cluster, client), rows=3)
        before = state(cluster, client)
        sparse.param_groups[0]["lr"] = 1e300
        dist.zero_grad()
        model(torch.tensor([1, 4])).backward()
        with pytest.raises(ValueError, match=r"learning rate of table 'table': 1e\+300 is past float32's range"):
            dist.step()
        assert state(cluster, client) == before
    finally:
        dist.close()


BAD_HYPERPARAMETERS = [
    # (torch optimizer, its group edited to, shard optimizer, hyperparameters, what the refusal names)
    (lambda h: torch.optim.SparseAdam(h, lr=0.1), {"betas": (1.0, 0.999)}, "sparse_adam", {"beta1": 1.0},
     "beta1: 1.0 is not in [0, 1)"),
    (lambda h: torch.optim.SparseAdam(h, lr=0.1), {"betas": (0.9, 2.0)}, "sparse_adam", {"beta2": 2.0},
     "beta2: 2.0 is not in [0, 1)"),
    (lambda h: torch.optim.Adagrad(h, lr=0.1), {"lr_decay": -1.0}, "adagrad", {"lr_decay": -1.0},
     "lr_decay: -1.0 is not >= 0"),
    (lambda h: torch.optim.Adagrad(h, lr=0.1), {"eps": 0.0}, "adagrad", {"eps": 0.0},
     "eps: 0.0 is not > 0"),
    (lambda h: torch.optim.Adam(h, lr=0.1), {"weight_decay": -0.5}, "adam", {"weight_decay": -0.5},
     "weight_decay: -0.5 is not >= 0"),
]


@pytest.mark.parametrize("make, edit, optimizer, hyper, named", BAD_HYPERPARAMETERS,
                         ids=["beta1=1", "beta2=2", "lr_decay=-1", "adagrad_eps=0", "weight_decay<0"])
def test_hyperparameters_out_of_range_are_refused_where_a_table_is_declared(fresh, make, edit, optimizer, hyper,
                                                                            named):
    """SparseAdam beta1=1 divided by zero, beta2=2 raised a math domain error, Adagrad lr_decay=-1 divided by
    zero at step 2 and moved rows uphill from step 3, Adagrad eps=0 stored NaN rows for a zero gradient: the
    shard declared those tables and dropped or poisoned their rounds. Now the shard refuses the declaration
    (INVALID_ARGUMENT naming the table and the setting; no table made) and the worker refuses such a param
    group before declaring anything."""
    cluster, client, numbers = fresh
    _, dist, _ = attach(cluster, lambda h: torch.optim.SGD(h, lr=0.1))
    try:
        push(client, dist, next(numbers), [1], torch.ones(1, DIM), 0.1)
        pull(client, dist, [1])
        before = state(cluster, client)
        spec = pb.TableSpec(name="bad", embedding_dim=DIM, padding_idx=-1, optimizer=optimizer, hyperparams=hyper,
                            init_scale=0.5)
        error = refused(lambda: client.declare_tables(pb.DeclareTablesRequest(
            worker_id=dist.worker_id, session=dist.session, tables=[spec])))
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT
        assert f"table 'bad': {optimizer} cannot run with {named}" in error.details, error.details
        missing = refused(lambda: client.export_rows("bad"))
        assert missing.code == grpc.StatusCode.FAILED_PRECONDITION and "not declared" in missing.details
        assert state(cluster, client) == before
    finally:
        dist.close()
    model = Tables()
    sparse = make([model.table.handle])
    sparse.param_groups[0].update(edit)  # torch checks at construction only: a group edited later
    torch_name = named.replace("beta1", "betas[0]").replace("beta2", "betas[1]")
    with pytest.raises(ValueError, match=re.escape(f"cannot run {type(sparse).__name__} with {torch_name}")):
        DistributedOptimizer(torch.optim.SGD(model.dense.parameters(), lr=0.0), model.named_parameters(),
                             servers=cluster.servers, model=model, worker_id="w1", sparse_optimizer=sparse)


NON_FINITE = [
    # (torch optimizer at lr, gradient value, lr of the bad round): the update overflows float32
    (lambda h: torch.optim.SGD(h, lr=0.1), 1e10, 1e38),  # rows - 1e48: -inf rows
    (lambda h: torch.optim.Adagrad(h, lr=0.1), 1e20, 0.1),  # accumulator + 1e40: inf state, finite rows
    (lambda h: torch.optim.AdamW(h, lr=0.1, weight_decay=1e10), 1.0, 1e37),  # row * (1 - 1e47): inf rows
]


@pytest.mark.parametrize("make, grad, lr", NON_FINITE, ids=["sgd_rows", "adagrad_state", "adamw_decay"])
def test_an_update_that_would_not_be_finite_is_refused_and_changes_nothing(fresh, make, grad, lr):
    """Finite lrs and gradients whose update is not: every call returned OK and later pulls served -inf or
    NaN rows. Now the round is refused (INVALID_ARGUMENT naming the table, on the next pull) before any row,
    state, step count or slot changes."""
    cluster, client, numbers = fresh
    _, dist, sparse = attach(cluster, make)
    base = sparse.param_groups[0]["lr"]
    try:
        push(client, dist, next(numbers), [1, 2], torch.ones(2, DIM), base)
        pull(client, dist, [1, 2])
        before = state(cluster, client)
        push(client, dist, next(numbers), [2, 3], torch.full((2, DIM), grad), lr)
        error = refused(lambda: pull(client, dist, [2, 3]))
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "sparse round 1 was refused" in error.details and "of table 'table'" in error.details
        assert "would not be finite" in error.details, error.details
        assert state(cluster, client) == before
        rows = pull(client, dist, [1, 2, 3])
        assert bool(torch.isfinite(rows).all())
        push(client, dist, next(numbers), [2, 3], torch.ones(2, DIM), base)
        pull(client, dist, [2])
        applied_after(before, state(cluster, client), rows=3)
    finally:
        dist.close()


class TwoTables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = ShardedEmbedding(None, DIM)
        self.other = ShardedEmbedding(None, DIM)
        self.dense = nn.Linear(1, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.dense((self.table(ids) + self.other(ids)).sum(-1, keepdim=True)).sum()


def test_a_round_is_refused_whole_when_one_of_its_tables_fails(fresh):
    """A round of two tables (one slab: same shape and optimizer) whose second table's update overflows: the
    first table keeps its rows and step count too (never half-applied), and both apply in the next round."""
    cluster, client, numbers = fresh
    model = TwoTables()
    dist = DistributedOptimizer(torch.optim.SGD(model.dense.parameters(), lr=0.0), model.named_parameters(),
                                servers=cluster.servers, model=model, worker_id="w0",
                                sparse_optimizer=torch.optim.SGD([model.table.handle, model.other.handle], lr=0.1))

    def both(lr_other: float, grad_other: float) -> None:
        client.push_rows(pb.PushRowsRequest(worker_id="w0", session=dist.session, push=next(numbers), tables=[
            pb.TableRows(table="table", ids=ids_bytes(torch.tensor([1, 2])), grads=rows_bytes(torch.ones(2, DIM)),
                         lr=0.1),
            pb.TableRows(table="other", ids=ids_bytes(torch.tensor([1, 2])),
                         grads=rows_bytes(torch.full((2, DIM), grad_other)), lr=lr_other)]))

    try:
        both(0.1, 1.0)
        pull(client, dist, [1])
        before = {name: state(cluster, client, name) for name in ("table", "other")}
        both(1e38, 1e10)
        error = refused(lambda: pull(client, dist, [1]))
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "update of table 'other'" in error.details and "would not be finite" in error.details
        assert {name: state(cluster, client, name) for name in ("table", "other")} == before
        both(0.1, 1.0)
        pull(client, dist, [1])
        for name in ("table", "other"):
            applied_after(before[name], state(cluster, client, name), rows=2)
    finally:
        dist.close()


def test_a_refused_round_counts_no_sightings_towards_admission(fresh):
    """With ``min_count=2`` a refused round must not count its ids' sightings: an id seen once before and once
    in the refused round is still one sighting short, an id seen only in the refused round has none."""
    cluster, client, numbers = fresh
    _, dist, _ = attach(cluster, lambda h: torch.optim.SGD(h, lr=0.1), min_count=2)
    try:
        push(client, dist, next(numbers), [1], torch.ones(1, DIM), 0.1)  # id 1 seen once: dropped
        pull(client, dist, [1])
        before = state(cluster, client)
        assert before["dropped_unadmitted_total"] == 1 and before["total_rows"] == 0
        push(client, dist, next(numbers), [1, 2], torch.full((2, DIM), 1e10), 1e38)  # 1 admitted, -inf: refused
        error = refused(lambda: pull(client, dist, [1, 2]))
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "would not be finite" in error.details
        assert state(cluster, client) == before
        push(client, dist, next(numbers), [2], torch.ones(1, DIM), 0.1)  # 2's first sighting: dropped
        pull(client, dist, [2])
        after = state(cluster, client)
        applied_after(before, after, rows=0)
        assert after["dropped_unadmitted_total"] == 2 and after["admitted_total"] == 0
        push(client, dist, next(numbers), [1], torch.ones(1, DIM), 0.1)  # 1's second sighting: admitted
        pull(client, dist, [1])
        after = state(cluster, client)
        assert after["total_rows"] == after["admitted_total"] == 1 and after["dropped_unadmitted_total"] == 2
        assert after["ids"] == ids_bytes(torch.tensor([1]))
    finally:
        dist.close()


def test_a_push_the_shard_refuses_is_raised_and_never_sent_again(fresh):
    """step()'s push (started without waiting) refused by the shard, here because the round of the worker's
    previous push was refused (Adam at lr 3e38): waiting for it raises the refusal, and it is not sent again. The
    shard says a refused round once, so a second send would be staged and applied as if nothing had happened."""
    cluster, client, numbers = fresh
    _, dist, _ = attach(cluster, lambda h: torch.optim.Adam(h, lr=0.01))
    try:
        before = a_round_then_an_overflowing_one(fresh, dist)
        dist.tables.send([[pb.PushRowsRequest(
            worker_id=dist.worker_id, session=dist.session, push=next(numbers),
            tables=[pb.TableRows(table="table", ids=ids_bytes(torch.tensor([1, 6])), grads=rows_bytes(
                torch.ones(2, DIM)), lr=0.01)])]])
        error = refused(dist.tables.wait_sent)
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "sparse round 1 was refused" in error.details
        assert state(cluster, client) == before  # neither push applied
        assert torch.equal(pull(client, dist, [6]), initial_rows("table", torch.tensor([6]), DIM, 0, 0.5))
        assert state(cluster, client) == before
    finally:
        dist.close()


def test_two_members_whose_summed_gradient_overflows_are_both_refused(fresh):
    """Two workers each push 3e38 for a row: each gradient is finite, their sum is not. Both members' next
    pull says the round was refused; nothing changed; the next round of both applies."""
    cluster, client, numbers = fresh
    _, d0, _ = attach(cluster, lambda h: torch.optim.SGD(h, lr=0.1), "w0")
    _, d1, _ = attach(cluster, lambda h: torch.optim.SGD(h, lr=0.1), "w1")
    try:
        for d in (d0, d1):
            push(client, d, next(numbers), [1], torch.ones(1, DIM), 0.1)
        pull(client, d0, [1])
        before = state(cluster, client)
        for d in (d0, d1):
            push(client, d, next(numbers), [1, 2], torch.full((2, DIM), 3e38), 0.1)
        for d in (d0, d1):
            error = refused(lambda: pull(client, d, [1, 2]))
            assert error.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "sparse round 1 was refused" in error.details and "would not be finite" in error.details
        assert state(cluster, client) == before
        for d in (d0, d1):
            push(client, d, next(numbers), [1, 2], torch.ones(2, DIM), 0.1)
        pull(client, d1, [1])
        applied_after(before, state(cluster, client), rows=2)
    finally:
        d0.close()
        d1.close()


def test_members_that_step_a_table_with_different_learning_rates_are_both_refused(fresh):
    """w0 at lr 0.1 and w1 at lr 1000 in one round: the shard used w0's lr without a word. Now the round is
    refused for both, naming the table and both lrs; raw, then with two DistributedOptimizers stepping in
    threads (each forward after the step raises)."""
    cluster, client, numbers = fresh
    m0, d0, _ = attach(cluster, lambda h: torch.optim.SGD(h, lr=0.1), "w0")
    m1, d1, _ = attach(cluster, lambda h: torch.optim.SGD(h, lr=1000.0), "w1")
    try:
        for d in (d0, d1):
            push(client, d, next(numbers), [1, 2], torch.ones(2, DIM), 0.1)
        pull(client, d0, [1])
        before = state(cluster, client)
        push(client, d0, next(numbers), [1, 2], torch.ones(2, DIM), 0.1)
        push(client, d1, next(numbers), [2, 3], torch.ones(2, DIM), 1000.0)
        for d in (d0, d1):
            error = refused(lambda: pull(client, d, [1, 2, 3]))
            assert error.code == grpc.StatusCode.INVALID_ARGUMENT
            assert ("workers 'w0' and 'w1' pushed table 'table' with different learning rates (0.1 vs 1000.0)"
                    in error.details), error.details
        assert state(cluster, client) == before
        rows = pull(client, d0, [1, 2, 3])
        push(client, d0, next(numbers), [1, 2], torch.ones(2, DIM), 0.5)
        push(client, d1, next(numbers), [2, 3], torch.full((2, DIM), 3.0), 0.5)
        after = pull(client, d1, [1, 2, 3])
        applied_after(before, state(cluster, client), rows=3)
        want = rows - 0.5 * torch.tensor([[0.5] * DIM, [2.0] * DIM, [1.5] * DIM])  # the average of both pushes
        assert torch.allclose(after, want, rtol=0, atol=1e-6)

        before = state(cluster, client)
        errors: dict[str, BaseException | None] = {}

        def step(model, dist) -> None:
            try:
                dist.zero_grad()
                model(torch.tensor([1, 2])).backward()
                dist.step()
                model(torch.tensor([1, 2]))  # the next forward pulls: the round's refusal is raised here
                errors[dist.worker_id] = None
            except BaseException as exc:
                errors[dist.worker_id] = exc

        threads = [threading.Thread(target=step, args=md) for md in ((m0, d0), (m1, d1))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for w in ("w0", "w1"):
            assert isinstance(errors.get(w), ShardRpcError), errors
            assert "different learning rates (0.1 vs 1000.0)" in str(errors[w]), errors[w]
        assert state(cluster, client) == before
    finally:
        d0.close()
        d1.close()

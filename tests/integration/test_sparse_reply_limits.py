"""Replies of the sparse calls are sized before they are built (issue 44, item 3), against real shard processes.

A PullRows reply or an ExportRows page is refused with RESOURCE_EXHAUSTED before its rows are read when it
would pass the shard's send limit (``--max-message-bytes``, naming it; an export page also names the
``max_rows`` that fits) or its memory budget (``--memory-budget-bytes``, naming it); what a reply materialises
is held against that budget until gRPC has sent it, and its bytes are made once, so a reply's peak on the
shard stays within twice its size plus 32 MiB of scratch (docs/sparse-tables.md, "Limits"). The shard's peak
resident memory is its ``VmHWM``, reset before each measured call (``/proc/<pid>/clear_refs``, Linux >= 4.0).

Before these changes (measured on the 2-core machine): the refused 120 MiB pull of the first test raised the
shard's peak by 1,086 MiB and took 5.4 s; a 64 MiB pull of ids that are not rows, +512 MiB; 64 MiB export
pages, +193 MiB; an export of a 512 MiB table in one page, refused by gRPC after +2,056 MiB; and no reply was
ever held against the memory budget.
"""

from __future__ import annotations

import re
import time

import grpc
import pytest
import torch
from torch import nn

from shardps.common.rows import ids_bytes, initial_rows, rows_bytes, rows_from
from shardps.proto import shardps_pb2 as pb
from shardps.worker import DistributedOptimizer, ShardedEmbedding, WireOptions
from shardps.worker.session.client import ShardClient, ShardRpcError
from tests.support.forked import ForkedCluster
from tests.support.prom import scrape, value

MiB = 1 << 20
#: What a reply may add to the shard's peak besides twice its bytes: id lookups, initial values computed a
#: block at a time, the allocator's rounding.
SCRATCH = 32 * MiB


class Tables(nn.Module):
    def __init__(self, **tables) -> None:
        super().__init__()
        for name, (dim, kw) in tables.items():
            setattr(self, name, ShardedEmbedding(None, dim, **kw))
        self.names = list(tables)
        self.dense = nn.Linear(1, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.dense(sum(getattr(self, n)(ids).sum(-1, keepdim=True) for n in self.names)).sum()


def attach(cluster, limit: int = 8 * MiB, **tables) -> tuple[DistributedOptimizer, ShardClient]:
    """A member with hashed SGD tables ``name=(dim, ShardedEmbedding arguments)``, and a raw client of shard 0."""
    model = Tables(**tables)
    dist = DistributedOptimizer(torch.optim.SGD(model.dense.parameters(), lr=0.0), model.named_parameters(),
                                servers=cluster.servers, model=model, worker_id="w0",
                                sparse_optimizer=torch.optim.SGD([getattr(model, n).handle for n in tables], lr=0.1),
                                wire=WireOptions(max_message_bytes=limit))
    return dist, ShardClient(cluster.addresses[0], index=0, max_message_bytes=limit, rpc_timeout=120.0)


def status(pid: int, key: str) -> int:
    """``key`` (VmRSS, VmHWM) of process ``pid``, bytes."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key}")


def reset_peak(pid: int) -> int:
    """Reset ``pid``'s VmHWM to its resident memory now; returns that resident memory, bytes."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
    return status(pid, "VmRSS")


def pull(dist, ids: torch.Tensor, table: str = "table") -> pb.PullRowsRequest:
    return pb.PullRowsRequest(worker_id=dist.worker_id, session=dist.session, table=table, ids=ids_bytes(ids))


def refused(call) -> ShardRpcError:
    with pytest.raises(ShardRpcError) as info:
        call()
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
    return info.value


def fill(client, dist, dim: int, rows: int, per_push: int) -> None:
    """Make rows 0..rows-1 of ``table`` with raw pushes of ``per_push`` rows each (a round each)."""
    grads = rows_bytes(torch.ones(per_push, dim))
    for number, start in enumerate(range(0, rows, per_push), start=1):
        ids = torch.arange(start, start + per_push)
        client.push_rows(pb.PushRowsRequest(worker_id=dist.worker_id, session=dist.session, push=number, tables=[
            pb.TableRows(table="table", ids=ids_bytes(ids), grads=grads, lr=0.1)]))
    client.pull_rows(pb.PullRowsRequest(worker_id=dist.worker_id, session=dist.session, after_push=True,
                                        table="table", ids=ids_bytes(torch.arange(1))))  # the last round applied


def test_a_pull_over_the_message_limit_is_refused_before_its_rows_are_built():
    """480 ids of a dim-65,536 table ask for a 120 MiB reply (3,840 bytes of request): over the default 8 MiB
    limit, refused at once naming the limit; the shard's peak memory does not move, and it serves on."""
    dim = 65536
    with ForkedCluster(1) as cluster:
        dist, client = attach(cluster, table=(dim, {}))
        pid = cluster.processes[0].pid
        try:
            ids = torch.arange(480)
            before = reset_peak(pid)
            started = time.monotonic()
            err = refused(lambda: client.pull_rows(pull(dist, ids)))
            took = time.monotonic() - started
            assert "message limit of 8388608 bytes (--max-message-bytes)" in err.details, err.details
            assert str(480 * dim * 4) in err.details  # the reply's rows, in bytes
            # the multi-table form too
            err = refused(lambda: client.pull_rows(pb.PullRowsRequest(
                worker_id=dist.worker_id, session=dist.session,
                tables=[pb.TableIds(table="table", ids=ids_bytes(ids))])))
            assert "--max-message-bytes" in err.details
            grew = status(pid, "VmHWM") - before
            assert grew < 16 * MiB, grew  # the rows were never built (before: +1,086 MiB)
            assert took < 3.0, took  # refused before any work (before: 5.4 s)
            # the shard serves pulls that fit, with the right rows; the initial values of a 7.75 MiB reply (ids
            # that are not rows) are computed a block at a time (before: int64 temporaries of the whole reply)
            client.pull_rows(pull(dist, torch.arange(1)))  # the first reply's one-time costs
            before = reset_peak(pid)
            reply = client.pull_rows(pull(dist, torch.arange(31)))
            grew = status(pid, "VmHWM") - before
            want = initial_rows("table", torch.arange(31), dim, 0, dim ** -0.5)
            assert torch.equal(rows_from(reply.rows, 31, dim), want)
            # 2 x the reply and 40 MiB of slack for the allocator: the process's peak once grew 47.84 MiB here
            # under a full suite's load, 0.34 MiB over 2 x 7.75 + 32
            assert grew <= 2 * len(reply.rows) + SCRATCH + 8 * MiB, grew / MiB
            assert client.stats().members == ["w0"]
        finally:
            client.close()
            dist.close()


def test_a_pull_and_a_paged_export_of_a_500_mb_table_peak_within_twice_their_reply():
    """A 512 MiB table (512 Ki rows of 256 float32, SGD): a 64 MiB pull of its rows, a 64 MiB pull of another
    table's ids that are not rows (initial values) and every 64 MiB page of its export raise the shard's peak
    resident memory by at most 2 x the reply + 32 MiB; the whole table in one page is refused naming
    max_rows."""
    dim, rows, per = 256, 512 * 1024, 64 * 1024
    limit = 80 * MiB
    with ForkedCluster(1, extra_args=("--max-message-bytes", str(limit))) as cluster:
        dist, client = attach(cluster, limit, table=(dim, {"init": "zeros"}), fresh=(dim, {}))
        pid = cluster.processes[0].pid
        try:
            fill(client, dist, dim, rows, per)
            reply_bytes = per * dim * 4
            for table, ids in (("table", torch.arange(rows - per, rows)), ("fresh", torch.arange(per))):
                before = reset_peak(pid)
                reply = client.pull_rows(pull(dist, ids, table))
                grew = status(pid, "VmHWM") - before
                assert len(reply.rows) == reply_bytes
                if table == "fresh":
                    assert torch.equal(rows_from(reply.rows, per, dim)[-3:],
                                       initial_rows("fresh", ids[-3:], dim, 0, dim ** -0.5))
                del reply
                assert grew <= 2 * reply_bytes + SCRATCH, (table, grew / MiB)  # before: +512 MiB for "fresh"
            err = refused(lambda: client.export_rows("table"))
            assert "--max-message-bytes" in err.details and f"of {rows})" in err.details, err.details
            fits = int(re.search(r"ask for at most (\d+) rows a page \(max_rows\)", err.details).group(1))
            assert fits * (8 + 4 * dim) <= limit < (fits + 1) * (8 + 4 * dim) + 1024  # a row: its id and weights
            worst, seen = 0, 0
            before = reset_peak(pid)
            while seen < rows:
                page = client.export_rows("table", offset=seen, max_rows=per)
                assert page.total_rows == rows and len(page.weights) == reply_bytes
                assert torch.equal(torch.frombuffer(bytearray(page.ids), dtype=torch.int64),
                                   torch.arange(seen, seen + per))
                seen += per
                del page
                worst = max(worst, status(pid, "VmHWM") - before)
                before = reset_peak(pid)
            assert worst <= 2 * (reply_bytes + 8 * per) + SCRATCH, worst / MiB  # before: +193 MiB
        finally:
            client.close()
            dist.close()


def test_a_reply_past_the_memory_budget_is_refused_naming_it_and_changes_nothing():
    """A shard with a memory budget of 1 GiB (message limit 1 GiB) holding a 400 MiB table: a pull whose reply
    takes 500 MiB and an export page of the whole table would need twice their bytes while built and sent,
    past the budget, and are refused naming --memory-budget-bytes before a row is read (the shard's peak stays
    put, no row counts as pulled); smaller replies are served right after (nothing stays held)."""
    dim, budget, limit = 65536, 1 << 30, 1 << 30
    args = ("--memory-budget-bytes", str(budget), "--max-message-bytes", str(limit), "--metrics-port", "0")
    with ForkedCluster(1, extra_args=args) as cluster:
        dist, client = attach(cluster, limit, table=(dim, {"init": "zeros"}))
        pid = cluster.processes[0].pid
        try:
            fill(client, dist, dim, 1600, 200)  # 1,600 rows of 256 KiB: 400 MiB
            resident = reset_peak(pid)

            def rows_pulled() -> float:
                return value(scrape(cluster.endpoints[0]["metrics"]), "shardps_shard_table_rows_pulled_total",
                             shard=0, table="table")

            pulled = rows_pulled()
            err = refused(lambda: client.pull_rows(pull(dist, torch.arange(2000))))  # needs 1,000 MiB alone
            assert f"memory budget of {budget} bytes (--memory-budget-bytes)" in err.details, err.details
            # the whole table in one page needs 800 MiB, and the shard holds the table (400 MiB) and more
            err = refused(lambda: client.export_rows("table"))
            assert f"memory budget of {budget} bytes (--memory-budget-bytes)" in err.details, err.details
            assert "max_rows" in err.details
            assert status(pid, "VmHWM") - resident < 16 * MiB
            assert rows_pulled() == pulled
            # nothing changed and nothing stays held: the table as it was, smaller replies served
            page = client.export_rows("table", offset=1500, max_rows=200)
            assert page.total_rows == 1600 and len(page.ids) == 100 * 8
            assert torch.equal(torch.frombuffer(bytearray(page.ids), dtype=torch.int64), torch.arange(1500, 1600))
            reply = client.pull_rows(pull(dist, torch.arange(1592, 1608)))
            got = rows_from(reply.rows, 16, dim)
            assert bool((got[:8] == -0.1).all()) and bool((got[8:] == 0).all())  # one SGD step of lr 0.1 from 0
            assert rows_pulled() == pulled + 16
            for _ in range(40):  # each holds about 32 MiB while it is sent, and gives it back: 40 fit in turn
                client.pull_rows(pull(dist, torch.arange(1592, 1608)))
        finally:
            client.close()
            dist.close()

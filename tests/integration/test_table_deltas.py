"""Touched-row deltas (``ExportRows(since_round=)``, ``table_delta``): what a serving replica applies to stay fresh.

Real shard processes. A snapshot (a delta since round 0) plus each later delta, applied in turn, must equal
the table's full export exactly at every point; a delta holds only the rows pushed since (not the others) and
the ids evicted since (``ttl_rounds``), and a shard restarted from an older checkpoint says the delta cannot
be applied (``forgotten``) instead of handing out a state the replica would silently mix with newer rows.
"""

from __future__ import annotations

import torch
from torch import nn

from shardps.worker import DistributedOptimizer, ShardedEmbedding
from shardps.worker.embedding.export import TableExport, export_table, table_delta
from shardps.worker.session.client import ShardClient
from tests.support.forked import ForkedCluster


def job(servers: str):
    model = nn.ModuleDict({"emb": ShardedEmbedding(None, 3, name="emb", ttl_rounds=3)})
    x = nn.Parameter(torch.zeros(1))
    dist = DistributedOptimizer(torch.optim.SGD([x], lr=0.1), [("x", x)], servers=servers, model=model,
                                worker_id="w0", sparse_optimizer=torch.optim.Adagrad([model["emb"].handle], lr=0.3))
    return model, dist


def step(model, dist, ids: list[int]) -> None:
    dist.zero_grad()
    model["emb"](torch.tensor(ids)).pow(2).sum().backward()
    dist.step()


def same(a: TableExport, b: TableExport) -> bool:
    return torch.equal(a.ids, b.ids) and torch.equal(a.weights, b.weights)


def test_a_snapshot_and_its_deltas_equal_the_export_and_hold_only_touched_rows(tmp_path):
    with ForkedCluster(2, extra_args=("--checkpoint-dir", str(tmp_path))) as shards:
        model, dist = job(shards.servers)
        clients = dist.clients
        try:
            step(model, dist, list(range(1, 21)))
            dist.tables.settle("emb")
            snapshot = table_delta(clients, "emb", [0, 0])
            replica = snapshot.apply(TableExport(snapshot.spec, torch.empty(0, dtype=torch.int64),
                                                 torch.empty(0, 3), {}, 0, []))
            assert not snapshot.forgotten and same(replica, export_table(clients, "emb"))
            rounds = snapshot.rounds
            for ids in ([5, 6, 7], [30, 31], [30, 31, 32], [5, 40]):  # ids 1-4 and 8-20 age out (ttl_rounds 3)
                step(model, dist, ids)
                dist.tables.settle("emb")
                delta = table_delta(clients, "emb", rounds)
                full = export_table(clients, "emb")
                touched = set(delta.ids.tolist())
                assert touched == set(ids), (touched, ids)  # the rows this step pushed, none of the others
                assert not delta.forgotten
                replica, rounds = delta.apply(replica), delta.rounds
                assert same(replica, full), "the replica differs from the export after a delta"
            gone = set(range(1, 21)) - {5, 6, 7}
            assert gone <= set(table_delta(clients, "emb", snapshot.rounds).evicted.tolist())
            assert not gone & set(replica.ids.tolist())
            for shard in range(2):  # a checkpoint now, then SIGKILL: the restored shard cannot list old evictions
                client = ShardClient(shards.addresses[shard], index=shard)
                try:
                    client.checkpoint()
                finally:
                    client.close()
            shards.restart(0, same_port=True)
            assert table_delta(clients, "emb", snapshot.rounds).forgotten
            again = table_delta(clients, "emb", [0, 0])  # the replica reads the whole table again
            assert not again.forgotten and same(again.apply(TableExport(again.spec, torch.empty(0, dtype=torch.int64),
                                                                        torch.empty(0, 3), {}, 0, [])),
                                                export_table(clients, "emb"))
        finally:
            dist.close()

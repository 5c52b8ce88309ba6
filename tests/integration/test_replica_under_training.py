"""A replica refreshing while training pushes rounds all the time ends equal to the export (no row missed).

A delta page is sized when the shard takes the call and read on its compute thread between rounds; a round
applied in between adds rows the page has no room for. The reply then counts more rows (``total_rows``) than
it holds, and the replica reads again (or, partial after three reads, keeps its ``since`` so the next delta
takes those rows): no row pushed is lost. Real shards, a trainer thread pushing as fast as it can, a replica
refreshing every 20 ms; after the trainer stops, one refresh must equal the export, row for row.
"""

from __future__ import annotations

import time

import torch

from shardps.worker.embedding.export import export_table
from shardps.worker.serving.replica import Replica
from tests.support.forked import ForkedCluster
from tests.support.row_trainer import RowTrainer

SECONDS = 6.0


def test_a_replica_refreshing_during_training_misses_no_row():
    with ForkedCluster(2, extra_args=("--threads", "1")) as shards:
        trainer = RowTrainer(shards.servers, 64)
        dist = trainer.dist
        try:
            with Replica(shards.servers, ["emb"], period=0.05, dense_every=None) as replica:
                try:
                    trainer.start()
                    deadline = time.monotonic() + SECONDS
                    while time.monotonic() < deadline:
                        replica.refresh()
                finally:
                    trainer.stop()
                assert not trainer.failed, trainer.failed[0]
                assert trainer.steps > 20 and replica.deltas > 20
                state = replica.refresh()
                full = export_table(dist.clients, "emb")
                mine = state.tables["emb"]
                missing = set(full.ids.tolist()) - set(mine.ids.tolist())
                assert not missing, f"{len(missing)} of {full.ids.numel()} rows never reached the replica"
                assert torch.equal(mine.ids, full.ids) and torch.equal(mine.weights, full.weights)
        finally:
            dist.close()

"""Delta reads while every round grows the shard's id index: no read may see the index half-grown.

A delta page is sized from the rows pushed since a round, which reads the shard's id index. The index is
grown (new keys inserted, the table rehashed into a larger one) on the shard's compute thread, by the
flush after a round or by the next lookup. Sizing a page on the event loop meanwhile read it half-grown:
``IndexError``/``RuntimeError`` in the shard (INTERNAL), and a pull on the compute thread could read garbage
slots. Pages are now sized on the compute thread. Real shard process; a trainer pushing 2,048 new ids a
round (the index crosses several powers of two) while three replicas refresh as fast as they can; every
read must succeed, and each replica ends equal to the export. (Without the fix it failed in about 2 of 5
runs here: the race needs a rehash to meet a page's sizing.)
"""

from __future__ import annotations

import threading
import time

import torch

from shardps.worker.embedding.export import export_table
from shardps.worker.serving.replica import Replica
from tests.support.forked import ForkedCluster
from tests.support.row_trainer import RowTrainer

SECONDS = 8.0
IDS_PER_ROUND = 2048
READERS = 3


def test_delta_reads_while_rounds_grow_the_index_never_fail():
    with ForkedCluster(1, extra_args=("--threads", "1")) as shards:
        trainer = RowTrainer(shards.servers, IDS_PER_ROUND)
        stop, failed = threading.Event(), []
        replicas = [Replica(shards.servers, ["emb"], period=0.05, dense_every=None) for _ in range(READERS)]

        def read(replica: Replica) -> None:
            try:
                while not stop.is_set():
                    replica.refresh()
            except Exception as exc:  # noqa: BLE001 - the test fails on it
                failed.append(exc)

        threads = [threading.Thread(target=read, args=(r,), daemon=True) for r in replicas]
        try:
            trainer.start()
            for t in threads:
                t.start()
            deadline = time.monotonic() + SECONDS
            while time.monotonic() < deadline and not failed and not trainer.failed:
                time.sleep(0.1)
            stop.set()
            for t in threads:
                t.join(60)
            trainer.stop()
            assert not failed and not trainer.failed, (failed + trainer.failed)[0]
            assert trainer.steps > 10
            full = export_table(trainer.dist.clients, "emb")
            for replica in replicas:
                mine = replica.refresh().tables["emb"]
                assert torch.equal(mine.ids, full.ids) and torch.equal(mine.weights, full.weights)
        finally:
            for r in replicas:
                r.close()
            trainer.dist.close()

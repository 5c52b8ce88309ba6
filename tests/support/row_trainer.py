"""A job that pushes new rows every round, trained in a thread, for the replica tests that read deltas while
rounds apply (``test_replica_under_training``, ``test_delta_reads_while_the_index_grows``)."""

from __future__ import annotations

import threading

import torch
from torch import nn

from shardps.worker import DistributedOptimizer, ShardedEmbedding


class RowTrainer:
    """A hashed table ``emb`` (dim 8, Adagrad) and a dense ``bias`` on ``servers``; :meth:`start` trains in a
    daemon thread, ``ids_per_round`` random new ids a step, until :meth:`stop`.

    Attributes: dist (the ``DistributedOptimizer``; the caller closes it), steps, failed (what the thread raised).
    """

    def __init__(self, servers: str, ids_per_round: int) -> None:
        self.model = nn.ModuleDict({"emb": ShardedEmbedding(None, 8, name="emb")})
        self.bias = nn.Parameter(torch.zeros(1))
        self.dist = DistributedOptimizer(torch.optim.SGD([self.bias], lr=0.1), [("bias", self.bias)], servers=servers,
                                         model=self.model, worker_id="w0",
                                         sparse_optimizer=torch.optim.Adagrad([self.model["emb"].handle], lr=0.1))
        self.ids_per_round, self.steps, self.failed = ids_per_round, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        g = torch.Generator().manual_seed(0)
        try:
            while not self._stop.is_set():
                ids = torch.randint(0, 1 << 40, (self.ids_per_round,), generator=g)  # new rows every round
                self.dist.zero_grad()
                (self.model["emb"](ids).sum(1) + self.bias - 1.0).pow(2).mean().backward()
                self.dist.step()
                self.steps += 1
        except Exception as exc:  # noqa: BLE001 - the test fails on it
            self.failed.append(exc)

    def start(self) -> "RowTrainer":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and wait until every round it pushed is applied."""
        self._stop.set()
        self._thread.join(60)
        self.dist.synchronize()

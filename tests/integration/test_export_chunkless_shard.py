"""Exporting a job whose dense part is smaller than its shard count: a shard holding no dense chunk.

The MovieLens factorisation's only dense parameter (``global_bias``) lives on shard 0, so shard 1 streams no
frame in ``Export``. Its version is its ``Stats``' (the job's): ``shardps export --servers`` and
``from_servers`` agree with shard 0's and export the tables, with no ``--allow-mixed-versions``.
"""

from __future__ import annotations

import subprocess
import sys

import torch
from safetensors import safe_open

from shardps.apps.movielens import MF
from shardps.worker import DistributedOptimizer
from shardps.worker.export import from_servers
from tests.support.forked import ForkedCluster


def test_a_shard_without_dense_chunks_exports_at_the_jobs_version(tmp_path):
    with ForkedCluster(2) as shards:
        model = MF(8, 0.01, 3.5)
        dist = DistributedOptimizer(
            torch.optim.Adam([model.global_bias], lr=1e-3), model.named_parameters(), servers=shards.servers,
            model=model, worker_id="w0", sparse_optimizer=torch.optim.Adagrad(
                [model.user.handle, model.item.handle, model.user_bias.handle, model.item_bias.handle], lr=0.02))
        try:
            for _ in range(3):
                dist.zero_grad()
                (model(torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6]))[0] - 4).pow(2).mean().backward()
                dist.step()
        finally:
            dist.close()
        with from_servers(shards.servers) as export:
            assert export.versions == [3, 3]
        out = tmp_path / "mf.safetensors"
        done = subprocess.run([sys.executable, "-m", "shardps.cli.main", "export", "--servers", shards.servers,
                               "--out", str(out)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "at version 3" in done.stdout
        with safe_open(str(out), "pt") as f:
            assert "global_bias" in f.keys() and any(k.startswith("user") for k in f.keys()), list(f.keys())

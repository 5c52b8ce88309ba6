"""float16 tables: rows stored and sent as float16, stepped in float32, against the matching one-process oracle.

A bounded ``ShardedEmbeddingBag`` and a hashed ``ShardedEmbedding`` with ``dtype=torch.float16`` train with
two workers (threads) and two real shard processes in sync, with Adagrad. The oracle is one process that
keeps the same tables as float32 tensors holding float16 values: it starts from the shards' initial rows
rounded to float16 (``TableSpec.initial_rows``), steps ``torch.optim.Adagrad`` in float32 and rounds every
weight to the nearest float16 after each step, which is what a shard does to the rows a round touches (the
untouched ones hold float16 values already). The two step the same float32 arithmetic up to the order of
operations, so a weight may land one float16 step (2^-10 of its magnitude) away where a float32 rounding
difference crosses a float16 rounding boundary: the stated tolerance. Also: a pull of a float16 table moves
half the bytes of the same float32 table's; a shard restarted from its checkpoint holds the same float16
rows; the local model answers as the live one, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardps
from shardps.common.rows import TableSpec
from shardps.worker import DistributedOptimizer, ShardedEmbedding, ShardedEmbeddingBag
from shardps.worker.table_file import read_export
from tests.support.forked import ForkedCluster, cluster_fixture
from tests.support.procs import run_module
from tests.support.threads import run_workers

N, DIM, STEPS, WORKERS = 50, 8, 10, 2
HALF = torch.float16
#: one float16 step of a weight's magnitude (10 fraction bits), the most a rounding boundary moves it
RTOL, ATOL = 2.0 ** -10, 2.0 ** -24


class Net(nn.Module):
    def __init__(self, dtype: torch.dtype = HALF) -> None:
        super().__init__()
        self.bag = ShardedEmbeddingBag(N, DIM, mode="sum", name="bag", dtype=dtype, init_scale=0.5)
        self.emb = ShardedEmbedding(None, DIM, name="emb", dtype=dtype, init=("normal", 0.0, 0.3))
        self.head = nn.Linear(2 * DIM, 1)
        with torch.no_grad():
            self.head.weight.copy_(torch.linspace(-0.5, 0.5, 2 * DIM)[None])
            self.head.bias.zero_()

    def forward(self, b: dict) -> torch.Tensor:
        return self.head(torch.cat([self.bag(b["bag"], b["offsets"]), self.emb(b["emb"])], 1)).squeeze(1)


def batch(worker: int, step: int) -> dict:
    g = torch.Generator().manual_seed(100 * step + worker)
    return {"bag": torch.randint(0, N, (12,), generator=g), "offsets": torch.tensor([0, 3, 7, 9]),
            "emb": torch.randint(0, 30, (4,), generator=g) * 7919, "y": torch.randn(4, generator=g)}


def specs(model: Net) -> dict[str, TableSpec]:
    return {"bag": model.bag.spec(), "emb": model.emb.spec()}


class Oracle(nn.Module):
    """One process: the same model with its tables as float32 tensors of float16 values (the hashed one over the
    ids the batches use), rounded to float16 after every step."""

    def __init__(self) -> None:
        super().__init__()
        sharded = Net()
        spec = specs(sharded)
        self.ids = torch.unique(torch.cat([batch(w, s)["emb"] for w in range(WORKERS) for s in range(STEPS + 1)]))
        self.bag = nn.EmbeddingBag(N, DIM, mode="sum", sparse=True)
        self.emb = nn.Embedding(self.ids.numel(), DIM, sparse=True)
        self.head = sharded.head
        with torch.no_grad():
            self.bag.weight.copy_(spec["bag"].initial_rows(torch.arange(N)))
            self.emb.weight.copy_(spec["emb"].initial_rows(self.ids))

    def forward(self, b: dict) -> torch.Tensor:
        emb = self.emb(torch.searchsorted(self.ids, b["emb"]))
        return self.head(torch.cat([self.bag(b["bag"], b["offsets"]), emb], 1)).squeeze(1)

    def train_steps(self) -> None:
        dense = torch.optim.SGD(self.head.parameters(), lr=0.1)
        sparse = torch.optim.Adagrad([self.bag.weight, self.emb.weight], lr=0.2)
        for step in range(STEPS):
            dense.zero_grad()
            sparse.zero_grad()
            loss = sum(nn.functional.mse_loss(self(b), b["y"]) for b in (batch(w, step) for w in range(WORKERS)))
            (loss / WORKERS).backward()
            dense.step()
            sparse.step()
            with torch.no_grad():  # what a shard stores: the nearest float16
                for table in (self.bag, self.emb):
                    table.weight.copy_(table.weight.to(HALF).float())


def train(servers: str, worker: int, out: dict) -> None:
    model = Net()
    dist = DistributedOptimizer(torch.optim.SGD(model.head.parameters(), lr=0.1), model.named_parameters(),
                                servers=servers, model=model, worker_id=f"w{worker}",
                                sparse_optimizer=torch.optim.Adagrad([model.bag.handle, model.emb.handle], lr=0.2))
    try:
        for step in range(STEPS):
            dist.zero_grad()
            b = batch(worker, step)
            nn.functional.mse_loss(model(b), b["y"]).backward()
            dist.step()
        dist.synchronize()
        if worker == 0:
            out["bag"] = dist.tables.export("bag").weight()
            emb = dist.tables.export("emb")
            out["emb"] = (emb.ids, emb.weights)
            out["head"] = {k: v.detach().clone() for k, v in model.head.state_dict().items()}
            out["state"] = model.state_dict()
            probe = batch(0, STEPS)
            with torch.no_grad():
                out["live"] = model(probe)
    finally:
        dist.close()


shards = cluster_fixture(2, min_workers=WORKERS)


def test_float16_tables_train_as_the_one_process_float16_oracle(shards):
    shards.reset()
    out: dict = {}
    run_workers(WORKERS, lambda w: train(shards.servers, w, out), timeout=240)
    want = Oracle()
    start = {"bag": want.bag.weight.detach().clone(), "emb": want.emb.weight.detach().clone()}
    want.train_steps()
    bag, ref = out["bag"], want.bag.weight.detach()
    assert torch.equal(bag, bag.to(HALF).float()), "the bag's rows must be float16 values"
    assert torch.allclose(bag, ref, rtol=RTOL, atol=ATOL), (bag - ref).abs().max()
    assert not torch.equal(bag, start["bag"]), "the bag must train"
    ids, rows = out["emb"]
    assert torch.equal(rows, rows.to(HALF).float()), "the hashed table's rows must be float16 values"
    trained = want.emb.weight.detach()[torch.searchsorted(want.ids, ids)]
    assert torch.allclose(rows, trained, rtol=RTOL, atol=ATOL), (rows - trained).abs().max()
    for k, v in out["head"].items():
        assert torch.allclose(v, want.head.state_dict()[k], rtol=1e-3, atol=1e-5), k
    local = shardps.local_model(Net(), out["state"])  # without shards: equal to the live model, bit for bit
    with torch.no_grad():
        assert torch.equal(local(batch(0, STEPS)), out["live"])


def pulled_bytes(servers: str, dtype: torch.dtype) -> tuple[int, torch.Tensor]:
    """Bytes of one pull of 40 rows of the bag, and the rows, with tables of ``dtype``."""
    model = Net(dtype)
    dist = DistributedOptimizer(torch.optim.SGD(model.head.parameters(), lr=0.1), model.named_parameters(),
                                servers=servers, model=model, worker_id="w0",
                                sparse_optimizer=torch.optim.Adagrad([model.bag.handle, model.emb.handle]))
    try:
        before = dist.tables.pulled_bytes
        rows = dist.tables.pull("bag", torch.arange(40))
        return dist.tables.pulled_bytes - before, rows
    finally:
        dist.close()


def test_a_float16_table_pulls_half_the_bytes_of_a_float32_one():
    with ForkedCluster(2) as cluster:
        full, full_rows = pulled_bytes(cluster.servers, torch.float32)
        cluster.reset()
        half, half_rows = pulled_bytes(cluster.servers, HALF)
    assert full == 40 * DIM * 4 and half == 40 * DIM * 2, (full, half)
    assert half_rows.dtype == torch.float32 and torch.equal(half_rows, full_rows.to(HALF).float())


def test_a_restarted_shard_restores_its_float16_rows_from_its_checkpoint(tmp_path):
    args = ("--checkpoint-dir", str(tmp_path), "--lease-seconds", "120")
    with ForkedCluster(1, extra_args=args) as cluster:
        model = Net()
        dist = DistributedOptimizer(torch.optim.SGD(model.head.parameters(), lr=0.1), model.named_parameters(),
                                    servers=cluster.servers, model=model, worker_id="w0",
                                    sparse_optimizer=torch.optim.Adagrad([model.bag.handle, model.emb.handle]))
        try:
            for step in range(3):
                dist.zero_grad()
                b = batch(0, step)
                nn.functional.mse_loss(model(b), b["y"]).backward()
                dist.step()
            dist.synchronize()
            before = {name: dist.tables.export(name) for name in ("bag", "emb")}
        finally:
            dist.close()
        proc = run_module("shardps.cli.main", "checkpoint", "--servers", cluster.servers, "--timeout", "60",
                          timeout=90)
        assert proc.returncode == 0, (proc.stdout, proc.stderr)
        cluster.restart(0, same_port=True)  # SIGKILL, then a new process on the same directory
        model = Net()
        dist = DistributedOptimizer(torch.optim.SGD(model.head.parameters(), lr=0.1), model.named_parameters(),
                                    servers=cluster.servers, model=model, worker_id="w1",
                                    sparse_optimizer=torch.optim.Adagrad([model.bag.handle, model.emb.handle]))
        try:
            for name, was in before.items():
                now = dist.tables.export(name)
                assert torch.equal(now.ids, was.ids) and torch.equal(now.weights, was.weights), name
                assert now.spec.dtype == "float16"
        finally:
            dist.close()
        for source in (("--servers", cluster.servers), ("--checkpoint-dir", str(tmp_path))):
            out = tmp_path / f"export{len(source[1])}.safetensors"
            proc = run_module("shardps.cli.main", "export", *source, "--out", str(out), timeout=90)
            assert proc.returncode == 0, (source, proc.stdout, proc.stderr)
            tensors, specs = read_export(out)  # float32 tensors of the float16 values, the specs saying float16
            assert specs["bag"].dtype == specs["emb"].dtype == "float16", source
            assert torch.equal(tensors["bag.weight"], before["bag"].weight()), source
            assert torch.equal(tensors["emb.ids"], before["emb"].ids), source
            assert torch.equal(tensors["emb.rows"], before["emb"].weights), source


def test_float16_settings_the_rows_cannot_hold_are_refused():
    for init in (("constant", 7e4), ("uniform", -1.0, 7e4), ("normal", 0.0, 2e4)):
        with pytest.raises(ValueError, match="past float16's range"):
            ShardedEmbeddingBag(10, 4, name="t", init=init, dtype=HALF).spec()
        ShardedEmbeddingBag(10, 4, name="t", init=init).spec()  # float32 holds them
    with pytest.raises(ValueError, match="torch.float32 or torch.float16"):
        ShardedEmbeddingBag(10, 4, dtype=torch.bfloat16)
    spec = ShardedEmbeddingBag(10, 4, name="t", dtype=HALF).spec()
    assert spec.row_bytes() == 4 * 2 and TableSpec.from_proto(spec.to_proto()) == spec


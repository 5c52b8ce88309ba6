"""``shardps export`` writes every sparse table beside the dense tensors, from live shards and from checkpoints.

A small job with a bounded and a hashed table trains on 2 real shards; the
real CLI (``python -m shardps.cli.main export``) then writes it from the live
shards and from their checkpoints, and every table must equal what the live
worker reads (``dist.tables.export(name)``: ``weight()`` for the bounded
table, ``ids``/``weights`` for the hashed one) bit for bit, with the specs in
the file's metadata. A table of 128 MB, over a hundred gRPC messages, exports in a
cold CLI process whose peak resident memory above its baseline (after its
imports) stays within the bound docs/operations.md states, far under the
table's size, from the live shards and from the checkpoints.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

import shardps

from shardps.common.checkpoint import find, write
from shardps.worker import DistributedOptimizer, ShardedEmbedding, ShardedEmbeddingBag, WireOptions
from shardps.worker.export import from_checkpoints, from_servers
from shardps.worker.table_file import read_export
from tests.support.forked import ForkedCluster
from tests.support.procs import REPO, run_module

#: Peak resident memory an export may add to its process's baseline (docs/operations.md#operator-commands).
EXPORT_PEAK_BYTES = 48 << 20


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return run_module("shardps.cli.main", *args, timeout=timeout)


class Model(nn.Module):
    def __init__(self, users: int, dim: int) -> None:
        super().__init__()
        self.user = ShardedEmbedding(users, dim, padding_idx=0)  # bounded: exported as user.weight
        self.item = ShardedEmbeddingBag(None, dim, mode="sum")  # hashed: item.ids and item.rows
        self.head = nn.Linear(2 * dim, 1)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(0, items.numel(), 2)
        out = self.head(torch.cat([self.user(users), self.item(items, offsets)], dim=1))
        return out.square().mean()


def attach(cluster, users: int, dim: int, wire: WireOptions | None = None):
    torch.manual_seed(0)
    model = Model(users, dim)
    sparse = torch.optim.Adagrad([model.user.handle, model.item.handle], lr=0.05)
    dist = DistributedOptimizer(torch.optim.SGD(model.head.parameters(), lr=0.1), model.named_parameters(),
                                servers=cluster.servers, model=model, sparse_optimizer=sparse,
                                wire=wire or WireOptions())
    return model, dist


def train(model, dist, batches) -> None:
    for users, items in batches:
        dist.zero_grad()
        model(users, items).backward()
        dist.step()
    dist.synchronize()


def check_file(path: Path, model: Model, dist) -> dict:
    """The export at ``path`` holds the dense tensors and both tables as the live worker reads them."""
    state, specs = read_export(path)
    user, item = dist.tables.export("user"), dist.tables.export("item")
    assert specs == {"user": user.spec, "item": item.spec}
    assert set(state) == {"head.weight", "head.bias", "user.weight", "item.ids", "item.rows"}
    assert torch.equal(state["head.weight"], model.head.weight.detach())
    assert torch.equal(state["head.bias"], model.head.bias.detach())
    assert torch.equal(state["user.weight"], user.weight())  # bit for bit: trained rows and initial rows
    assert state["user.weight"][0].abs().sum() == 0  # the padding row
    assert torch.equal(state["item.ids"], item.ids) and torch.equal(state["item.rows"], item.weights)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    tables = json.loads(meta["shardps.tables"])
    assert tables["user"]["num_embeddings"] == user.spec.num_embeddings and tables["item"]["optimizer"] == "adagrad"
    assert meta["job_id"] and meta["versions"] == f"{dist.version},{dist.version}"
    # a fresh local model loads the file and answers what the live model answers (unseen hashed ids included)
    local = shardps.local_model(Model(model.user.num_embeddings, model.user.embedding_dim), path)
    users, items = torch.arange(model.user.num_embeddings), torch.arange(-40, 80) * 1_000_003
    with torch.no_grad():
        assert torch.equal(local(users, items), model(users, items))
    return state


def test_export_writes_every_table_from_live_shards_and_checkpoints(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    with ForkedCluster(2, extra_args=("--checkpoint-dir", str(ckpt))) as cluster:
        model, dist = attach(cluster, users=60, dim=4)
        try:
            gen = torch.Generator().manual_seed(1)
            train(model, dist, [(torch.randint(0, 60, (16,), generator=gen),
                                 torch.randint(-10**12, 10**12, (32,), generator=gen)) for _ in range(4)])
            trained = dist.tables.export("user").ids.numel() + dist.tables.export("item").ids.numel()

            live = tmp_path / "live.safetensors"
            proc = cli("export", "--servers", cluster.servers, "--out", str(live))  # the shards list their tables
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert f"exported 2 tensors and 2 tables ({trained} trained rows) of job" in proc.stdout, proc.stdout
            assert f"at version {dist.version} to {live}" in proc.stdout
            live_state = check_file(live, model, dist)

            with from_servers(cluster.servers, model=model) as export:  # Python: the model names its tables
                assert sorted(export.tables) == ["item", "user"] and export.table_rows() == trained
                check_file(export.save(tmp_path / "api.safetensors"), model, dist)

            proc = cli("export", "--servers", cluster.servers, "--out", str(tmp_path / "one.safetensors"),
                       "--tables", "user")
            assert proc.returncode == 0 and "exported 2 tensors and 1 table (" in proc.stdout, proc.stderr
            for bad, says in ((["--tables", "user,nope"], "'nope' is not declared"),
                              (["--tables", "user", "--out", str(tmp_path / "m.pt")], "only to .safetensors")):
                args = ["export", "--servers", cluster.servers, "--out", str(tmp_path / "bad.safetensors"), *bad]
                proc = cli(*args)
                assert proc.returncode == 1 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
            assert not (tmp_path / "bad.safetensors").exists() and not (tmp_path / "m.pt").exists()

            proc = cli("checkpoint", "--servers", cluster.servers)
            assert proc.returncode == 0, proc.stderr
            out = tmp_path / "ckpt.safetensors"
            proc = cli("export", "--checkpoint-dir", str(ckpt), "--out", str(out))
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert f"and 2 tables ({trained} trained rows)" in proc.stdout
            from_ckpt = check_file(out, model, dist)
            assert from_ckpt.keys() == live_state.keys()
            assert all(torch.equal(from_ckpt[k], v) for k, v in live_state.items())
        finally:
            dist.close()

    # a checkpoint whose table rows are missing (intact otherwise: its checksums fit) is refused loudly
    bad = tmp_path / "bad"
    for shard in range(2):
        snap = find(ckpt / f"shard-{shard}", shard_index=shard).snapshot
        if shard == 1:
            del snap.tensors["rows/item/weights"]
        write(bad / f"shard-{shard}", snap, keep=3)
    proc = cli("export", "--checkpoint-dir", str(bad), "--out", str(tmp_path / "bad.safetensors"))
    assert proc.returncode == 1 and "rows/item/weights tensor is missing" in proc.stderr, proc.stderr
    assert not (tmp_path / "bad.safetensors").exists()
    with pytest.raises(RuntimeError, match="not in the checkpoints"):
        from_checkpoints(ckpt, tables=["nope"])


#: Runs ``shardps.cli.main.main(argv[2:])`` after the imports any export makes, then writes its baseline
#: (VmRSS once imported) and peak (VmHWM) resident memory, in bytes, as JSON to argv[1]. Started cold by
#: ``subprocess`` (exec): its peak counts only its own pages.
MEASURE = """
import json, sys
import grpc, safetensors, torch
from shardps.cli import main as cli
import shardps.worker.export, shardps.worker.table_file, shardps.worker.session.client

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

baseline = status("VmRSS")
try:
    code = cli.main(sys.argv[2:])
finally:
    with open(sys.argv[1], "w") as f:
        json.dump({"baseline": baseline, "peak": status("VmHWM")}, f)
sys.exit(code)
"""


def export_cold(args: list[str], tmp_path: Path) -> tuple[subprocess.CompletedProcess, int]:
    """Run ``shardps export args`` in a cold process: ``(result, peak bytes above its baseline)``."""
    report = tmp_path / "rss.json"
    proc = subprocess.run([sys.executable, "-c", MEASURE, str(report), "export", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    rss = json.loads(report.read_text())
    return proc, rss["peak"] - rss["baseline"]


def test_a_table_larger_than_many_messages_exports_in_bounded_memory(tmp_path: Path) -> None:
    users, dim, items, per_step = 300_000, 64, 500_000, 16_000  # tables of 77 and 128 MB; pages of 1 MiB
    ckpt = tmp_path / "ckpt"
    with ForkedCluster(2, extra_args=("--checkpoint-dir", str(ckpt), "--max-message-bytes", str(4 << 20))) as cluster:
        model, dist = attach(cluster, users, dim, WireOptions(max_message_bytes=4 << 20))
        try:
            gen = torch.Generator().manual_seed(2)
            batches = []
            for start in range(0, items, per_step):  # every item once (hashed rows), users here and there
                count = min(per_step, items - start)
                batches.append((torch.randint(0, users, (count // 2,), generator=gen),
                                torch.arange(start, start + count) * 7919 - 10**9))
            train(model, dist, batches)
            item = dist.tables.export("item")
            assert item.ids.numel() == items and item.weights.nbytes > 120e6
            table_bytes = item.weights.nbytes

            results = {}
            for source in ("live", "checkpoint"):
                out = tmp_path / f"{source}.safetensors"
                if source == "live":
                    args = ["--servers", cluster.servers, "--tables", "user,item", "--max-message-bytes", str(2 << 20)]
                else:
                    assert cli("checkpoint", "--servers", cluster.servers).returncode == 0
                    args = ["--checkpoint-dir", str(ckpt)]
                proc, peak = export_cold([*args, "--out", str(out)], tmp_path)
                assert proc.returncode == 0, proc.stderr[-3000:]
                print(f"{source}: peak RSS above baseline {peak / 2**20:.1f} MiB for a table of "
                      f"{table_bytes / 2**20:.0f} MiB (and a bounded one of {users * dim * 4 / 2**20:.0f} MiB)")
                assert peak < EXPORT_PEAK_BYTES and peak < table_bytes / 3, f"{source}: {peak / 2**20:.1f} MiB"
                results[source] = out
            state, specs = read_export(results["live"])
            assert torch.equal(state["item.ids"], item.ids) and torch.equal(state["item.rows"], item.weights)
            assert torch.equal(state["user.weight"], dist.tables.export("user").weight())
            del state
            again, _ = read_export(results["checkpoint"])
            assert torch.equal(again["item.rows"], item.weights)
            assert torch.equal(again["user.weight"], dist.tables.export("user").weight())
        finally:
            dist.close()

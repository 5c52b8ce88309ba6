"""Checkpoint names, crash safety, ``shardps checkpoint`` before the first dense round, and the write's peak memory.

Real shard processes with ``--checkpoint-dir``, driven over raw gRPC by one hand-made member (a one-weight
dense model and one sparse table, SGD) so that sparse rounds can run at an unchanged dense version:

- every state gets a checkpoint of its own name (its sequence number, dense version and sparse round), an
  existing name is never written again, ``--keep-checkpoints 2`` keeps the two newest, and a checkpoint of an
  unchanged state writes nothing and names the one that holds it (issue 44, item 4);
- the files a crash between the tensor file and its manifest leaves (built by hand from what the shard
  wrote) never make a checkpoint: the restart restores the newest intact one and Stats names it;
- ``shardps checkpoint`` exits 0 naming what it wrote before the first dense round, and 3 with "nothing to
  checkpoint" on a shard that holds no initialised job;
- a checkpoint of a 512 MiB table raises the shard's peak RSS (``VmHWM``, reset through ``clear_refs``) by
  less than a quarter of the table (issue 44, item 3: copied whole, it rose by 1582 MiB, 3.1x the table).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from shardps.common import safetensors_stream
from shardps.common.rows import TableSpec, ids_bytes, ids_from, rows_bytes, rows_from
from shardps.proto import shardps_pb2 as pb
from shardps.worker.cluster import LocalCluster
from shardps.worker.session.client import ShardClient
from tests.support.forked import ForkedCluster
from tests.support.procs import run_module
from tests.support.raw import RawWorker, plan_and_spec

DIM = 8
NAME = re.compile(r"^checkpoint-\d{8}-v\d{12}-r\d{12}\.json$")


class Member:
    """One raw member of a shard's job: a one-weight dense model (SGD) and table ``t`` (SGD, ``dim``, ``init``)."""

    def __init__(self, cluster, dim: int = DIM, init: str = "", **client) -> None:
        self.client = ShardClient(cluster.addresses[0], index=0, **client)
        model = nn.Linear(1, 1, bias=False)
        self.raw = RawWorker(self.client, "w0", *plan_and_spec(model, torch.optim.SGD(model.parameters(), lr=0.1)))
        if self.raw.join().initialise:  # (a shard restored from a checkpoint holds the job already)
            self.raw.init(0, dict(model.named_parameters()))
        self.dim, self.pushes = dim, 0
        spec = TableSpec(name="t", embedding_dim=dim, optimizer="sgd", init=init).to_proto()
        self.client.declare_tables(pb.DeclareTablesRequest(worker_id="w0", session=self.raw.session, tables=[spec]))

    def push(self, ids: torch.Tensor, fill: float = 0.25) -> None:
        """One sparse round: ``fill`` as the gradient of every row of ``ids`` (int64 ``[n]``), lr 0.5. The only
        member's push starts the round at once: a checkpoint or an export asked for next waits for it."""
        self.pushes += 1
        grads = torch.full((ids.numel(), self.dim), fill)
        self.client.push_rows(pb.PushRowsRequest(worker_id="w0", session=self.raw.session, push=self.pushes, tables=[
            pb.TableRows(table="t", ids=ids_bytes(ids), grads=rows_bytes(grads), lr=0.5)]))

    def close(self) -> None:
        self.client.close()


def rows(address: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Table ``t``'s ``(ids, weights, sparse round)`` on the shard at ``address`` (no membership needed)."""
    client = ShardClient(address, index=0)
    try:
        reply = client.export_rows("t")
    finally:
        client.close()
    ids = ids_from(reply.ids)
    return ids, rows_from(reply.weights, ids.numel(), DIM), reply.round


def stats(address: str) -> pb.StatsReply:
    client = ShardClient(address, index=0)
    try:
        return client.stats()
    finally:
        client.close()


def manifests(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("checkpoint-*.json"))


def files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}


def checkpoint_cli(cluster) -> tuple[int, str, str]:
    proc = run_module("shardps.cli.main", "checkpoint", "--servers", cluster.servers, "--timeout", "60", timeout=90)
    return proc.returncode, proc.stdout, proc.stderr


def test_sparse_rounds_at_one_dense_version_get_names_of_their_own_and_keep_checkpoints_keeps_them(tmp_path):
    directory = tmp_path / "shard-0"
    args = ("--checkpoint-dir", str(tmp_path), "--keep-checkpoints", "2", "--lease-seconds", "120")
    with ForkedCluster(1, extra_args=args) as cluster:
        code, out, err = checkpoint_cli(cluster)  # no job yet: nothing to write, said so, exit 3
        assert code == 3 and "nothing to checkpoint" in out and "no initialised job" in out, (code, out, err)
        assert not directory.exists() or not manifests(directory)
        member = Member(cluster)
        try:
            written = []
            for round_ in (1, 2, 3):
                member.push(torch.arange(10) * round_)
                code, out, err = checkpoint_cli(cluster)  # dense version 0 throughout: only the sparse round moves
                assert code == 0, (code, out, err)
                name = re.search(r"wrote (checkpoint-\S+\.json)", out).group(1)
                assert NAME.match(name) and f"dense version 0, sparse round {round_}" in out, out
                assert name not in written and (directory / name).exists()
                written.append(name)
                before = files(directory)
                code, again, err = checkpoint_cli(cluster)  # nothing changed: nothing written, the same name
                assert code == 0 and f"unchanged since {name}" in again, (code, again, err)
                assert files(directory) == before, "an unchanged state wrote nothing"
                assert manifests(directory) == sorted(written[-2:])  # --keep-checkpoints 2: the two newest
                for kept in written[-2:]:  # each kept one is whole: manifest and its own tensor file
                    assert (directory / kept.replace(".json", ".safetensors")).exists()
            live = rows(cluster.addresses[0])
            assert live[2] == 3
        finally:
            member.close()
        cluster.restart(0, same_port=True)  # SIGKILL, then a new process on the same directory
        restored = stats(cluster.addresses[0])
        assert restored.restored_checkpoint == written[-1] and restored.checkpoint_name == written[-1]
        assert restored.restored_version == 0 and restored.restored_sparse_round == 3
        after = rows(cluster.addresses[0])
        assert torch.equal(after[0], live[0]) and torch.equal(after[1], live[1]) and after[2] == 3


@pytest.mark.parametrize("crash", ["before-manifest", "in-manifest", "in-tensor-file"])
def test_a_crash_while_writing_never_pairs_new_tensors_with_an_old_manifest(tmp_path, crash):
    """The files a crash leaves, rebuilt from what the shard wrote: checkpoint A (round 1) whole, and of
    checkpoint B (round 2, the same dense version 1) the tensor file in place but no manifest (``before-manifest``),
    plus a half-written manifest at its temporary name (``in-manifest``), or only half of B's tensor file
    at its temporary name (``in-tensor-file``). The restart restores A, bit for bit, and Stats names it."""
    directory = tmp_path / "shard-0"
    args = ("--checkpoint-dir", str(tmp_path), "--lease-seconds", "120")
    with ForkedCluster(1, extra_args=args) as cluster:
        member = Member(cluster)
        try:
            member.raw.push(0, fill=0.5)  # one dense round: both checkpoints are of dense version 1
            member.push(torch.arange(20))
            a = member.client.checkpoint()
            state_a, written_a = rows(cluster.addresses[0]), files(directory)
            member.push(torch.arange(10, 30), fill=-1.0)
            b = member.client.checkpoint()
            written_b = files(directory)
        finally:
            member.close()
        assert (a.version, b.version) == (1, 1) and (a.sparse_round, b.sparse_round) == (1, 2) and a.name != b.name
        pid = cluster.processes[0].pid
        cluster.processes[0].kill()  # SIGKILL; the files are then put as the crash would have left them
        cluster.processes[0].wait(timeout=30)
        for f in directory.iterdir():
            f.unlink() if f.is_file() else None
        for name, data in written_a.items():  # A, exactly as it was when B's write began
            (directory / name).write_bytes(data)
        tensors = {n: d for n, d in written_b.items() if n.endswith(".safetensors") and written_a.get(n) != d}
        manifest = {n: d for n, d in written_b.items() if n.endswith(".json") and written_a.get(n) != d}
        assert len(tensors) == 1 and len(manifest) == 1, (sorted(written_a), sorted(written_b))
        (tensor_name, tensor_data), = tensors.items()
        (manifest_name, manifest_data), = manifest.items()
        if crash == "in-tensor-file":  # the shard streams the tensor file into a hidden temporary file
            (directory / f".{tensor_name}.{pid}.partial").write_bytes(tensor_data[: len(tensor_data) // 2])
        else:
            (directory / tensor_name).write_bytes(tensor_data)  # renamed into place; the manifest never came
            if crash == "in-manifest":
                (directory / f"{manifest_name}.tmp").write_bytes(manifest_data[: len(manifest_data) // 2])
        cluster.restart(0, same_port=True)  # (the old process is gone already)
        restored = stats(cluster.addresses[0])
        assert restored.restored_checkpoint == a.name and restored.restored_sparse_round == 1
        state = rows(cluster.addresses[0])
        assert torch.equal(state[0], state_a[0]) and torch.equal(state[1], state_a[1]) and state[2] == 1
        assert manifests(directory) == [a.name]
        assert not [p for p in directory.iterdir() if p.name.endswith((".partial", ".tmp"))], "temporary files left"
        if crash != "in-tensor-file":
            assert (directory / "damaged" / tensor_name).exists()  # B's orphan, set aside
            assert f"skipping checkpoint {directory / tensor_name}" in cluster.log_path(0).read_text()
        member = Member(cluster)  # the job goes on from A: its next checkpoint is at B's versions, under a new name
        try:
            member.push(torch.arange(5))
            c = member.client.checkpoint()
        finally:
            member.close()
        assert c.written and (c.version, c.sparse_round) == (b.version, b.sparse_round) and c.name != a.name
        if crash != "in-tensor-file":  # B's tensor file was there (now in damaged/): its name is not used again
            assert c.name != b.name


def _rss(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of process ``pid``, bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc clear_refs")
def test_a_checkpoint_of_a_512_mib_table_adds_less_than_a_quarter_of_it_to_the_shards_peak_rss(tmp_path, monkeypatch):
    """The shard runs as its own process (not forked) with glibc's malloc set to hand every freed buffer of
    128 KiB or more back at once, so that its resident size is what it holds: a shard keeps up to 1 GiB of
    freed memory for reuse otherwise (``shardps.common.memory``), which would hide what a checkpoint allocates."""
    dim, rows_n, per_push = 128, 1 << 20, 1 << 16  # 512 MiB of weights (SGD: no optimizer state)
    table_bytes = rows_n * dim * 4
    message = 48 << 20
    args = ("--checkpoint-dir", str(tmp_path), "--lease-seconds", "300", "--max-message-bytes", str(message))
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 << 10))
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", str(128 << 10))
    with LocalCluster(1, extra_args=args) as cluster:
        member = Member(cluster, dim=dim, init="zeros", max_message_bytes=message)  # (zeros: a quick fill)
        try:
            member.raw.push(0, fill=0.5)  # one dense round (version 1)
            for start in range(0, rows_n, per_push):
                member.push(torch.arange(start, start + per_push))
            # A first checkpoint lets the shard settle (the index flush after the last round grows the row store
            # for the next one: a copy of the rows, not the checkpoint's); one row more makes the next one new.
            member.client.checkpoint()
            member.push(torch.tensor([rows_n]))
            pid = cluster.processes[0].pid
            before = _rss(pid)["VmRSS"]
            Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS: the peak of what follows
            reply = member.client.checkpoint()
            peak = _rss(pid)["VmHWM"]
            sample = member.client.export_rows("t", offset=rows_n // 2, max_rows=4)
        finally:
            member.close()
    print(f"shard RSS before the checkpoint {before / 2**20:.0f} MiB, peak while writing {peak / 2**20:.0f} MiB "
          f"(+{(peak - before) / 2**20:.0f} MiB for a {table_bytes / 2**20:.0f} MiB table)")
    assert reply.version == 1 and reply.sparse_round == rows_n // per_push + 1 and reply.written
    assert peak - before < table_bytes // 4, (before, peak)
    data = (tmp_path / "shard-0" / reply.name).with_suffix(".safetensors")
    fd = os.open(data, os.O_RDONLY)
    try:  # the streamed file holds the rows in id order
        _, entries, start = safetensors_stream.read_header(fd)
        ids = safetensors_stream.read_rows(fd, entries["rows/t/ids"], start, rows_n // 2, 4)
        weights = safetensors_stream.read_rows(fd, entries["rows/t/weights"], start, rows_n // 2, 4)
    finally:
        os.close(fd)
    assert ids.tolist() == list(range(rows_n // 2, rows_n // 2 + 4))
    assert torch.equal(weights, rows_from(sample.weights, 4, dim))

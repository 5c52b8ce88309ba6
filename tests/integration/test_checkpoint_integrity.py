"""Checkpoints that cannot be mixed up: a shard loads only its own intact checkpoints, export checks the plan.

Real shard processes with ``--checkpoint-dir`` trained by a real worker
process, stopped with SIGTERM (a final checkpoint), then started again on
directories an operator got wrong: another shard's files, a manifest edited
by hand, the only checkpoint damaged; and ``shardps export`` run against a
model or shard count the checkpoints were not written for.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from shardps.common.checkpoint import Name
from tests.support.procs import run_module, run_worker, shard_stats
from tests.support.worker_proc import model


def trained(start_cluster, ckpt: Path, num_shards: int, *extra: str, steps: int = 6) -> tuple[str, ...]:
    """``num_shards`` shards checkpointing every 4 rounds, trained ``steps`` rounds, stopped; their flags."""
    args = ("--checkpoint-dir", str(ckpt), *extra)
    cluster = start_cluster(num_shards, extra_args=args)
    proc = run_worker(cluster.servers, "w0", "--steps", str(steps))
    assert proc.returncode == 0 and f"done version={steps}" in proc.stdout, proc.stderr[-2000:]
    assert cluster.stop() == [0] * num_shards  # SIGTERM: a final checkpoint of version `steps`
    return args


def manifest(directory: Path, version: int) -> Path:
    """The manifest of the newest checkpoint of dense version ``version`` in ``directory``."""
    names = [Name.parse(p.name) for p in directory.glob("*.json")]
    return directory / max((n for n in names if n.version == version), key=Name.order).manifest


def shard(ckpt: Path, index: int, num_shards: int, *extra: str) -> subprocess.CompletedProcess:
    """Run one shard process on ``ckpt`` that must stop before serving (it is killed after 60 s otherwise)."""
    return run_module("shardps.cli.server", "--shard-index", str(index), "--num-shards", str(num_shards),
                      "--port", "0", "--checkpoint-dir", str(ckpt), *extra, timeout=60)


def test_a_shard_refuses_another_shards_checkpoints(start_cluster, tmp_path: Path) -> None:
    """Swapped directories (shard 1's files in shard 0's place and back) are refused, naming both indices."""
    ckpt = tmp_path / "ckpt"
    args = trained(start_cluster, ckpt, 2)
    before = {p: p.read_bytes() for p in sorted(ckpt.rglob("*")) if p.is_file()}

    def swap() -> None:
        (ckpt / "shard-0").rename(tmp_path / "swap")
        (ckpt / "shard-1").rename(ckpt / "shard-0")
        (tmp_path / "swap").rename(ckpt / "shard-1")

    swap()
    for index, other in ((0, 1), (1, 0)):
        proc = shard(ckpt, index, 2)
        assert proc.returncode == 1 and "listening" not in proc.stdout, proc.stderr[-2000:]
        assert f"expected shard index {index}, found {other}" in proc.stderr, proc.stderr[-2000:]
    swap()
    after = {p: p.read_bytes() for p in sorted(ckpt.rglob("*")) if p.is_file()}
    assert after == before, "a refused start changes nothing"
    cluster = start_cluster(2, extra_args=args)  # each shard on its own files again: restored
    assert [s.version for s in shard_stats(cluster.addresses)] == [6, 6]


def test_an_edited_manifest_is_refused_and_the_previous_checkpoint_loaded(start_cluster, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    args = trained(start_cluster, ckpt, 2, "--checkpoint-every-rounds", "4")  # versions 4 and 6 on disk
    # the version each shard falls back to: its checkpoint before the final one (4, or a round later where a
    # loaded machine delayed the scheduled checkpoint to the next moment between rounds)
    older = {sorted(Name.parse(p.name).version for p in (ckpt / f"shard-{i}").glob("*.json"))[-2] for i in range(2)}
    assert len(older) == 1 and 4 <= min(older) < 6, older
    (fallback,) = older
    edited, kept = [], []
    for index, edit in enumerate(("version", "lr")):
        path = manifest(ckpt / f"shard-{index}", 6)
        edited.append(path)
        kept.append(manifest(ckpt / f"shard-{index}", fallback))
        m = json.loads(path.read_text())
        if edit == "version":
            m["version"] = 7
        else:
            group = next(iter(m["hyperparams"]))
            m["hyperparams"][group]["lr"] = 1.0
        path.write_text(json.dumps(m, sort_keys=True))
    cluster = start_cluster(2, extra_args=args)
    assert [s.version for s in shard_stats(cluster.addresses)] == [fallback, fallback]
    for index in range(2):
        log = cluster.log_path(index).read_text()
        assert f"skipping checkpoint {edited[index]}" in log, log[-2000:]
        assert "does not match its own SHA-256" in log, log[-2000:]
        assert f"loaded checkpoint {kept[index]} (version {fallback}, sparse round 0)" in log
        assert (ckpt / f"shard-{index}" / "damaged" / edited[index].name).exists()
    proc = run_worker(cluster.servers, "w0", "--steps", "2")
    assert proc.returncode == 0 and f"done version={fallback + 2}" in proc.stdout, proc.stderr[-2000:]


def test_a_lost_only_checkpoint_stops_the_shard_until_asked_to_start_over(start_cluster, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    trained(start_cluster, ckpt, 1)  # one checkpoint only: version 6, at SIGTERM
    data = manifest(ckpt / "shard-0", 6).with_suffix(".safetensors")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    proc = shard(ckpt, 0, 1)
    assert proc.returncode == 1 and "listening" not in proc.stdout, proc.stderr[-2000:]
    assert f"{ckpt / 'shard-0'} holds checkpoints but none is intact" in proc.stderr, proc.stderr[-2000:]
    assert data.with_suffix(".json").name in proc.stderr and "--start-empty-over-damaged-checkpoints" in proc.stderr
    assert data.exists(), "a refused start changes nothing"

    cluster = start_cluster(1, extra_args=("--checkpoint-dir", str(ckpt), "--start-empty-over-damaged-checkpoints"))
    log = cluster.log_path(0).read_text()
    assert "WARNING" in log and "starting EMPTY" in log, log[-2000:]
    stats = shard_stats(cluster.addresses)[0]
    assert stats.version == 0 and not stats.job_id
    assert (ckpt / "shard-0" / "damaged" / data.name).exists() and not data.exists()


def test_export_refuses_a_plan_that_does_not_match_the_model(start_cluster, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    trained(start_cluster, ckpt, 2)
    out = tmp_path / "model.safetensors"
    other = tmp_path / "other.safetensors"  # the test worker's model with another hidden width
    save_file({k: v.contiguous() for k, v in model(32).state_dict().items()}, str(other))
    proc = run_module("shardps.cli.main", "export", "--checkpoint-dir", str(ckpt), "--model-state", str(other),
                      "--out", str(out))
    assert proc.returncode == 1 and not out.exists(), proc.stderr[-2000:]
    assert "parameter '0.weight': expected shape (32, 16) (numel 512) from the model, found shape (40, 16) " \
           "(numel 640)" in proc.stderr, proc.stderr[-2000:]
    proc = run_module("shardps.cli.main", "export", "--checkpoint-dir", str(ckpt), "--num-shards", "3",
                      "--out", str(out))
    assert proc.returncode == 1 and not out.exists(), proc.stderr[-2000:]
    assert "expected 3 shards, found 2" in proc.stderr, proc.stderr[-2000:]

    right = tmp_path / "right.pt"
    torch.save(model(40).state_dict(), right)
    proc = run_module("shardps.cli.main", "export", "--checkpoint-dir", str(ckpt), "--model-state", str(right),
                      "--num-shards", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    model(40).load_state_dict(load_file(out), strict=True)

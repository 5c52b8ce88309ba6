"""Shard checkpoints: SIGTERM writes one with every applied round, a restart restores it bit for bit.

Real shard processes with ``--checkpoint-dir``, stopped with SIGTERM and
started again on the same directory; a real worker process trains, then
resumes the restored job.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from shardps.common.checkpoint import Name
from tests.support.procs import run_worker as run_process
from tests.support.procs import shard_stats as stats_of


def run_worker(servers: str, steps: int) -> subprocess.CompletedProcess:
    return run_process(servers, "w0", "--steps", str(steps))


def shard_stats(cluster) -> list:
    return stats_of(cluster.addresses, digest=True)


def checkpoints(directory: Path) -> list[Name]:
    """The names of the whole checkpoints in ``directory`` (a manifest each), oldest first."""
    return sorted((Name.parse(p.name) for p in directory.glob("*.json")), key=Name.order)


def trained(start_cluster, ckpt: Path):
    """Two shards checkpointing every 4 rounds, trained 10 rounds by one worker; their Stats at version 10."""
    args = ("--checkpoint-dir", str(ckpt), "--checkpoint-every-rounds", "4", "--keep-checkpoints", "3")
    cluster = start_cluster(2, extra_args=args)
    proc = run_worker(cluster.servers, 10)
    assert proc.returncode == 0 and "done version=10" in proc.stdout, proc.stderr[-2000:]
    before = shard_stats(cluster)
    assert [s.version for s in before] == [10, 10]
    assert cluster.stop() == [0, 0]  # SIGTERM: a final checkpoint, then a clean exit
    return args, before


def test_sigterm_checkpoint_is_restored_bit_for_bit_and_the_job_resumes(start_cluster, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    args, before = trained(start_cluster, ckpt)
    for shard in range(2):  # rounds 4 and 8 on schedule, 10 at SIGTERM; the newest 3 kept, in the order written
        names = checkpoints(ckpt / f"shard-{shard}")
        assert [(n.version, n.sparse_round) for n in names] == [(4, 0), (8, 0), (10, 0)], names
        assert [n.sequence for n in names] == [1, 2, 3]
    cluster = start_cluster(2, extra_args=args)
    after = shard_stats(cluster)
    assert [s.version for s in after] == [10, 10] and [s.checkpoint_version for s in after] == [10, 10]
    assert [s.digest for s in after] == [s.digest for s in before], "parameters and optimizer state differ"
    assert [s.job_id for s in after] == [s.job_id for s in before]
    proc = run_worker(cluster.servers, 3)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "joined version=10 resumed=True" in proc.stdout and "done version=13" in proc.stdout


@pytest.mark.parametrize("damage", ["flip", "truncate", "no-manifest"])
def test_a_damaged_newest_checkpoint_is_skipped(start_cluster, tmp_path: Path, damage: str) -> None:
    ckpt = tmp_path / "ckpt"
    args, _ = trained(start_cluster, ckpt)
    intact = set()  # the version each shard falls back to: its newest checkpoint but one (8 when the schedule
    for shard in range(2):  # wrote rounds 4 and 8; a loaded machine may have delayed or skipped one)
        names = checkpoints(ckpt / f"shard-{shard}")
        assert names[-1].version == 10 and len(names) >= 2, names
        intact.add(names[-2].version)
        newest = ckpt / f"shard-{shard}" / names[-1].stem  # of version 10
        data = newest.with_suffix(".safetensors")
        if damage == "flip":
            raw = bytearray(data.read_bytes())
            raw[len(raw) // 2] ^= 0xFF
            data.write_bytes(bytes(raw))
        elif damage == "truncate":
            data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
        else:
            newest.with_suffix(".json").unlink()
    assert len(intact) == 1 and 0 < min(intact) < 10, intact
    (fallback,) = intact
    cluster = start_cluster(2, extra_args=args)
    assert [s.version for s in shard_stats(cluster)] == [fallback, fallback]
    if damage != "no-manifest":
        assert "skipping checkpoint" in cluster.log_path(0).read_text()
    proc = run_worker(cluster.servers, 2)
    assert proc.returncode == 0 and f"done version={fallback + 2}" in proc.stdout, proc.stderr[-2000:]


def test_an_older_version_can_be_restored_on_request(start_cluster, tmp_path: Path) -> None:
    """After a SIGKILL the shards' newest checkpoints may differ: --restore-version picks one they all have."""
    ckpt = tmp_path / "ckpt"
    args, _ = trained(start_cluster, ckpt)
    cluster = start_cluster(2, extra_args=(*args, "--restore-version", "9"))
    assert [s.version for s in shard_stats(cluster)] == [8, 8]


@pytest.mark.parametrize("num_shards, extra, message", [
    (3, (), "checkpoint is of a job with 2 shards, not 3"),  # the shard count changed
    (2, ("--restore-version", "3"), "no intact checkpoint of version <= 3"),  # 3 is older than any kept
])
def test_a_checkpoint_that_cannot_be_restored_stops_the_shard(start_cluster, tmp_path: Path, num_shards: int,
                                                              extra: tuple, message: str) -> None:
    """Never serve something other than asked: the shard exits with the reason instead of starting empty."""
    args, _ = trained(start_cluster, tmp_path / "ckpt")
    with pytest.raises(RuntimeError, match=message):
        start_cluster(num_shards, extra_args=(*args, *extra))

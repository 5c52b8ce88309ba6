"""A shard's optimizer threads: ``--threads``, and the default from CPU affinity and the cgroup CPU quota."""

import os
from pathlib import Path

import pytest

from shardps.cli.server import parse_args
from shardps.common.cores import usable_cores
from shardps.server.config import ShardConfig

CORES = {0, 1, 2, 3, 4, 5, 6, 7}


def cgroup_v2(tmp_path: Path, cpu_max: str) -> Path:
    (tmp_path / "cpu.max").write_text(cpu_max + "\n")
    return tmp_path


def cgroup_v1(tmp_path: Path, quota: int, period: int = 100000, sub: str = "cpu") -> Path:
    (tmp_path / sub).mkdir()
    (tmp_path / sub / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (tmp_path / sub / "cpu.cfs_period_us").write_text(f"{period}\n")
    return tmp_path


def test_affinity_alone_without_a_cgroup_quota(tmp_path: Path) -> None:
    assert usable_cores(CORES, tmp_path) == 8  # no cgroup files at all
    assert usable_cores({3}, tmp_path) == 1
    assert usable_cores(set(), tmp_path) == 1  # never 0
    assert usable_cores(CORES, cgroup_v2(tmp_path, "max 100000")) == 8


@pytest.mark.parametrize("cpu_max, cores", [("200000 100000", 2), ("150000 100000", 1), ("50000 100000", 1),
                                            ("1600000 100000", 8), ("400000 50000", 8)])
def test_cgroup_v2_quota_caps_the_affinity(tmp_path: Path, cpu_max: str, cores: int) -> None:
    """``cpu.max`` "quota period": the quota in CPUs, rounded down (a pod limited to 1.5 CPUs gets 1 thread), >= 1."""
    assert usable_cores(CORES, cgroup_v2(tmp_path, cpu_max)) == cores


@pytest.mark.parametrize("quota, cores", [(300000, 3), (-1, 8), (20000, 1)])
def test_cgroup_v1_cfs_quota(tmp_path: Path, quota: int, cores: int) -> None:
    assert usable_cores(CORES, cgroup_v1(tmp_path, quota)) == cores


def test_cgroup_v1_combined_controller_and_malformed_files(tmp_path: Path) -> None:
    assert usable_cores(CORES, cgroup_v1(tmp_path, 200000, sub="cpu,cpuacct")) == 2
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "cpu.max").write_text("garbage\n")
    assert usable_cores(CORES, bad) == 8
    (bad / "cpu.max").write_text("100000 0\n")
    assert usable_cores(CORES, bad) == 8


def test_default_reads_this_process() -> None:
    cores = usable_cores()
    assert 1 <= cores <= len(os.sched_getaffinity(0))


def test_shard_config_and_flag() -> None:
    assert ShardConfig(shard_index=0, num_shards=1).threads == usable_cores()
    assert ShardConfig(shard_index=0, num_shards=1, threads=0).threads == usable_cores()
    assert ShardConfig(shard_index=0, num_shards=1, threads=3).threads == 3
    with pytest.raises(ValueError, match="threads must be >= 1"):
        ShardConfig(shard_index=0, num_shards=1, threads=-2)
    base = ["--shard-index", "0", "--num-shards", "1"]
    assert parse_args(base).threads == usable_cores()
    assert parse_args([*base, "--threads", "5"]).threads == 5
    with pytest.raises(SystemExit):
        parse_args([*base, "--threads", "-1"])


def test_local_cluster_splits_the_cores_among_its_shards() -> None:
    """Shards started next to the worker get the usable cores split among them and the worker, at least 1 each;
    the argument list is read back by the shard's own parser."""
    from shardps.worker import LocalCluster

    def base_of(cluster: LocalCluster) -> int:
        return parse_args(cluster.shard_args(0)).threads

    for shards in (1, 2, 4):
        assert base_of(LocalCluster(shards)) == max(1, usable_cores() // (shards + 1))
    assert base_of(LocalCluster(2, threads=3)) == 3
    assert base_of(LocalCluster(2, threads=3, extra_args=("--threads", "7"))) == 7  # the caller's flag wins
    with pytest.raises(ValueError, match="threads must be >= 1"):
        LocalCluster(2, threads=0)

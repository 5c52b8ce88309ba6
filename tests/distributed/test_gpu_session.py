"""benchmarks/gpu_session.py: the prepared run for a lent GPU host runs every step here too, at smoke sizes.

On a machine without CUDA the GPU tests are skipped (pytest exits 0), the
GPU benchmark runs its job on the CPU and the wire benchmark runs as
anywhere: every step must exit 0 and leave its JSON and log, and
session.json must say what ran. A budget too small for the later steps
skips them and says so (exit 1), rather than running past the device
call's limit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.procs import wait_until

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_session.py"
#: The steps of ``run`` without ``--wheels``, in order.
STEPS = ["gpu_tests", "gpu", "gpu_stream_processes", "gpu_shard_cores", "wire"]


@pytest.mark.timeout(460)
def test_gpu_session_runs_every_step_at_smoke_sizes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SCRIPT), "run", "--out", str(out), "--smoke", "--budget-seconds", "420"],
                          capture_output=True, text=True, timeout=440, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    session = json.loads((out / "session.json").read_text())
    assert [s["name"] for s in session["steps"]] == STEPS
    assert all(s["returncode"] == 0 and s["seconds"] > 0 for s in session["steps"]), session["steps"]
    assert session["device"]["torch"] and session["device"]["device"] in ("cpu", session["device"]["device"])
    gpu = json.loads((out / "gpu.json").read_text())
    rows = {r["system"]: r for r in gpu["rows"]}
    assert set(rows) == {"torch", "torch_cpu_adamw", "shardps_2", "shardps_2_plain"}
    assert rows["shardps_2"]["streamed"] is True and rows["shardps_2_plain"]["streamed"] is False
    for name in ("shardps_2", "shardps_2_plain"):  # sync, one worker: the exact oracle's final loss either way
        assert rows[name]["shards"] == 2 and rows[name]["push_dtype"] == "fp32"
        assert rows[name]["final_loss_abs_diff_vs_cpu_adamw"] < 1e-5, rows[name]
    # push then pull: each shard answers only after its whole push (and the update) is in
    assert rows["shardps_2_plain"]["phases_ms"]["round_wait"] > 0
    cores = json.loads((out / "gpu_shard_cores.json").read_text())
    split = gpu["shard_threads"]["2"]  # LocalCluster's default: the usable cores split among 2 shards and the worker
    assert cores["shard_threads"]["2"] == len(os.sched_getaffinity(0)) >= split >= 1
    assert {r["system"] for r in cores["rows"]} == set(rows)
    relayed = {r["system"]: r for r in json.loads((out / "gpu_stream_processes.json").read_text())["rows"]}
    assert set(relayed) == {"torch", "torch_cpu_adamw", "shardps_2_procs", "shardps_2_plain_procs"}
    for name in ("shardps_2_procs", "shardps_2_plain_procs"):  # the same exact oracle through the helpers
        assert relayed[name]["stream_processes"] is True, relayed[name]
        assert relayed[name]["final_loss_abs_diff_vs_cpu_adamw"] < 1e-5, relayed[name]
    wire = json.loads((out / "wire.json").read_text())
    assert wire["shardps_gbps"] > 0 and wire["cpu_seconds_per_round"]["shardps"]["client"] > 0
    tests_log = (out / "gpu_tests.log").read_text()
    if session["device"]["device"] == "cpu":  # every GPU test is reported as skipped, none silently absent
        assert "skipped" in tests_log and "passed" not in tests_log and "failed" not in tests_log, tests_log[-2000:]


@pytest.mark.timeout(120)
def test_a_budget_too_small_skips_the_later_steps_and_fails(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SCRIPT), "run", "--out", str(out), "--smoke", "--budget-seconds", "12"],
                          capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:]
    steps = json.loads((out / "session.json").read_text())["steps"]
    assert [s["name"] for s in steps] == STEPS
    skipped = [s for s in steps if s.get("skipped")]
    assert [s["name"] for s in skipped] == STEPS[:-1] and all(s["returncode"] is None for s in skipped)
    # the last step had the budget's rest: a wire run that does not fit in it is killed with every shard it started
    wire = steps[-1]
    assert wire["limit_seconds"] <= 12 and (wire["returncode"] == 0 or wire.get("killed") or wire.get("skipped"))
    assert "skipped: gpu_tests, gpu, gpu_stream_processes, gpu_shard_cores" in proc.stdout
    # SIGKILLed processes take a moment to exit
    wait_until(lambda: not _processes_in_session(wire.get("session")), 10, "a killed step's processes to exit")


def _processes_in_session(sid: int | None) -> list[str]:
    """Command lines of the running processes of session ``sid`` (a step and everything it started)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if sid is not None and int(fields[3]) == sid and fields[0] != "Z":  # session id; zombies are gone
                found.append((stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except (OSError, IndexError, ValueError):
            continue
    return found


def test_bad_arguments_are_refused_before_anything_runs(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "run", "--out", str(tmp_path / "o"), "--wheels",
                           str(tmp_path / "missing")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--wheels" in proc.stderr and "no such folder" in proc.stderr
    (tmp_path / "empty").mkdir()
    proc = subprocess.run([sys.executable, str(SCRIPT), "run", "--out", str(tmp_path / "o"), "--wheels",
                           str(tmp_path / "empty")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no shardps wheel" in proc.stderr, proc.stderr
    assert not (tmp_path / "o").exists()


def test_the_wheels_are_the_projects_requirements_without_torch() -> None:
    """What a GPU host is given: pyproject.toml's runtime requirements (torch left to the host's CUDA build) and the
    test runner, with their version ranges, so that pip upgrades what the host has too old and nothing else."""
    code = ("import sys, json; sys.path.insert(0, 'benchmarks'); import gpu_session; "
            "print(json.dumps(gpu_session.WHEELS))")
    wheels = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                                       cwd=REPO, check=True).stdout)
    names = {w.split(">")[0].split("<")[0].split("=")[0] for w in wheels}
    assert "torch" not in names
    assert {"grpcio", "protobuf", "grpcio-health-checking", "safetensors", "pytest", "pytest-timeout"} <= names
    assert any(w.startswith("protobuf>=") for w in wheels), wheels

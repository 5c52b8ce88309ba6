"""``shardps export`` (and ``shardps checkpoint``): a plain ``state_dict`` from the live shards or their checkpoints, as the workers had it.

The digits job runs as a user runs it (the ``shardps`` CLI, real shard and
worker processes); its report holds the test accuracy of worker 0's final
model. The export of the live shards, in safetensors and in ``.pt``, loads
with ``load_state_dict(strict=True)`` into a fresh model and gives exactly
that accuracy; the export of the shards' checkpoints after SIGTERM holds the
same tensors. Checkpoints at different versions are refused until
``--version`` picks one.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch
from safetensors.torch import load_file

from shardps.apps.digits import load_split, make_model
from shardps.worker.export import from_checkpoints
from tests.support.procs import run_module


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_module("shardps.cli.main", *args, timeout=timeout)


def accuracy(state: dict[str, torch.Tensor]) -> float:
    model = make_model(128, 0)
    model.load_state_dict(state, strict=True)
    _, _, x_test, y_test = load_split(0)
    with torch.no_grad():
        return (model(x_test).argmax(1) == y_test).float().mean().item()


def test_export_from_live_shards_and_checkpoints_gives_the_workers_model(start_cluster, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    cluster = start_cluster(2, min_workers=2, extra_args=("--checkpoint-dir", str(ckpt),
                                                          "--checkpoint-every-rounds", "20"))
    report_path = tmp_path / "report.json"
    proc = cli("train", "digits", "--servers", cluster.servers, "--epochs", "4", "--no-progress",
               "--report", str(report_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["test_accuracy"] > 0.9

    live = {}
    for suffix in ("safetensors", "pt"):
        out = tmp_path / f"model.{suffix}"
        proc = cli("export", "--servers", cluster.servers, "--out", str(out))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"version {report['steps']}" in proc.stdout
        live[suffix] = load_file(out) if suffix == "safetensors" else torch.load(out, weights_only=True)
        assert abs(accuracy(live[suffix]) - report["test_accuracy"]) < 1e-6  # the same images right
    assert all(torch.equal(live["pt"][k], v) for k, v in live["safetensors"].items())
    proc = cli("checkpoint", "--servers", cluster.servers)  # on request: the operator's command
    assert proc.returncode == 0 and proc.stdout.count(f"(dense version {report['steps']}, sparse round 0)") == 2, \
        proc.stdout + proc.stderr

    assert cluster.stop() == [0, 0]  # SIGTERM: a final checkpoint of the last version
    out = tmp_path / "from-checkpoints.safetensors"
    proc = cli("export", "--checkpoint-dir", str(ckpt), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported = load_file(out)
    assert exported.keys() == live["safetensors"].keys()
    assert all(torch.equal(exported[k], v) for k, v in live["safetensors"].items())

    # shards at different versions: refused with the fix, then one version from every shard
    newest = sorted((ckpt / "shard-1").glob("*.json"))[-1]
    newest.unlink()
    proc = cli("export", "--checkpoint-dir", str(ckpt), "--out", str(out))
    assert proc.returncode == 1 and "--version" in proc.stderr and "different" not in proc.stdout
    common = from_checkpoints(ckpt, allow_mixed_versions=True).versions[1]
    proc = cli("export", "--checkpoint-dir", str(ckpt), "--version", str(common), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"version {common}" in proc.stdout and accuracy(load_file(out)) > 0.5


def test_export_refuses_bad_input(tmp_path: Path) -> None:
    proc = cli("export", "--out", str(tmp_path / "m.safetensors"))
    assert proc.returncode == 2 and "--servers" in proc.stderr and "--checkpoint-dir" in proc.stderr
    proc = cli("export", "--checkpoint-dir", str(tmp_path / "none"), "--out", str(tmp_path / "m.pt"))
    assert proc.returncode == 1 and "no intact checkpoint" in proc.stderr
    assert not (tmp_path / "m.pt").exists()

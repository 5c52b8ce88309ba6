"""Checkpoint files (``shardps.common.checkpoint``): names never reused, old names still read, incomplete and
renamed checkpoints refused, ``keep`` counting whole checkpoints, temporary files of a crash removed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from shardps.common import checkpoint
from shardps.common.checkpoint import Name
from shardps.proto import shardps_pb2 as pb


def snapshot(version: int, sparse_round: int, fill: float = 1.0) -> checkpoint.Snapshot:
    tensors = {"param/0": torch.full((5,), fill), "buffers": torch.arange(3, dtype=torch.uint8),
               "state/0/step": torch.tensor(float(version)), "rows/t/ids": torch.arange(4),
               "rows/t/weights": torch.full((4, 2), fill)}
    return checkpoint.Snapshot(
        version=version, job_id="job", fingerprint="fp", initialised_by="w0",
        plan=pb.PlanSpec(num_shards=1).SerializeToString(), spec=b"", static_digest="", hyperparams={0: {"lr": 0.1}},
        tensors=tensors, shard_index=0, num_shards=1, sparse={"round": sparse_round, "tables": {}})


def test_each_write_takes_a_new_name_and_reads_back_bit_for_bit(tmp_path: Path) -> None:
    first = checkpoint.write(tmp_path, snapshot(0, 1), keep=5)
    second = checkpoint.write(tmp_path, snapshot(0, 1, fill=2.0), keep=5)  # the same versions: another name
    assert (first.name, second.name) == ("checkpoint-00000001-v000000000000-r000000000001.json",
                                         "checkpoint-00000002-v000000000000-r000000000001.json")
    found = checkpoint.find(tmp_path, shard_index=0, num_shards=1)
    assert found.path == second and found.snapshot.name == Name(2, 0, 1) and found.snapshot.sparse_round == 1
    for key, value in snapshot(0, 1, fill=2.0).tensors.items():
        got = found.snapshot.tensors[key]
        assert got.dtype == value.dtype and torch.equal(got, value), key
    checkpoint.write(tmp_path, snapshot(1, 1), keep=2)  # the oldest goes
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"{n.stem}{suffix}" for n in (Name(2, 0, 1), Name(3, 1, 1)) for suffix in (".json", ".safetensors"))
    with pytest.raises(FileExistsError):
        checkpoint.start(tmp_path, Name(3, 1, 1), [])


def _old_checkpoint(directory: Path, snap: checkpoint.Snapshot) -> Path:
    """A checkpoint as shardps wrote it before sequence numbers: ``checkpoint-<version>``, no sequence field."""
    data = save(snap.tensors)
    name = Name(-1, snap.version)
    (directory / name.tensors).write_bytes(data)
    manifest = checkpoint.manifest_of(snap, name, len(data), hashlib.sha256(data).hexdigest())
    del manifest["sequence"], manifest["sparse_round"]
    manifest["manifest_sha256"] = checkpoint.manifest_digest(manifest)
    (directory / name.manifest).write_text(json.dumps(manifest, sort_keys=True))
    return directory / name.manifest


def test_old_names_are_restored_and_count_as_older_than_any_sequence_number(tmp_path: Path) -> None:
    old = _old_checkpoint(tmp_path, snapshot(9, 4))
    found = checkpoint.find(tmp_path, shard_index=0, num_shards=1)
    assert found.path == old and found.snapshot.version == 9 and found.snapshot.sparse_round == 4
    new = checkpoint.write(tmp_path, snapshot(3, 0), keep=5)  # after a reset: a lower version, written later
    assert checkpoint.find(tmp_path).path == new
    assert checkpoint.find(tmp_path, at_most=2).snapshot is None  # --restore-version counts dense versions
    checkpoint.write(tmp_path, snapshot(4, 0), keep=2)
    assert not old.exists(), "keep counts the old names too"


def test_an_incomplete_or_renamed_checkpoint_is_damaged_and_the_previous_one_taken(tmp_path: Path) -> None:
    a = checkpoint.write(tmp_path, snapshot(1, 1), keep=5)
    b = checkpoint.write(tmp_path, snapshot(1, 2), keep=5)
    b.unlink()  # a crash between the tensor file and the manifest
    found = checkpoint.find(tmp_path)
    assert found.path == a and found.skipped == [(b.with_suffix(".safetensors"),
                                                  "its manifest is missing: a write that did not finish")]
    b.with_suffix(".safetensors").unlink()
    renamed = tmp_path / Name(7, 1, 1).manifest  # a's manifest under another name (its tensor file stays a's)
    renamed.write_bytes(a.read_bytes())
    found = checkpoint.find(tmp_path)
    assert found.path == a and "sequence number 1" in found.skipped[0][1], found.skipped


def test_temporary_files_of_a_crash_are_removed_and_keep_counts_whole_checkpoints(tmp_path: Path) -> None:
    checkpoint.write(tmp_path, snapshot(1, 1), keep=5)
    orphan = tmp_path / Name(2, 1, 2).tensors  # a tensor file whose manifest never came
    orphan.write_bytes(b"x")
    for name in (".checkpoint-00000003-v000000000001-r000000000003.safetensors.123.partial",
                 "checkpoint-00000003-v000000000001-r000000000003.json.tmp"):
        (tmp_path / name).write_bytes(b"half")
    assert len(checkpoint.remove_temporary(tmp_path)) == 2
    assert checkpoint.next_sequence(tmp_path) == 3  # the orphan's number is never used again
    third = checkpoint.write(tmp_path, snapshot(1, 3), keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([third.name, third.with_suffix(".safetensors").name])

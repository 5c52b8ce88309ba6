"""A shard checkpoint opened for reading one tensor, or a few rows of one, at a time: bounded memory.

``shardps.common.checkpoint.read`` loads a checkpoint's whole tensor file
(to check its SHA-256, then every tensor), so reading a shard that holds
large sparse tables takes twice their size in memory. :func:`find_open`
takes the same checkpoint with the same checks, and keeps memory bounded:

- the manifest is checked as ``read`` checks it (format, its own SHA-256,
  the version of its file name, the shard that wrote it, its tensor file's
  name, the plan's shard count);
- the tensor file is opened once, and its size and SHA-256 computed through
  that descriptor in 1 MiB blocks; every later read goes through the same
  descriptor (``os.pread``), so it reads exactly the bytes checked, even if
  the shard replaces or deletes the checkpoint meanwhile;
- the safetensors header is checked whole (``shardps.common.safetensors_stream.read_header``)
  before any tensor is read; :meth:`OpenCheckpoint.tensor` and
  :meth:`OpenCheckpoint.rows` then read one tensor, or a range of its rows.

Damaged checkpoints are skipped for the next older intact one, and one
written by another shard is refused, exactly as ``shardps.common.checkpoint.find`` does.
"""

from __future__ import annotations

import base64
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shardps.proto import shardps_pb2 as pb
from shardps.common.checkpoint import CheckpointError, DamagedCheckpoint, check_owner, listing, load_manifest
from shardps.common.safetensors_stream import Entry, read_header, read_rows

__all__ = ["OpenCheckpoint", "find_open", "open_checkpoint"]

_BLOCK = 1 << 20


@dataclass
class OpenCheckpoint:
    """One intact checkpoint of a shard, its tensor file open (close it with :meth:`close`).

    Attributes:
        path: the manifest's path; manifest: the manifest (checked).
        version, job_id, fingerprint, shard_index, num_shards: as ``shardps.common.checkpoint.Snapshot``'s.
        plan: ``PlanSpec`` bytes. sparse: the sparse tables' manifest entry (``{"round", "tables"}``).
        entries: the tensor file's tensors by name.
    """

    path: Path
    manifest: dict
    fd: int
    entries: dict[str, Entry]
    data_start: int
    version: int = 0
    job_id: str = ""
    fingerprint: str = ""
    shard_index: int = 0
    num_shards: int = 0
    plan: bytes = b""
    sparse: dict = field(default_factory=dict)

    @property
    def file(self) -> Path:
        """The tensor file's path."""
        return self.path.with_suffix(".safetensors")

    def tensor(self, name: str) -> torch.Tensor | None:
        """Tensor ``name`` read whole (None: the file has no such tensor)."""
        entry = self.entries.get(name)
        return None if entry is None else read_rows(self.fd, entry, self.data_start)

    def rows(self, name: str, start: int, count: int) -> torch.Tensor:
        """Rows ``[start, start + count)`` of tensor ``name`` (shape ``[count, *shape[1:]]``, its dtype).

        Raises:
            KeyError: no such tensor. ValueError: the rows are outside it.
        """
        return read_rows(self.fd, self.entries[name], self.data_start, start, count)

    def close(self) -> None:
        """Close the tensor file (safe to call twice; also when the object is collected)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()


def open_checkpoint(path: Path, shard_index: int | None = None, num_shards: int | None = None) -> OpenCheckpoint:
    """Open the checkpoint whose manifest is ``path``: every byte checked (streamed), the tensor file left open.

    Raises:
        DamagedCheckpoint: the manifest or the tensor file fails a check (the message says which).
        ForeignCheckpoint: intact, but written by another shard (``shardps.common.checkpoint.check_owner``).
    """
    m = load_manifest(path)  # its checksum, and its version, sparse round, sequence and tensor file by name
    check_owner(m, path, shard_index, num_shards)
    fd = -1
    try:
        data_path = path.with_name(m["tensors"]["file"])
        if data_path.name != path.with_suffix(".safetensors").name:
            raise DamagedCheckpoint(f"its manifest names another tensor file, {data_path.name}")
        try:
            fd = os.open(data_path, os.O_RDONLY)
        except OSError as exc:
            raise DamagedCheckpoint(f"its tensor file cannot be read ({exc})") from None
        digest, size = hashlib.sha256(), 0
        while block := os.pread(fd, _BLOCK, size):
            digest.update(block)
            size += len(block)
        if size != m["tensors"]["bytes"] or digest.hexdigest() != m["tensors"]["sha256"]:
            raise DamagedCheckpoint(f"{data_path.name} does not match its manifest's size and SHA-256 "
                                    "(torn or corrupt)")
        plan = base64.b64decode(m["plan"])
        if pb.PlanSpec.FromString(plan).num_shards != m["num_shards"]:
            raise DamagedCheckpoint("its plan's shard count is not the manifest's num_shards")
        _, entries, data_start = read_header(fd, data_path.name)
        return OpenCheckpoint(path=path, manifest=m, fd=fd, entries=entries, data_start=data_start,
                              version=int(m["version"]), job_id=m["job_id"], fingerprint=m["fingerprint"],
                              shard_index=int(m["shard_index"]), num_shards=int(m["num_shards"]), plan=plan,
                              sparse=dict(m.get("sparse") or {}))
    except BaseException as exc:
        if fd >= 0:
            os.close(fd)
        if isinstance(exc, CheckpointError) or not isinstance(exc, Exception):
            raise
        raise DamagedCheckpoint(f"its manifest or tensor file is malformed ({type(exc).__name__}: {exc})") from None


def find_open(directory: Path, *, shard_index: int | None = None, num_shards: int | None = None,
              at_most: int = 0) -> tuple[OpenCheckpoint | None, list[tuple[Path, str]]]:
    """The newest intact checkpoint in ``directory`` (of version <= ``at_most`` when given), opened, and
    ``(path, reason)`` of every damaged one skipped before it, newest first (``common.checkpoint.find``'s choice).

    Raises:
        ForeignCheckpoint: an intact checkpoint (before any intact one of this shard) was written by
            another shard index or for another shard count.
    """
    skipped: list[tuple[Path, str]] = []
    if not directory.is_dir():
        return None, skipped
    for name, manifest, _ in listing(directory):  # newest (highest sequence number) first
        if at_most and name.version > at_most:
            continue
        path = directory / name.manifest
        if not manifest:
            skipped.append((directory / name.tensors, "its manifest is missing: a write that did not finish"))
            continue
        try:
            return open_checkpoint(path, shard_index, num_shards), skipped
        except DamagedCheckpoint as exc:
            skipped.append((path, str(exc)))
    return None, skipped

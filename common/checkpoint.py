"""Shard checkpoints: the partition's parameters, optimizer state, buffers and version, on disk.

One checkpoint is two files in ``<checkpoint-dir>/shard-<index>/``:

- ``checkpoint-<version>.safetensors``: the tensors (``param/<group>``:
  flat fp32 parameters of a param group; ``buffers``: the buffer byte arena;
  ``state/<key index>/<name>``: optimizer state per key), in safetensors
  (data, never pickle: loading a checkpoint runs no code);
- ``checkpoint-<version>.json``: the manifest, written last: version, job id,
  plan and optimizer spec (base64 protobuf), the digest of the parameters
  outside the optimizer, each group's current hyperparameters, and the
  SHA-256 and size of the tensor file.

Writing is atomic: each file is written to a temporary name, fsynced and
renamed, then the directory is fsynced; the manifest's existence marks a
complete checkpoint. The newest ``keep`` are kept. Restoring takes the
newest checkpoint whose manifest parses and whose tensor file has the
recorded size and SHA-256; a torn or corrupt one is skipped with a log line
naming it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

log = logging.getLogger(__name__)

_NAME = re.compile(r"^checkpoint-(\d{12})\.json$")


@dataclass
class Snapshot:
    """A shard's state at one version, detached from the live buffers (taken between rounds).

    Attributes:
        version: rounds applied.
        job_id, fingerprint: the job's identity and plan fingerprint.
        initialised_by: the worker whose parameters started the job (shards compare it at Join).
        plan: ``PlanSpec`` bytes; spec: ``OptimizerSpec`` bytes.
        static_digest: SHA-256 of the parameters outside the optimizer.
        hyperparams: ``{group: {name: value}}`` of the groups this shard steps (lr included).
        tensors: ``param/<g>`` (fp32, 1-D), ``buffers`` (uint8), ``state/<key>/<name>``.
        members: the job's member ids when it was taken (a restored shard waits for them to come back).
    """

    version: int
    job_id: str
    fingerprint: str
    initialised_by: str
    plan: bytes
    spec: bytes
    static_digest: str
    hyperparams: dict[int, dict]
    tensors: dict[str, torch.Tensor]
    members: list[str] = field(default_factory=list)

    def params(self) -> dict[int, torch.Tensor]:
        return {int(k.split("/")[1]): v for k, v in self.tensors.items() if k.startswith("param/")}

    def states(self) -> dict[int, dict[str, torch.Tensor]]:
        out: dict[int, dict[str, torch.Tensor]] = {}
        for k, v in self.tensors.items():
            if k.startswith("state/"):
                _, key, name = k.split("/", 2)
                out.setdefault(int(key), {})[name] = v
        return out


def _fsync_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(directory: Path, snap: Snapshot, keep: int) -> Path:
    """Write ``snap`` atomically into ``directory`` and keep the newest ``keep`` checkpoints.

    Returns:
        The manifest's path.

    Raises:
        OSError: the disk refused (the previous checkpoints are untouched).
    """
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"checkpoint-{snap.version:012d}"
    data = save_tensors({k: v.contiguous() for k, v in snap.tensors.items()})
    _fsync_write(directory / f"{stem}.safetensors", data)
    manifest = {
        "format": 1, "version": snap.version, "job_id": snap.job_id, "fingerprint": snap.fingerprint,
        "initialised_by": snap.initialised_by,
        "plan": base64.b64encode(snap.plan).decode(), "optimizer": base64.b64encode(snap.spec).decode(),
        "static_digest": snap.static_digest, "members": list(snap.members), "hyperparams": {str(g): hp for g, hp in snap.hyperparams.items()},
        "tensors": {"file": f"{stem}.safetensors", "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()},
    }
    path = directory / f"{stem}.json"
    _fsync_write(path, json.dumps(manifest, sort_keys=True).encode())
    _fsync_dir(directory)
    for old in sorted(p for p in directory.iterdir() if _NAME.match(p.name))[:-keep]:
        old.unlink(missing_ok=True)  # the manifest first: a half-deleted checkpoint is never taken as complete
        old.with_suffix(".safetensors").unlink(missing_ok=True)
    return path


def _read(manifest_path: Path) -> Snapshot:
    m = json.loads(manifest_path.read_text())
    data_path = manifest_path.with_name(m["tensors"]["file"])
    data = data_path.read_bytes()
    if len(data) != m["tensors"]["bytes"] or hashlib.sha256(data).hexdigest() != m["tensors"]["sha256"]:
        raise ValueError(f"{data_path.name} does not match its manifest's size and SHA-256 (torn or corrupt)")
    return Snapshot(
        version=int(m["version"]), job_id=m["job_id"], fingerprint=m["fingerprint"],
        initialised_by=m["initialised_by"],
        plan=base64.b64decode(m["plan"]), spec=base64.b64decode(m["optimizer"]), static_digest=m["static_digest"],
        hyperparams={int(g): hp for g, hp in m["hyperparams"].items()}, tensors=load_tensors(data),
        members=[str(w) for w in m.get("members", [])],
    )


def newest(directory: Path, at_most: int = 0) -> Snapshot | None:
    """The newest complete, intact checkpoint in ``directory`` (of version <= ``at_most`` when given), or None.

    Bad ones are logged and skipped.
    """
    if not directory.is_dir():
        return None
    for path in sorted((p for p in directory.iterdir() if _NAME.match(p.name)), reverse=True):
        if at_most and int(_NAME.match(path.name).group(1)) > at_most:
            continue
        try:
            return _read(path)
        except Exception as exc:  # OSError, bad JSON, missing fields, safetensors' own errors: all mean "skip it"
            log.warning("skipping checkpoint %s: %s", path, exc)
    return None

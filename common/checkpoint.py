"""Shard checkpoints: the partition's parameters, optimizer state, buffers and version, on disk.

One checkpoint is two files in ``<checkpoint-dir>/shard-<index>/``:

- ``checkpoint-<version>.safetensors``: the tensors (``param/<group>``:
  flat fp32 parameters of a param group; ``buffers``: the buffer byte arena;
  ``state/<key index>/<name>``: optimizer state per key), in safetensors
  (data, never pickle: loading a checkpoint runs no code);
- ``checkpoint-<version>.json``: the manifest, written last (format
  :data:`FORMAT`): version, job id, plan fingerprint, the index of the shard
  that wrote it and the job's shard count, plan and optimizer spec (base64
  protobuf), the digest of the parameters outside the optimizer, each
  group's current hyperparameters, the SHA-256 and size of the tensor file,
  and ``manifest_sha256``: the SHA-256 of the manifest's own canonical
  content (``json.dumps(sort_keys=True, separators=(",", ":"))``) computed
  with that field empty. Every byte that is loaded is covered by a checksum.

Writing is atomic: each file is written to a temporary name, fsynced and
renamed, then the directory is fsynced; the manifest's existence marks a
complete checkpoint. The newest ``keep`` are kept.

Reading (:func:`find`) goes from the newest checkpoint down and takes the
first intact one. A checkpoint is *damaged* when its manifest is missing,
does not parse, lacks a field, fails its own SHA-256 (edited by hand), names
another version than its file name, or its tensor file does not have the
recorded size and SHA-256 (torn or corrupt); damaged ones are skipped and
reported with the reason (:class:`Found`). Manifests of format 1 (written
before the shard identity and the manifest checksum existed) cannot be
verified and count as damaged too. An intact checkpoint written by another
shard index, or for a job with another shard count, is never skipped
quietly: :class:`ForeignCheckpoint` names what was expected and what was
found (a swapped or copied ``--checkpoint-dir``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from shardps.proto import shardps_pb2 as pb

#: Manifest format written (and the only one read): shard identity and manifest checksum included.
FORMAT = 2

_NAME = re.compile(r"^checkpoint-(\d{12})\.json$")
#: Any file of a checkpoint, complete or not (a tensor file whose manifest never came is one too).
_ANY = re.compile(r"^checkpoint-(\d{12})\.(json|safetensors)$")


class CheckpointError(ValueError):
    """A checkpoint that must not be loaded (the message names the file and the reason)."""


class DamagedCheckpoint(CheckpointError):
    """Torn, corrupt, edited, incomplete or of an older unverifiable format: skipped for an older intact one."""


class ForeignCheckpoint(CheckpointError):
    """Intact, but written by another shard index or for another shard count: refused, never skipped."""


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
        shard_index, num_shards: the shard that wrote it and the job's shard count.
        members: the job's member ids when it was taken (a restored shard waits for them to come back).
        sparse: the sparse tables' round and per-table spec and numbers (their rows are the
            ``rows/<table>/<name>`` tensors; ``server/sparse/tables.py``).
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
    shard_index: int
    num_shards: int
    members: list[str] = field(default_factory=list)
    sparse: dict = field(default_factory=dict)

    def params(self) -> dict[int, torch.Tensor]:
        return {int(k.split("/")[1]): v for k, v in self.tensors.items() if k.startswith("param/")}

    def states(self) -> dict[int, dict[str, torch.Tensor]]:
        out: dict[int, dict[str, torch.Tensor]] = {}
        for k, v in self.tensors.items():
            if k.startswith("state/"):
                _, key, name = k.split("/", 2)
                out.setdefault(int(key), {})[name] = v
        return out


@dataclass
class Found:
    """What :func:`find` saw in a shard's checkpoint directory.

    Attributes:
        snapshot: the newest intact checkpoint (of version <= ``at_most`` when given), or None.
        path: its manifest's path (None with no snapshot).
        skipped: ``(path, reason)`` of every damaged checkpoint looked at before it, newest first.
        present: the names of every checkpoint file in the directory (``checkpoint-*.json``
            and ``checkpoint-*.safetensors``), complete or not.
    """

    snapshot: Snapshot | None = None
    path: Path | None = None
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    present: list[str] = field(default_factory=list)


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


def manifest_digest(manifest: dict) -> str:
    """SHA-256 (hex) of a manifest's canonical JSON with its ``manifest_sha256`` field empty."""
    canonical = json.dumps({**manifest, "manifest_sha256": ""}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


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
        "format": FORMAT, "version": snap.version, "job_id": snap.job_id, "fingerprint": snap.fingerprint,
        "shard_index": snap.shard_index, "num_shards": snap.num_shards, "initialised_by": snap.initialised_by,
        "plan": base64.b64encode(snap.plan).decode(), "optimizer": base64.b64encode(snap.spec).decode(),
        "static_digest": snap.static_digest, "members": list(snap.members), "sparse": snap.sparse,
        "hyperparams": {str(g): hp for g, hp in snap.hyperparams.items()},
        "tensors": {"file": f"{stem}.safetensors", "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()},
    }
    manifest["manifest_sha256"] = manifest_digest(manifest)
    path = directory / f"{stem}.json"
    _fsync_write(path, json.dumps(manifest, sort_keys=True).encode())
    _fsync_dir(directory)
    for old in sorted(p for p in directory.iterdir() if _NAME.match(p.name))[:-keep]:
        old.unlink(missing_ok=True)  # the manifest first: a half-deleted checkpoint is never taken as complete
        old.with_suffix(".safetensors").unlink(missing_ok=True)
    return path


def _manifest(path: Path) -> dict:
    """The manifest at ``path``, checked against its own SHA-256 and file name.

    Raises:
        DamagedCheckpoint: unreadable, not JSON, of another format, edited, or naming another version.
    """
    try:
        m = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise DamagedCheckpoint(f"its manifest cannot be read as JSON ({exc})") from None
    if not isinstance(m, dict):
        raise DamagedCheckpoint("its manifest is not a JSON object")
    if m.get("format") != FORMAT or "manifest_sha256" not in m:
        raise DamagedCheckpoint(
            f"its manifest is of format {m.get('format')!r}, not {FORMAT}: written by an older shardps, without "
            "the shard's identity and the manifest's checksum, so it cannot be verified (restore it with the "
            "shardps that wrote it, or start over)")
    if m["manifest_sha256"] != manifest_digest(m):
        raise DamagedCheckpoint("its manifest does not match its own SHA-256 (manifest_sha256): it was edited "
                                "or corrupted after it was written")
    name_version = int(_NAME.match(path.name).group(1)) if _NAME.match(path.name) else None
    if m.get("version") != name_version:
        raise DamagedCheckpoint(f"its manifest holds version {m.get('version')!r}, its file name {name_version}")
    return m


def check_owner(m: dict, path: Path, shard_index: int | None, num_shards: int | None) -> None:
    """Refuse a manifest ``m`` (at ``path``) written by another shard than ``shard_index`` of ``num_shards``.

    None: not checked.

    Raises:
        ForeignCheckpoint: the message names the expected and the found shard index / shard count.
    """
    found_index, found_shards = m["shard_index"], m["num_shards"]
    problems = []
    if shard_index is not None and found_index != shard_index:
        problems.append(f"expected shard index {shard_index}, found {found_index}")
    if num_shards is not None and found_shards != num_shards:
        problems.append(f"expected {num_shards} shards, found {found_shards}: the checkpoint is of a job with "
                        f"{found_shards} shards, not {num_shards}")
    if problems:
        raise ForeignCheckpoint(
            f"{path} was written by shard {found_index} of {found_shards} (job {m['job_id']}, plan "
            f"{m['fingerprint']}), not by shard {shard_index if shard_index is not None else found_index} of "
            f"{num_shards if num_shards is not None else found_shards}: {'; '.join(problems)}. It is not loaded: "
            f"{path.parent} must hold only what that shard wrote (was a shard-<index> directory copied, renamed "
            "or swapped?)")


def read(path: Path, shard_index: int | None = None, num_shards: int | None = None) -> Snapshot:
    """The checkpoint whose manifest is ``path``, every byte checked, written by ``shard_index`` of ``num_shards``.

    Raises:
        DamagedCheckpoint: the manifest or the tensor file fails its checks (the message says which).
        ForeignCheckpoint: intact, but another shard's (see :func:`check_owner`).
    """
    m = _manifest(path)
    try:
        check_owner(m, path, shard_index, num_shards)
        data_path = path.with_name(m["tensors"]["file"])
        if data_path.name != path.with_suffix(".safetensors").name:
            raise DamagedCheckpoint(f"its manifest names another tensor file, {data_path.name}")
        try:
            data = data_path.read_bytes()
        except OSError as exc:
            raise DamagedCheckpoint(f"its tensor file cannot be read ({exc})") from None
        if len(data) != m["tensors"]["bytes"] or hashlib.sha256(data).hexdigest() != m["tensors"]["sha256"]:
            raise DamagedCheckpoint(f"{data_path.name} does not match its manifest's size and SHA-256 "
                                    "(torn or corrupt)")
        plan = base64.b64decode(m["plan"])
        if pb.PlanSpec.FromString(plan).num_shards != m["num_shards"]:
            raise DamagedCheckpoint("its plan's shard count is not the manifest's num_shards")
        return Snapshot(
            version=int(m["version"]), job_id=m["job_id"], fingerprint=m["fingerprint"],
            initialised_by=m["initialised_by"], plan=plan, spec=base64.b64decode(m["optimizer"]),
            static_digest=m["static_digest"], hyperparams={int(g): hp for g, hp in m["hyperparams"].items()},
            tensors=load_tensors(data), shard_index=int(m["shard_index"]), num_shards=int(m["num_shards"]),
            members=[str(w) for w in m.get("members", [])], sparse=dict(m.get("sparse", {})),
        )
    except CheckpointError:
        raise
    except Exception as exc:  # a missing field, bad base64/protobuf, safetensors' own errors: all damage
        raise DamagedCheckpoint(f"its manifest or tensor file is malformed ({type(exc).__name__}: {exc})") from None


def find(directory: Path, *, shard_index: int | None = None, num_shards: int | None = None,
         at_most: int = 0) -> Found:
    """The newest intact checkpoint in ``directory`` (of version <= ``at_most`` when given) and what was skipped.

    Checkpoints newer than ``at_most`` are not looked at. A tensor file without its
    manifest (a write that did not finish) counts as a damaged checkpoint.

    Raises:
        ForeignCheckpoint: an intact checkpoint (before any intact one of this shard) was
            written by another shard index or for another shard count.
    """
    found = Found()
    if not directory.is_dir():
        return found
    names = sorted(p.name for p in directory.iterdir() if _ANY.match(p.name))
    found.present = names
    versions = sorted({int(_ANY.match(n).group(1)) for n in names}, reverse=True)
    for version in versions:
        if at_most and version > at_most:
            continue
        path = directory / f"checkpoint-{version:012d}.json"
        if path.name not in names:
            found.skipped.append((path.with_suffix(".safetensors"),
                                  "its manifest is missing: a write that did not finish"))
            continue
        try:
            found.snapshot, found.path = read(path, shard_index, num_shards), path
            return found
        except DamagedCheckpoint as exc:
            found.skipped.append((path, str(exc)))
    return found


def set_aside(directory: Path, paths: list[Path]) -> Path:
    """Move damaged checkpoints (manifest and tensor file of each ``paths`` entry) to ``directory/damaged``.

    They stay for inspection, out of the way of new checkpoints (``keep`` counts only
    ``directory``'s own). Returns the folder they went to.

    Raises:
        OSError: a file could not be moved.
    """
    aside = directory / "damaged"
    aside.mkdir(exist_ok=True)
    for path in paths:
        for f in (path.with_suffix(".json"), path.with_suffix(".safetensors")):
            if f.exists():
                target, n = aside / f.name, 1
                while target.exists():
                    target, n = aside / f"{f.name}.{n}", n + 1
                os.replace(f, target)
    _fsync_dir(directory)
    return aside

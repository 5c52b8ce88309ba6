"""Shard checkpoints: the partition's parameters, optimizer state, buffers, sparse tables and version, on disk.

One checkpoint is two files in ``<checkpoint-dir>/shard-<index>/`` named by a stem no other checkpoint of
the directory ever had (:class:`Name`), ``checkpoint-<sequence>-v<version>-r<sparse round>``: the sequence
number (eight digits or more) is one above every one in the directory and its ``damaged/``, the dense
version and the sparse round (rounds applied) have twelve digits. The newest checkpoint is the one of the
highest sequence number, the last written (also after a ``shardps reset`` or ``--restore-version``).

- ``<stem>.safetensors``: the tensors (``param/<group>``: flat fp32 parameters of a param group;
  ``buffers``: the buffer byte arena; ``state/<key index>/<name>``: optimizer state per key;
  ``rows/<table>/<name>``: sparse rows in id order, ``shardps.server.sparse.table``), in safetensors
  (data, never pickle: loading a checkpoint runs no code);
- ``<stem>.json``: the manifest, written last (format :data:`FORMAT`): version, sparse round, sequence
  number, job id, plan fingerprint, the index of the shard that wrote it and the job's shard count, plan
  and optimizer spec (base64 protobuf), the digest of the parameters outside the optimizer, each group's
  hyperparameters, the sparse tables' numbers, the name, SHA-256 and size of its tensor file, and
  ``manifest_sha256``: the SHA-256 of the manifest's own canonical content (``json.dumps(sort_keys=True,
  separators=(",", ":"))``) computed with that field empty. Every byte that is loaded is checksummed.

Writing (:func:`start`, :func:`finish`) streams the tensor file, header first, then each tensor's bytes in
the pieces the caller hands over, into a hidden temporary file (``.<stem>.safetensors.<pid>.partial``,
``shardps.common.safetensors_stream.StreamWriter``), hashes it by reading it back, fsyncs and renames it;
then the manifest goes to ``<stem>.json.tmp``, is fsynced and renamed, and the directory fsynced. A name
that exists is never written again, so a crash leaves every earlier checkpoint as it was, and at worst a
temporary file (removed at the next start, :func:`remove_temporary`) or a tensor file without its manifest
(incomplete: skipped and set aside). The newest ``keep`` whole checkpoints are kept (:func:`prune`).

Reading (:func:`find`) goes from the newest checkpoint down and takes the first intact one. A checkpoint
is *damaged* when its manifest is missing, does not parse, lacks a field, fails its own SHA-256 (edited by
hand), names another version, sparse round, sequence number or tensor file than its file name, or its
tensor file does not have the recorded size and SHA-256 (torn or corrupt); damaged ones are skipped and
reported with the reason (:class:`Found`). Manifests of format 1 (before the shard identity and the
manifest checksum) cannot be verified and count as damaged. Checkpoints named ``checkpoint-<version>``
(written before sequence numbers) are still read, as older than any other. An intact checkpoint of
another shard index or shard count is never skipped quietly: :class:`ForeignCheckpoint` names what was
expected and found (a swapped or copied ``--checkpoint-dir``).
"""

from __future__ import annotations

import base64
import errno
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shardps.proto import shardps_pb2 as pb
from shardps.common.safetensors_stream import DTYPES, StreamWriter, read_header, read_rows

#: Manifest format written (and the only one read): shard identity and manifest checksum included.
FORMAT = 2

_NEW = re.compile(r"^checkpoint-(\d{8,})-v(\d{12})-r(\d{12})\.(json|safetensors)$")
_OLD = re.compile(r"^checkpoint-(\d{12})\.(json|safetensors)$")
#: Temporary files of writes that did not finish: a tensor file being streamed, a manifest being written.
_TEMPORARY = re.compile(r"^(\.checkpoint-.*\.partial|checkpoint-.*\.tmp)$")


class CheckpointError(ValueError):
    """A checkpoint that must not be loaded (the message names the file and the reason)."""


class DamagedCheckpoint(CheckpointError):
    """Torn, corrupt, edited, incomplete or of an older unverifiable format: skipped for an older intact one."""


class ForeignCheckpoint(CheckpointError):
    """Intact, but written by another shard index or for another shard count: refused, never skipped."""


@dataclass(frozen=True)
class Name:
    """The name of one checkpoint (its files are ``<stem>.json`` and ``<stem>.safetensors``).

    Attributes:
        sequence: its place in the directory's order of writing (-1: a ``checkpoint-<version>`` name written
            before sequence numbers, older than any other).
        version: dense rounds applied. sparse_round: sparse rounds applied (None in an old name).
    """

    sequence: int
    version: int
    sparse_round: int | None = None

    @property
    def stem(self) -> str:
        if self.sequence < 0:
            return f"checkpoint-{self.version:012d}"
        return f"checkpoint-{self.sequence:08d}-v{self.version:012d}-r{self.sparse_round or 0:012d}"

    @property
    def manifest(self) -> str:  # the manifest's file name
        return f"{self.stem}.json"

    @property
    def tensors(self) -> str:  # the tensor file's name
        return f"{self.stem}.safetensors"

    def order(self) -> tuple[int, int]:  # sort key: the higher, the newer
        return self.sequence, self.version

    @staticmethod
    def parse(filename: str) -> "Name | None":
        """The name of the checkpoint ``filename`` (a manifest or tensor file) belongs to; None: not a checkpoint's."""
        if m := _NEW.match(filename):
            return Name(int(m.group(1)), int(m.group(2)), int(m.group(3)))
        if m := _OLD.match(filename):
            return Name(-1, int(m.group(1)))
        return None


@dataclass
class Snapshot:
    """A shard's state at one version: its numbers, and (read from a checkpoint) its tensors.

    Attributes:
        version: rounds applied.
        job_id, fingerprint: the job's identity and plan fingerprint.
        initialised_by: the worker whose parameters started the job (shards compare it at Join).
        plan: ``PlanSpec`` bytes; spec: ``OptimizerSpec`` bytes.
        static_digest: SHA-256 of the parameters outside the optimizer.
        hyperparams: ``{group: {name: value}}`` of the groups this shard steps (lr included).
        tensors: ``param/<g>`` (fp32, 1-D), ``buffers`` (uint8), ``state/<key>/<name>``, ``rows/<table>/<name>``
            (empty while a checkpoint is written: its tensors are streamed, :func:`start`).
        shard_index, num_shards: the shard that wrote it and the job's shard count.
        members: the job's member ids when it was taken (a restored shard waits for them to come back).
        sparse: the sparse tables' round and per-table spec and numbers (their rows are the
            ``rows/<table>/<name>`` tensors; ``server/sparse/tables.py``).
        name: the checkpoint it was read from (None: not read from one).
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
    name: Name | None = None

    @property
    def sparse_round(self) -> int:
        """Sparse rounds applied."""
        return int(self.sparse.get("round", 0))

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
    os.replace(tmp, path)  # (a new name: nothing of another checkpoint is replaced)


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


def listing(directory: Path) -> list[tuple[Name, bool, bool]]:
    """Every checkpoint in ``directory``, newest first: ``(name, its manifest is there, its tensor file is there)``.

    Files of other names (temporary files, ``damaged/``) are not listed.
    """
    if not directory.is_dir():
        return []
    found: dict[Name, list[bool]] = {}
    for p in directory.iterdir():
        name = Name.parse(p.name)
        if name is not None:
            found.setdefault(name, [False, False])[0 if p.name.endswith(".json") else 1] = True
    return [(n, *found[n]) for n in sorted(found, key=Name.order, reverse=True)]


def next_sequence(directory: Path) -> int:
    """One above the highest sequence number of ``directory``'s checkpoints and of those in its ``damaged/``."""
    highest = 0
    for folder in (directory, directory / "damaged"):
        if folder.is_dir():
            for p in folder.iterdir():
                name = Name.parse(p.name)
                highest = max(highest, name.sequence if name is not None else 0)
    return highest + 1


def remove_temporary(directory: Path) -> list[str]:
    """Remove the temporary files of writes that never finished (a crash); returns their names.

    Call it only while nothing writes into ``directory`` (the shard's start). Raises OSError.
    """
    if not directory.is_dir():
        return []
    gone = sorted(p.name for p in directory.iterdir() if _TEMPORARY.match(p.name) and not p.is_dir())
    for name in gone:
        (directory / name).unlink(missing_ok=True)
    return gone


def start(directory: Path, name: Name, layout: list[tuple[str, str, tuple[int, ...]]]) -> StreamWriter:
    """Begin checkpoint ``name``'s tensor file: a :class:`StreamWriter` of ``layout`` (``(tensor name, dtype name,
    shape)``, ``shardps.common.safetensors_stream.layout``) into a temporary file of ``directory``, its header
    written. Hand it each tensor's bytes (``writer.write(name, tensor or bytes)``), then call :func:`finish`
    (or ``writer.abort()``).

    Raises:
        FileExistsError: a checkpoint of that name exists (names are never reused).
        ValueError: a malformed layout. OSError: the disk lacks the room for the file, or refused.
    """
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / name.manifest).exists() or (directory / name.tensors).exists():
        raise FileExistsError(f"{directory / name.stem}.* exists: a checkpoint's name is never written again")
    try:
        return StreamWriter(directory / name.tensors, layout)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        raise OSError(errno.ENOSPC, f"checkpoint {name.tensors} does not fit: {exc.strerror}") from None


def manifest_of(snap: Snapshot, name: Name, size: int, sha256: str) -> dict:
    """The manifest of checkpoint ``name`` holding ``snap`` (its numbers), its tensor file of ``size`` bytes."""
    manifest = {
        "format": FORMAT, "version": snap.version, "sparse_round": snap.sparse_round, "sequence": name.sequence,
        "job_id": snap.job_id, "fingerprint": snap.fingerprint,
        "shard_index": snap.shard_index, "num_shards": snap.num_shards, "initialised_by": snap.initialised_by,
        "plan": base64.b64encode(snap.plan).decode(), "optimizer": base64.b64encode(snap.spec).decode(),
        "static_digest": snap.static_digest, "members": list(snap.members), "sparse": snap.sparse,
        "hyperparams": {str(g): hp for g, hp in snap.hyperparams.items()},
        "tensors": {"file": name.tensors, "bytes": size, "sha256": sha256},
    }
    manifest["manifest_sha256"] = manifest_digest(manifest)
    return manifest


def finish(directory: Path, writer: StreamWriter, name: Name, snap: Snapshot, keep: int) -> Path:
    """Complete checkpoint ``name`` begun by :func:`start`: hash the tensor file (read back in 256 KiB pieces),
    fsync and rename it, write the manifest (``snap``'s numbers, ``tensors`` ignored) the same way, fsync the
    directory, then keep the newest ``keep`` whole checkpoints (:func:`prune`).

    Returns:
        The manifest's path.

    Raises:
        ValueError: a tensor lacks bytes (the temporary file is removed).
        OSError: the disk refused (the temporary file is removed; older checkpoints are untouched).
    """
    try:
        with open(writer.tmp, "rb") as f:
            sha256 = hashlib.file_digest(f, "sha256").hexdigest()
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    path = directory / name.manifest
    _fsync_write(path, json.dumps(manifest_of(snap, name, writer.size, sha256), sort_keys=True).encode())
    _fsync_dir(directory)
    prune(directory, keep)
    return path


def prune(directory: Path, keep: int) -> list[Name]:
    """Delete every checkpoint older than the newest ``keep`` whole ones (manifest first, then tensor file, so
    a half-deleted one is never taken as whole), incomplete ones among them; returns those deleted."""
    whole, gone = 0, []
    for name, manifest, tensors in listing(directory):
        if whole >= keep:
            (directory / name.manifest).unlink(missing_ok=True)
            (directory / name.tensors).unlink(missing_ok=True)
            gone.append(name)
        elif manifest and tensors:
            whole += 1
    return gone


def write(directory: Path, snap: Snapshot, keep: int) -> Path:
    """Write ``snap`` (its tensors in memory) as the next checkpoint of ``directory``, keep the newest ``keep``.

    A shard streams its checkpoints instead (:func:`start`, :func:`finish`); this is the same on a snapshot
    held whole. Returns the manifest's path.

    Raises:
        ValueError: a tensor of a dtype safetensors files here do not take. OSError: the disk refused.
    """
    name = Name(next_sequence(directory), snap.version, snap.sparse_round)
    tensors = {k: v.detach().cpu().contiguous() for k, v in snap.tensors.items()}
    layout = [(k, DTYPES.get(v.dtype, str(v.dtype)), tuple(v.shape)) for k, v in tensors.items()]
    writer = start(directory, name, layout)
    try:
        for k, v in tensors.items():
            writer.write(k, v)
    except BaseException:
        writer.abort()
        raise
    return finish(directory, writer, name, snap, keep)


def load_manifest(path: Path) -> dict:
    """The manifest at ``path``, checked against its own SHA-256 and its file name (version, sparse round,
    sequence number, tensor file).

    Raises:
        DamagedCheckpoint: unreadable, not JSON, of another format, edited, or not matching its file name.
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
    name = Name.parse(path.name)
    if name is None or not path.name.endswith(".json"):
        raise DamagedCheckpoint(f"{path.name} is not the name of a checkpoint's manifest")
    if m.get("version") != name.version:
        raise DamagedCheckpoint(f"its manifest holds version {m.get('version')!r}, its file name {name.version}")
    if name.sequence >= 0 and (m.get("sequence"), m.get("sparse_round")) != (name.sequence, name.sparse_round):
        raise DamagedCheckpoint(f"its manifest holds sequence number {m.get('sequence')!r} and sparse round "
                                f"{m.get('sparse_round')!r}, its file name {name.sequence} and {name.sparse_round}")
    tensors = m.get("tensors")
    if not isinstance(tensors, dict) or tensors.get("file") != name.tensors:
        raise DamagedCheckpoint(f"its manifest names another tensor file, "
                                f"{tensors.get('file') if isinstance(tensors, dict) else tensors!r}")
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


def _tensors(data_path: Path, size: int, sha256: str) -> dict[str, torch.Tensor]:
    """Every tensor of the file at ``data_path``, once its size and SHA-256 are checked, read through the one
    descriptor that was checked (memory: the tensors, plus 256 KiB).

    Raises:
        DamagedCheckpoint: unreadable, another size or SHA-256, a malformed header.
    """
    try:
        fd = os.open(data_path, os.O_RDONLY)
    except OSError as exc:
        raise DamagedCheckpoint(f"its tensor file cannot be read ({exc})") from None
    try:
        with open(fd, "rb", closefd=False) as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        if os.fstat(fd).st_size != size or digest != sha256:
            raise DamagedCheckpoint(f"{data_path.name} does not match its manifest's size and SHA-256 "
                                    "(torn or corrupt)")
        _, entries, data_start = read_header(fd, data_path.name)
        return {k: read_rows(fd, e, data_start) for k, e in entries.items()}
    finally:
        os.close(fd)


def read(path: Path, shard_index: int | None = None, num_shards: int | None = None) -> Snapshot:
    """The checkpoint whose manifest is ``path``, every byte checked, written by ``shard_index`` of ``num_shards``.

    Memory: the checkpoint's tensors once (the file is hashed and read a piece at a time).

    Raises:
        DamagedCheckpoint: the manifest or the tensor file fails its checks (the message says which).
        ForeignCheckpoint: intact, but another shard's (see :func:`check_owner`).
    """
    m = load_manifest(path)
    try:
        check_owner(m, path, shard_index, num_shards)
        tensors = _tensors(path.with_name(m["tensors"]["file"]), m["tensors"]["bytes"], m["tensors"]["sha256"])
        plan = base64.b64decode(m["plan"])
        if pb.PlanSpec.FromString(plan).num_shards != m["num_shards"]:
            raise DamagedCheckpoint("its plan's shard count is not the manifest's num_shards")
        return Snapshot(
            version=int(m["version"]), job_id=m["job_id"], fingerprint=m["fingerprint"],
            initialised_by=m["initialised_by"], plan=plan, spec=base64.b64decode(m["optimizer"]),
            static_digest=m["static_digest"], hyperparams={int(g): hp for g, hp in m["hyperparams"].items()},
            tensors=tensors, shard_index=int(m["shard_index"]), num_shards=int(m["num_shards"]),
            members=[str(w) for w in m.get("members", [])], sparse=dict(m.get("sparse", {})),
            name=Name.parse(path.name),
        )
    except CheckpointError:
        raise
    except Exception as exc:  # a missing field, bad base64/protobuf, a malformed header: all damage
        raise DamagedCheckpoint(f"its manifest or tensor file is malformed ({type(exc).__name__}: {exc})") from None


def find(directory: Path, *, shard_index: int | None = None, num_shards: int | None = None,
         at_most: int = 0) -> Found:
    """The newest intact checkpoint in ``directory`` (of version <= ``at_most`` when given) and what was skipped.

    Newest: the highest sequence number (:class:`Name`). Checkpoints of a version above ``at_most`` are not
    looked at. A tensor file without its manifest (a write that did not finish) counts as a damaged checkpoint.

    Raises:
        ForeignCheckpoint: an intact checkpoint (before any intact one of this shard) was
            written by another shard index or for another shard count.
    """
    found = Found()
    entries = listing(directory)
    found.present = sorted(f for name, manifest, tensors in entries
                           for f, there in ((name.manifest, manifest), (name.tensors, tensors)) if there)
    for name, manifest, _ in entries:
        if at_most and name.version > at_most:
            continue
        path = directory / name.manifest
        if not manifest:
            found.skipped.append((directory / name.tensors, "its manifest is missing: a write that did not finish"))
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
    ``directory``'s own; their sequence numbers are never used again). Returns the folder they went to.

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

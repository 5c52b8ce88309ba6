"""Export: an ordinary PyTorch ``state_dict`` and every sparse table, from the live shards or their checkpoints.

Each shard holds a partition of the parameters (fp32 master copies) and of
the buffers in the plan; exporting reads every partition at one version per
shard and puts the tensors back together under their original names and
shapes, ready for ``model.load_state_dict(strict=True)`` (parameters the
optimizer did not own never reach the shards: pass ``model=`` to take them
from a local model, else ``strict=True`` names them as missing).

Sparse tables (``shardps.worker.table_file``): an :class:`Export` also holds
a :class:`~shardps.worker.table_sources.TableSource` that reads each table's
rows a page at a time when :meth:`Export.save` writes them (a bounded table
``T`` as ``T.weight`` ``[num_embeddings, dim]``, a hashed one as ``T.ids``
and ``T.rows``), so a table larger than memory exports in bounded memory. The
live shards' clients or the checkpoints' files stay open until
:meth:`Export.close` (an ``Export`` is a context manager).
:func:`~shardps.worker.table_file.read_export` reads the file back.

Versions: in sync training every shard applies the same rounds, so an
export is consistent when every shard is at the same version. A live
export waits (up to ``wait_seconds``) for the shards to agree, and refuses
when they do not (a round was in flight throughout, or a shard restored an
older checkpoint, see ``shardps.worker.session.recovery``), naming each shard's
version, unless ``allow_mixed_versions``; the tables' rows must all come from
one sparse round per shard, and no dense round may be applied before the
file is complete (export between steps). From checkpoints, the newest
intact checkpoint of each shard is taken, or the one of ``version``.

Mix-ups are refused, never exported: each shard's checkpoint must have been
written by that shard (the index and shard count its manifest records, see
``shardps.common.checkpoint``) of one job and plan; with ``num_shards`` the
plan must have that many shards; with ``model`` (a module or a
``state_dict``) every parameter and buffer of the plan must be in the model
with the same shape (:func:`check_plan` names the first that is not, with
the shape and element count expected and found). The model's entries that
are not in the plan (parameters outside the optimizer) are taken from it.

Never pickle: checkpoints are read with safetensors' format, and the output is
written as safetensors (``.safetensors``) or ``torch.save`` of plain
tensors (``.pt``, loadable with ``torch.load(weights_only=True)``; no tables).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from shardps.proto import shardps_pb2 as pb
from shardps.common.addresses import parse_servers
from shardps.common.checkpoint_stream import find_open
from shardps.common.codec import TORCH_DTYPES
from shardps.common.plan import PartitionPlan
from shardps.common.rows import TableSpec
from shardps.common.security import ChannelSecurity
from shardps.common.transport import DEFAULT_MAX_MESSAGE_BYTES
from shardps.worker.embedding.modules import ShardedTable
from shardps.worker.pipeline.streams import ParameterSink
from shardps.worker.session.client import ShardClient
from shardps.worker.table_file import Progress, write_export
from shardps.worker.table_sources import CheckpointTables, LiveTables, Page, TableSource, listed_tables


@dataclass
class Export:
    """An assembled model state and the job's sparse tables (read when saved).

    Attributes:
        state_dict: ``{name: tensor}``: parameters in fp32 with their shapes,
            buffers in their own dtype (and, with ``model=``, the model's other entries).
        versions: the version each shard's partition is at, in shard order.
        job_id: the job's id.
        source: where the tables' rows are read from (None: no tables).
    """

    state_dict: dict[str, torch.Tensor]
    versions: list[int]
    job_id: str
    source: TableSource | None = None

    @property
    def tables(self) -> dict[str, TableSpec]:
        """``{name: TableSpec}`` of every exported table (empty without tables)."""
        return dict(self.source.specs) if self.source is not None else {}

    @property
    def sparse_rounds(self) -> list[int]:
        """Each shard's sparse round (rounds of table updates applied) the tables are at; empty without tables."""
        return list(self.source.rounds) if self.source is not None and self.source.specs else []

    def table_rows(self, name: str | None = None) -> int:
        """Trained rows of table ``name`` on all shards (None: of every table). Raises KeyError: no such table."""
        if name is None:
            return sum(self.source.rows(n) for n in self.tables)
        if name not in self.tables:
            raise KeyError(f"no table {name!r} in this export (tables: {sorted(self.tables)})")
        return self.source.rows(name)

    def table_pages(self, name: str) -> Iterator[Page]:
        """Table ``name``'s trained rows from every shard, ascending ids, a page at a time (read now, not kept).

        Yields:
            ``(ids int64 [k], rows float32 [k, dim])``; at most a few pages of the message limit (live) or
            4 MiB (checkpoints) each.

        Raises:
            KeyError: no such table. TableError: a page is malformed or the rows changed (live).
        """
        if name not in self.tables:
            raise KeyError(f"no table {name!r} in this export (tables: {sorted(self.tables)})")
        return self.source.pages(name)

    def save(self, path: str | Path, progress: Progress | None = None) -> Path:
        """Write the state and every table to ``path``: safetensors for ``*.safetensors`` (streamed, bounded
        memory), else ``torch.save`` of the plain ``state_dict`` (``*.pt``: refused with tables).

        The job id, versions and the tables' specs go into the safetensors metadata
        (``shardps.worker.table_file``); ``progress(table, rows written, rows)`` is called as tables are written.

        Raises:
            ValueError: tables with a ``.pt`` path, or a table whose key is a dense key too (both named).
            TableError: a table's rows are malformed, or the live shards trained during the export.
            OSError: not enough free space, or the disk refused (nothing is left at ``path``).
        """
        metadata = {"job_id": self.job_id, "versions": ",".join(map(str, self.versions))}
        return write_export(path, self.state_dict, metadata, self.source, progress)

    def close(self) -> None:
        """Release what the tables are read from (the shards' channels, the checkpoints' files)."""
        if self.source is not None:
            self.source.close()

    def __enter__(self) -> "Export":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _empty(plan: PartitionPlan) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    params = {k.key: torch.zeros(k.shape, dtype=torch.float32) for k in plan.keys}
    buffers = {b.key: torch.zeros(b.shape, dtype=TORCH_DTYPES[b.dtype]) for b in plan.buffers}
    return params, buffers


Model = torch.nn.Module | Mapping[str, torch.Tensor]


def _dense_state(module: torch.nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """``module.state_dict()`` without its sharded tables (whose rows are exported as tables, not read here)."""
    if isinstance(module, ShardedTable):
        return {}
    if not any(isinstance(m, ShardedTable) for m in module.modules()):
        return module.state_dict(prefix=prefix)
    state = {prefix + n: p.detach() for n, p in module.named_parameters(recurse=False)}
    state.update({prefix + n: b.detach() for n, b in module.named_buffers(recurse=False)})
    for name, child in module.named_children():
        state.update(_dense_state(child, f"{prefix}{name}."))
    return state


def _model_state(model: Model | None) -> Mapping[str, torch.Tensor] | None:
    return _dense_state(model) if isinstance(model, torch.nn.Module) else model


def model_tables(model: Model | None) -> list[str] | None:
    """The names of the sharded tables of ``model`` (a module: its ``ShardedEmbedding``/``ShardedEmbeddingBag``
    modules, named by ``name=`` or their path); None for a ``state_dict`` or no model (nothing to tell)."""
    if not isinstance(model, torch.nn.Module):
        return None
    return [m.name or path for path, m in model.named_modules() if isinstance(m, ShardedTable)]


def check_plan(plan: PartitionPlan, *, model: Model | None = None, num_shards: int | None = None,
               source: str = "the job") -> None:
    """Refuse to export ``plan`` for another model or shard count.

    Args:
        plan: the job's partition plan (from a checkpoint or a live shard).
        model: the model the export is for (a module, or its ``state_dict``); None: not checked.
        num_shards: the shard count expected; None: not checked.
        source: what the plan came from, for the message.

    Raises:
        RuntimeError: another shard count, or the first parameter (then buffer), in plan
            order, that the model lacks or holds with another shape; the message names it
            with the shape and element count expected (the model's) and found (the plan's).
    """
    if num_shards is not None and plan.num_shards != num_shards:
        raise RuntimeError(f"{source} has {plan.num_shards} shards, not {num_shards}: expected {num_shards} "
                           f"shards, found {plan.num_shards}")
    state = _model_state(model)
    if state is None:
        return
    for kind, entries in (("parameter", plan.keys), ("buffer", plan.buffers)):
        for entry in entries:
            value = state.get(entry.key)
            found = f"found shape {entry.shape} (numel {entry.numel}) in the plan of {source}"
            if value is None:
                raise RuntimeError(f"the plan of {source} does not match the model: {kind} {entry.key!r} is not "
                                   f"in the model; {found}")
            if tuple(value.shape) != entry.shape:
                raise RuntimeError(f"the plan of {source} does not match the model: {kind} {entry.key!r}: expected "
                                   f"shape {tuple(value.shape)} (numel {value.numel()}) from the model, {found}")


def finish_state(params: dict, buffers: dict, model: Model | None) -> dict[str, torch.Tensor]:
    """The exported ``state_dict``: ``params`` and ``buffers``, then the model's entries the shards do not hold."""
    state = {**params, **buffers}
    for name, value in (_model_state(model) or {}).items():
        state.setdefault(name, value.detach().clone())
    return state


def from_servers(servers: list[str] | str, *, model: Model | None = None, tables: Sequence[str] | None = None,
                 wait_seconds: float = 30.0, allow_mixed_versions: bool = False, rpc_timeout: float = 60.0,
                 connect_timeout: float = 10.0, security: ChannelSecurity | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Export:
    """Read every live shard's partition (no membership needed) and assemble the model state; the tables are
    read when the result is saved (close it, or use it as a context manager, when done).

    Args:
        servers: shard addresses in shard order (a list or ``"host:port,..."``).
        model: the model exported for (a module or its ``state_dict``): the plan must match it
            (:func:`check_plan`), and it fills in entries the shards do not hold (parameters outside the optimizer).
        tables: the names of the tables to export. None: the tables the shards list, else those of ``model``
            (a module: :func:`model_tables`), else none (the shards' protocol does not list its tables yet).
        wait_seconds: how long to wait for the shards to agree on a version.
        allow_mixed_versions: return shards at different versions (and sparse rounds) instead of refusing.
        rpc_timeout, connect_timeout: seconds per call, and to wait for each shard to answer.
        security: TLS / mutual TLS / bearer token of the channels (default: plaintext, no token).
        max_message_bytes: the gRPC message limit (the shards' ``--max-message-bytes``): a table page is at
            most half of it.

    Raises:
        RuntimeError: the shards serve different jobs or plans, hold no job, hold a plan that
            does not match ``model`` or stay at different versions (the message names them and the flag).
        TableError: (a RuntimeError) the shards hold a table with different specs or at different sparse rounds.
        ShardRpcError: a shard refused (a table it does not hold: FAILED_PRECONDITION) or could not be
            reached (after retries).
        ConnectionError: a shard did not answer at all.
    """
    servers = parse_servers(servers)
    clients = [ShardClient(a, index=i, rpc_timeout=rpc_timeout, connect_timeout=connect_timeout, security=security,
                           max_message_bytes=max_message_bytes)
               for i, a in enumerate(servers)]
    owned = False
    try:
        stats = [c.stats(plan=True) for c in clients]
        jobs = {(s.job_id, s.plan_fingerprint) for s in stats}
        if len(jobs) != 1 or not all(s.initialised for s in stats):
            raise RuntimeError(f"the shards do not hold one initialised job: {[(s.job_id, s.initialised) for s in stats]}")
        plan = PartitionPlan.from_proto(stats[0].plan)
        if plan.num_shards != len(clients):
            raise RuntimeError(f"the job has {plan.num_shards} shards; {len(clients)} addresses were given")
        check_plan(plan, model=model, source=f"the job {stats[0].job_id} the shards hold")
        names = tables if tables is not None else listed_tables(stats[0])
        names = names if names is not None else (model_tables(model) or [])
        deadline = time.monotonic() + wait_seconds
        while True:
            params, buffers = _empty(plan)
            sink = ParameterSink(plan, params, buffers)
            versions = [sink.receive(c, c.export(), 0, "export") for c in clients]
            for i, c in enumerate(clients):  # a shard holding no dense chunk sends none: its version is its Stats'
                if not plan.shard_chunks(i) and not plan.shard_buffer_chunks(i):
                    versions[i] = c.stats().version
            if len(set(versions)) == 1 or allow_mixed_versions:
                break
            if max(versions) - min(versions) > 1 or time.monotonic() >= deadline:
                raise RuntimeError(
                    f"the shards are at versions {versions}: exporting them together would mix rounds. In sync "
                    "training they agree between rounds (stop or pause the workers and export again); a shard "
                    "restored from an older checkpoint stays behind for good (export anyway with "
                    "--allow-mixed-versions / allow_mixed_versions=True)"
                )
            time.sleep(0.2)  # a round is in flight: read again once it is applied everywhere
        source = None
        if names:
            source = LiveTables(clients, list(names), versions=versions, max_message_bytes=max_message_bytes,
                                allow_mixed_versions=allow_mixed_versions)
            owned = True
        return Export(finish_state(params, buffers, model), versions, stats[0].job_id, source)
    finally:
        if not owned:
            for c in clients:
                c.close()


def _flat(snap, name: str, dtype: str, start: int, count: int) -> torch.Tensor:
    """Elements ``[start, start + count)`` of the 1-D tensor ``name`` of checkpoint ``snap``, read alone.

    Raises:
        RuntimeError: the tensor is missing, of another dtype or shape, or too short (the checkpoint is damaged).
    """
    entry = snap.entries.get(name)
    if entry is None or entry.dtype != dtype or len(entry.shape) != 1 or start + count > entry.shape[0]:
        raise RuntimeError(f"{snap.file}: its {name} tensor is missing or does not hold elements [{start}, "
                           f"{start + count}) as {dtype}: the checkpoint is damaged")
    return snap.rows(name, start, count)


def from_checkpoints(directory: str | Path, num_shards: int | None = None, *, version: int = 0,
                     model: Model | None = None, allow_mixed_versions: bool = False,
                     tables: Sequence[str] | None = None) -> Export:
    """Assemble the model state from the shards' checkpoints under ``directory`` (the shards' ``--checkpoint-dir``);
    the tables are read when the result is saved (close it, or use it as a context manager, when done).

    Each checkpoint is checked whole (its SHA-256 computed as it is read, in blocks) and then read a tensor,
    or a page of a table's rows, at a time: memory holds the dense model, not the checkpoints.

    Args:
        directory: holds ``shard-0``, ``shard-1``, ... (one per shard).
        num_shards: expected shard count (default: the plan's).
        version: take each shard's checkpoint of exactly this version (0: the newest intact one of each).
        model, allow_mixed_versions: as :func:`from_servers` (the plan must match ``model``).
        tables: the tables to export (None: every table of the checkpoints).

    Raises:
        FileNotFoundError: a shard has no intact checkpoint (of ``version``); the message names the damaged ones.
        shardps.common.checkpoint.ForeignCheckpoint: (a ``ValueError``) ``shard-<i>`` holds a checkpoint
            written by another shard index or for another shard count (expected and found named).
        RuntimeError: the checkpoints belong to different jobs or plans, are at different
            versions, or their plan does not match ``num_shards`` or ``model`` (:func:`check_plan`).
        TableError: (a RuntimeError) the checkpoints hold different tables or specs, a table named in
            ``tables`` is not there, or a table's tensors are missing or malformed (the file is named).
    """
    directory = Path(directory)
    snaps, plan = [], None
    try:
        shard = 0
        while plan is None or shard < plan.num_shards:
            where = directory / f"shard-{shard}"
            snap, skipped = find_open(where, shard_index=shard, num_shards=plan.num_shards if plan else num_shards,
                                      at_most=version)
            if snap is not None:
                snaps.append(snap)
            if snap is None or (version and snap.version != version):
                damaged = "; ".join(f"{p.name}: {reason}" for p, reason in skipped)
                raise FileNotFoundError(f"no intact checkpoint{f' of version {version}' if version else ''} in "
                                        f"{where}" + (f" (damaged: {damaged})" if damaged else ""))
            if plan is None:
                plan = PartitionPlan.from_proto(pb.PlanSpec.FromString(snap.plan))
                if plan.fingerprint != snap.fingerprint:
                    raise RuntimeError(f"{snap.path}: its plan does not match its fingerprint {snap.fingerprint}")
                check_plan(plan, model=model, num_shards=num_shards,
                           source=f"the checkpoints in {directory} (job {snap.job_id})")
            shard += 1
        if len({(s.job_id, s.fingerprint) for s in snaps}) != 1:
            raise RuntimeError("the checkpoints belong to different jobs or plans: "
                               f"{[(f'shard-{i}', s.job_id, s.fingerprint[:12]) for i, s in enumerate(snaps)]}")
        versions = [s.version for s in snaps]
        if len(set(versions)) != 1 and not allow_mixed_versions:
            raise RuntimeError(f"the shards' newest checkpoints are at versions {versions}: pass version=V "
                               "(--version V) to take one version from every shard, or allow_mixed_versions=True")
        params, buffers = _empty(plan)
        for i, snap in enumerate(snaps):
            for c in plan.shard_chunks(i):
                flat = _flat(snap, f"param/{c.group}", "F32", c.shard_offset, c.numel)
                params[c.key].view(-1)[c.offset : c.offset + c.numel] = flat
            for c in plan.shard_buffer_chunks(i):
                dtype = TORCH_DTYPES[c.dtype]
                values = _flat(snap, "buffers", "U8", c.shard_offset, c.numel * dtype.itemsize).view(dtype)
                buffers[c.key].view(-1)[c.offset : c.offset + c.numel] = values
        source = CheckpointTables(snaps, tables, allow_mixed_versions=allow_mixed_versions)
    except BaseException:
        for snap in snaps:
            snap.close()
        raise
    if not source.specs:
        source.close()
        source = None
    return Export(finish_state(params, buffers, model), versions, snaps[0].job_id, source)

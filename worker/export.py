"""Export: assemble an ordinary PyTorch ``state_dict`` from the live shards or from their checkpoint directories.

Each shard holds a partition of the parameters (fp32 master copies) and of
the buffers in the plan; exporting reads every partition at one version per
shard and puts the tensors back together under their original names and
shapes, ready for ``model.load_state_dict(strict=True)`` (parameters the
optimizer did not own never reach the shards: pass ``model=`` to take them
from a local model, else ``strict=True`` names them as missing).

Versions: in sync training every shard applies the same rounds, so an
export is consistent when every shard is at the same version. A live
export waits (up to ``wait_seconds``) for the shards to agree, and refuses
when they do not (a round was in flight throughout, or a shard restored an
older checkpoint, see ``shardps.worker.session.recovery``), naming each shard's
version, unless ``allow_mixed_versions``. From checkpoints, the newest
intact checkpoint of each shard is taken, or the one of ``version``.

Mix-ups are refused, never exported: each shard's checkpoint must have been
written by that shard (the index and shard count its manifest records, see
``shardps.common.checkpoint``) of one job and plan; with ``num_shards`` the
plan must have that many shards; with ``model`` (a module or a
``state_dict``) every parameter and buffer of the plan must be in the model
with the same shape (:func:`check_plan` names the first that is not, with
the shape and element count expected and found). The model's entries that
are not in the plan (parameters outside the optimizer) are taken from it.

Never pickle: checkpoints are read with safetensors, and the output is
written with safetensors (``.safetensors``) or ``torch.save`` of plain
tensors (``.pt``, loadable with ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from shardps.proto import shardps_pb2 as pb
from shardps.common.addresses import parse_servers
from shardps.common.checkpoint import find
from shardps.common.codec import TORCH_DTYPES
from shardps.common.plan import PartitionPlan
from shardps.common.security import ChannelSecurity
from shardps.worker.session.client import ShardClient
from shardps.worker.pipeline.streams import ParameterSink


@dataclass
class Export:
    """An assembled model state.

    Attributes:
        state_dict: ``{name: tensor}``: parameters in fp32 with their shapes,
            buffers in their own dtype (and, with ``model=``, the model's other entries).
        versions: the version each shard's partition is at, in shard order.
        job_id: the job's id.
    """

    state_dict: dict[str, torch.Tensor]
    versions: list[int]
    job_id: str

    def save(self, path: str | Path) -> Path:
        """Write ``state_dict`` to ``path``: safetensors for ``*.safetensors``, else ``torch.save`` (``*.pt``).

        The versions and job id go into the safetensors metadata.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.contiguous() for k, v in self.state_dict.items()}
        if path.suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file(tensors, str(path), metadata={"job_id": self.job_id,
                                                    "versions": ",".join(map(str, self.versions))})
        else:
            torch.save(tensors, path)
        return path


def _empty(plan: PartitionPlan) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    params = {k.key: torch.zeros(k.shape, dtype=torch.float32) for k in plan.keys}
    buffers = {b.key: torch.zeros(b.shape, dtype=TORCH_DTYPES[b.dtype]) for b in plan.buffers}
    return params, buffers


Model = torch.nn.Module | Mapping[str, torch.Tensor]


def _model_state(model: Model | None) -> Mapping[str, torch.Tensor] | None:
    return model.state_dict() if isinstance(model, torch.nn.Module) else model


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


def _finish(params: dict, buffers: dict, model: Model | None) -> dict[str, torch.Tensor]:
    state = {**params, **buffers}
    for name, value in (_model_state(model) or {}).items():
        state.setdefault(name, value.detach().clone())
    return state


def from_servers(servers: list[str] | str, *, model: Model | None = None, wait_seconds: float = 30.0,
                 allow_mixed_versions: bool = False, rpc_timeout: float = 60.0,
                 connect_timeout: float = 10.0, security: ChannelSecurity | None = None) -> Export:
    """Read every live shard's partition (no membership needed) and assemble the model state.

    Args:
        servers: shard addresses in shard order (a list or ``"host:port,..."``).
        model: the model exported for (a module or its ``state_dict``): the plan must match it
            (:func:`check_plan`), and it fills in entries the shards do not hold (parameters outside the optimizer).
        wait_seconds: how long to wait for the shards to agree on a version.
        allow_mixed_versions: return shards at different versions instead of refusing.
        rpc_timeout, connect_timeout: seconds per call, and to wait for each shard to answer.
        security: TLS / mutual TLS / bearer token of the channels (default: plaintext, no token).

    Raises:
        RuntimeError: the shards serve different jobs or plans, hold no job, hold a plan that
            does not match ``model`` or stay at different versions (the message names them and the flag).
        ShardRpcError: a shard refused or could not be reached (after retries).
        ConnectionError: a shard did not answer at all.
    """
    servers = parse_servers(servers)
    clients = [ShardClient(a, index=i, rpc_timeout=rpc_timeout, connect_timeout=connect_timeout, security=security)
               for i, a in enumerate(servers)]
    try:
        stats = [c.stats(plan=True) for c in clients]
        jobs = {(s.job_id, s.plan_fingerprint) for s in stats}
        if len(jobs) != 1 or not all(s.initialised for s in stats):
            raise RuntimeError(f"the shards do not hold one initialised job: {[(s.job_id, s.initialised) for s in stats]}")
        plan = PartitionPlan.from_proto(stats[0].plan)
        if plan.num_shards != len(clients):
            raise RuntimeError(f"the job has {plan.num_shards} shards; {len(clients)} addresses were given")
        check_plan(plan, model=model, source=f"the job {stats[0].job_id} the shards hold")
        deadline = time.monotonic() + wait_seconds
        while True:
            params, buffers = _empty(plan)
            sink = ParameterSink(plan, params, buffers)
            versions = [sink.receive(c, c.export(), 0, "export") for c in clients]
            if len(set(versions)) == 1 or allow_mixed_versions:
                return Export(_finish(params, buffers, model), versions, stats[0].job_id)
            if max(versions) - min(versions) > 1 or time.monotonic() >= deadline:
                raise RuntimeError(
                    f"the shards are at versions {versions}: exporting them together would mix rounds. In sync "
                    "training they agree between rounds (stop or pause the workers and export again); a shard "
                    "restored from an older checkpoint stays behind for good (export anyway with "
                    "--allow-mixed-versions / allow_mixed_versions=True)"
                )
            time.sleep(0.2)  # a round is in flight: read again once it is applied everywhere
    finally:
        for c in clients:
            c.close()


def from_checkpoints(directory: str | Path, num_shards: int | None = None, *, version: int = 0,
                     model: Model | None = None, allow_mixed_versions: bool = False) -> Export:
    """Assemble the model state from the shards' checkpoints under ``directory`` (the shards' ``--checkpoint-dir``).

    Args:
        directory: holds ``shard-0``, ``shard-1``, ... (one per shard).
        num_shards: expected shard count (default: the plan's).
        version: take each shard's checkpoint of exactly this version (0: the newest intact one of each).
        model, allow_mixed_versions: as :func:`from_servers` (the plan must match ``model``).

    Raises:
        FileNotFoundError: a shard has no intact checkpoint (of ``version``); the message names the damaged ones.
        shardps.common.checkpoint.ForeignCheckpoint: (a ``ValueError``) ``shard-<i>`` holds a checkpoint
            written by another shard index or for another shard count (expected and found named).
        RuntimeError: the checkpoints belong to different jobs or plans, are at different
            versions, or their plan does not match ``num_shards`` or ``model`` (:func:`check_plan`).
    """
    directory = Path(directory)
    snaps, plan = [], None
    shard = 0
    while plan is None or shard < plan.num_shards:
        where = directory / f"shard-{shard}"
        found = find(where, shard_index=shard, num_shards=plan.num_shards if plan else num_shards, at_most=version)
        snap = found.snapshot
        if snap is None or (version and snap.version != version):
            damaged = "; ".join(f"{p.name}: {reason}" for p, reason in found.skipped)
            raise FileNotFoundError(f"no intact checkpoint{f' of version {version}' if version else ''} in {where}"
                                    + (f" (damaged: {damaged})" if damaged else ""))
        if plan is None:
            plan = PartitionPlan.from_proto(pb.PlanSpec.FromString(snap.plan))
            if plan.fingerprint != snap.fingerprint:
                raise RuntimeError(f"{found.path}: its plan does not match its fingerprint {snap.fingerprint}")
            check_plan(plan, model=model, num_shards=num_shards,
                       source=f"the checkpoints in {directory} (job {snap.job_id})")
        snaps.append(snap)
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
        flat = snap.params()
        for c in plan.shard_chunks(i):
            params[c.key].view(-1)[c.offset : c.offset + c.numel] = flat[c.group][c.shard_offset : c.shard_offset + c.numel]
        arena = snap.tensors.get("buffers")
        for c in plan.shard_buffer_chunks(i):
            dtype = TORCH_DTYPES[c.dtype]
            values = arena[c.shard_offset : c.shard_offset + c.numel * dtype.itemsize].view(dtype)
            buffers[c.key].view(-1)[c.offset : c.offset + c.numel] = values
    return Export(_finish(params, buffers, model), versions, snaps[0].job_id)

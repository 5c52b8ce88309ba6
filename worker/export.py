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

Never pickle: checkpoints are read with safetensors, and the output is
written with safetensors (``.safetensors``) or ``torch.save`` of plain
tensors (``.pt``, loadable with ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from shardps.proto import shardps_pb2 as pb
from shardps.common.addresses import parse_servers
from shardps.common.checkpoint import newest
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


def _finish(params: dict, buffers: dict, model: torch.nn.Module | None) -> dict[str, torch.Tensor]:
    state = {**params, **buffers}
    if model is not None:
        for name, value in model.state_dict().items():
            state.setdefault(name, value.detach().clone())
    return state


def from_servers(servers: list[str] | str, *, model: torch.nn.Module | None = None, wait_seconds: float = 30.0,
                 allow_mixed_versions: bool = False, rpc_timeout: float = 60.0,
                 connect_timeout: float = 10.0, security: ChannelSecurity | None = None) -> Export:
    """Read every live shard's partition (no membership needed) and assemble the model state.

    Args:
        servers: shard addresses in shard order (a list or ``"host:port,..."``).
        model: fills in entries the shards do not hold (parameters outside the optimizer).
        wait_seconds: how long to wait for the shards to agree on a version.
        allow_mixed_versions: return shards at different versions instead of refusing.
        rpc_timeout, connect_timeout: seconds per call, and to wait for each shard to answer.
        security: TLS / mutual TLS / bearer token of the channels (default: plaintext, no token).

    Raises:
        RuntimeError: the shards serve different jobs or plans, hold no job, or
            stay at different versions (the message names them and the flag).
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
                     model: torch.nn.Module | None = None, allow_mixed_versions: bool = False) -> Export:
    """Assemble the model state from the shards' checkpoints under ``directory`` (the shards' ``--checkpoint-dir``).

    Args:
        directory: holds ``shard-0``, ``shard-1``, ... (one per shard).
        num_shards: expected shard count (default: the plan's).
        version: take each shard's checkpoint of exactly this version (0: the newest intact one of each).
        model, allow_mixed_versions: as :func:`from_servers`.

    Raises:
        FileNotFoundError: a shard has no intact checkpoint (of ``version``).
        RuntimeError: the checkpoints belong to different jobs, or are at different versions.
    """
    directory = Path(directory)
    snaps, plan = [], None
    shard = 0
    while plan is None or shard < plan.num_shards:
        snap = newest(directory / f"shard-{shard}", version)
        if snap is None or (version and snap.version != version):
            raise FileNotFoundError(f"no intact checkpoint{f' of version {version}' if version else ''} in "
                                    f"{directory / f'shard-{shard}'}")
        if plan is None:
            plan = PartitionPlan.from_proto(pb.PlanSpec.FromString(snap.plan))
            if num_shards is not None and plan.num_shards != num_shards:
                raise RuntimeError(f"the checkpoints are of a job with {plan.num_shards} shards, not {num_shards}")
        snaps.append(snap)
        shard += 1
    if len({(s.job_id, s.fingerprint) for s in snaps}) != 1:
        raise RuntimeError(f"the checkpoints belong to different jobs: {[s.job_id for s in snaps]}")
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

"""The partition plan: the deterministic map key -> chunks -> shard.

Every worker and every shard computes the same plan from the same inputs
(parameter keys, shapes, param-group indices, ``num_shards``,
``chunk_bytes``). Each flattened parameter is cut into chunks of at most
``chunk_bytes`` of fp32 (the shards' master precision); chunks are assigned,
in key order, to the shard holding the fewest bytes so far (ties to the
lowest index), which balances bytes to within one chunk. Within a shard,
the chunks of each param group are laid out back to back in plan order: a
chunk's ``shard_offset`` is its element offset in that shard's flat buffer
for its group. Parameter-server sharding by key ranges follows Li et al.,
"Scaling Distributed Machine Learning with the Parameter Server" (OSDI 2014).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from shardps.proto import shardps_pb2 as pb

MASTER_ITEMSIZE = 4  # shards keep fp32 master weights
MIN_CHUNK_BYTES = 16
PLAN_FORMAT = 1


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """One parameter: ``key`` (name), ``shape`` and optimizer ``group`` index."""

    key: str
    shape: tuple[int, ...]
    group: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class Chunk:
    """A contiguous slice ``[offset, offset + numel)`` (elements) of flattened ``key``.

    ``index`` is the chunk's position in the plan, ``shard`` the shard that
    holds it and ``shard_offset`` its element offset in that shard's flat
    fp32 buffer of param group ``group``.
    """

    index: int
    key: str
    group: int
    offset: int
    numel: int
    shard: int
    shard_offset: int


@dataclass(frozen=True, kw_only=True)
class PartitionPlan:
    """Deterministic partition of a model's parameters over ``num_shards`` shards.

    Build it with :meth:`build` (or :meth:`from_proto` on the shard side).
    """

    keys: tuple[KeyInfo, ...]
    num_shards: int
    chunk_bytes: int
    chunks: tuple[Chunk, ...] = field(repr=False)
    fingerprint: str

    @classmethod
    def build(cls, keys: Iterable[KeyInfo], *, num_shards: int, chunk_bytes: int) -> "PartitionPlan":
        """Compute the plan.

        Args:
            keys: parameters in ``model.named_parameters()`` order.
            num_shards: number of shard processes, >= 1.
            chunk_bytes: largest chunk in bytes of fp32, a multiple of 4 and >= 16.

        Raises:
            ValueError: no keys, a duplicate or empty key, a negative dimension,
                ``num_shards < 1`` or a bad ``chunk_bytes`` (the message names the fix).
        """
        keys = tuple(KeyInfo(k.key, tuple(int(d) for d in k.shape), int(k.group)) for k in keys)
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        if chunk_bytes < MIN_CHUNK_BYTES or chunk_bytes % MASTER_ITEMSIZE:
            raise ValueError(
                f"chunk_bytes must be a multiple of {MASTER_ITEMSIZE} and >= {MIN_CHUNK_BYTES}, got {chunk_bytes}"
            )
        if not keys:
            raise ValueError("the model has no parameters to shard")
        seen: set[str] = set()
        for k in keys:
            if not k.key:
                raise ValueError("parameter keys must be non-empty strings")
            if k.key in seen:
                raise ValueError(f"duplicate parameter key {k.key!r}")
            if any(d < 0 for d in k.shape) or k.group < 0:
                raise ValueError(f"parameter {k.key!r} has a negative dimension or group: {k}")
            seen.add(k.key)

        per_chunk = chunk_bytes // MASTER_ITEMSIZE
        fingerprint = cls._fingerprint(keys, num_shards, chunk_bytes)
        load = [0] * num_shards
        fill: dict[tuple[int, int], int] = {}
        chunks: list[Chunk] = []
        for k in keys:
            for offset in range(0, k.numel, per_chunk):
                numel = min(per_chunk, k.numel - offset)
                shard = min(range(num_shards), key=lambda s: (load[s], s))
                load[shard] += numel
                shard_offset = fill.get((shard, k.group), 0)
                fill[(shard, k.group)] = shard_offset + numel
                chunks.append(Chunk(len(chunks), k.key, k.group, offset, numel, shard, shard_offset))
        return cls(
            keys=keys, num_shards=num_shards, chunk_bytes=chunk_bytes, chunks=tuple(chunks), fingerprint=fingerprint
        )

    @staticmethod
    def _fingerprint(keys: tuple[KeyInfo, ...], num_shards: int, chunk_bytes: int) -> str:
        canon = json.dumps(
            [PLAN_FORMAT, num_shards, chunk_bytes, [[k.key, list(k.shape), k.group] for k in keys]],
            separators=(",", ":"),
        )
        return hashlib.sha256(canon.encode()).hexdigest()[:16]

    @classmethod
    def fingerprint_of_proto(cls, spec: pb.PlanSpec) -> str:
        """The fingerprint the plan of ``spec`` would have, in O(keys): without building its chunks."""
        keys = tuple(KeyInfo(k.key, tuple(int(d) for d in k.shape), int(k.group)) for k in spec.keys)
        return cls._fingerprint(keys, spec.num_shards, spec.chunk_bytes)

    @classmethod
    def from_proto(cls, spec: pb.PlanSpec) -> "PartitionPlan":
        """Rebuild the plan from its wire form (see :meth:`build` for errors)."""
        return cls.build(
            (KeyInfo(k.key, tuple(k.shape), k.group) for k in spec.keys),
            num_shards=spec.num_shards,
            chunk_bytes=spec.chunk_bytes,
        )

    def to_proto(self) -> pb.PlanSpec:
        return pb.PlanSpec(
            keys=[pb.KeySpec(key=k.key, shape=k.shape, group=k.group) for k in self.keys],
            num_shards=self.num_shards,
            chunk_bytes=self.chunk_bytes,
        )

    @property
    def num_groups(self) -> int:
        return max(k.group for k in self.keys) + 1

    def shard_chunks(self, shard: int) -> list[Chunk]:
        """The chunks shard ``shard`` holds, in plan order."""
        return [c for c in self.chunks if c.shard == shard]

    def group_numel(self, shard: int, group: int) -> int:
        """Elements in shard ``shard``'s flat buffer for param group ``group``."""
        return sum(c.numel for c in self.chunks if c.shard == shard and c.group == group)

    def shard_bytes(self) -> list[int]:
        """fp32 bytes held by each shard."""
        out = [0] * self.num_shards
        for c in self.chunks:
            out[c.shard] += c.numel * MASTER_ITEMSIZE
        return out


def keys_from_named_parameters(
    named_parameters: Sequence[tuple[str, object]], param_groups: Sequence[dict]
) -> list[KeyInfo]:
    """KeyInfo for each ``(name, tensor)``, with the index of the param group that holds it.

    Raises:
        ValueError: a parameter is in no param group, or a param-group
            parameter has no name in ``named_parameters``.
    """
    group_of: dict[int, int] = {}
    for g, group in enumerate(param_groups):
        for p in group["params"]:
            group_of[id(p)] = g
    out = []
    named_ids = set()
    for name, p in named_parameters:
        if id(p) not in group_of:
            raise ValueError(f"parameter {name!r} is not in any param group of the optimizer")
        named_ids.add(id(p))
        out.append(KeyInfo(name, tuple(p.shape), group_of[id(p)]))
    missing = set(group_of) - named_ids
    if missing:
        raise ValueError(
            f"{len(missing)} optimizer parameter(s) have no name in named_parameters: "
            "pass model.named_parameters() of the model the optimizer was built on"
        )
    return out

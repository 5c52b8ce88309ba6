"""Optimizer state on the wire: the frames of GetState and SetState.

A key's per-element state entries (``exp_avg``, ``momentum_buffer``, ...)
travel like its parameter: one frame per chunk of the key on this shard,
``ChunkHeader.state`` naming the entry, ``offset`` the element offset in
the whole flattened parameter. Scalar entries (``step``) travel once per
key held by this shard, as one-element frames at offset 0. All values are
fp32, the shards' precision. The worker reassembles each key from every
shard that holds part of it (``shardps.worker.optimizer_state``).
"""

from __future__ import annotations

import torch

from shardps.common.codec import DecodedFrame, FrameError, copy_payload, encode_chunk
from shardps.server.dense.chunks import ChunkTable
from shardps.server.errors import InvalidArgument
from shardps.server.dense.optimizer import ShardOptimizer


def _scalar_names(optimizer: ShardOptimizer) -> dict[int, set[str]]:
    """Each group's scalar state entries (one trial step per group)."""
    return {g: optimizer.expected_state(g)[1] for g in optimizer.groups}


def encode_state(table: ChunkTable, optimizer: ShardOptimizer, version: int) -> list[bytes]:
    """Every state entry of every key this shard holds, as frames (see the module docstring)."""
    frames = []
    scalars = _scalar_names(optimizer)
    for k, state in sorted(optimizer.get_state().items()):
        group, start, end = table.key_slices[k]
        key = table.plan.keys[k].key
        for name, value in sorted(state.items()):
            value = value.reshape(-1).to(torch.float32)
            if name in scalars[group]:
                frames.append(encode_chunk(key, 0, value[:1], version, state=name))
                continue
            for i in table.chunks_of_key[k]:
                c = table.chunks[i]
                part = value[c.shard_offset - start : c.shard_offset - start + c.numel]
                frames.append(encode_chunk(c.key, c.offset, part, version, state=name))
    return frames


def decode_state(table: ChunkTable, optimizer: ShardOptimizer, frames: list[DecodedFrame]) -> dict[int, dict]:
    """Rebuild ``{key index: {name: tensor}}`` from SetState frames.

    Raises:
        InvalidArgument: a frame for a key or chunk this shard does not hold, a
            repeated or missing chunk of an entry, or a malformed payload.
    """
    index_of = {k.key: i for i, k in enumerate(table.plan.keys)}
    local = {(c.key, c.offset): c for c in table.chunks}
    scalars = _scalar_names(optimizer)
    out: dict[int, dict[str, torch.Tensor]] = {}
    filled: dict[tuple[int, str], int] = {}
    seen: set[tuple[int, str, int]] = set()
    for frame in frames:
        h = frame.header
        k = index_of.get(h.key)
        if k is None or k not in table.key_slices:
            raise InvalidArgument(f"state frame for key {h.key[:64]!r}, which this shard does not hold")
        group, start, end = table.key_slices[k]
        if not h.state:
            raise InvalidArgument(f"state frame of key {h.key!r} names no state entry")
        scalar = h.state in scalars[group]
        if (k, h.state, h.offset) in seen:
            raise InvalidArgument(f"state {h.state!r} of key {h.key!r} at element {h.offset} was sent twice")
        seen.add((k, h.state, h.offset))
        try:
            if scalar:
                value = torch.empty(1)
                copy_payload(h, frame.payload, value)
                out.setdefault(k, {})[h.state] = value
                filled[(k, h.state)] = 1
                continue
            c = local.get((h.key, h.offset))
            if c is None or c.numel != h.numel:
                raise InvalidArgument(f"state {h.state!r} of key {h.key!r} at element {h.offset} is not a chunk of "
                                      "this shard")
            value = out.setdefault(k, {}).setdefault(h.state, torch.full((end - start,), float("nan")))
            copy_payload(h, frame.payload, value[c.shard_offset - start : c.shard_offset - start + c.numel])
        except FrameError as exc:
            raise InvalidArgument(f"state of key {h.key!r}: {exc}") from None
        filled[(k, h.state)] = filled.get((k, h.state), 0) + c.numel
    for (k, name), n in filled.items():
        group, start, end = table.key_slices[k]
        if name not in scalars[group] and n != end - start:
            raise InvalidArgument(f"state {name!r} of key {table.plan.keys[k].key!r} is missing chunks")
    return out

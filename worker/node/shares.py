"""A local rank's share of its node's round: the shards it owns, pushed and pulled with the node's session.

Reduction within a node by chunk ownership (after BytePS, Jiang et al.,
OSDI 2020, which splits each tensor's partitions over the local GPUs for
the reduction within the machine): shard ``s`` of the partition plan is *owned* by local rank
``s % L`` of a node with ``L`` local ranks. Since plan format 4 a shard
holds one contiguous range of the flat fp32 vector of the plan's keys (in
plan order), so the node's reduce-scatter sends each range to its owner,
point to point (:func:`reduce_scatter`), and the all-gather is one
``dist.broadcast`` of the range back from its owner (``worker/node/optimizer.py``).

To the shards the node is still one contributor: the leader (local rank 0)
joins every shard, holds the leases and the rejoin logic, and hands the
other local ranks its worker id and session, with which they push their
shards' chunks and pull them back (:class:`ShardShare`). Each shard sees
one stream per round from that member, as from a single process.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import wait
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardps.proto import shardps_pb2 as pb
from shardps.common.plan import Chunk, PartitionPlan
from shardps.worker.session.client import ShardClient
from shardps.worker.pipeline.streams import ParameterSink, Round, push_requests


def owner(shard: int, local_ranks: int) -> int:
    """The local rank (0-based, within the node) that pushes and pulls shard ``shard``."""
    return shard % local_ranks


def key_starts(plan: PartitionPlan) -> dict[str, int]:
    """Where each of the plan's keys begins in the flat vector of :func:`shard_segments` (elements)."""
    start, at = {}, 0
    for k in plan.keys:
        start[k.key], at = at, at + k.numel
    return start


def shard_segments(plan: PartitionPlan) -> list[list[tuple[int, int]]]:
    """Each shard's ranges ``(start, length)`` (elements) of the flat vector of the plan's keys.

    The flat vector is every key's parameter flattened and laid end to end in
    plan order (``torch.cat([p.reshape(-1) for p in params])``). Touching
    chunks are merged: under plan format 4 each shard has one range (or none).
    """
    start = key_starts(plan)
    segments: list[list[tuple[int, int]]] = [[] for _ in range(plan.num_shards)]
    for c in plan.chunks:
        a = start[c.key] + c.offset
        runs = segments[c.shard]
        if runs and runs[-1][0] + runs[-1][1] == a:
            runs[-1] = (runs[-1][0], runs[-1][1] + c.numel)
        else:
            runs.append((a, c.numel))
    return segments


def param_pieces(segments: list[tuple[int, int]], params: list[torch.Tensor], starts: list[int]
                 ) -> list[tuple[torch.Tensor, int, int, int]]:
    """Where one shard's ``segments`` (of :func:`shard_segments`) fall in ``params``.

    Args:
        segments: the shard's ranges ``(start, length)`` of the flat vector, elements.
        params: the parameters in plan order; ``starts``: where each begins in the flat vector.

    Returns:
        ``(parameter, offset in it, offset in the flat vector, numel)`` for each piece.
    """
    pieces = []
    for a, n in segments:
        for p, start in zip(params, starts):
            lo, hi = max(a, start), min(a + n, start + p.numel())
            if lo < hi:
                pieces.append((p, lo - start, lo, hi - lo))
    return pieces


def copy_pieces(flat: torch.Tensor, pieces: list[tuple[torch.Tensor, int, int, int]], into_flat: bool) -> None:
    """Copy the parameters' elements of ``pieces`` (:func:`param_pieces`) into ``flat`` (fp32, the flat vector),
    or back out of it into the parameters."""
    for p, at, lo, n in pieces:
        piece = p.data.view(-1)[at : at + n]
        if into_flat:
            flat[lo : lo + n].copy_(piece)
        else:
            piece.copy_(flat[lo : lo + n])


def reduce_scatter(flat: torch.Tensor, segments: list[list[tuple[int, int]]], rank: int, size: int,
                   group: dist.ProcessGroup | None, scratch: torch.Tensor | None = None) -> torch.Tensor | None:
    """Average each shard's ranges of ``flat`` over the local ranks, on the shard's owner (in place).

    Point to point: every rank sends each range it does not own to the range's
    owner (``owner(s, size)``), and each owner receives the other ranks' copies
    of its ranges and sums them in local-rank order, then divides by ``size``
    (so the result does not depend on arrival order). For the 10.5 M-parameter
    MLP of ``benchmarks/train.py`` on 2 cores this took 31-45 ms per step
    where one ``dist.reduce`` per shard took 60-90 ms (Gloo's reduce copies
    and chunks more). One ``dist.batch_isend_irecv``: Gloo on CPU, NCCL on CUDA.

    Args:
        flat: this rank's gradients, the flat vector of :func:`shard_segments`
            (float32, shape ``(total numel,)``); on return the ranges this rank owns
            hold the node's average, the others are left as they were.
        segments: :func:`shard_segments` of the plan.
        rank, size: this rank's index within the node and the node's number of local ranks.
        group: the node's process group (``None``: the default group).
        scratch: the receive buffer a previous call returned, reused (a fresh one per
            step costs a page fault per 4 KiB); float32, ``(size - 1) x`` owned numel.

    Returns:
        The receive buffer to pass as ``scratch`` next time (``None`` if this rank owns nothing).

    Raises:
        RuntimeError: from ``torch.distributed`` if a peer fails or the group is broken.
    """
    if size == 1:
        return scratch
    owned = sum(n for s, runs in enumerate(segments) if owner(s, size) == rank for _, n in runs)
    if owned and (scratch is None or scratch.numel() != (size - 1) * owned):
        scratch = torch.empty((size - 1) * owned, dtype=flat.dtype, device=flat.device)
    ops, sums, at, tag = [], [], 0, 0
    for s, runs in enumerate(segments):
        dst = owner(s, size)
        for a, n in runs:
            tag += 1  # one tag per range: each pair's messages match by tag, never by arrival
            if dst != rank:
                ops.append(dist.P2POp(dist.isend, flat.narrow(0, a, n), _peer(group, dst), group, tag))
                continue
            terms = []
            for r in range(size):
                if r == rank:
                    terms.append(flat.narrow(0, a, n))
                else:
                    terms.append(scratch.narrow(0, at, n))
                    ops.append(dist.P2POp(dist.irecv, terms[-1], _peer(group, r), group, tag))
                    at += n
            sums.append((flat.narrow(0, a, n), terms))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    for out, terms in sums:  # local-rank order: the same sum whichever copy arrived first
        total = terms[0]
        for t in terms[1:]:
            total.add_(t)
        if total is not out:
            out.copy_(total)
        out.div_(size)
    return scratch if owned else None


def all_gather(flat: torch.Tensor | None, pieces: dict[int, list[tuple[torch.Tensor, int, int, int]]],
               segments: list[list[tuple[int, int]]], rank: int, size: int, group: dist.ProcessGroup | None,
               buffer_chunks: Sequence[tuple[torch.Tensor, Chunk]] = ()) -> None:
    """Give every local rank each shard's new parameters (and buffer chunks) from the shard's owner, in place.

    The owner pulled them into its parameters; they go through ``flat`` (one
    ``dist.broadcast`` per range of :func:`shard_segments`) and back out into
    every other rank's parameters.

    Args:
        flat: a float32 buffer of the flat vector's numel, reused across steps; ``None``
            when the plan has no parameters.
        pieces: ``{shard: param_pieces(...)}``: where each shard's ranges fall in the parameters.
        segments: :func:`shard_segments` of the plan.
        rank, size, group: this rank's index within the node, the node's number of local
            ranks, and its process group (``None``: the default group).
        buffer_chunks: ``(buffer, chunk)`` of every buffer chunk of the plan.

    Raises:
        RuntimeError: from ``torch.distributed`` if a peer fails or the group is broken.
    """
    if flat is not None:
        owned = [s for s in pieces if owner(s, size) == rank]
        copy_pieces(flat, [x for s in owned for x in pieces[s]], into_flat=True)
        for s, runs in enumerate(segments):
            for a, n in runs:
                dist.broadcast(flat.narrow(0, a, n), src=_peer(group, owner(s, size)), group=group)
        copy_pieces(flat, [x for s in pieces if s not in owned for x in pieces[s]], into_flat=False)
    for b, c in buffer_chunks:
        dist.broadcast(b.view(-1).narrow(0, c.offset, c.numel), src=_peer(group, owner(c.shard, size)), group=group)


def _peer(group: dist.ProcessGroup | None, local: int) -> int:
    """The global rank of local rank ``local`` of ``group`` (``None``: the default group)."""
    return dist.get_global_rank(group, local) if group is not None else local


@dataclass(frozen=True)
class NodeSession:
    """What the leader hands every local rank so that they push as the node (sent once, at construction).

    Attributes:
        worker_id, session: the node's member id and the leader's session token.
        plan: the job's partition plan, serialised (``pb.PlanSpec`` bytes).
        pull_dtype: the wire code of pulled parameters (``shardps.common.codec.wire_dtype``).
        push_dtype: the torch dtype gradients are sent in.
        checksum: CRC-32 on every gradient chunk.
    """

    worker_id: str
    session: str
    plan: bytes
    pull_dtype: int
    push_dtype: torch.dtype
    checksum: bool


class ShardShare:
    """Pushes one round's chunks of the shards this rank owns and pulls them back into the model.

    Args:
        node: the node's session (from the leader).
        plan: the job's partition plan.
        clients: ``{shard: ShardClient}`` for the shards this rank owns.
        params: ``{key: parameter}`` of the plan's keys (the pulled values are written in place).
        buffers: ``{key: buffer}`` of the plan's buffers.
        rpc_timeout: deadline of each push, seconds.
    """

    def __init__(self, node: NodeSession, plan: PartitionPlan, clients: dict[int, ShardClient],
                 params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], rpc_timeout: float) -> None:
        self.node, self.plan, self.clients, self.rpc_timeout = node, plan, dict(clients), rpc_timeout
        self.params, self.buffers = params, buffers
        self.sink = ParameterSink(plan, params, buffers)
        self._chunks: dict[int, list[Chunk]] = {s: plan.shard_chunks(s) for s in self.clients}
        self._buffer_chunks: dict[int, list[Chunk]] = {s: plan.shard_buffer_chunks(s) for s in self.clients}
        self._counts: dict[str, int] = {}
        for s in self.clients:
            for c in (*self._chunks[s], *self._buffer_chunks[s]):
                self._counts[c.key] = self._counts.get(c.key, 0) + 1
        self._start = key_starts(plan)
        self._pool = ShardClient.call_pool(max(1, len(self.clients)), "shardps-share")  # daemon: never holds the exit
        self.last_pushed_bytes: dict[int, int] = {}

    def push_pull(self, versions: Sequence[int], trailer: pb.RoundTrailer, flat: torch.Tensor,
                  absent: set[str]) -> tuple[dict[int, int], list[tuple[int, BaseException]]]:
        """Push this rank's shards' part of the round and pull their new parameters (blocking).

        Args:
            versions: each shard's version, as the leader holds it (the round pushed to it).
            trailer: the round's trailer (the same on every local rank).
            flat: the node's averaged gradient, the flat vector of :func:`shard_segments`
                (float32, shape ``(total numel,)``; only this rank's ranges are read).
            absent: keys without a gradient on any local rank (not sent).

        Returns:
            ``({shard: version received}, [(shard, error), ...])`` for the shards this rank owns.
        """
        rnd = Round(self.plan.num_shards, self._counts)
        for s, client in self.clients.items():
            header = pb.RoundHeader(worker_id=self.node.worker_id, session=self.node.session, round=versions[s],
                                    plan_fingerprint=self.plan.fingerprint, pull_dtype=self.node.pull_dtype)
            q = rnd.queues[s]
            for c in self._chunks[s]:
                if c.key not in absent:
                    a = self._start[c.key] + c.offset
                    q.put(("grad", c, flat[a : a + c.numel]))
            for c in self._buffer_chunks[s]:
                q.put(("buffer", c, self.buffers[c.key].detach().reshape(-1)[c.offset : c.offset + c.numel].to("cpu")))
            q.put(("trailer", trailer))
            q.put(None)
            rnd.calls.append(client.push_pull(push_requests(header, s, self.node.push_dtype, self.node.checksum, rnd,
                                                            self.rpc_timeout)))
        futures = {s: self._pool.submit(self.sink.receive, client, call, versions[s] + 1, "push_pull", rnd)
                   for (s, client), call in zip(self.clients.items(), rnd.calls)}
        wait(futures.values())  # blocking wait for every owned shard's pull
        self.last_pushed_bytes = {s: rnd.pushed_bytes[s] for s in self.clients}
        applied = {s: f.result() for s, f in futures.items() if f.exception() is None}
        failed = [(s, f.exception()) for s, f in futures.items() if f.exception() is not None]
        return applied, failed

    def close(self, own_clients: bool) -> None:
        """Stop the threads; close the channels too if this rank made them (not the leader's)."""
        self._pool.shutdown(wait=False)
        if own_clients:
            for client in self.clients.values():
                client.close()

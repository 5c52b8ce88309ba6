"""What the operator commands take from a shard's reply: never trusted, checked before it is used or printed.

A command may be pointed at a misconfigured, compromised or impostor
server. Its replies are therefore

* bounded by the protocol's own limits: every reply is at most the channel's
  message limit (``shardps.common.transport``); a text field longer than
  :data:`MAX_TEXT_CHARS` (a job id, a checkpoint path: ``PATH_MAX``) or a
  Stats reply that lists more members than its own ``max_workers`` is
  refused (:class:`ProtocolError`), and sizes a reply *declares* (a plan's
  shapes) are never allocated before the bytes they describe have arrived
  (:func:`export_live`);
* printed through :func:`printable`, which escapes control characters (ESC
  and the other C0 and C1 codes, DEL, Unicode line and bidi controls) as
  ``\\xHH``/``\\uHHHH``, so a reply cannot drive the operator's terminal,
  and through :func:`json_chunks`, which streams ``stats``' JSON (its
  escaping leaves no control character either) instead of building it.

Nothing here imports torch until an export's bytes have all arrived and
checked out.
"""

from __future__ import annotations

import json
import math
import re
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from shardps.proto import shardps_pb2 as pb
from shardps.common.plan import BUFFER_ITEMSIZE, MASTER_ITEMSIZE, MIN_CHUNK_BYTES, PartitionPlan
from shardps.common.transport import DEFAULT_MAX_MESSAGE_BYTES
from shardps.worker.session.retry import RetryPolicy

#: Longest text field a command accepts from a shard (a checkpoint path: Linux's PATH_MAX).
MAX_TEXT_CHARS = 4096
#: Most characters of a shard's text (an error's details) a command prints; the rest is counted, not shown.
SHOWN_CHARS = 1024
_CONTROL = "\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069"
_UNSAFE_TEXT = re.compile(f"[{_CONTROL}]")  # newline and tab kept
_UNSAFE_LINE = re.compile(f"[{_CONTROL}\n\t]")


class ProtocolError(RuntimeError):
    """A shard answered outside the protocol (a size beyond its limits, a frame the plan does not have)."""


def bound(client, deadline: float):
    """Give ``client``'s next call (retries included) at most what is left until ``deadline``
    (``time.monotonic()``); returns ``client``."""
    left = max(0.001, deadline - time.monotonic())
    client.rpc_timeout, client.retry = left, RetryPolicy(total_seconds=left)
    return client


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str, *, one_line: bool = True, limit: int = SHOWN_CHARS) -> str:
    """``text`` from a shard, safe to print: control characters escaped, at most ``limit`` characters shown.

    ESC, the other C0 and C1 control codes, DEL and the Unicode line and bidi
    controls become ``\\xHH``/``\\uHHHH``; so do newline and tab when
    ``one_line`` (a shard's text inside one line of output). A longer text
    ends with ``... (N characters)``.
    """
    text = str(text)
    cut = f"... ({len(text)} characters)" if len(text) > limit else ""
    return (_UNSAFE_LINE if one_line else _UNSAFE_TEXT).sub(_escape, text[:limit]) + cut


def checked_text(value: str, what: str, shard: int, address: str) -> str:
    """``value`` if it is at most :data:`MAX_TEXT_CHARS` long.

    Raises:
        ProtocolError: it is longer (the message shows its start, escaped).
    """
    if len(value) > MAX_TEXT_CHARS:
        raise ProtocolError(f"shard {shard} ({address}) answered outside the protocol: its {what} has "
                            f"{len(value)} characters (at most {MAX_TEXT_CHARS}): {printable(value, limit=64)}")
    return value


def check_stats(reply: pb.StatsReply, shard: int, address: str) -> None:
    """Refuse a Stats reply whose lists exceed its own limits, or whose texts are too long.

    Raises:
        ProtocolError: ``members``, ``pushed``, ``rejoining`` or ``clocks`` longer than
            ``max_workers``, ``shard_index`` not below ``num_shards``, or a text over :data:`MAX_TEXT_CHARS`.
    """
    where = f"shard {shard} ({address}) answered outside the protocol:"
    for name in ("members", "pushed", "clocks"):
        if len(getattr(reply, name)) > reply.max_workers:
            raise ProtocolError(f"{where} its Stats lists {len(getattr(reply, name))} {name}, more than its "
                                f"max_workers {reply.max_workers}")
    if reply.shard_index >= reply.num_shards:
        raise ProtocolError(f"{where} shard_index {reply.shard_index} of {reply.num_shards} shards")
    for name in ("members", "pushed", "rejoining"):
        for value in getattr(reply, name):
            checked_text(value, f"Stats {name} entry", shard, address)
    for name in ("plan_fingerprint", "optimizer", "job_id", "digest", "incarnation"):
        checked_text(getattr(reply, name), f"Stats {name}", shard, address)


# ---- stats as JSON, streamed ------------------------------------------------------------------------------


def _scalar(field, value) -> str:
    if field.type == field.TYPE_ENUM:
        entry = field.enum_type.values_by_number.get(value)
        return json.dumps(entry.name if entry is not None else value)
    if field.type == field.TYPE_BYTES:
        import base64

        return json.dumps(base64.b64encode(value).decode())
    if isinstance(value, float) and not math.isfinite(value):
        return json.dumps("NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity"))
    return json.dumps(value)  # ensure_ascii: every control character is a \\u escape


def _value(field, value, level: int) -> Iterator[str]:
    if field.type == field.TYPE_MESSAGE:
        yield from message_chunks(value, level)
    else:
        yield _scalar(field, value)


def _items(pairs: Iterator[tuple[str, Callable[[int], Iterator[str]]]], level: int, brackets: str) -> Iterator[str]:
    """A JSON object (``brackets="{}"``, pairs of key and value writer) or array (keys None), indented by 2."""
    pad, first = "\n" + "  " * (level + 1), True
    for key, write in pairs:
        yield (brackets[0] if first else ",") + pad + ("" if key is None else json.dumps(key) + ": ")
        yield from write(level + 1)
        first = False
    yield brackets if first else "\n" + "  " * level + brackets[1]


def message_chunks(message, level: int = 0, lead: Mapping[str, object] | None = None) -> Iterator[str]:
    """A protobuf message as indented JSON text, in pieces: keys in ``.proto`` order after ``lead``'s.

    64-bit integers stay JSON numbers, every field is present (an unset
    message field is ``null``), enums are names, non-finite floats are
    ``"NaN"``/``"Infinity"``/``"-Infinity"`` (protobuf's JSON names), so the
    text is strict JSON. Repeated fields are read one element at a time: the
    text is never held whole.
    """
    def pairs():
        for key, value in (lead or {}).items():
            yield key, lambda _level, value=value: iter((json.dumps(value),))
        for f in message.DESCRIPTOR.fields:
            value = getattr(message, f.name)
            if f.message_type is not None and f.message_type.GetOptions().map_entry:
                inner = f.message_type.fields_by_name["value"]
                yield f.name, lambda lv, value=value, inner=inner: _items(
                    ((str(k), lambda l2, v=v: _value(inner, v, l2)) for k, v in value.items()), lv, "{}")
            elif f.is_repeated:
                yield f.name, lambda lv, value=value, f=f: _items(
                    ((None, lambda l2, v=v: _value(f, v, l2)) for v in value), lv, "[]")
            elif f.has_presence and not message.HasField(f.name):
                yield f.name, lambda _level: iter(("null",))
            else:
                yield f.name, lambda lv, value=value, f=f: _value(f, value, lv)

    return _items(pairs(), level, "{}")


def json_chunks(replies: list[tuple[str, pb.StatsReply]]) -> Iterator[str]:
    """``stats``' document in pieces: an array with an object per ``(address, reply)``, ``address`` first."""
    return _items(((None, lambda lv, a=a, r=r: message_chunks(r, lv, {"address": a})) for a, r in replies), 0, "[]")


# ---- export from live shards, bounded by what arrived -----------------------------------------------------


@dataclass
class _Spec:
    """What a plan declares, checked in O(keys) without building it."""

    entries: dict[str, tuple[int, int]]  # key -> (elements, wire dtype: FLOAT32 for parameters)
    declared_bytes: int  # parameters in fp32, buffers in their dtype
    min_chunks: int  # every valid export has at least this many frames


def _check_spec(spec: pb.PlanSpec, num_shards: int, max_message_bytes: int) -> _Spec:
    problem = None
    if spec.num_shards != num_shards:
        problem = f"the job has {spec.num_shards} shards; {num_shards} addresses were given"
    elif not MIN_CHUNK_BYTES <= spec.chunk_bytes <= max_message_bytes or spec.chunk_bytes % MASTER_ITEMSIZE:
        problem = f"its plan's chunk_bytes {spec.chunk_bytes} is not a multiple of 4 in [16, {max_message_bytes}]"
    entries, declared, chunks = {}, 0, 0
    for spec_entry, buffer in [*((k, False) for k in spec.keys), *((b, True) for b in spec.buffers)]:
        if problem:
            break
        dtype = spec_entry.dtype if buffer else pb.FLOAT32
        itemsize = BUFFER_ITEMSIZE.get(dtype)
        if not spec_entry.key or len(spec_entry.key) > MAX_TEXT_CHARS or spec_entry.key in entries or itemsize is None:
            problem = f"its plan has an empty, overlong, repeated or unknown-dtype key {printable(spec_entry.key, limit=64)}"
            break
        numel = math.prod(spec_entry.shape)
        entries[spec_entry.key] = (numel, dtype)
        declared += numel * itemsize
        chunks += -(-numel // max(1, spec.chunk_bytes // itemsize))
    if not problem and not spec.keys:
        problem = "its plan has no parameters"
    if problem:
        raise ProtocolError(f"the shards' plan cannot be exported: {problem}")
    return _Spec(entries, declared, chunks)


@dataclass
class _Received:
    """One shard's export stream as it arrived: ``(header, payload)`` per frame, checked against the spec."""

    version: int | None = None
    frames: list[tuple[pb.ChunkHeader, bytes]] = field(default_factory=list)
    payload_bytes: int = 0


def _receive(client, spec: _Spec, deadline: float, budget: list[int]) -> _Received:
    """Read shard ``client.index``'s Export stream; each frame checked before it is kept.

    ``budget`` holds the payload bytes still allowed (the plan's declared bytes): more is refused.
    """
    shard, got = client.index, _Received()
    where = f"shard {shard} ({client.address}) answered outside the protocol:"
    bound(client, deadline)
    try:
        for raw in client.export():  # blocking reads, bounded by the call's deadline
            try:
                frame = pb.Frame.FromString(raw)
            except Exception:  # protobuf's DecodeError
                raise ProtocolError(f"{where} a frame of {len(raw)} bytes is not a Frame") from None
            if not frame.HasField("header") or any(frame.HasField(k) for k in ("round", "trailer", "report", "commit")):
                raise ProtocolError(f"{where} its Export sent a frame that is not a chunk")
            header = pb.ChunkHeader()
            header.CopyFrom(frame.header)
            payload, frame = frame.payload, None
            entry = spec.entries.get(header.key)
            itemsize = BUFFER_ITEMSIZE.get(header.dtype)
            if entry is None or header.dtype != entry[1]:
                raise ProtocolError(f"{where} a chunk of key {printable(header.key, limit=64)} (dtype {header.dtype}) "
                                    "that the plan does not have")
            if not 0 < header.numel <= entry[0] - header.offset or len(payload) != header.numel * itemsize:
                raise ProtocolError(f"{where} a chunk of key {printable(header.key, limit=64)} declares {header.numel} "
                                    f"elements at offset {header.offset} of {entry[0]} and carries {len(payload)} bytes")
            if header.HasField("crc32") and zlib.crc32(payload) != header.crc32:
                raise ProtocolError(f"{where} a chunk of key {printable(header.key, limit=64)} fails its CRC-32 check")
            if got.version is not None and header.version != got.version:
                raise ProtocolError(f"{where} chunks of versions {got.version} and {header.version} in one export")
            budget[0] -= len(payload)
            if budget[0] < 0:
                raise ProtocolError(f"{where} the shards sent more bytes than the plan's {spec.declared_bytes}")
            got.version = header.version
            got.frames.append((header, payload))
            got.payload_bytes += len(payload)
    except grpc.RpcError as exc:
        raise client.error("export", exc) from None
    return got


def _match(plan: PartitionPlan, received: list[_Received]) -> None:
    """Every chunk of the plan arrived exactly once, from its own shard, with its own size."""
    chunk_at = {(c.key, c.offset): c for c in (*plan.chunks, *plan.buffer_chunks)}
    counts = [0] * plan.num_shards
    for c in chunk_at.values():
        counts[c.shard] += 1
    seen = set()
    for shard, got in enumerate(received):
        for header, _ in got.frames:
            c = chunk_at.get((header.key, header.offset))
            if c is None or c.shard != shard or c.numel != header.numel or (header.key, header.offset) in seen:
                raise ProtocolError(f"shard {shard} answered outside the protocol: a chunk that is not its own in the "
                                    f"plan (key {printable(header.key, limit=64)}, offset {header.offset})")
            seen.add((header.key, header.offset))
        if len(got.frames) != counts[shard]:
            raise ProtocolError(f"shard {shard} sent {len(got.frames)} of the {counts[shard]} chunks of its export")


def _assemble(plan: PartitionPlan, received: list[_Received]) -> dict:
    """The state_dict from chunks that all arrived: only now is torch imported and memory allocated."""
    import torch

    from shardps.common.codec import TORCH_DTYPES, copy_payload

    state = {k.key: torch.empty(k.shape, dtype=torch.float32) for k in plan.keys}
    state.update({b.key: torch.empty(b.shape, dtype=TORCH_DTYPES[b.dtype]) for b in plan.buffers})
    for got in received:
        for header, payload in got.frames:
            copy_payload(header, memoryview(payload), state[header.key].view(-1)[header.offset:][: header.numel])
        got.frames.clear()
    return state


def export_live(servers: tuple[str, ...], *, connect: Callable[[int, str], object], deadline: float,
                wait_seconds: float, allow_mixed_versions: bool, model: Mapping | None = None,
                max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, tables: Sequence[str] | None = None):
    """Export the live shards' model, allocating only for bytes that arrived and checked out.

    The plan comes from shard 0's Stats; its declared sizes are checked in
    O(keys) without building it. Every shard's Export stream is then read
    and each frame checked (a key of the plan, its size within the key, its
    payload exactly ``numel x itemsize`` bytes, one version, no more bytes in
    all than the plan declares). Only when every shard's chunks arrived is the
    plan built (at most as many chunks as frames arrived, plus one per shard)
    and each chunk matched to it; only then is torch imported and the model
    allocated. Versions: as ``shardps.worker.export.from_servers``.

    Tables (``tables``, else those the shards list): opened only then
    (``shardps.worker.table_sources.LiveTables``, every call bounded by ``deadline``), their rows read a page at
    a time, each checked, when the result is saved; the clients stay open until the result is closed.

    Args:
        connect: ``(index, address) -> ShardClient`` with timeouts bounded by ``deadline``.
        deadline: ``time.monotonic()`` by which everything is done, waiting included.
        model: a state_dict the plan must match; its other entries fill in the export.
        max_message_bytes: the clients' and the shards' message limit (a table page is at most half of it).
        tables: the names of the tables to export (None: those the shards list, if their protocol does).

    Returns:
        A ``shardps.worker.export.Export`` (close it when done).

    Raises:
        ProtocolError: a reply outside the protocol. RuntimeError: no one job, or versions that
            do not agree; ``TableError`` (one): a table's specs or sparse rounds differ between shards.
        ShardRpcError, ConnectionError: a shard refused (a table it does not hold) or did not answer in time.
    """
    clients: list = []
    owned = False
    try:
        for i, address in enumerate(servers):
            clients.append(connect(i, address))
        stats = []
        for i, c in enumerate(clients):
            stats.append(bound(c, deadline).stats(plan=True))
            checked_text(stats[-1].job_id, "job id", i, c.address)
        jobs = {(s.job_id, s.plan_fingerprint) for s in stats}
        if len(jobs) != 1 or not all(s.initialised for s in stats):
            raise RuntimeError("the shards do not hold one initialised job: "
                               f"{[(printable(s.job_id, limit=64), s.initialised) for s in stats]}")
        job_id = printable(stats[0].job_id, limit=64)
        spec = _check_spec(stats[0].plan, len(clients), max_message_bytes)
        wait_until = min(deadline, time.monotonic() + wait_seconds)
        received: list[_Received] = []
        while True:
            received.clear()  # a reading that did not agree goes before the next one arrives
            budget = [spec.declared_bytes]
            received += [_receive(c, spec, deadline, budget) for c in clients]
            # a shard that sent no frame holds no dense chunk (checked against the plan below): its Stats' version
            versions = [bound(c, deadline).stats().version if r.version is None else r.version
                        for c, r in zip(clients, received)]
            if len(set(versions)) == 1 or allow_mixed_versions:
                break
            if max(versions) - min(versions) > 1 or time.monotonic() >= wait_until:
                raise RuntimeError(
                    f"the shards are at versions {versions}: exporting them together would mix rounds. In sync "
                    "training they agree between rounds (stop or pause the workers and export again); a shard "
                    "restored from an older checkpoint stays behind for good (export anyway with "
                    "--allow-mixed-versions)")
            time.sleep(0.2)  # a round is in flight: read again once it is applied everywhere
        frames = sum(len(r.frames) for r in received)
        if frames < spec.min_chunks or budget[0] != 0:
            raise ProtocolError(f"the shards sent {frames} chunks ({spec.declared_bytes - budget[0]} bytes) of a plan "
                                f"of at least {spec.min_chunks} chunks ({spec.declared_bytes} bytes)")
        try:
            plan = PartitionPlan.from_proto(stats[0].plan)  # at most `frames` + one chunk per shard: bounded
        except ValueError as exc:
            raise ProtocolError(f"the shards' plan cannot be exported: {exc}") from None
        _match(plan, received)
        from shardps.worker import export as exporting
        from shardps.worker.table_sources import LiveTables, listed_tables

        exporting.check_plan(plan, model=model, source=f"the job {job_id} the shards hold")
        state = _assemble(plan, received)
        for name, value in (model or {}).items():
            state.setdefault(name, value.detach().clone())
        names = list(tables) if tables is not None else (listed_tables(stats[0]) or [])
        source = None
        if names:
            source = LiveTables(clients, names, versions=versions, max_message_bytes=max_message_bytes,
                                before_call=lambda c: bound(c, deadline), allow_mixed_versions=allow_mixed_versions)
            owned = True
        return exporting.Export(state, versions, stats[0].job_id, source)
    finally:
        if not owned:
            for c in clients:
                c.close()

"""Replies of the sparse calls (PullRows, ExportRows): sized before they are built, held against the shard's
memory budget until they are sent, and encoded once.

A reply's size follows from its request alone: a pull's is its ids times its tables' row bytes, an export
page's its rows times (8 + the row's weights, + its optimizer state when asked) plus the table's spec. So a
reply that would pass the shard's send limit (``--max-message-bytes``) is refused with RESOURCE_EXHAUSTED
naming that limit (an export page also names the ``max_rows`` that fits) before a row is read; one that
would take the shard past its memory budget (``--memory-budget-bytes``) is refused naming the budget. Both
checks are a few additions on the event loop: an oversized request never reaches the compute thread.

Memory. :class:`ReplyBytes` writes the reply's protobuf encoding once, into a buffer of its size: the rows
are gathered straight into it (``fused.read_rows(out=)``), then it becomes the ``bytes`` gRPC sends
(``service.py`` passes them through, no protobuf message is built). At its peak a reply so takes
:data:`REPLY_COPIES` times its size (the buffer and its ``bytes`` while they are made; the ``bytes`` and
gRPC's own copy of them while they are sent) plus bounded scratch: the id lookups and, for ids that are not
rows, the initial values, computed ``fused.INIT_BLOCK_VALUES`` at a time. Before, a reply went through a
tensor, a numpy copy, a protobuf message and its serialisation, and initial values through int64
temporaries of the whole reply: a 120 MiB reply peaked at about 1 GiB. :class:`ReplyBudget` holds
``REPLY_COPIES x size + scratch`` of every reply from before its first row is read until gRPC has sent it
(``context.add_done_callback``); a reply is refused when the shard's resident memory plus what the replies
in flight hold plus its own need would pass the budget (conservative: a reply already built is counted in
both). Near the budget, the resident memory counted leaves out what malloc holds free: the shard keeps
freed memory (``shardps.common.memory``), and a reply's buffers are taken from it first.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import warnings
from collections.abc import Awaitable, Callable

import torch

from shardps.common.rows import state_widths
from shardps.server.errors import ResourceExhausted
from shardps.server.membership.admission import resident_bytes
from shardps.server.sparse.deltas import delta_items
from shardps.server.sparse.fused import INIT_BLOCK_VALUES

__all__ = ["REPLY_COPIES", "ReplyBytes", "ReplyBudget", "Held", "PullReply", "ExportReply", "check_size",
           "field_bytes", "free_heap_bytes"]

#: Copies of a reply's bytes alive at once at its peak: see the module docstring.
REPLY_COPIES = 2
#: Scratch bytes per initial value being computed (``fused.INIT_BLOCK_VALUES`` at most at once).
SCRATCH_PER_VALUE = 48
#: Scratch bytes per id of a pull: the index lookup (a window of entries per id) and the ids' copies.
SCRATCH_PER_ID = 256
#: Scratch bytes per row of the table an export page is read from: every id and slot of the table (one pass
#: over the index), sorted.
SCRATCH_PER_ROW = 64
#: Bytes of a scalar field at most (a one-byte key and a 10-byte varint).
_SCALAR = 11

_frombuffer_warned = False
_mallinfo2 = None  # glibc's mallinfo2, once looked up (False: none)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def free_heap_bytes() -> int:
    """Bytes malloc holds free in this process's heap (glibc's ``mallinfo2().fordblks``; 0 where there is none):
    resident since they were used, and handed out again before the process asks the kernel for more (the shard
    keeps freed memory on purpose: ``shardps.common.memory``)."""
    global _mallinfo2
    if _mallinfo2 is None:
        _mallinfo2 = False
        if platform.libc_ver()[0] == "glibc":
            try:
                _mallinfo2 = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
                _mallinfo2.restype = _MallInfo2
            except (OSError, AttributeError):  # glibc before 2.33
                _mallinfo2 = False
    return int(_mallinfo2().fordblks) if _mallinfo2 else 0


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if not value:
            out.append(low)
            return bytes(out)
        out.append(low | 0x80)


def _delimited(number: int, length: int) -> bytes:
    """The key and length of length-delimited field ``number`` (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(length)


def _entry_key(key: str) -> bytes:
    """A ``map<string, bytes>`` entry's key field."""
    data = key.encode()
    return _delimited(1, len(data)) + data


def field_bytes(number: int, length: int, key: str | None = None) -> int:
    """Bytes of a length-delimited field ``number`` whose payload is ``length`` bytes; with ``key``, of a
    ``map<string, bytes>`` entry ``key -> payload`` (field ``number`` of the message)."""
    if key is None:
        return len(_delimited(number, length)) + length
    inner = len(_entry_key(key)) + len(_delimited(2, length)) + length
    return len(_delimited(number, inner)) + inner


def check_size(size: int, config, what: str, fix: str) -> None:
    """Refuse a reply of ``size`` bytes over ``config.max_message_bytes`` (the shard's send limit).

    Raises:
        ResourceExhausted: naming the reply (``what``), its size, the limit and ``fix``.
    """
    if size > config.max_message_bytes:
        raise ResourceExhausted(f"{what} would take {size} bytes, over the shard's message limit of "
                                f"{config.max_message_bytes} bytes (--max-message-bytes): {fix}; nothing was read")


class ReplyBytes:
    """One reply's protobuf bytes, written once: length-delimited fields whose payload is rows are written in
    place (:meth:`rows` hands out a writable tensor over the payload), small fields as bytes (:meth:`raw`);
    :meth:`finish` makes the ``bytes``. The buffer is allocated at the first write, on the
    thread that writes; it is freed once :meth:`finish` returned and the tensors handed out are dropped.

    Args:
        capacity: bytes the reply takes at most (the sizes of its fields; unused room is left out).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._buf: bytearray | None = None
        self._at = 0
        self._regions: list[tuple[int, int, int, torch.dtype]] = []  # (offset, n, width, dtype) of each rows field

    def _buffer(self) -> bytearray:
        if self._buf is None:
            self._buf = bytearray(self.capacity)
        return self._buf

    def _write(self, data: bytes) -> None:
        self._buffer()
        end = self._at + len(data)
        if end > self.capacity:
            raise ValueError(f"reply over its {self.capacity} bytes")  # a bug: the sizes are computed first
        self._buf[self._at:end] = data
        self._at = end

    def raw(self, data: bytes) -> None:
        """Append already encoded fields (a small message's serialisation: fields concatenate)."""
        self._write(data)

    def rows(self, number: int, n: int, width: int, dtype: torch.dtype = torch.float32,
             key: str | None = None) -> torch.Tensor:
        """Write field ``number``'s key and length, and hand out ``dtype`` ``[n, width]`` over its payload (the
        caller fills it, on this thread, before :meth:`finish`). With ``key``: a ``map<string, bytes>`` entry
        ``key -> payload``. A tensor over the buffer keeps it alive: drop it after :meth:`finish`."""
        length = n * width * dtype.itemsize
        if key is None:
            self._write(_delimited(number, length))
        else:
            inner = _entry_key(key) + _delimited(2, length)
            self._write(_delimited(number, len(inner) + length) + inner)
        self._regions.append((self._at, n, width, dtype))
        if not length:
            return torch.empty(n, width, dtype=dtype)
        if self._at + length > self.capacity:
            raise ValueError(f"reply over its {self.capacity} bytes")
        view = torch.frombuffer(self._buffer(), dtype=dtype, count=n * width, offset=self._at).view(n, width)
        self._at += length
        return view

    def finish(self) -> bytes:
        """The reply's bytes (what was written). The buffer is dropped here; tensors over it keep it alive."""
        if self._buf is None:
            return b""
        data = bytes(memoryview(self._buf)[:self._at])
        self._buf = None
        return data

    def views(self, data: bytes) -> list[torch.Tensor]:
        """Read-only tensors over ``data`` (:meth:`finish`'s) for each :meth:`rows` field, in order: the rows as
        sent, kept without a copy (nothing may write them)."""
        global _frombuffer_warned
        out = []
        for offset, n, width, dtype in self._regions:
            if not n * width:
                out.append(torch.empty(n, width, dtype=dtype))
                continue
            if _frombuffer_warned:
                out.append(torch.frombuffer(data, dtype=dtype, count=n * width, offset=offset).view(n, width))
                continue
            with warnings.catch_warnings():  # torch warns once per process that bytes are read-only
                warnings.simplefilter("ignore")
                out.append(torch.frombuffer(data, dtype=dtype, count=n * width, offset=offset).view(n, width))
            _frombuffer_warned = True
        return out


class Held:
    """Bytes a reply holds of its shard's :class:`ReplyBudget`; :meth:`release` gives them back (once)."""

    def __init__(self, budget: "ReplyBudget", need: int) -> None:
        self.budget, self.need = budget, need

    def release(self, *_) -> None:
        """Give the bytes back; later calls do nothing (any arguments are ignored: a gRPC done callback)."""
        if self.need:
            self.budget.held -= self.need
            self.need = 0

    def until(self, sent) -> None:
        """Release once the reply was sent: ``sent(callback)`` registers a callback for the call's end (gRPC's
        ``context.add_done_callback``); None: now (the caller holds the reply)."""
        if sent is None:
            self.release()
        else:
            sent(self.release)


class ReplyBudget:
    """The memory the shard's replies in flight hold against ``config.memory_budget_bytes`` (event loop only).

    Attributes:
        held: bytes held by replies being built or sent.
    """

    def __init__(self, config) -> None:
        self.config = config
        self.held = 0

    def hold(self, need: int, what: str, fix: str) -> Held:
        """Hold ``need`` bytes for a reply, or refuse it.

        Raises:
            ResourceExhausted: the shard's resident memory (less :func:`free_heap_bytes`), what replies in flight
                hold and ``need`` would pass the budget; the message names ``what``, the figures,
                ``--memory-budget-bytes`` and ``fix``.
        """
        budget = self.config.memory_budget_bytes
        resident = resident_bytes()
        if resident + self.held + need > budget:  # near the budget: what malloc holds free is used first
            resident -= min(resident, free_heap_bytes())
        if resident + self.held + need > budget:
            raise ResourceExhausted(
                f"{what} needs about {need} bytes of memory while it is built and sent; the shard holds {resident} "
                f"bytes (resident, less what malloc holds free) and its replies in flight {self.held} more, past its "
                f"memory budget of {budget} bytes (--memory-budget-bytes): {fix}, or raise --memory-budget-bytes; "
                "nothing was read")
        self.held += need
        return Held(self, need)

    async def serve(self, reply, fix: str, sent, build: Callable[[], Awaitable[bytes]]) -> bytes:
        """``await build()`` holding ``reply.need`` bytes (:meth:`hold`, ``reply.describe()`` names it) from now
        until the reply was sent (``Held.until(sent)``), or until ``build`` raises.

        Raises:
            ResourceExhausted: see :meth:`hold` (``build`` is not called); what ``build`` raises.
        """
        held = self.hold(reply.need, reply.describe(), fix)
        try:
            data = await build()
        except BaseException:
            held.release()
            raise
        held.until(sent)
        return data


def _names(tables: list) -> str:
    return ", ".join(repr(t.spec.name) for t in tables[:4]) + (", ..." if len(tables) > 4 else "")


class PullReply:
    """A ``PullRowsReply``, sized at construction: ``rows`` (one table) or one ``parts`` entry per table, then
    ``round``.

    Args:
        tables: the pull's tables (``RowTable``); counts: ids of each (the request's id bytes // 8).
        several: the request's ``tables`` form (``parts``), else ``table``/``ids`` (``rows``).
        config: the shard's ``ShardConfig``.

    Attributes:
        size: bytes of the reply at most; need: bytes of memory it may take at its peak (module docstring).

    Raises:
        ResourceExhausted: ``size`` is over ``config.max_message_bytes`` (naming it and the reply).
    """

    def __init__(self, tables: list, counts: list[int], several: bool, config) -> None:
        self.tables, self.counts, self.several = tables, counts, several
        self._number = 3 if several else 1
        widths = [n * t.spec.embedding_dim for t, n in zip(tables, counts)]
        self.size = sum(field_bytes(self._number, t.spec.row_dtype.itemsize * v) for t, v in zip(tables, widths)) \
            + _SCALAR
        self.need = REPLY_COPIES * self.size + SCRATCH_PER_ID * sum(counts) + \
            SCRATCH_PER_VALUE * min(sum(widths), INIT_BLOCK_VALUES)
        check_size(self.size, config, self.describe(), "pull fewer ids at once (a worker splits its pulls under "
                   "its WireOptions(max_message_bytes=), which must not be above the shards' limit)")
        self.bytes = ReplyBytes(self.size)
        self._out: list[torch.Tensor] | None = None
        self._data = b""

    def describe(self) -> str:
        """The reply, for messages: its ids, tables and bytes of rows."""
        rows = sum(t.spec.row_dtype.itemsize * n * t.spec.embedding_dim for t, n in zip(self.tables, self.counts))
        return f"the reply to a pull of {sum(self.counts)} ids of {_names(self.tables)} ({rows} bytes of rows)"

    def out(self) -> list[torch.Tensor]:
        """``[n_k, dim_k]`` of each table's dtype over the reply's payload, to read the rows into (compute thread)."""
        if self._out is None:
            self._out = [self.bytes.rows(self._number, n, t.spec.embedding_dim, t.spec.row_dtype)
                         for t, n in zip(self.tables, self.counts)]
        return self._out

    def finish(self, round_: int) -> list[torch.Tensor]:
        """Make the reply's bytes, with ``round_`` (compute thread; :meth:`take` hands them out): read-only
        ``[n_k, dim_k]`` of its rows over them (each table's dtype)."""
        self.out()
        if round_:
            self.bytes.raw(_varint(2 << 3) + _varint(round_))
        self._out = None  # the buffer goes with the last tensor over it
        self._data = self.bytes.finish()
        return self.bytes.views(self._data)

    def take(self) -> bytes:
        """The bytes :meth:`finish` made (once)."""
        data, self._data = self._data, b""
        return data


class ExportReply:
    """An ``ExportRowsReply`` page: ``ids``, ``weights``, one ``state`` entry per optimizer state (when asked),
    then ``spec``, ``state_width``, ``round``, ``step`` and ``total_rows``.

    Args:
        table: the ``RowTable``; start, rows: the page, rows ``[start, start + rows)`` in id order; state: with
            the optimizer state.

    Attributes:
        spec: the table's spec, encoded; size: bytes of the reply at most; need: bytes of memory it may take.
    """

    def __init__(self, table, start: int, rows: int, state: bool, since: int = 0, extra: bytes = b"") -> None:
        self.table, self.start, self.rows, self.state, self.since = table, start, rows, state, since
        self.extra = extra  # encoded fields appended as they are (``deltas.shard_fields``)
        self.evicted_limit = 1 << 62
        self.spec = table.spec.to_proto().SerializeToString()
        self.widths = state_widths(table.spec.optimizer, table.spec.embedding_dim) if state else {}
        self.size = self.size_of(rows)
        # the pass over the index (a few bool masks of its capacity, 14 bytes an entry) and the table's ids sorted
        self.need = REPLY_COPIES * self.size + SCRATCH_PER_ROW * table.rows + table.index.nbytes() // 4

    @classmethod
    def page(cls, table, offset: int, max_rows: int, state: bool, config, since: int = 0,
             extra: bytes = b"") -> "ExportReply":
        """The page ``offset``, ``max_rows`` (0: all the rows from ``offset``) of ``table`` as it is now, sized;
        ``since`` > 0: of the rows last pushed in rounds ``>= since`` (a delta, ``deltas.py``); ``extra``: encoded
        fields of the reply to append (the shard's incarnation and stream offsets, ``deltas.shard_fields``).

        Raises:
            ResourceExhausted: the page is over ``config.max_message_bytes``: the message names the limit, the
                page and the most rows a page of this table may hold (``max_rows``), or that none fits.
        """
        total = table.rows if not since else int((table.touched[table.items()[1]] >= since).sum())
        start = min(offset, total)
        rows = total - start if not max_rows else min(max_rows, total - start)
        page = cls(table, start, rows, state, since, extra)
        page.evicted_limit = config.max_message_bytes // 4  # a delta's evicted ids beyond this: say forgotten
        if page.size > config.max_message_bytes:
            fits = page.fitting_rows(config.max_message_bytes)
            check_size(page.size, config, page.describe(), f"ask for at most {fits} rows a page (max_rows)" if fits
                       else "not even one row fits: raise --max-message-bytes")
        return page

    def describe(self) -> str:
        """The page, for messages."""
        state = " with optimizer state" if self.state else ""
        return (f"the export page of table {self.table.spec.name!r} (rows {self.start} to {self.start + self.rows} "
                f"of {self.table.rows}{state})")

    def size_of(self, rows: int) -> int:
        """Bytes of a page of ``rows`` rows of this table at most."""
        dim = self.table.spec.embedding_dim
        size = field_bytes(2, 8 * rows) + field_bytes(3, self.table.spec.row_dtype.itemsize * rows * dim) + \
            field_bytes(1, len(self.spec))
        for name, width in self.widths.items():
            size += field_bytes(4, 4 * rows * width, name) + field_bytes(5, 2 * _SCALAR + len(name))
        return size + 3 * _SCALAR + len(self.extra)

    def fitting_rows(self, limit: int) -> int:
        """The most rows a page of this table may hold under ``limit`` bytes (0: not even one)."""
        low, high = 0, max(1, limit)
        while low < high:  # size_of grows with rows
            mid = (low + high + 1) // 2
            if self.size_of(mid) <= limit:
                low = mid
            else:
                high = mid - 1
        return low

    def read(self, round_now: Callable[[], int]) -> bytes:
        """The page's bytes (compute thread, between rounds): the rows in id order gathered straight into the
        reply, ``round_now()`` its round."""
        table = self.table
        ids, slots = delta_items(*table.items(), table.touched, self.since)
        total = ids.numel()
        evicted = table.evictions.since(self.since) if self.since and self.start == 0 else None
        if evicted is not None and 8 * evicted.numel() > self.evicted_limit:
            evicted = None  # too many to send: the replica reads the whole table instead
        return self.write(ids[self.start: self.start + self.rows], slots[self.start: self.start + self.rows],
                          round_now(), table.step, total, evicted, bool(self.since and self.start == 0 and
                                                                       evicted is None))

    def write(self, ids: torch.Tensor, slots: torch.Tensor, round_: int, step: int, total: int,
              evicted: torch.Tensor | None = None, forgotten: bool = False) -> bytes:
        """The page's bytes: ``ids`` (int64 ``[m]``, ``m <= rows``) and the weights (and state) at ``slots`` (int64
        ``[m]``) gathered straight into the reply, then the spec and the numbers; a delta's ``evicted`` ids
        (int64) and ``forgotten`` flag. Compute thread."""
        m = ids.numel()
        e = 0 if evicted is None else evicted.numel()
        out = ReplyBytes(self.size_of(m) + (field_bytes(9, 8 * e) if e else 0) + 2)
        if e:
            out.rows(9, e, 1, torch.int64).copy_(evicted.view(e, 1))
        out.rows(2, m, 1, torch.int64).copy_(ids.view(m, 1))
        torch.index_select(self.table.weights, 0, slots,
                           out=out.rows(3, m, self.table.spec.embedding_dim, self.table.spec.row_dtype))
        for name, width in self.widths.items():
            torch.index_select(self.table.state[name], 0, slots, out=out.rows(4, m, width, key=name))
        tail = bytearray(_delimited(1, len(self.spec)) + self.spec)
        for name, width in self.widths.items():
            entry = _entry_key(name) + _varint(2 << 3) + _varint(width)
            tail += _delimited(5, len(entry)) + entry
        for number, value in ((6, round_), (7, step), (8, total), (10, int(forgotten))):
            if value:
                tail += _varint(number << 3) + _varint(value)
        out.raw(bytes(tail) + self.extra)
        return out.finish()

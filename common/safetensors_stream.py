"""Safetensors files written and read a piece at a time: memory bounded by the piece, not by the tensor.

``safetensors.torch.save_file`` needs every tensor in memory and ``load_file``
reads them whole; ``safe_open`` maps the file, and the mapped pages a read
touches count in the process's resident memory until it closes the file.
An export of tables much larger than memory needs neither, so this module
writes and reads the format itself (https://github.com/huggingface/safetensors,
"Format"):

- 8 bytes: ``N``, the header's size, unsigned little-endian 64-bit;
- ``N`` bytes: the header, a UTF-8 JSON object ``{name: {"dtype", "shape",
  "data_offsets": [begin, end]}, "__metadata__": {str: str}}``, padded with
  spaces so that the data starts at a multiple of 8 bytes (as safetensors
  0.4 and later write it);
- the data: every tensor's bytes, row-major and little-endian, at its
  offsets relative to the data's start, with no hole and no overlap.

:class:`StreamWriter` computes the header from the tensors' names, dtypes and
shapes first (so sizes must be known before the bytes come), writes it, and
then takes each tensor's bytes in order, piece by piece (``os.pwrite``: the
page cache holds them, not the process). It writes to a temporary file in the
output's folder and renames it over the output only when every tensor has all
its bytes (:meth:`StreamWriter.commit`), so a failed export leaves no file.
The layout is safetensors' own: tensors sorted by item size (largest first),
then by name, so every tensor starts at a multiple of its item size.

:func:`read_header` and :func:`read_rows` read such a file (anyone's
safetensors file) with ``os.pread``: the header checked whole before use,
then any range of rows of a tensor.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["DTYPES", "ITEMSIZE", "Entry", "StreamWriter", "layout", "read_header", "read_rows", "tensor_bytes"]

#: safetensors' dtype names of the torch dtypes written and read here.
DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_TORCH = {name: dtype for dtype, name in DTYPES.items()}
#: Bytes per element of each safetensors dtype name.
ITEMSIZE: dict[str, int] = {name: dtype.itemsize for dtype, name in DTYPES.items()}
#: The largest header read (safetensors' own limit): a longer one is refused before it is read.
MAX_HEADER_BYTES = 100_000_000
_ALIGN = 8


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file.

    Attributes:
        name: its key; dtype: safetensors' dtype name (``"F32"``, ``"I64"``, ...);
        shape: its shape; begin, end: its bytes, relative to the start of the data (bytes).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def row_bytes(self) -> int:
        """Bytes of one index along dimension 0 (the whole tensor for a 0-d one)."""
        return ITEMSIZE[self.dtype] * math.prod(self.shape[1:])


def layout(tensors: list[tuple[str, str, tuple[int, ...]]],
           metadata: dict[str, str] | None = None) -> tuple[bytes, dict[str, Entry]]:
    """The header (its 8-byte size included, padded to 8 bytes) and every tensor's place, before any data.

    Args:
        tensors: ``(name, dtype name, shape)`` of each tensor, names unique.
        metadata: ``__metadata__``: string keys and values.

    Raises:
        ValueError: a repeated or empty name, the name ``__metadata__``, an unknown dtype, a negative
            dimension, or metadata that is not strings.
    """
    names = [t[0] for t in tensors]
    if len(set(names)) != len(names) or not all(isinstance(n, str) and n and n != "__metadata__" for n in names):
        raise ValueError("tensor names must be unique, non-empty strings other than '__metadata__'")
    meta = dict(metadata or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise ValueError("safetensors metadata takes string keys and string values")
    places, offset = {}, 0
    for name, dtype, shape in sorted(tensors, key=lambda t: (-ITEMSIZE.get(t[1], 0), t[0])):
        if dtype not in ITEMSIZE:
            raise ValueError(f"tensor {name!r}: dtype {dtype!r} is not one of {sorted(ITEMSIZE)}")
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"tensor {name!r}: negative dimension in shape {shape}")
        size = ITEMSIZE[dtype] * math.prod(shape)
        places[name] = Entry(name, dtype, shape, offset, offset + size)
        offset += size
    header = {"__metadata__": meta} if meta else {}
    header.update({e.name: {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
                   for e in places.values()})
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % _ALIGN)
    return struct.pack("<Q", len(text)) + text, places


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A CPU tensor's elements as row-major little-endian bytes, without a copy when it is contiguous.

    Raises:
        ValueError: a dtype :data:`DTYPES` does not hold, or a big-endian machine.
    """
    if tensor.dtype not in DTYPES:
        raise ValueError(f"dtype {tensor.dtype} cannot be written to safetensors here (one of {list(DTYPES)})")
    if sys.byteorder != "little":  # torch holds tensors in the machine's order; the format is little-endian
        raise ValueError("safetensors files are written on little-endian machines only")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        done = os.pwrite(fd, data, offset)
        data, offset = data[done:], offset + done


class StreamWriter:
    """A safetensors file written tensor by tensor, piece by piece, renamed into place when complete.

    Args:
        path: the output file (replaced only by :meth:`commit`).
        tensors: ``(name, dtype name, shape)`` of every tensor the file will hold (:func:`layout`).
        metadata: the header's ``__metadata__`` (strings).

    Raises:
        ValueError: as :func:`layout`.
        OSError: the folder cannot take the file (not enough free space for all its bytes: ``ENOSPC``,
            checked before anything is written), or the disk refused a write.
    """

    def __init__(self, path: str | Path, tensors: list[tuple[str, str, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        header, self.entries = layout(tensors, metadata)
        self.data_start = len(header)
        self.size = self.data_start + sum(e.nbytes for e in self.entries.values())
        self.path.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.path.parent).free
        if free < self.size:
            raise OSError(28, f"{self.path.parent} has {free} bytes free; the export needs {self.size}")
        self.tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.partial")
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.written = dict.fromkeys(self.entries, 0)
        try:
            _pwrite_all(self.fd, memoryview(header), 0)
        except BaseException:
            self.abort()
            raise

    def write(self, name: str, data: torch.Tensor | bytes | memoryview) -> None:
        """Append ``data`` to tensor ``name``'s bytes (a tensor: its dtype must be the entry's).

        Raises:
            ValueError: an unknown name, another dtype, or more bytes than the tensor has.
            OSError: the disk refused.
        """
        entry = self.entries.get(name)
        if entry is None:
            raise ValueError(f"{name!r} is not a tensor of this file")
        if isinstance(data, torch.Tensor):
            if DTYPES.get(data.dtype) != entry.dtype:
                raise ValueError(f"tensor {name!r} is {entry.dtype}, got {data.dtype}")
            data = tensor_bytes(data)
        data = memoryview(data).cast("B")
        done = self.written[name]
        if done + len(data) > entry.nbytes:
            raise ValueError(f"tensor {name!r} takes {entry.nbytes} bytes; {done + len(data)} were written")
        _pwrite_all(self.fd, data, self.data_start + entry.begin + done)
        self.written[name] = done + len(data)

    def commit(self) -> Path:
        """Check that every tensor got all its bytes, flush the file to disk and rename it to ``path``.

        Raises:
            ValueError: a tensor lacks bytes (named; the file is removed).
            OSError: the disk refused (the file is removed).
        """
        try:
            short = [f"{n} ({self.written[n]} of {e.nbytes} bytes)" for n, e in self.entries.items()
                     if self.written[n] != e.nbytes]
            if short:
                raise ValueError(f"the export is incomplete: {', '.join(short[:5])}")
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1
            os.replace(self.tmp, self.path)
        except BaseException:
            self.abort()
            raise
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        return self.path

    def abort(self) -> None:
        """Close and remove the temporary file (nothing is left at ``path``); safe to call twice."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> "StreamWriter":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is not None:
            self.abort()


def _pread_exact(fd: int, size: int, offset: int, what: str) -> bytes:
    data = os.pread(fd, size, offset)
    if len(data) != size:
        raise ValueError(f"{what}: the file ends {size - len(data)} bytes early (truncated)")
    return data


def read_header(fd: int, what: str = "the file") -> tuple[dict[str, str], dict[str, Entry], int]:
    """Read and check the header of the safetensors file open as ``fd``: ``(metadata, entries, data start)``.

    Checked before anything else is read: the size is at most :data:`MAX_HEADER_BYTES` and within the
    file; the header is a JSON object; each tensor has a known dtype, a shape of non-negative integers and
    offsets of exactly ``numel x itemsize`` bytes; together the tensors cover the data exactly, with no
    hole and no overlap, up to the file's end.

    Raises:
        ValueError: any of these fails (the message starts with ``what``).
    """
    size = os.fstat(fd).st_size
    if size < 8:
        raise ValueError(f"{what} is not a safetensors file ({size} bytes)")
    (n,) = struct.unpack("<Q", _pread_exact(fd, 8, 0, what))
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise ValueError(f"{what} declares a header of {n} bytes in a file of {size} bytes")
    try:
        header = json.loads(_pread_exact(fd, n, 8, what))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{what}: its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{what}: its header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"{what}: its __metadata__ is not an object of strings")
    entries = {}
    for name, spec in header.items():
        try:
            dtype, shape, (begin, end) = spec["dtype"], tuple(spec["shape"]), spec["data_offsets"]
            ok = dtype in ITEMSIZE and all(type(d) is int and d >= 0 for d in shape) and \
                type(begin) is int and type(end) is int and end - begin == ITEMSIZE[dtype] * math.prod(shape)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"{what}: tensor {name!r} has a malformed entry {str(spec)[:200]}")
        entries[name] = Entry(name, dtype, shape, begin, end)
    position = 0
    for entry in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if entry.begin != position:
            raise ValueError(f"{what}: tensor {entry.name!r} starts at byte {entry.begin} of the data, not {position} "
                             "(a hole or an overlap)")
        position = entry.end
    if 8 + n + position != size:
        raise ValueError(f"{what}: its tensors end at byte {8 + n + position}, the file at byte {size}")
    return metadata, entries, 8 + n


def read_rows(fd: int, entry: Entry, data_start: int, start: int = 0, count: int | None = None) -> torch.Tensor:
    """Indices ``[start, start + count)`` along dimension 0 of tensor ``entry`` (all from ``start``: None),
    read with ``os.pread`` into a fresh tensor of the entry's dtype and shape ``[count, *shape[1:]]``
    (a 0-d tensor: read whole, ``start`` 0).

    Raises:
        ValueError: the range is outside the tensor, or the file ends early.
    """
    dtype = _TORCH[entry.dtype]
    if not entry.shape:
        count, shape = 1, ()
    else:
        count = entry.shape[0] - start if count is None else count
        if not (0 <= start and 0 <= count and start + count <= entry.shape[0]):
            raise ValueError(f"rows [{start}, {start + count}) are outside tensor {entry.name!r} of shape "
                             f"{entry.shape}")
        shape = (count, *entry.shape[1:])
    out = torch.empty(shape, dtype=dtype)
    size = count * entry.row_bytes
    if size:
        target = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        offset, done = data_start + entry.begin + start * entry.row_bytes, 0
        while done < size:
            got = os.preadv(fd, [target[done:]], offset + done)
            if got <= 0:
                raise ValueError(f"tensor {entry.name!r}: the file ends {size - done} bytes early (truncated)")
            done += got
    return out

"""A checkpoint's tensor file written from the shard's live tensors: one consistent state, bounded memory.

:func:`stream` runs on the shard's compute thread as one piece of work,
queued (``ShardStore.run``, priority ``DENSE``) at a moment when no dense
round is being applied and the sparse tables are settled
(``SparseTables.settled``). Everything that changes the tensors runs on that
thread and is queued after it (a dense round's chunks at the same priority,
a sparse round or an index flush at a lower one), so the file holds exactly
one state, without a copy of it:

- parameters and buffers go from the live tensors to the file (``os.pwrite``
  into the page cache, no copy);
- the dense optimizer state as ``ShardOptimizer.get_state`` returns it (that
  call copies it: one copy of the dense state at most);
- each sparse table's rows in id order, :data:`BLOCK_BYTES` of rows at a
  time (``RowTable.write_snapshot``), plus the table's ids and slots sorted
  (about 32 bytes per row of the table being written, at the peak).

So the shard's resident memory rises by about one block, the largest
table's sorted ids, and the dense optimizer state while a checkpoint is
written, not by a copy of every table. Rounds and pulls wait for this work
(the rows go to the page cache at memory speed: about 0.5 s per GiB here);
the file's SHA-256, fsync and rename come after, on the checkpoint writer's
thread, while rounds go on (``shardps.common.checkpoint.finish``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from shardps.common import checkpoint
from shardps.common.safetensors_stream import DTYPES, StreamWriter, read_header, tensor_bytes

#: Bytes of sparse rows gathered and written at a time (a dense comparison reads this much at a time too).
BLOCK_BYTES = 8 << 20


def dense_tensors(params: dict[int, torch.Tensor], buffers: torch.Tensor, optimizer) -> list[tuple[str, torch.Tensor]]:
    """The dense tensors of a checkpoint: ``param/<group>`` (the live fp32 tensors), ``buffers`` (the live uint8
    arena), ``state/<key>/<name>`` (``optimizer.get_state()``'s copies). Compute thread, between rounds."""
    out = [(f"param/{g}", t) for g, t in params.items()]
    out.append(("buffers", buffers))
    for key, entries in optimizer.get_state().items():
        out.extend((f"state/{key}/{name}", value) for name, value in entries.items())
    return out


def same_dense(path: Path, dense: list[tuple[str, torch.Tensor]]) -> bool:
    """Whether the tensor file at ``path`` holds exactly ``dense`` besides its ``rows/`` tensors (the same names,
    dtypes, shapes and bytes), read :data:`BLOCK_BYTES` at a time. False when it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        _, entries, start = read_header(fd, path.name)
        held = {k: e for k, e in entries.items() if not k.startswith("rows/")}
        if set(held) != {name for name, _ in dense}:
            return False
        for name, tensor in dense:
            entry = held[name]
            if entry.dtype != DTYPES.get(tensor.dtype) or entry.shape != tuple(tensor.shape):
                return False
            data = tensor_bytes(tensor)
            for at in range(0, len(data), BLOCK_BYTES):
                piece = data[at: at + BLOCK_BYTES]
                if os.pread(fd, len(piece), start + entry.begin + at) != piece:
                    return False
        return True
    except (OSError, ValueError):
        return False
    finally:
        os.close(fd)


def stream(directory: Path, name: checkpoint.Name, params: dict[int, torch.Tensor], buffers: torch.Tensor,
           optimizer, layout: list[tuple[str, str, tuple[int, ...]]], write_rows,
           previous: Path | None = None) -> StreamWriter | None:
    """Write checkpoint ``name``'s tensor file into a temporary file of ``directory`` (compute thread, see the
    module docstring); finish it with ``shardps.common.checkpoint.finish``.

    Args:
        params, buffers, optimizer: the job's live parameters (``{group: fp32 [n]}``), buffer arena (uint8) and
            ``ShardOptimizer``.
        layout, write_rows: the sparse tables' tensors and their writer (``SparseTables.snapshot``).
        previous: the tensor file of the newest checkpoint when its numbers (job, versions, hyperparameters,
            tables) are this state's: if its dense tensors are these too, nothing is written.

    Returns:
        The open writer, every byte written; None: the state is ``previous``'s (nothing written).

    Raises:
        ValueError: a tensor of a dtype safetensors files here do not take; a table that changed meanwhile
            (RuntimeError). OSError: the disk lacks the room or refused (nothing is left of the file).
    """
    dense = dense_tensors(params, buffers, optimizer)
    if previous is not None and same_dense(previous, dense):
        return None
    for tensor_name, tensor in dense:
        if tensor.dtype not in DTYPES:
            raise ValueError(f"tensor {tensor_name!r}: dtype {tensor.dtype} is not one of {list(DTYPES)}")
    writer = checkpoint.start(directory, name, [(n, DTYPES[t.dtype], tuple(t.shape)) for n, t in dense] + layout)
    try:
        for tensor_name, tensor in dense:
            writer.write(tensor_name, tensor)
        del dense
        write_rows(writer.write, BLOCK_BYTES)
    except BaseException:
        writer.abort()
        raise
    return writer

"""Keep freed chunk-sized buffers in the process's heap instead of handing them back to the kernel.

Every chunk on the wire is a fresh ``bytes`` object of up to a few MiB on
both ends (the encoded frame, gRPC's received message, the pulled payload).
glibc's malloc serves an allocation above its *mmap threshold* (128 KiB at
start, raised after frees up to 32 MiB) with new ``mmap`` pages, and hands
free memory at the top of its heap back to the kernel above its *trim
threshold* (twice the mmap threshold). A round that frees a model's worth
of chunks therefore returns the pages, and the next round faults every
4 KiB page in again: on a 2-core host, making 32 MiB of 4 MiB ``bytes``
objects that way takes 13 ms, against 3 ms when freed memory is reused (the
copy itself). :func:`retain_freed_memory` sets both thresholds once per
process with ``mallopt(3)``, so that chunk-sized buffers come from the heap
and freed ones are reused, and keeps every thread on one malloc arena:
gRPC's threads allocate messages in arenas of their own otherwise, and
glibc unmaps such an arena's heap whenever all of it is free, whatever the
trim threshold (64 MiB rounds of ``benchmarks/wire.py`` on 2 cores, both
thresholds set: 1.11 GB/s with one arena, 0.83 with two, 0.76 with glibc's
8 per core). The same cost is why PyTorch's performance guide suggests
jemalloc or TCMalloc for CPU training; ``mallopt`` needs no preloaded
library and works after the process started.

The price: up to :data:`RETAIN_BYTES` of freed memory stays mapped to the
process (its resident size stays near its peak instead of shrinking back),
and threads that allocate at the same moment take turns on the one arena's
lock (allocations of up to 1 KiB come from each thread's own cache first).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

#: ``mallopt``'s parameter numbers (glibc ``malloc.h``).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
#: Allocations up to this many bytes come from the heap, not from fresh ``mmap`` pages: 32 MiB, the largest
#: value glibc accepts on 64-bit hosts (every chunk, frame and gRPC message shardps makes is smaller).
MMAP_THRESHOLD_BYTES = 32 << 20
#: Free memory kept at the top of the heap before malloc returns it to the kernel, bytes (1 GiB).
RETAIN_BYTES = 1 << 30
#: Environment variables through which glibc takes the same settings at start: where one is set, the
#: operator chose, and :func:`retain_freed_memory` leaves malloc alone.
GLIBC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX", "GLIBC_TUNABLES")

_done: str | None = None


def retain_freed_memory() -> str:
    """Make this process's malloc reuse freed chunk-sized buffers (glibc ``mallopt``; once per process).

    Sets the mmap threshold to :data:`MMAP_THRESHOLD_BYTES`, the trim
    threshold to :data:`RETAIN_BYTES` and the number of arenas to one. Does nothing where the C library is
    not glibc, or where one of :data:`GLIBC_ENV` is set (the operator's own
    malloc settings win). Never raises: the data plane works either way,
    only slower.

    Returns:
        What was done, for a log line: ``"retained"``, or why not.
    """
    global _done
    if _done is not None:
        return _done
    if platform.libc_ver()[0] != "glibc":
        _done = "not glibc: malloc left as it is"
    elif any(name in os.environ for name in GLIBC_ENV):
        _done = "malloc settings come from the environment"
    else:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            ok = all(libc.mallopt(param, value) for param, value in (
                (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (M_TRIM_THRESHOLD, RETAIN_BYTES), (M_ARENA_MAX, 1)))
        except (OSError, AttributeError) as exc:
            ok, why = False, str(exc)
        else:
            why = "mallopt refused"
        _done = "retained" if ok else f"malloc left as it is: {why}"
    return _done

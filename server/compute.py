"""``PriorityExecutor``: the shard's one compute thread, taking queued work by priority.

Everything that touches a shard's tensors runs on one thread, one piece at a
time, so no two pieces see each other half done. A plain one-thread pool runs
them in submission order; this executor runs the lowest priority number first
and keeps submission order within a priority. The shard queues a sparse
table's work behind its dense round's (a dense round is a few ms of work that
a worker's next forward waits for), a prefetch's early read of rows for a
later round (a look-ahead, needed only once that round is applied) behind the
sparse work a worker waits for now, and keeps what merely tidies up (a round's
new keys entering the id index) for when nothing else waits. Measured on the
1 worker x 1 shard DeepFM of ``benchmarks/recommender.py``: the look-ahead of
step k + 1's prefetch (1.5-3 ms) arrived just before step k's pull became
ready and delayed its answer, which that worker's forward was waiting for.
"""

from __future__ import annotations

import itertools
import queue
import threading
from concurrent.futures import Executor, Future

__all__ = ["PriorityExecutor", "DENSE", "SPARSE", "AHEAD", "IDLE"]

#: Priorities (lowest runs first): dense rounds and everything else, sparse rounds and pulls, look-ahead
#: reads of prefetches for rounds not applied yet, idle work.
DENSE, SPARSE, AHEAD, IDLE = 0, 1, 2, 3


class PriorityExecutor(Executor):
    """One thread; :meth:`submit_at` queues ``fn(*args)`` at a priority (see the module docstring), and
    :meth:`submit` at :data:`DENSE`. A call that started runs to its end (work is never interrupted).

    Args:
        name: the thread's name.
    """

    def __init__(self, name: str = "shard-compute") -> None:
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        return self.submit_at(DENSE, fn, *args, **kwargs)

    def submit_at(self, priority: int, fn, /, *args, **kwargs) -> Future:
        """Queue ``fn(*args, **kwargs)`` at ``priority``; its future.

        Raises:
            RuntimeError: the executor was shut down.
        """
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new work after shutdown")
            self._queue.put((priority, next(self._order), future, fn, args, kwargs))
        return future

    def _work(self) -> None:
        while True:
            _, _, future, fn, args, kwargs = self._queue.get()
            if future is None:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller through its future
                future.set_exception(exc)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking work; the work queued so far still runs (``cancel_futures``: it is cancelled instead)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if cancel_futures:
                while True:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    item[2].cancel()
            self._queue.put((float("inf"), next(self._order), None, None, (), {}))
        if wait:
            self._thread.join()

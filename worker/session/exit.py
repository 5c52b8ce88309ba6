"""A script that ends without ``close()``: nothing of shardps holds the interpreter, and what it opened is closed.

A training script that raises (or returns, or calls ``sys.exit``) without
closing its ``DistributedOptimizer`` must still exit, with its own exit
code, so that torchrun or Kubernetes can restart it. Two things used to
keep such a process alive:

- ``concurrent.futures.ThreadPoolExecutor`` threads are not daemon threads,
  and the interpreter joins them at exit (``threading._register_atexit``,
  before any ``atexit`` handler runs): a pool thread waiting for a round
  that will never close (this worker raised before ``step()``) held the
  process until the call's deadline (``WireOptions.rpc_timeout``, 120 s),
  and every later one too;
- nothing left the shards, so the other workers' rounds waited for this
  one until its lease ran out.

:class:`DaemonPool` is the executor of every call shardps makes to several
shards at once: its threads are daemon threads that the interpreter never
waits for. :func:`close_at_exit` registers what must be closed when the
interpreter exits (an optimizer leaves the shards; a ``LocalCluster`` stops
its shard processes); one ``atexit`` handler closes whatever is still open,
the last registered first, each at most once, in the process that opened it
(a forked child closes only its own). A process killed by a signal runs no
exit handler: its shards drop it at lease expiry, and a ``LocalCluster``'s
shard processes are stopped by the kernel (``shardps.worker.cluster``).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future

__all__ = ["DaemonPool", "close_at_exit", "forget"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
#: key -> (the process that registered it, the function that closes it), in registration order
_pending: dict[int, tuple[int, Callable[[], None]]] = {}
_keys = itertools.count(1)


def close_at_exit(close: Callable[[], None]) -> int:
    """Call ``close()`` when the interpreter exits, unless :func:`forget` is called first.

    Handlers run from one ``atexit`` handler, the last registered first (an
    optimizer closes before the cluster it trains on), after the interpreter
    has joined every non-daemon thread. An exception in one is logged and
    the others still run.

    Returns:
        The key to pass to :func:`forget` once the object is closed.
    """
    key = next(_keys)
    with _lock:
        _pending[key] = (os.getpid(), close)
    return key


def forget(key: int) -> None:
    """Do not call the handler registered under ``key`` at exit (it was closed); an unknown key is ignored."""
    with _lock:
        _pending.pop(key, None)


def _close_pending() -> None:
    """The ``atexit`` handler: close what this process registered and did not close, newest first."""
    with _lock:
        mine = [close for pid, close in _pending.values() if pid == os.getpid()]
        _pending.clear()
    for close in reversed(mine):
        try:
            close()
        except Exception:  # one failure must not keep the others open
            log.exception("closing %r at exit failed", close)


atexit.register(_close_pending)


class DaemonPool(Executor):
    """``ThreadPoolExecutor``'s behaviour (up to ``max_workers`` threads, made when no thread is idle, named
    ``<thread_name_prefix>_<n>``) with daemon threads that the interpreter does not wait for at exit.

    ``submit``, ``map`` and ``shutdown`` are ``concurrent.futures.Executor``'s.
    A thread stays busy until its call returns: closing the channels (or
    cancelling the calls) is what ends calls in flight.

    Raises:
        ValueError: ``max_workers < 1``.
    """

    def __init__(self, max_workers: int, thread_name_prefix: str = "shardps-pool") -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self._max_workers, self._prefix = max_workers, thread_name_prefix
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._shutdown = False

    def submit(self, fn, /, *args, **kwargs) -> Future:
        """Run ``fn(*args, **kwargs)`` on a pool thread.

        Raises:
            RuntimeError: the pool was shut down.
        """
        future: Future = Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._work.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max_workers:
                thread = threading.Thread(target=self._run, name=f"{self._prefix}_{len(self._threads)}", daemon=True)
                thread.start()
                self._threads.append(thread)
        return future

    def _run(self) -> None:
        while True:
            item = self._work.get()  # blocking wait for work (a daemon thread: never waited for at exit)
            if item is None:  # shut down: pass the word on to the next thread
                self._work.put(None)
                return
            future, fn, args, kwargs = item
            del item
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:  # handed to the future's owner, as ThreadPoolExecutor does
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            del future, fn, args, kwargs
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Refuse new work; threads end once the work queued before is done (``cancel_futures``: queued work
        that has not started is cancelled). ``wait``: block until every thread has ended."""
        with self._lock:
            self._shutdown = True
            if cancel_futures:
                while True:
                    try:
                        item = self._work.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        item[0].cancel()
            self._work.put(None)
            threads = list(self._threads)
        if wait:
            for thread in threads:
                if thread is not threading.current_thread():
                    thread.join()

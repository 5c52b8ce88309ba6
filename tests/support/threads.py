"""Worker threads for oracle tests: each runs one replica's training loop, errors re-raised in the test."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def run_workers(n: int, fn: Callable[[int], T], timeout: float = 120.0) -> list[T]:
    """Run ``fn(0) .. fn(n - 1)`` in ``n`` daemon threads and return their results in order.

    Raises:
        AssertionError: a thread is still running after ``timeout`` seconds.
        BaseException: the first exception a thread raised.
    """
    results: list = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = fn(i)
        except BaseException as exc:  # re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), f"a worker thread hung for {timeout} s"
    if errors:
        raise errors[0]
    return results

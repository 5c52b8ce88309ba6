"""Waking the coroutines that wait for something on a shard to change (a version, a member, a round)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Notifier:
    """Wake every coroutine waiting for a change on the shard (no thread is held while waiting)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify_all(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``predicate()`` holds or ``timeout`` seconds pass; returns ``predicate()``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not predicate():
            event = self._event
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except TimeoutError:
                return predicate()
        return True

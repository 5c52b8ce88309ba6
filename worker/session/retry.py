"""Retrying calls to a shard: capped exponential backoff with full jitter, for a bounded total time.

After UNAVAILABLE (the shard is restarting, the connection dropped) or
DEADLINE_EXCEEDED, a call is tried again after a random delay drawn
uniformly from ``[0, min(max_delay, initial_delay * 2**attempt)]`` ("full
jitter": M. Brooker, "Exponential Backoff And Jitter", AWS Architecture
Blog, 2015; the gRPC connection-backoff spec uses the same capped
exponential shape), so that many workers retrying one restarted shard do not
arrive in lockstep. Once ``total_seconds`` have passed since the first
attempt the last error is raised (a :class:`ShardRpcError` naming the shard).

Only calls that are safe to repeat are retried: Join with the same session
is the member retrying (the shard changes nothing), Leave, Stats, Reset,
Checkpoint, Pull and Export change nothing when repeated. A push is never
re-sent by this loop: see ``DistributedOptimizer`` for what happens to a
round whose push stream failed.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Status codes after which a repeatable call is tried again.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


@dataclass(frozen=True)
class RetryPolicy:
    """How long and how often to retry (all in seconds).

    Attributes:
        total_seconds: give up (raise the last error) once this much time has
            passed since the first attempt; 0 disables retries.
        initial_delay: the first backoff's upper bound.
        max_delay: cap of every backoff.
    """

    total_seconds: float = 60.0
    initial_delay: float = 0.05
    max_delay: float = 2.0
    #: called with the call's description before each retry (the worker's metrics count them)
    on_retry: Callable[[str], None] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.total_seconds < 0 or self.initial_delay <= 0 or self.max_delay < self.initial_delay:
            raise ValueError(f"bad retry policy {self}: need total_seconds >= 0 and 0 < initial_delay <= max_delay")

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """The backoff before retry number ``attempt`` (0-based): uniform in ``[0, min(max, initial * 2**attempt)]``."""
        cap = min(self.max_delay, self.initial_delay * (2 ** min(attempt, 30)))
        return (rng or random).uniform(0.0, cap)


def retry(call: Callable[[], T], policy: RetryPolicy, what: str, code_of: Callable[[BaseException], object],
          retry_on: frozenset = RETRYABLE) -> T:
    """Run ``call()`` until it succeeds, retrying errors whose ``code_of(error)`` is in ``retry_on``.

    Args:
        call: the attempt (raises on failure).
        policy: backoff and the total time bound.
        what: named in the log line of each retry.
        code_of: the gRPC status code of an exception (None for anything else, which is raised at once).

    Raises:
        Whatever ``call`` raised last, once the error is not retryable or ``policy.total_seconds`` ran out.
    """
    deadline = time.monotonic() + policy.total_seconds
    attempt = 0
    while True:
        try:
            return call()
        except Exception as exc:
            code = code_of(exc)
            left = deadline - time.monotonic()
            if code not in retry_on or left <= 0:
                raise
            pause = min(policy.delay(attempt), left)  # the last attempt comes at the deadline, not before it
            if attempt == 0 or attempt % 10 == 0:
                log.warning("%s failed (%s); retrying for up to %.0fs more", what, getattr(code, "name", code),
                            deadline - time.monotonic())
            attempt += 1
            if policy.on_retry is not None:
                policy.on_retry(what)
            time.sleep(pause)

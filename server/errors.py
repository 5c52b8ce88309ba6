"""Errors the shard store raises; the gRPC service maps each to the status of the same name."""

from __future__ import annotations

import asyncio
import weakref


class ShardError(Exception):
    """Base class: ``code`` is the name of the gRPC status code the service answers with."""

    code = "INTERNAL"


class InvalidArgument(ShardError):
    """The request itself is wrong (unknown key, wrong size, bad optimizer, NaN gradient)."""

    code = "INVALID_ARGUMENT"


class FailedPrecondition(ShardError):
    """The request is well-formed but does not fit the shard's job or membership now (plan mismatch, not joined)."""

    code = "FAILED_PRECONDITION"


class Aborted(ShardError):
    """A concurrent change got in the way; retrying the call is safe."""

    code = "ABORTED"


class DeadlineExceeded(ShardError):
    """A wait for a version did not finish in time."""

    code = "DEADLINE_EXCEEDED"


class Unavailable(ShardError):
    """The shard is shutting down."""

    code = "UNAVAILABLE"


class AlreadyExists(ShardError):
    """A Join for a worker id that is a live member from another process (another session)."""

    code = "ALREADY_EXISTS"


class ResourceExhausted(ShardError):
    """A limit of the shard is reached (members, waiting calls, memory budget)."""

    code = "RESOURCE_EXHAUSTED"


# A call the store ends from outside (a member left while its push or Init streamed):
# the task is cancelled and the service answers with the error recorded here.
_stopped: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def stop_call(task: asyncio.Task, error: ShardError) -> None:
    """End the call running in ``task`` with ``error`` as its status (not a silent cancellation)."""
    _stopped[task] = error
    task.cancel()


def stopped_with(task: asyncio.Task | None) -> ShardError | None:
    """The error :func:`stop_call` ended ``task`` with, or None if it was cancelled otherwise."""
    return _stopped.pop(task, None) if task is not None else None

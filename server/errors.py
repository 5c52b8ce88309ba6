"""Errors the shard store raises; the gRPC service maps each to the status of the same name."""

from __future__ import annotations


class ShardError(Exception):
    """Base class: ``code`` is the name of the gRPC status code the service answers with."""

    code = "INTERNAL"


class InvalidArgument(ShardError):
    """The request itself is wrong (unknown key, wrong size, bad optimizer, NaN gradient)."""

    code = "INVALID_ARGUMENT"


class FailedPrecondition(ShardError):
    """The request is well-formed but does not fit the shard's state (plan mismatch, not joined)."""

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

"""Consistency modes of a job: sync (BSP), async (ASP) and ssp (bounded staleness), and staleness counts.

- **sync**: bulk synchronous rounds (``rounds.py``): a round averages one push
  of every member and is applied once; a pull of version ``r + 1`` waits for it.
- **async** (asynchronous parallel, as in Hogwild-style parameter servers; Li
  et al., OSDI 2014): each push is applied on its own, in arrival order, with
  the learning rates it carries; the pushing worker gets the newest version
  back without waiting for anybody else.
- **ssp** with bound ``s`` (Ho et al., "More Effective Distributed ML via a
  Stale Synchronous Parallel Parameter Server", NIPS 2013): pushes are applied
  on arrival as in async (Ho et al.'s choice: no work is held back), and a
  worker's clock is the number of its pushes this shard applied. A worker at
  clock ``c`` gets its parameters back only once the slowest live member is
  at ``c - s`` or later, so no worker computes more than ``s`` clocks ahead of
  the slowest. With ``s = 0`` every worker waits for every other at each
  clock, but the gradients are still applied one by one (one optimizer step
  per push), which is not sync mode's single averaged step: use ``sync`` for
  the exact equivalent of single-process training.

Staleness of an applied gradient is the shard's version at apply time minus
the version the gradient was computed from (the round its push names).
Optionally (off by default) async/ssp divide each push's learning rates by
``max(1, staleness)`` (Zhang et al., "Staleness-aware Async-SGD", IJCAI 2016).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardps.common.modes import MAX_STALENESS, MODES, mode_problem
from shardps.proto import shardps_pb2 as pb
from shardps.server.errors import FailedPrecondition, InvalidArgument

__all__ = ["MAX_STALENESS", "MODES", "STALENESS_BUCKETS", "Mode", "StalenessHistogram"]

#: Staleness histogram entries: 0 .. STALENESS_BUCKETS - 2 one each, the last counts everything above.
STALENESS_BUCKETS = 32


@dataclass(frozen=True)
class Mode:
    """A job's consistency mode: ``name`` in :data:`MODES`, ssp's bound ``staleness``, lr scaling."""

    name: str = "sync"
    staleness: int = 0
    scale_lr: bool = False

    @property
    def synchronous(self) -> bool:
        return self.name == "sync"

    @classmethod
    def from_proto(cls, spec: pb.ModeSpec) -> "Mode":
        """Check a worker's ``ModeSpec``.

        Raises:
            InvalidArgument: an unknown mode, a bound outside ssp, lr scaling in sync mode.
        """
        name = spec.mode or "sync"
        staleness = spec.staleness if spec.staleness or name == "ssp" else None  # 0 is proto3's "not set"
        problem = mode_problem(name, staleness, spec.scale_lr_by_staleness)
        if problem:
            raise InvalidArgument(problem)
        return cls(name, spec.staleness, spec.scale_lr_by_staleness)

    def to_proto(self) -> pb.ModeSpec:
        return pb.ModeSpec(mode=self.name, staleness=self.staleness, scale_lr_by_staleness=self.scale_lr)

    def describe(self) -> str:
        extra = f" s={self.staleness}" if self.name == "ssp" else ""
        return f"{self.name}{extra}{' with staleness-scaled lr' if self.scale_lr else ''}"

    def check_commit(self, what: str, needs_commit: bool) -> None:
        """An async/ssp push is applied alone, at once: it cannot wait for a report/commit exchange.

        Workers clip and unscale their own gradient there (``shardps.worker.pipeline.own``); a
        push that asks the shards to (an older worker) is refused instead of stalling the shard.

        Raises:
            InvalidArgument: ``needs_commit`` (a trailer with ``max_grad_norm`` or ``inv_scale``) outside sync.
        """
        if needs_commit and not self.synchronous:
            raise InvalidArgument(f"{what}: in {self.name} mode each push is applied on its own; the worker clips "
                                  "and unscales its own gradient and pushes it without max_grad_norm or inv_scale "
                                  "(update the worker)")

    def check_same(self, other: "Mode") -> None:
        """A later joiner must train in the job's mode.

        Raises:
            FailedPrecondition: naming both modes.
        """
        if other != self:
            raise FailedPrecondition(
                f"the worker trains in mode {other.describe()!r} but this job runs in mode {self.describe()!r} "
                "(the first worker fixed it): start every worker with the same mode, or reset the shards"
            )


class StalenessHistogram:
    """Counts of applied gradients by staleness (see the module docstring); ``counts`` has STALENESS_BUCKETS."""

    def __init__(self) -> None:
        self.counts = [0] * STALENESS_BUCKETS

    def record(self, staleness: int, n: int = 1) -> None:
        self.counts[min(max(staleness, 0), STALENESS_BUCKETS - 1)] += n

    def reset(self) -> None:
        self.counts = [0] * STALENESS_BUCKETS

"""The decision of a round that clips or scales: one global answer from every shard's report.

``torch.nn.utils.clip_grad_norm_`` after DDP clips the averaged gradient by
its norm over the whole model, and ``torch.amp.GradScaler`` skips a step
when any gradient is not finite. With the model split over shards, each
shard measures its part (``RoundReport``) and every worker combines all
parts the same way into the same ``RoundCommit``: skip, or the clip
coefficient, computed with clip_grad_norm_'s float32 arithmetic. The
worker also hands the global found-inf to the GradScaler, so that
``scaler.update()`` backs off or grows the scale on every worker alike.

A round that fails on a shard before every report is in (the shard died or
restarted) cannot be decided: it is abandoned, and the other shards skip
it (``Round.wait_decided``). Once the failed shards are rejoined, the step
returns as skipped, with a warning: no shard applied the round, as no
shard applies a round skipped for Inf.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.amp.grad_scaler import OptState

from shardps.proto import shardps_pb2 as pb

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RoundOptions:
    """What a worker asks of every round it pushes.

    Attributes:
        max_grad_norm: clip the averaged gradient to this total norm (None: no clipping).
        norm_type: the norm's order, as clip_grad_norm_'s (2.0; ``inf`` allowed).
        grad_scaler: a ``torch.amp.GradScaler`` whose scaled gradients the worker
            pushes (None, or a disabled scaler: not scaled).
    """

    max_grad_norm: float | None = None
    norm_type: float = 2.0
    grad_scaler: torch.amp.GradScaler | None = None

    def __post_init__(self) -> None:
        if self.max_grad_norm is not None and not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be a finite number > 0, got {self.max_grad_norm}")
        if not (self.norm_type == math.inf or (math.isfinite(self.norm_type) and self.norm_type > 0)):
            raise ValueError(f"norm_type must be > 0 or inf, got {self.norm_type}")
        if self.grad_scaler is not None and not isinstance(self.grad_scaler, torch.amp.GradScaler):
            raise ValueError(f"grad_scaler must be a torch.amp.GradScaler, got {type(self.grad_scaler).__name__}")

    @property
    def scaled(self) -> bool:
        return self.grad_scaler is not None and self.grad_scaler.is_enabled()

    @property
    def needs_commit(self) -> bool:
        return self.scaled or self.max_grad_norm is not None

    def trailer_fields(self) -> dict:
        """The RoundTrailer fields for this round (reads the current scale: a host sync, once per step)."""
        fields = {"max_grad_norm": self.max_grad_norm or 0.0, "norm_type": self.norm_type}
        if self.scaled:
            # GradScaler.unscale_ multiplies by scale.double().reciprocal().float(): the same float32 value
            fields["inv_scale"] = torch.tensor(self.grad_scaler.get_scale(), dtype=torch.float64).reciprocal().float().item()
        return fields


def decide(reports: Sequence[pb.RoundReport], options: RoundOptions, round_: int) -> tuple[pb.RoundCommit, float]:
    """Combine every shard's report of ``round_`` into the commit every worker sends.

    Returns:
        ``(commit, total_norm)``; the total norm of the (unscaled) averaged
        gradient, NaN when not finite or not measured.
    """
    if any(r.found_inf for r in reports):
        return pb.RoundCommit(round=round_, skip=True, clip_coef=1.0), math.nan
    p = options.norm_type
    parts = [r.norm_part for r in reports]
    total = max(parts, default=0.0) if math.isinf(p) else sum(parts) ** (1.0 / p)
    if options.max_grad_norm is None:
        return pb.RoundCommit(round=round_, skip=False, clip_coef=1.0), total
    # clip_grad_norm_: clamp(max_norm / (total_norm + 1e-6), max=1) in float32
    coef = torch.clamp(options.max_grad_norm / (torch.tensor(total, dtype=torch.float32) + 1e-6), max=1.0).item()
    return pb.RoundCommit(round=round_, skip=False, clip_coef=coef), total


def record_found_inf(scaler: torch.amp.GradScaler, optimizer: object, found_inf: bool) -> None:
    """Tell ``scaler`` what the round found, as its own ``step(optimizer)`` would have, for ``update()``.

    Uses GradScaler's per-optimizer bookkeeping (``_per_optimizer_states``),
    the same the fused optimizers' path relies on.
    """
    state = scaler._per_optimizer_states[id(optimizer)]
    state["found_inf_per_device"] = {torch.device("cpu"): torch.tensor([1.0 if found_inf else 0.0])}
    state["stage"] = OptState.STEPPED


def await_decision(rnd, options: RoundOptions, optimizer: object, finish: Callable[[], None]) -> bool:
    """Wait for the verdict of a round that clips or scales (``rnd``: a ``worker.rounds.Round``); hand it on.

    Returns:
        Whether the round was skipped (the GradScaler is told whether it found Inf; a round abandoned because
        a shard failed before reporting found none).

    Raises:
        ShardRpcError: from ``finish()``, when the round failed before its reports on a shard that could not
            be rejoined.
        RuntimeError: a round skipped for overflow without a GradScaler.
    """
    if not rnd.wait_decided():
        finish()  # raises the failure
        raise RuntimeError("the shards ended the round without a report")
    if rnd.abandoned:
        error = rnd.failed()
        finish()  # raises the failure, unless every failed shard was rejoined
        log.warning("the round of this step was lost: a shard failed before every shard reported (%s); the other "
                    "shards skipped it, so no shard applied it, and the step counts as skipped", error)
        if options.scaled:
            record_found_inf(options.grad_scaler, optimizer, False)
        return True
    if options.scaled:
        record_found_inf(options.grad_scaler, optimizer, rnd.commit.skip)
    elif rnd.commit.skip:
        finish()
        raise RuntimeError(
            f"round {rnd.commit.round} was skipped on every shard: the averaged gradient is not finite (float32 "
            "overflow); lower the learning rate or the loss, or train with a GradScaler"
        )
    return rnd.commit.skip

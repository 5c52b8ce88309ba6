"""Consistency modes: the names and the one check of a mode's arguments, used on both ends of the wire.

The worker raises ``ValueError`` with the problem at ``DistributedOptimizer(...)``;
the shard answers INVALID_ARGUMENT with the same text when a client sends it
anyway. What each mode does is in ``shardps.server.consistency.modes``.
"""

from __future__ import annotations

__all__ = ["MAX_STALENESS", "MODES", "mode_problem"]

MODES = ("sync", "async", "ssp")
#: The largest ssp bound a shard accepts (clocks).
MAX_STALENESS = 1 << 20


def mode_problem(mode: str, staleness: int | None, scale_lr_by_staleness: bool) -> str | None:
    """What is wrong with these consistency-mode arguments, or None when they are valid.

    Args:
        mode: one of :data:`MODES`.
        staleness: ssp's bound ``s`` in clocks, an int in ``[0, MAX_STALENESS]``;
            None (or 0 from the wire) for the other modes.
        scale_lr_by_staleness: divide learning rates by the staleness (async and ssp only).

    Returns:
        A message naming the fix, or None.
    """
    if mode not in MODES:
        return f"mode must be one of {', '.join(repr(m) for m in MODES)}, got {str(mode)[:40]!r}"
    if mode == "ssp" and (not isinstance(staleness, int) or isinstance(staleness, bool) or staleness < 0):
        return f"mode='ssp' needs staleness=s, an int >= 0 (clocks a worker may run ahead); got {staleness!r}"
    if mode != "ssp" and staleness is not None:
        return f"staleness={staleness!r} only applies to mode='ssp', not {mode!r}"
    if staleness is not None and staleness > MAX_STALENESS:
        return f"staleness bound {staleness} is above the limit {MAX_STALENESS}"
    if scale_lr_by_staleness and mode == "sync":
        return "scale_lr_by_staleness applies to mode='async' or 'ssp' (sync rounds have no staleness)"
    return None

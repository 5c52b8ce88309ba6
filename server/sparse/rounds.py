"""What keeps a sparse round all-or-nothing: merging the members' pushes, naming a step that failed.

A shard applies a sparse round as dense rounds are applied: every member's
rows averaged, the members agreeing on each table's learning rate (a round
whose members disagree is refused for all of them, naming the table, the
workers and both rates), the update computed into temporaries and checked
finite before anything of the shard changes
(``shardps.server.sparse.fused.prepare_round``), then committed. A step
that raises or would not be finite becomes a :class:`~shardps.server.errors.ShardError`
naming the tables and the cause (:func:`step_failed`, :func:`not_finite`);
the shard records it for every member of the round, and each member's next
pull or push raises it (``SparseTables.failed``).

Every function runs on the shard's compute thread and changes nothing.
"""

from __future__ import annotations

import torch

from shardps.server.checks import shown
from shardps.server.errors import InvalidArgument, ResourceExhausted, ShardError

__all__ = ["merged_round", "step_failed", "not_finite"]


def merged_round(tables: dict, pushes: list) -> list[tuple]:
    """One round's rows per table: ``tables`` ``{name: RowTable}``, ``pushes`` the members' staged pushes
    (``.worker``, ``.tables`` ``{name: (ids int64 [n], grads float32 [n, dim], lr)}``), in worker order.

    Returns ``[(table, unique ids int64 [m], gradient float32 [m, dim], sightings int64 [m], lr)]`` for the
    tables some push carries: each id's gradient is the sum over the pushes that carry it divided by the
    number of pushes (the average over the members), its sightings the pushes that carry it.

    Raises:
        InvalidArgument: two members pushed a table with different learning rates (the message names the
            table, both workers and both rates). Nothing is changed.
    """
    merged = []
    for name, table in tables.items():
        parts = [(p.worker, p.tables[name]) for p in pushes if name in p.tables]
        if not parts:
            continue
        lead, (_, _, lr) = parts[0][0], parts[0][1]
        for worker, (_, _, other) in parts[1:]:
            if other != lr:
                raise InvalidArgument(
                    f"workers {shown(lead)} and {shown(worker)} pushed table {shown(name)} with different learning "
                    f"rates ({lr!r} vs {other!r}): every worker must step a table with the same lr (the same "
                    "schedule); nothing of the round was applied")
        if len(parts) == 1:
            ids, grads = parts[0][1][0], parts[0][1][1]
            unique, summed, sightings = ids, grads, torch.ones_like(ids)
        else:
            ids = torch.cat([p[0] for _, p in parts])
            unique, inverse = torch.unique(ids, return_inverse=True)
            summed = torch.zeros(unique.numel(), table.spec.embedding_dim).index_add_(
                0, inverse, torch.cat([p[1] for _, p in parts]))
            sightings = torch.bincount(inverse, minlength=unique.numel())
        merged.append((table, unique, summed / len(pushes) if len(pushes) > 1 else summed, sightings, lr))
    return merged


def _names(tables: list) -> str:
    names = list(dict.fromkeys(t.spec.name for t in tables))
    shown_names = ", ".join(shown(n) for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"table{'s' if len(names) > 1 else ''} {shown_names}"


def step_failed(exc: BaseException, tables: list, optimizer: str, lr: float, step: int) -> ShardError:
    """The error a sparse round is refused with when the optimizer step of ``tables`` (``RowTable``, one
    group: same ``optimizer``, lr and ``step``) raised ``exc`` on the round's temporaries (nothing changed).

    The arithmetic of the step (``ArithmeticError``, ``ValueError``, a ``RuntimeError`` such as torch's
    "value cannot be converted to type float without overflow") is the round's input at fault:
    INVALID_ARGUMENT. An allocation that failed: RESOURCE_EXHAUSTED. Anything else is a fault of the shard:
    INTERNAL (``ShardError``). Each message names the tables, the optimizer, lr and step, and the cause."""
    cause = f"{type(exc).__name__}: {exc}"
    what = (f"the {optimizer} step of {_names(tables)} (lr {lr!r}, step {step}) failed ({cause}); nothing of "
            "the round was applied")
    if isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError) and "alloc" in str(exc).lower()):
        return ResourceExhausted(f"{what}: the shard ran out of memory")
    if isinstance(exc, (ArithmeticError, ValueError, RuntimeError)):
        return InvalidArgument(f"{what}: lower the learning rate or change the table's hyperparameters")
    return ShardError(f"{what}: see the shard's log")


def not_finite(tables: list, optimizer: str, lr: float, step: int) -> InvalidArgument:
    """The error a sparse round is refused with when its update of ``tables`` (one group: same ``optimizer``,
    lr and ``step``) would store Inf or NaN in rows or optimizer state (nothing changed)."""
    return InvalidArgument(
        f"the {optimizer} update of {_names(tables)} (lr {lr!r}, step {step}) would not be finite (Inf or NaN in "
        "its rows or optimizer state); nothing of the round was applied: lower the learning rate or check the "
        "gradients")

"""ssp's bounded-staleness rule: when a member may go on, and the error naming who holds it back.

Stale synchronous parallel with bound ``s`` (Ho et al., "More Effective
Distributed ML via a Stale Synchronous Parallel Parameter Server", NIPS
2013; see ``modes.py``): a member whose clock is ``c`` waits until the
slowest live member's clock is ``c - s`` or more. A member that leaves or is
dropped stops being waited for (only live members count). In sync and async
modes the rule always allows.

The waiting itself (the notifier, the deadline, a member leaving
meanwhile) is the store's ``ShardStore.wait_turn``; this module only says
whether the wait is over and what to tell a member whose wait ran out.
"""

from __future__ import annotations

from shardps.server.checks import shown
from shardps.server.consistency.modes import Mode
from shardps.server.errors import DeadlineExceeded
from shardps.server.membership.members import Member, Membership


def slowest_clock(members: Membership) -> int:
    """The lowest clock of the live members (0 with none)."""
    return min((m.clock for m in members.members()), default=0)


def clock_allowed(mode: Mode, member: Member, members: Membership) -> bool:
    """Whether ``member`` may go on past its clock: always outside ssp; in ssp once the slowest is close enough."""
    return mode.name != "ssp" or slowest_clock(members) >= member.clock - mode.staleness


def turn_overdue(shard_index: int, mode: Mode, member: Member, members: Membership, limit: float,
                 applied: bool) -> DeadlineExceeded:
    """The error for ``member``, whose turn did not come within ``limit`` seconds; names the slowest members.

    Args:
        applied: whether the member's push was applied by then.
    """
    slow = sorted(members.members(), key=lambda m: m.clock)[:5]
    return DeadlineExceeded(
        f"shard {shard_index}: worker {shown(member.worker_id)} at clock {member.clock} waited "
        f"{limit:.1f}s (push applied: {applied}); slowest workers "
        f"{[(shown(m.worker_id), m.clock) for m in slow]} (ssp bound {mode.staleness})"
    )

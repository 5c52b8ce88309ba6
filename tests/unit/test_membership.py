"""Membership leases with a fake clock: calls renew, silence expires, the epoch counts every change."""

import pytest

from shardps.server.errors import AlreadyExists, FailedPrecondition
from shardps.server.membership.members import Membership


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_calls_renew_the_lease_and_silence_expires_it() -> None:
    clock = Clock()
    members = Membership(8, lease_seconds=10.0, clock=clock)
    members.admit("a", "s1")
    members.admit("b", "s2")
    assert members.epoch == 2
    clock.now += 8
    members.get("a", "s1")  # a call renews a's lease
    clock.now += 4
    assert [m.worker_id for m in members.expire()] == ["b"]  # 12 s silent
    assert members.ids() == ["a"] and members.epoch == 3 and members.expiries == 1
    with pytest.raises(FailedPrecondition, match="lease"):
        members.get("b", "s2")
    clock.now += 10.5
    assert [m.worker_id for m in members.expire()] == ["a"]
    assert members.expire() == [] and members.epoch == 4


def test_an_id_is_refused_while_its_holder_lives_and_free_after_expiry() -> None:
    clock = Clock()
    members = Membership(8, lease_seconds=10.0, clock=clock)
    members.admit("a", "old")
    clock.now += 5
    with pytest.raises(AlreadyExists, match="lease expires"):
        members.admit("a", "new")  # the old process may still be alive
    clock.now += 6
    members.expire()
    member, new = members.admit("a", "new")  # the same worker coming back
    assert new and member.session == "new"


def test_a_session_dropped_at_lease_expiry_never_joins_again() -> None:
    """A process that was silent past its lease (SIGSTOP, a long network cut) may not rejoin with its session: the
    rounds went on without it, and a rejoin after UNAVAILABLE would let its stale steps count on some shards only.
    A restarted process (a new session) joins as usual; a member's own renewal is untouched."""
    clock = Clock()
    members = Membership(8, lease_seconds=10.0, clock=clock)
    members.admit("a", "s1")
    members.admit("b", "s2")
    members.admit("b", "s2")  # a live member's Join again: a renewal
    clock.now += 11
    members.get("a", "s1")  # too late, but not yet expired by the shard's check
    assert [m.worker_id for m in members.expire()] == ["b"]
    epoch = members.epoch
    with pytest.raises(FailedPrecondition, match="lease expired .* may not join again"):
        members.admit("b", "s2")
    assert members.ids() == ["a"] and members.epoch == epoch  # the refusal changed nothing
    member, new = members.admit("b", "s3")  # the restarted process
    assert new and member.session == "s3"

"""``checks.disagreement``: the members of one dense round must step with the same lrs and hyperparameters."""

from __future__ import annotations

from shardps.server.checks import disagreement

CURRENT = {0: {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0}}  # the shard's group 0, as it steps it now


def test_members_that_agree_pass():
    assert disagreement(["w0", "w1"], [[0.1], [0.1]], [None, None], CURRENT) is None
    changed = [{"momentum": 0.5, "weight_decay": 0.0}]
    assert disagreement(["w0", "w1"], [[0.1], [0.1]], [changed, changed], CURRENT) is None
    unchanged = [{"momentum": 0.9, "weight_decay": 0}]  # a member that sends the current values (a resend)
    assert disagreement(["w0", "w1"], [[0.1], [0.1]], [None, unchanged], CURRENT) is None


def test_different_learning_rates_are_named():
    why = disagreement(["w0", "w1"], [[0.1], [0.2]], [None, None], CURRENT)
    assert why is not None and "workers 'w0' and 'w1' pushed different learning rates ([0.1] vs [0.2])" in why


def test_a_change_only_one_member_makes_is_refused_whichever_member_makes_it():
    changed = [{"momentum": 0.5, "weight_decay": 0.0}]
    for pushed in ([None, changed], [changed, None]):  # the first member (whose values a round used) or another
        why = disagreement(["w0", "w1"], [[0.1], [0.1]], pushed, CURRENT)
        assert why is not None and "step with different hyperparameters" in why, pushed

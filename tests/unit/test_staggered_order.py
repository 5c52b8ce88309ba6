"""The order in which async/ssp workers push their shards (``streams.staggered_order``)."""

from __future__ import annotations

import threading
import time

import pytest

from shardps.worker.pipeline.streams import Round, staggered_order


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 7])
def test_every_worker_pushes_every_shard_once_and_workers_start_at_different_shards(num_shards: int) -> None:
    orders = [staggered_order(m, num_shards) for m in range(1, num_shards + 1)]
    for order in orders:
        assert sorted(order) == list(range(num_shards))
        assert all(b == (a + 1) % num_shards for a, b in zip(order, order[1:]))  # round the shards
    # S workers that joined one after another meet a different shard at every position of their orders
    for position in range(num_shards):
        assert sorted(order[position] for order in orders) == list(range(num_shards))


def test_member_numbers_past_the_shard_count_go_round_again() -> None:
    assert staggered_order(1, 3) == [0, 1, 2]
    assert staggered_order(3, 3) == [2, 0, 1]
    assert staggered_order(4, 3) == staggered_order(1, 3)
    assert staggered_order(0, 2) == [1, 0]  # a member number of 0 (an old shard) still gives an order


class _Call:
    """The one method of a gRPC call that ``Round.wait_turn`` reads."""

    def __init__(self, done: bool) -> None:
        self._done = done

    def done(self) -> bool:
        return self._done


def test_a_turn_waits_for_the_shard_before_it_not_for_an_earlier_one_that_already_answered() -> None:
    rnd = Round(3, {"w": 3})
    rnd.after = {1: 0, 2: 1}
    rnd.calls = [_Call(done=True), _Call(done=False), _Call(done=False)]  # shard 0 answered, shard 1 still pushes
    started = time.monotonic()
    rnd.wait_turn(2, timeout=0.3)
    assert time.monotonic() - started >= 0.3  # waited for shard 1 (until the deadline here)

    rnd.calls[1] = _Call(done=True)  # shard 1's call ended before its stream handed over everything: broken
    started = time.monotonic()
    rnd.wait_turn(2, timeout=30)
    assert time.monotonic() - started < 1.0

    rnd.calls[1] = _Call(done=False)
    threading.Timer(0.1, rnd.sent[1].set).start()  # shard 1's stream hands over its last frame
    started = time.monotonic()
    rnd.wait_turn(2, timeout=30)
    assert 0.05 < time.monotonic() - started < 1.0

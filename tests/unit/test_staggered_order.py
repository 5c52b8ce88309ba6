"""The order in which async/ssp workers push their shards (``streams.staggered_order``)."""

from __future__ import annotations

import pytest

from shardps.worker.pipeline.streams import staggered_order


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

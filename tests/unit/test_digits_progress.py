"""The digits job's progress bar shows the epoch a worker is in, never past the run's epochs."""

from __future__ import annotations

from shardps.apps.digits import DigitsConfig, epoch_of, steps_per_epoch


def test_sync_epoch_follows_the_rounds() -> None:
    config = DigitsConfig(workers=3, epochs=5, mode="sync")
    per = steps_per_epoch(config)
    assert [epoch_of(config, v, local_steps=0) for v in (0, per - 1, per, 5 * per)] == [1, 1, 2, 5]


def test_async_epoch_follows_the_workers_own_steps() -> None:
    # the shards' version counts every worker's pushes: 3 workers push 3x one worker's steps
    config = DigitsConfig(workers=3, epochs=5, mode="async")
    per = steps_per_epoch(config)
    assert epoch_of(config, version=3 * per, local_steps=per) == 2
    assert epoch_of(config, version=15 * per, local_steps=5 * per) == 5  # was shown as epoch 16 of 5

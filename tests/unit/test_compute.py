"""The shard's compute thread: queued work runs by priority, in submission order within one."""

import threading

import pytest

from shardps.server.compute import AHEAD, DENSE, IDLE, SPARSE, PriorityExecutor


def test_queued_work_runs_by_priority_and_in_order_within_one():
    ex = PriorityExecutor("test-compute")
    gate, ran = threading.Event(), []
    try:
        first = ex.submit(gate.wait, 10)  # holds the thread while the rest is queued
        futures = [ex.submit_at(p, ran.append, name) for p, name in [
            (IDLE, "idle"), (AHEAD, "ahead"), (SPARSE, "sparse 1"), (DENSE, "dense 1"), (SPARSE, "sparse 2"),
            (DENSE, "dense 2")]]
        gate.set()
        assert first.result(10) is True
        for f in futures:
            f.result(10)
        assert ran == ["dense 1", "dense 2", "sparse 1", "sparse 2", "ahead", "idle"]
    finally:
        ex.shutdown()


def test_errors_reach_the_caller_and_shutdown_runs_what_was_queued():
    ex = PriorityExecutor("test-compute")
    gate, ran = threading.Event(), []
    ex.submit(gate.wait, 10)
    failing = ex.submit_at(SPARSE, lambda: 1 / 0)
    queued = ex.submit_at(IDLE, ran.append, "after shutdown was asked")
    threading.Timer(0.2, gate.set).start()
    ex.shutdown(wait=True)
    with pytest.raises(ZeroDivisionError):
        failing.result(1)
    assert queued.result(1) is None and ran == ["after shutdown was asked"]
    with pytest.raises(RuntimeError, match="after shutdown"):
        ex.submit(print)

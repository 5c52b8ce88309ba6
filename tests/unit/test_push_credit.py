"""Credit on streamed pushes (``WireOptions.push_credit_bytes``, ``Round.wait_credit``): a push stream waits
while more than its credit of chunks to a shard are unanswered, and never waits for good."""

from __future__ import annotations

import threading
import time

import pytest

from shardps.worker import WireOptions
from shardps.worker.config import push_credit_chunks
from shardps.worker.pipeline import streams
from shardps.worker.pipeline.streams import Round


class _Call:
    """The one method of a gRPC call that ``Round.wait_credit`` reads."""

    def __init__(self) -> None:
        self.ended = False

    def done(self) -> bool:
        return self.ended


def _round(credit: int, shards: int = 2) -> Round:
    rnd = Round(shards, {"w": 1})
    rnd.credit = credit
    rnd.calls = [_Call() for _ in range(shards)]
    return rnd


def _waiter(rnd: Round, shard: int, sent: int) -> threading.Thread:
    t = threading.Thread(target=rnd.wait_credit, args=(shard, sent), daemon=True)
    t.start()
    return t


def test_credit_in_chunks_of_the_push_wire_type() -> None:
    assert push_credit_chunks(WireOptions(chunk_bytes=256 << 10), 4) == 0  # no credit
    wire = WireOptions(chunk_bytes=256 << 10, push_credit_bytes=1 << 20)
    assert push_credit_chunks(wire, 4) == 4  # fp32 frames of 256 KiB
    assert push_credit_chunks(wire, 2) == 8  # bf16 frames of 128 KiB: the same bytes in flight
    assert push_credit_chunks(WireOptions(chunk_bytes=256 << 10, push_credit_bytes=1), 4) == 1  # at least one


def test_a_stream_waits_while_more_than_its_credit_is_unanswered() -> None:
    rnd = _round(credit=2)
    assert rnd.wait_credit(0, 2) is None  # 2 unanswered before the third chunk: within the credit
    t = _waiter(rnd, 0, 3)  # 3 unanswered: waits
    time.sleep(0.3)
    assert t.is_alive(), "the stream sent a chunk beyond its credit"
    rnd.answer_arrived(1)  # another shard's answer gives this stream nothing
    time.sleep(0.2)
    assert t.is_alive()
    rnd.answer_arrived(0)
    t.join(timeout=5)
    assert not t.is_alive() and rnd.answered == [1, 1] and not rnd.uncredited


def test_a_stream_without_an_answer_for_a_while_sends_the_rest_of_its_round_without_credit(monkeypatch) -> None:
    monkeypatch.setattr(streams, "CREDIT_STALL_SECONDS", 0.3)
    rnd = _round(credit=1)
    started = time.monotonic()
    rnd.wait_credit(0, 5)  # nothing ever answers (members pushing in different orders): it stops waiting
    assert 0.3 <= time.monotonic() - started < 5 and rnd.uncredited == {0}
    started = time.monotonic()
    rnd.wait_credit(0, 50)  # and does not wait again in this round
    assert time.monotonic() - started < 0.1
    t = _waiter(rnd, 1, 5)  # the other shard's stream still has its credit
    time.sleep(0.1)
    assert t.is_alive()
    rnd.answer_arrived(1, rewind=True)  # that shard started the round over: no credit for it either
    t.join(timeout=5)
    assert not t.is_alive() and rnd.uncredited == {0, 1}


@pytest.mark.parametrize("how", ["call-ended", "round-failed"])
def test_a_stream_stops_waiting_when_its_call_ends_or_the_round_fails(how: str) -> None:
    rnd = _round(credit=1)
    t = _waiter(rnd, 0, 4)
    time.sleep(0.1)
    assert t.is_alive()
    if how == "call-ended":
        rnd.calls[0].ended = True
    else:
        from concurrent.futures import Future
        failed: Future = Future()
        failed.set_exception(RuntimeError("shard 1 broke"))
        rnd.futures.append(failed)
    t.join(timeout=5)
    assert not t.is_alive()

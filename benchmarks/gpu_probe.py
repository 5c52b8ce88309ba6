"""The probes of ``benchmarks/gpu.py``: a shardps worker's timeline, measured from outside its code.

In the benchmark's own process, :class:`Probe` wraps the push streams'
request iterators (``steps.push_requests``) and their chunk queues, the
pulled-frame iterator of ``ParameterSink.receive`` and
``ForwardWaits._wait``; nothing in ``shardps`` changes. Marks are
``time.perf_counter()`` seconds.
"""

from __future__ import annotations

import threading
import time

import torch

now = time.perf_counter



class StepRecord:
    """What the probes saw of one step's round (perf_counter seconds; per-shard marks by shard index)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sums: dict[str, float] = {}
        self.push_start: dict[int, float] = {}
        self.push_end: dict[int, float] = {}
        self.first_pulled: dict[int, float] = {}
        self.last_pulled: dict[int, float] = {}

    def add(self, name: str, seconds: float) -> None:
        with self.lock:
            self.sums[name] = self.sums.get(name, 0.0) + seconds

    def first(self, marks: dict[int, float], shard: int, t: float) -> None:
        with self.lock:
            marks.setdefault(shard, t)

    def last(self, marks: dict[int, float], shard: int, t: float) -> None:
        with self.lock:
            marks[shard] = t


class TimedQueue:
    """A push stream's chunk queue whose ``get`` times the wait and does the gradient's copy to host itself.

    ``push_requests`` copies a gradient chunk to host memory in the wire type (``HostCopies``: on CUDA a
    side stream that waits for the gradient's own event, into pinned memory) right after taking it off the
    queue, on the same thread; this does exactly that copy one call earlier, with the worker's own
    ``HostCopies``, timed, and hands over the host copy, whose own copy is then a no-op.
    """

    def __init__(self, inner, record: StepRecord, shard: int, push_dtype: torch.dtype) -> None:
        from shardps.worker.pipeline.device import HostCopies

        self.inner, self.record, self.shard, self.push_dtype = inner, record, shard, push_dtype
        self.to_host = HostCopies()

    def put(self, item) -> None:
        self.inner.put(item)

    def get(self, *args, **kwargs):
        t = now()
        item = self.inner.get(*args, **kwargs)
        t1 = now()
        self.record.add("queue_wait", t1 - t)
        if item is not None and item[0] == "grad":
            self.record.first(self.record.push_start, self.shard, t1)
            host = self.to_host(item[2], self.push_dtype, item[3] if len(item) > 3 else None)
            self.record.add("grad_copy_off_device", now() - t1)  # on CUDA: waiting for the gradient, then the copy
            item = ("grad", item[1], host)
        return item


class Probe:
    """Wraps the worker's push streams, pulled-frame reader and forward waits in this process (see the docstring)."""

    def __init__(self) -> None:
        self.step = -1
        self.records: dict[int, StepRecord] = {}
        self._undo: list = []

    def record(self, step: int) -> StepRecord:
        return self.records.setdefault(step, StepRecord())

    def install(self) -> "Probe":
        from shardps.worker.pipeline import overlap, steps, streams

        probe = self
        push_requests, receive, wait = steps.push_requests, streams.ParameterSink.receive, overlap.ForwardWaits._wait

        def timed_push_requests(header, shard, push_dtype, checksum, rnd, commit_timeout):
            record = rnd._bench_record = probe.record(probe.step)  # opened by this step's first gradient hook
            rnd.queues[shard] = TimedQueue(rnd.queues[shard], record, shard, push_dtype)
            frames = push_requests(header, shard, push_dtype, checksum, rnd, commit_timeout)

            def timed():
                while True:
                    t = now()
                    try:
                        frame = next(frames)
                    except StopIteration:
                        record.last(record.push_end, shard, now())  # the last frame went to gRPC
                        return
                    t1 = now()
                    record.add("push_inside", t1 - t)  # queue wait + copy off the device + encoding
                    yield frame
                    record.add("push_send", now() - t1)  # gRPC writing the frame

            return timed()

        def timed_receive(sink, client, call, min_version, what, rnd=None):
            record = getattr(rnd, "_bench_record", None)
            if record is None:  # the initial pull
                return receive(sink, client, call, min_version, what, rnd)
            shard = client.index

            def frames():
                asked = now()
                for raw in call:
                    t = now()
                    record.add("pull_network_wait", t - asked)
                    record.first(record.first_pulled, shard, t)
                    record.last(record.last_pulled, shard, t)
                    yield raw
                    asked = now()
                    record.add("copy_onto_device", asked - t)  # decoding and copying the frame into the model

            return receive(sink, client, frames(), min_version, what, rnd)

        def timed_wait(waits, module, args):
            t = now()
            try:
                return wait(waits, module, args)
            finally:
                probe.record(probe.step).add("forward_wait_for_pull", now() - t)

        steps.push_requests = timed_push_requests
        streams.ParameterSink.receive = timed_receive
        overlap.ForwardWaits._wait = timed_wait
        self._undo = [(steps, "push_requests", push_requests), (streams.ParameterSink, "receive", receive),
                      (overlap.ForwardWaits, "_wait", wait)]
        return self

    def remove(self) -> None:
        for owner, name, original in self._undo:
            setattr(owner, name, original)
        self._undo = []

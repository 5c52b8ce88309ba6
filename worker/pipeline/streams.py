"""The push and pull streams of one step: request frames out, parameter frames back into the model.

Threads: gRPC's request-consumer thread runs :func:`push_requests` for each
shard, encoding chunks from a queue the gradient hooks and ``step()`` fill;
a small thread pool runs :meth:`ParameterSink.receive` on the frames coming
back. Hooks only slice tensors and enqueue them: no host sync, no I/O.

A push stream is the round header, gradient chunks, buffer chunks and a
trailer. In a round that clips or scales, each shard first answers with a
report; once every shard's report is in, the worker decides (``commit.py``)
and each push stream sends the commit before the parameters come back (a
skip, if the round failed on a shard before every report came in).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import wait

import grpc
import torch

from shardps.proto import shardps_pb2 as pb
from shardps.common.codec import (
    FrameError, check_payload, copy_payload, decode_frame, encode_chunk, encode_chunk_parts, encode_control,
    encode_round, payload_tensor,
)
from shardps.common.plan import Chunk, PartitionPlan
from shardps.worker.pipeline.device import HostCopies
from shardps.worker.session.client import ShardClient

#: How often a staggered push stream looks whether its round failed while it waits for its turn, seconds.
TURN_POLL_SECONDS = 0.05
#: A push stream that waited this long for its shard's next answer sends the rest of its round without credit
#: (``WireOptions.push_credit_bytes``), seconds.
CREDIT_STALL_SECONDS = 1.0


def staggered_order(member_number: int, num_shards: int) -> list[int]:
    """The order in which an async/ssp worker pushes its shards: all of them, starting at its own.

    Worker ``m`` (its member number, 1 for a job's first worker) starts at
    shard ``(m - 1) mod S`` and goes round. A shard applies an async push
    once all of that worker's part for it has arrived, so a worker that
    pushes every shard at once gets every answer only after its whole push
    (a step costs 2 M / R on its link: M model bytes, R link rate). Pushed
    one shard after another, shard k's answer comes back while shard k + 1
    is pushed, and the link sends and receives at once (about M / R + M /
    (S x R)); starting at different shards, workers that push at the same
    time meet on different shards (the rotation of all-to-all schedules).
    Workers that drift onto the same shard move on together until their
    speeds differ (docs/performance.md, Cluster in one box, measures it).

    Returns:
        The shard indices, ``num_shards`` of them, each once.
    """
    start = (member_number - 1) % num_shards if num_shards else 0
    return [(start + k) % num_shards for k in range(num_shards)]


class GradientEditedError(RuntimeError):
    """A gradient changed after its push to the shards started (the shards would get a mix of both)."""


class Round:
    """State of one push/pull round trip across all shards.

    ``ready[key]`` is set once every chunk of ``key`` (a parameter or a
    buffer) has been pulled; ``sent[shard]`` once the push stream to
    ``shard`` has encoded its last chunk; ``decided`` once ``commit`` holds
    the decision of a round that clips or scales: made from every shard's
    report, or a skip when the round failed on a shard before every report
    was in (``abandoned``: no shard applies it; see :meth:`wait_decided`).
    ``sources[key]`` is the gradient tensor pushed for ``key`` and its
    ``_version`` then, to detect edits made after the push started.
    """

    def __init__(self, num_shards: int, chunks_per_key: dict[str, int],
                 decide: Callable[[list[pb.RoundReport]], pb.RoundCommit] | None = None) -> None:
        self.queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(num_shards)]
        self.calls: list = []
        self.pushed: set[str] = set()
        self.sources: dict[str, tuple[torch.Tensor, int]] = {}
        self.sent = [threading.Event() for _ in range(num_shards)]
        self.remaining = dict(chunks_per_key)
        self.ready = {key: threading.Event() for key in chunks_per_key}
        self.lock = threading.Lock()
        self.futures: list = []
        self.decide = decide
        self.reports: dict[int, pb.RoundReport] = {}
        self.commit: pb.RoundCommit | None = None
        self.decided = threading.Event()
        self.abandoned = False
        #: staggered pushes (async/ssp): ``after[shard]`` is the shard whose push stream must hand over all of its
        #: frames before this one sends its first chunk (:func:`staggered_order`)
        self.after: dict[int, int] = {}
        #: streamed rounds (``WireOptions.streamed``): the learning rates and hyperparameters sent in the header
        self.options: pb.RoundTrailer | None = None
        #: streamed rounds: gradient chunks a push stream may have unanswered (``WireOptions.push_credit_bytes``;
        #: 0: no limit); ``answered[shard]``: the round's chunks received from each shard so far; ``uncredited``:
        #: shards whose push stream stopped waiting for credit
        self.credit = 0
        self.answered = [0] * num_shards
        self.answered_at = [0.0] * num_shards
        self.uncredited: set[int] = set()
        self.answers = [threading.Condition() for _ in range(num_shards)]
        # for the worker's metrics: when step() closed the pushes, when each shard's push ended, bytes each way
        self.closed_at = 0.0
        self.sent_at = [0.0] * num_shards
        self.pushed_bytes = [0] * num_shards
        self.pulled_bytes = [0] * num_shards
        # the timeline of the round (time.perf_counter()): opened, first and last frame pulled from each shard
        self.opened_at = time.perf_counter()
        self.first_pulled_at = [0.0] * num_shards
        self.first_sent_at = [0.0] * num_shards  # the first gradient or buffer frame handed to gRPC, per shard
        self.last_pulled_at = [0.0] * num_shards

    def chunk_arrived(self, key: str) -> None:
        with self.lock:
            self.remaining[key] -= 1
            done = self.remaining[key] == 0
        if done:
            self.ready[key].set()

    def report_arrived(self, shard: int, report: pb.RoundReport) -> None:
        """Record a shard's report; the last one makes the decision every push stream then commits."""
        with self.lock:  # the decision and an abandonment (:meth:`wait_decided`): the first one stands
            self.reports[shard] = report
            complete = len(self.reports) == len(self.queues) and self.commit is None
            if complete:
                self.commit = self.decide([self.reports[s] for s in sorted(self.reports)])
        if complete:
            self.decided.set()

    def wait_turn(self, shard: int, timeout: float) -> None:
        """Wait (up to ``timeout`` seconds) until the push stream before ``shard``'s in ``after`` has handed over
        every frame; stop waiting as soon as the round failed or the previous shard's call ended first (cancelled,
        or broken: its stream never finishes). Other shards' calls ending says nothing: an earlier shard of the
        order answers, and its call ends, while later ones are still pushed."""
        previous, deadline = self.after[shard], time.monotonic() + timeout
        while not self.sent[previous].wait(TURN_POLL_SECONDS):  # blocking wait for the previous shard's push
            calls = self.calls
            if (self.failed() is not None or (previous < len(calls) and calls[previous].done())
                    or time.monotonic() > deadline):
                return

    def answer_arrived(self, shard: int, rewind: bool = False) -> None:
        """A chunk of this round came back from ``shard`` (``rewind``: the shard started the round over: its
        push stream sends the rest without credit)."""
        with self.answers[shard]:
            self.answered[shard] += 1
            self.answered_at[shard] = time.monotonic()
            if rewind:
                self.uncredited.add(shard)
            self.answers[shard].notify()

    def wait_credit(self, shard: int, sent: int) -> None:
        """Block ``shard``'s push stream, before it sends its gradient chunk number ``sent`` (0-based), while
        more than ``credit`` of its chunks are unanswered.

        A streamed round's shard answers a chunk once every member pushed it, so no worker's stream runs more
        than ``credit`` chunks ahead of the slowest member's at that shard, and the link carries what the shard
        can use now (credit-based scheduling: Peng et al., "A Generic Communication Scheduler for Distributed
        DNN Training Acceleration", SOSP 2019; docs/performance.md measures it). The stream stops waiting for
        good (the rest of its round goes without credit) once no answer came for
        :data:`CREDIT_STALL_SECONDS` (workers that push their chunks in different orders would otherwise wait
        on each other), and stops waiting when the round failed or the shard's call ended.
        """
        since = time.monotonic()
        with self.answers[shard]:
            while sent - self.answered[shard] > self.credit and shard not in self.uncredited:
                self.answers[shard].wait(TURN_POLL_SECONDS)  # blocking wait for the shard's next answer
                calls = self.calls
                if self.failed() is not None or (shard < len(calls) and calls[shard].done()):
                    return
                if time.monotonic() - max(since, self.answered_at[shard]) > CREDIT_STALL_SECONDS:
                    self.uncredited.add(shard)

    def failed(self) -> BaseException | None:
        for f in self.futures:
            if f.done() and f.exception() is not None:
                return f.exception()
        return None

    def check_edits(self, params: dict[str, torch.Tensor]) -> None:
        """Cancel the round and raise if a ``.grad`` was replaced or changed in place after its push started.

        Raises:
            GradientEditedError: naming the key and the supported ways to change gradients.
        """
        for key, (grad, version) in self.sources.items():
            if params[key].grad is not grad or grad._version != version:
                for call in self.calls:
                    call.cancel()
                raise GradientEditedError(
                    f"the gradient of {key!r} changed after its push to the shards started: for clipping pass "
                    "max_grad_norm=... to DistributedOptimizer instead of calling clip_grad_norm_; with a "
                    "GradScaler pass grad_scaler=scaler and call dist.step() (not scaler.unscale_ or "
                    "scaler.step); for other edits between backward() and step(), pass push_during_backward=False"
                )
        self.sources.clear()  # the queues hold what is still to be sent; old gradients may be freed

    def outcome(self) -> tuple[dict[int, int], list[tuple[int, BaseException]]]:
        """Wait for every shard's pull of this round (each bounded by its call's deadline).

        Returns:
            ``({shard: version received}, [(shard, error), ...])``.
        """
        wait(self.futures)  # blocking wait for every shard
        applied = {s: f.result() for s, f in enumerate(self.futures) if f.exception() is None}
        failed = [(s, f.exception()) for s, f in enumerate(self.futures) if f.exception() is not None]
        return applied, failed

    def wait_decided(self, timeout: float | None = None) -> bool:
        """Wait until ``commit`` is decided (up to ``timeout`` seconds; None: no limit); False if it was not, or
        if every shard's call ended without a report.

        A round that failed on a shard before every report came in is
        abandoned: ``commit`` becomes a skip, which every push stream sends,
        so that the shards still holding the round end it changing nothing
        (a decision sent to some shards and a skip to others would leave the
        partitions of one model at different steps). A failure after the
        decision changes nothing here.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.decided.wait(TURN_POLL_SECONDS):  # blocking wait for every shard's report
            if self.failed() is not None:
                with self.lock:
                    if self.commit is None:
                        self.commit, self.abandoned = pb.RoundCommit(skip=True, clip_coef=1.0), True
                self.decided.set()
            elif (self.futures and all(f.done() for f in self.futures)) or \
                    (deadline is not None and time.monotonic() > deadline):
                return False
        return True

    def commit_for(self, round_: int) -> pb.RoundCommit:
        """The decided ``commit`` as the shard whose round is ``round_`` takes it (the shards' versions differ once
        one restarted from its checkpoint: each commit names the round its shard collects)."""
        return pb.RoundCommit(round=round_, skip=self.commit.skip, clip_coef=self.commit.clip_coef)


def push_requests(
    header: pb.RoundHeader, shard: int, push_dtype: torch.dtype, checksum: bool, rnd: Round, commit_timeout: float,
) -> Iterator[bytes | tuple[bytes, memoryview]]:
    """Request stream of one shard's push; runs on gRPC's request-consumer thread.

    Each chunk comes as :func:`~shardps.common.codec.encode_chunk_parts`'s ``(prefix, payload)``, written
    before the next is asked for (:meth:`ShardClient.push_pull <shardps.worker.session.client.ShardClient.push_pull>`
    joins them for gRPC; a stream process's relay writes both to its socket, uncopied); the other frames
    are ``bytes``.

    Yields the round header, then what ``step()`` and the hooks put on ``q``:
    ``("grad", chunk, values[, ready])`` (sent in ``push_dtype``; ``ready``: the
    CUDA event of :func:`~shardps.worker.pipeline.device.mark_ready`), ``("buffer", chunk,
    values)`` (sent in their own dtype) and ``("trailer", RoundTrailer)``,
    until ``None``; then, if the round needs one, the commit. ``q`` is ``rnd.queues[shard]``. In a streamed
    round with ``rnd.credit``, each gradient chunk waits for its credit first (:meth:`Round.wait_credit`).
    """
    q = rnd.queues[shard]
    to_host = HostCopies()
    sent = 0  # gradient chunks sent
    frame = encode_round(header)
    rnd.pushed_bytes[shard] = len(frame)
    yield frame
    if shard in rnd.after:
        rnd.wait_turn(shard, commit_timeout)
    while (item := q.get()) is not None:  # blocking wait for the hooks and step()
        kind = item[0]
        if kind == "trailer":
            frame = encode_control(trailer=item[1])
            # counted before it is handed over: a streamed round's answer may end before this generator resumes
            rnd.pushed_bytes[shard] += len(frame)
            rnd.sent_at[shard] = time.perf_counter()
            yield frame
            continue
        chunk, values = item[1], item[2]
        if kind == "grad":  # CUDA: narrowed on the device and copied on a side stream, off the hook (device.py)
            if rnd.credit:
                rnd.wait_credit(shard, sent)
            sent += 1
            values = to_host(values, push_dtype, item[3] if len(item) > 3 else None)
        parts = encode_chunk_parts(chunk.key, chunk.offset, values, header.round, checksum=checksum)
        rnd.pushed_bytes[shard] += len(parts[0]) + len(parts[1])
        rnd.first_sent_at[shard] = rnd.first_sent_at[shard] or time.perf_counter()
        yield parts
    rnd.sent[shard].set()  # every gradient byte of this shard is copied into a frame
    if rnd.decide is not None and rnd.wait_decided(commit_timeout):  # blocking wait for every shard's report
        yield encode_control(commit=rnd.commit_for(header.round))


def init_requests(
    header: pb.RoundHeader, plan: PartitionPlan, shard: int, params: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
) -> Iterator[bytes]:
    """Request stream of one shard's Init: the round header, this shard's chunks of ``params`` in fp32, its buffers."""
    yield encode_round(header)
    for c in plan.shard_chunks(shard):
        flat = params[c.key].detach().reshape(-1)
        yield encode_chunk(c.key, c.offset, flat[c.offset : c.offset + c.numel].to("cpu", torch.float32), 0)
    for c in plan.shard_buffer_chunks(shard):
        flat = buffers[c.key].detach().reshape(-1)
        yield encode_chunk(c.key, c.offset, flat[c.offset : c.offset + c.numel].to("cpu"), 0)


class ParameterSink:
    """Where pulled chunks go: the model's parameters and buffers, per the partition plan.

    Args:
        plan: the job's partition plan.
        params: ``{key: parameter tensor}`` (CPU or CUDA, any floating dtype).
        buffers: ``{key: buffer tensor}`` of the buffers in the plan.
    """

    def __init__(self, plan: PartitionPlan, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> None:
        self.params, self.buffers = params, buffers
        self.chunk_at: dict[tuple[str, int], Chunk] = {(c.key, c.offset): c for c in (*plan.chunks,
                                                                                         *plan.buffer_chunks)}
        self.shard_sizes = [0] * plan.num_shards
        for c in (*plan.chunks, *plan.buffer_chunks):
            self.shard_sizes[c.shard] += 1

    def receive(
        self, client: ShardClient, call: Iterable[bytes], min_version: int, what: str, rnd: Round | None = None
    ) -> int:
        """Copy every frame of ``call`` from shard ``client.index`` into the model (a report goes to ``rnd``).

        Returns:
            The version received (``min_version`` if the shard holds no chunks).

        Raises:
            ShardRpcError: the call failed (the shard's status and message).
            RuntimeError: the shard answered outside the protocol.
        """
        shard = client.index
        version, count, size = None, 0, 0
        held = [] if rnd is not None and rnd.options is not None else None  # streamed: copied once the call ends OK
        try:
            with torch.no_grad():
                for raw in call:  # blocking reads from the network
                    size += len(raw)
                    if rnd is not None:
                        rnd.last_pulled_at[shard] = time.perf_counter()
                        rnd.first_pulled_at[shard] = rnd.first_pulled_at[shard] or rnd.last_pulled_at[shard]
                    frame = decode_frame(raw)
                    if frame.round is not None and held is not None:
                        # the shard started the streamed round over without another member's push: what came
                        # so far is void, every chunk comes again
                        held.clear()
                        version, count = None, 0
                        if rnd.credit:
                            rnd.answer_arrived(shard, rewind=True)
                        continue
                    if frame.report is not None and rnd is not None and rnd.decide is not None and count == 0:
                        rnd.report_arrived(shard, frame.report)
                        continue
                    h = frame.header
                    c = self.chunk_at.get((h.key, h.offset)) if h is not None else None
                    if c is None or c.shard != shard or c.numel != h.numel:
                        raise RuntimeError(f"shard {shard} sent a frame that is not in the partition plan: {frame}")
                    if version is None:
                        version = h.version
                    if h.version != version or version < min_version:
                        raise RuntimeError(f"shard {shard} sent version {h.version}, expected {version or min_version}")
                    target = self.buffers[c.key] if c.buffer else self.params[c.key].data
                    count += 1
                    if held is not None:  # checked now: a bad frame fails the pull before any chunk is copied
                        if target.is_cuda:  # staged in pinned memory now, onto the device at the end
                            payload = payload_tensor(h, frame.payload, pin=True)
                        else:
                            check_payload(h, frame.payload)
                            payload = frame.payload
                        held.append((h, payload, target, c))
                        if rnd.credit:  # (a lock and a wake-up per chunk: only where a push stream waits on it)
                            rnd.answer_arrived(shard)
                        continue
                    copy_payload(h, frame.payload, target.view(-1)[c.offset : c.offset + c.numel])
                    if rnd is not None:
                        rnd.chunk_arrived(c.key)
        except grpc.RpcError as exc:
            raise client.error(what, exc) from None
        except FrameError as exc:
            raise RuntimeError(f"shard {shard} sent a malformed frame in its {what}: {exc}") from None
        finally:
            if rnd is not None:
                rnd.pulled_bytes[shard] = size
        if count != self.shard_sizes[shard]:
            raise RuntimeError(f"shard {shard} sent {count} of {self.shard_sizes[shard]} chunks in its {what}")
        if held:  # the shard applied the whole round: only now does any of it reach the model
            with torch.no_grad():
                for h, payload, target, c in held:
                    dst = target.view(-1)[c.offset : c.offset + c.numel]
                    if isinstance(payload, torch.Tensor):
                        dst.copy_(payload)
                    else:
                        copy_payload(h, payload, dst)
                    rnd.chunk_arrived(c.key)
        return min_version if version is None else version

"""The push/pull half of :class:`~shardps.worker.optimizer.DistributedOptimizer`: one round per step.

Each step opens one PushPull stream per shard at the first gradient hook
(``shardps.worker.pipeline.streams``), enqueues every gradient's chunks as it is
ready, closes the streams at ``step()`` with the round's trailer (learning
rates, changed hyperparameters, absent keys, loss scale, clipping) and reads
the parameters coming back in the background. :class:`RoundSteps` is a
mixin: ``DistributedOptimizer.__init__`` sets every attribute it uses.

In sync mode a push carries round ``r`` (the version the worker holds) and
comes back with version ``r + 1``; in async and ssp modes it comes back with
the newest version once this push is applied (and, in ssp, once the slowest
live worker is close enough), so the versions received are only ``> r``.
There, with clipping or a GradScaler, the worker pushes at ``step()`` its own
gradient, unscaled and clipped by itself (``own.py``), and the trailer asks
the shards for neither (``_pushed_options``: no report, no commit).
"""

from __future__ import annotations

import math
import time

import torch

from shardps.proto import shardps_pb2 as pb
from shardps.common.optim import current_lrs
from shardps.worker.config import push_credit_chunks
from shardps.worker.pipeline.commit import decide
from shardps.worker.pipeline.device import mark_ready
from shardps.worker.session.recovery import divergence
from shardps.worker.pipeline.streams import GradientEditedError, Round, init_requests, push_requests, staggered_order


class RoundSteps:
    """Opening, filling and finishing the rounds of a ``DistributedOptimizer`` (see the module docstring)."""

    #: the stream batch the next round trains (``DistributedOptimizer.set_stream_span``), sent in its trailer
    _span: pb.StreamSpan | None = None
    # ------------------------------------------------------------ joining
    def _header(self, round_: int = 0) -> pb.RoundHeader:
        return pb.RoundHeader(worker_id=self.worker_id, session=self.session, round=round_,
                              plan_fingerprint=self.plan.fingerprint, pull_dtype=self._pull_code,
                              scaled=self._pushed_options.scaled)

    def _init_frames(self, shard: int):
        return init_requests(self._header(), self.plan, shard, self._params, self._buffers)

    def _initial_pull(self, shard: int, calls: list) -> int:
        client = self._clients[shard]
        call = client.pull(pb.PullRequest(
            min_version=0, plan_fingerprint=self.plan.fingerprint, dtype=self._pull_code,
            worker_id=self.worker_id, session=self.session,
        ))
        calls.append(call)
        return self._sink.receive(client, call, 0, "pull")

    # ------------------------------------------------------------ pushing
    def _open_round(self) -> Round:
        """Start one PushPull stream per shard (first gradient hook of a step). Caller holds ``_lock``."""
        if self._round is None:
            self._finish_pull(rejoin=False)  # blocking wait, normally a no-op: the forward already waited
            self.check_healthy()  # DistributedOptimizer's: diverged partitions or a lost membership
            decide = self._decide if self._pushed_options.needs_commit else None
            if decide is not None:
                self.last_grad_norm = math.nan  # until decided (an abandoned round is never)
            rnd = Round(len(self._clients), self._chunk_counts, decide)
            if self.mode.mode not in ("", "sync"):  # async/ssp: one shard after another (staggered_order)
                order = staggered_order(self._member_number, len(self._clients))
                rnd.after = dict(zip(order[1:], order[:-1]))
            # the shards apply each chunk as it completes (streamed.py); a round that trains a stream batch is
            # applied or skipped whole (set_stream_span), so it is not streamed
            if self._streamed and decide is None and self._span is None:
                rnd.options = pb.RoundTrailer(lrs=self._round_lrs(), group_hyperparams_json=self._hyperparams.changed())
                rnd.credit = push_credit_chunks(self._wire, self._push_dtype.itemsize)
            for shard, client in enumerate(self._clients):
                header = self._header(self.versions[shard])
                if rnd.options is not None:
                    header.streamed = True
                    header.options.CopyFrom(rnd.options)
                requests = push_requests(header, shard, self._push_dtype, self._checksum, rnd, self._rpc_timeout)
                rnd.calls.append(client.push_pull(requests))
            if rnd.options is not None:  # the new version comes back while the round is pushed
                self._receive(rnd)
            self._round = rnd
        return self._round

    def _decide(self, reports: list[pb.RoundReport]) -> pb.RoundCommit:
        commit, self.last_grad_norm = decide(reports, self._options, reports[0].round)
        return commit

    def _enqueue(self, rnd: Round, key: str, grad: torch.Tensor) -> None:
        rnd.sources[key] = (grad, grad._version)
        flat, ready = grad.detach().reshape(-1), mark_ready(grad)
        for c in self._chunks_of.get(key, ()):
            rnd.queues[c.shard].put(("grad", c, flat[c.offset : c.offset + c.numel], ready))
        rnd.pushed.add(key)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        key = self._key_of[id(param)]
        self._counts[key] += 1
        if self._counts[key] < self._passes:
            return
        with self._lock:
            rnd = self._open_round()
            if key in rnd.pushed:
                raise RuntimeError(
                    f"gradient of {key!r} is ready again before step(): call step() after every "
                    f"{self._passes} backward pass(es), or raise backward_passes_per_step"
                )
            self._enqueue(rnd, key, param.grad)

    def _round_lrs(self) -> list[float]:
        """Each param group's learning rate now (read at every step: LR schedulers work).

        Raises:
            ValueError: a learning rate is not finite or negative.
        """
        lrs = current_lrs(self._optimizer)
        bad = [(g, lr) for g, lr in enumerate(lrs) if not (math.isfinite(lr) and lr >= 0)]
        if bad:
            raise ValueError(f"learning rate of param group {bad[0][0]} is {bad[0][1]}; it must be finite and >= 0")
        return lrs

    def _trailer(self, lrs: list[float], absent: list[int]) -> pb.RoundTrailer:
        """The trailer closing a round: ``lrs``, the hyperparameters changed since the last round, the absent keys
        (indices into the plan's keys) and the clipping / loss-scale fields."""
        span, self._span = self._span, None  # each step says its own
        return pb.RoundTrailer(lrs=lrs, group_hyperparams_json=self._hyperparams.changed(), absent_keys=absent,
                               span=span, **self._pushed_options.trailer_fields())

    def _start_pull(self, grads: dict[str, torch.Tensor | None] | None = None) -> None:
        """Close this round's pushes (trailer included) and start reading every shard's answer in the background.

        ``grads``: what to push instead of each ``p.grad`` not pushed yet (``{key: tensor or None}``;
        ``OwnGradient.prepare``'s unscaled and clipped copies in async/ssp); None: the ``.grad`` tensors.
        """
        lrs = self._round_lrs()
        with self._lock:
            rnd = self._open_round()
            try:
                rnd.check_edits(self._params)
                if rnd.options is not None and (lrs != list(rnd.options.lrs) or self._hyperparams.changed()):
                    for call in rnd.calls:
                        call.cancel()
                    self._hyperparams.resend()
                    raise ValueError(
                        "the learning rates or hyperparameters changed between the step's first gradient and step(): "
                        "with WireOptions(streamed=True) the shards apply each chunk as it arrives, so set them "
                        "before backward() (LR schedulers stepped after step() do), or pass streamed=False")
            except (GradientEditedError, ValueError):
                self._round, self._counts = None, dict.fromkeys(self._counts, 0)
                raise
            absent = []
            for key, p in self._params.items():
                if key not in rnd.pushed:
                    grad = p.grad if grads is None else grads[key]
                    if grad is None:
                        absent.append(self._index[key])  # torch.optim skips it; so do the shards
                    else:
                        self._enqueue(rnd, key, grad)
            for key, b in self._buffers.items():
                flat = b.detach().to("cpu").reshape(-1).clone()  # the next forward may change it while it is sent
                for c in self._chunks_of.get(key, ()):
                    rnd.queues[c.shard].put(("buffer", c, flat[c.offset : c.offset + c.numel]))
            trailer = self._trailer(lrs, absent)
            rnd.closed_at = time.perf_counter()
            for q in rnd.queues:
                q.put(("trailer", trailer))
                q.put(None)
            self._round = None
            self._counts = dict.fromkeys(self._counts, 0)
        if self._waits is not None:
            self._waits.learn()
        if not rnd.futures:
            self._receive(rnd)
        self._pulling = rnd
        if self._watcher is not None:
            self._watcher.begin(min(self.versions))  # says what the round waits for if it takes over 2 s

    def _receive(self, rnd: Round) -> None:
        """Read every shard's answer to ``rnd`` in the background (the pool's threads)."""
        expected = [v + 1 for v in self.versions]
        rnd.futures = [
            self._pool.submit(self._sink.receive, self._clients[s], call, expected[s], "push_pull", rnd)
            for s, call in enumerate(rnd.calls)
        ]

    def _finish_pull(self, rejoin: bool = True) -> None:
        """Wait for the pending pulls (if any), record the versions received, rejoin restarted shards.

        Every shard's outcome is awaited, not only the first failure. A shard
        that restarted or dropped the connection is joined again and its
        current version pulled (``shardps.worker.session.recovery``); one still
        unreachable past the retry budget makes this step raise, and the
        end of each later step tries again (raising while it is down). If
        some shards applied the round and others failed it for another
        reason, the model's partitions are at different versions and every
        later step raises (sync training cannot go on from a half-applied
        round).
        """
        rnd, self._pulling = self._pulling, None
        if rnd is not None:
            try:
                applied, failed = rnd.outcome()  # blocking wait for every shard's answer
            finally:
                if self._watcher is not None:
                    self._watcher.end()
            if not failed:
                self.last_timeline = {
                    "step_called": rnd.closed_at - rnd.opened_at, "push_end": max(rnd.sent_at) - rnd.opened_at,
                    "first_pull": min((t for t in rnd.first_pulled_at if t), default=rnd.opened_at) - rnd.opened_at,
                    "last_pull": max(rnd.last_pulled_at) - rnd.opened_at}
                self.last_shard_timeline = [
                    {name: (t - rnd.opened_at if t else None) for name, t in (
                        ("push_start", rnd.first_sent_at[s]), ("push_end", rnd.sent_at[s]),
                        ("first_pull", rnd.first_pulled_at[s]), ("last_pull", rnd.last_pulled_at[s]))}
                    for s in range(len(rnd.sent_at))]
                self.metrics.round_trip(max(rnd.sent_at) - rnd.closed_at, time.perf_counter() - rnd.closed_at,
                                        sum(rnd.pushed_bytes), sum(rnd.pulled_bytes))
            if failed:
                self._hyperparams.resend()  # a refused round changed no hyperparameter on its shards
            rejoined, down, other = self._recovery.recover(failed) if failed else ({}, [], [])
            self.versions = [applied.get(s, rejoined.get(s, v)) for s, v in enumerate(self.versions)]
            if other or down:
                shard, error = (other or down)[0]
                if other and applied and not rnd.abandoned:  # (an abandoned round was skipped where it arrived)
                    self._diverged = divergence(applied, shard, error, self.versions)
                raise error
        if rejoin and self._recovery is not None and self._recovery.restarted:
            for shard, version in self._recovery.between_steps().items():
                self.versions[shard] = version

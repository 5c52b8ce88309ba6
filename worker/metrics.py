"""Prometheus metrics of one worker process (prometheus-client).

No series names a worker: Prometheus' ``instance`` label (the scrape target)
tells worker processes apart, so labels stay bounded (``method`` and ``phase``
only: fixed sets of call and phase names).

==================================  =========  ==========================================================
name                                type       what
==================================  =========  ==========================================================
shardps_worker_step_seconds         histogram  one training step: from the end of a ``step()`` to the end
                                               of the next (forward, backward and the round trip)
shardps_worker_push_seconds         histogram  from ``step()`` until every shard got this step's gradients
shardps_worker_pull_seconds         histogram  from ``step()`` until this step's parameters are in the model
shardps_worker_pushed_bytes_total   counter    Frame bytes pushed (gradients, buffers, trailers)
shardps_worker_pulled_bytes_total   counter    Frame bytes of parameters pulled
shardps_worker_steps_total          counter    steps (rounds) finished
shardps_worker_samples_total        counter    samples the trainer reported (:meth:`WorkerMetrics.count_samples`)
shardps_worker_samples_per_second   gauge      samples of the last step over its step seconds
shardps_worker_retries_total{method} counter   calls retried after UNAVAILABLE / DEADLINE_EXCEEDED
shardps_worker_node_phase_seconds   histogram  one phase of a ``NodeOptimizer`` step by chunk ownership, on
  {phase}                                      the node leader: ``reduce_scatter`` (the local ranks' gradients),
                                               ``push_pull`` (its own shards), ``all_gather`` (the new model)
shardps_worker_info{version}        gauge      1; the software version
==================================  =========  ==========================================================
"""

from __future__ import annotations

import logging
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from shardps.common.version import shardps_version

log = logging.getLogger(__name__)

#: Step, push and pull durations, seconds.
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: The ``method`` label's values: the calls a worker retries; anything else counts as ``other``.
RETRIED_METHODS = ("join", "leave", "reset", "stats", "checkpoint", "heartbeat", "pull", "export", "other")
#: The ``phase`` label's values: the phases of a ``NodeOptimizer`` step by chunk ownership, in order.
NODE_PHASES = ("reduce_scatter", "push_pull", "all_gather")


class WorkerMetrics:
    """The metrics of one worker process in ``registry`` (a fresh ``CollectorRegistry`` when None).

    Thread-safe (prometheus-client's metrics are; the step clock has a lock).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.step_seconds = Histogram("shardps_worker_step_seconds", "One training step, step() end to step() end "
                                      "(seconds).", buckets=SECONDS_BUCKETS, registry=r)
        self.push_seconds = Histogram("shardps_worker_push_seconds", "From step() until every shard got the "
                                      "step's gradients (seconds).", buckets=SECONDS_BUCKETS, registry=r)
        self.pull_seconds = Histogram("shardps_worker_pull_seconds", "From step() until the step's parameters "
                                      "are in the model (seconds).", buckets=SECONDS_BUCKETS, registry=r)
        self.pushed_bytes = Counter("shardps_worker_pushed_bytes", "Frame bytes pushed to the shards.", registry=r)
        self.pulled_bytes = Counter("shardps_worker_pulled_bytes", "Frame bytes pulled from the shards.", registry=r)
        self.steps = Counter("shardps_worker_steps", "Steps (rounds) finished.", registry=r)
        self.samples = Counter("shardps_worker_samples", "Samples the trainer reported.", registry=r)
        self.samples_per_second = Gauge("shardps_worker_samples_per_second",
                                        "Samples of the last step over its step seconds.", registry=r)
        self._retries = Counter("shardps_worker_retries", "Calls retried after UNAVAILABLE or DEADLINE_EXCEEDED.",
                                ("method",), registry=r)
        for method in RETRIED_METHODS:
            self._retries.labels(method)
        self._node_phases = Histogram("shardps_worker_node_phase_seconds", "One phase of a NodeOptimizer step by "
                                      "chunk ownership, on the node leader (seconds).", ("phase",),
                                      buckets=SECONDS_BUCKETS, registry=r)
        for phase in NODE_PHASES:
            self._node_phases.labels(phase)
        Gauge("shardps_worker_info", "The shardps software version (always 1).", ("version",),
              registry=r).labels(shardps_version()).set(1)
        self._lock = threading.Lock()
        self._server = None
        self._last_step: float | None = None
        self._step_samples = 0

    def count_samples(self, n: int) -> None:
        """The trainer processed ``n`` samples in the current step (call before or after ``step()``).

        Raises:
            ValueError: ``n`` is negative.
        """
        if n < 0:
            raise ValueError(f"samples must be >= 0, got {n}")
        self.samples.inc(n)
        with self._lock:
            self._step_samples += n

    def step_finished(self) -> None:
        """A ``step()`` returned: observe the step's seconds and samples per second."""
        now = time.perf_counter()
        with self._lock:
            last, self._last_step = self._last_step, now
            samples, self._step_samples = self._step_samples, 0
        self.steps.inc()
        if last is not None:
            seconds = now - last
            self.step_seconds.observe(seconds)
            if samples and seconds > 0:
                self.samples_per_second.set(samples / seconds)

    def round_trip(self, push_seconds: float, pull_seconds: float, pushed_bytes: int, pulled_bytes: int) -> None:
        """One step's round trip to every shard finished (seconds and Frame bytes, all shards together)."""
        self.push_seconds.observe(max(0.0, push_seconds))
        self.pull_seconds.observe(max(0.0, pull_seconds))
        self.pushed_bytes.inc(pushed_bytes)
        self.pulled_bytes.inc(pulled_bytes)

    def node_phase(self, phase: str, seconds: float) -> None:
        """The node leader finished ``phase`` (one of :data:`NODE_PHASES`) of a step, in ``seconds`` of wall time.

        Raises:
            ValueError: ``phase`` is not one of :data:`NODE_PHASES`.
        """
        if phase not in NODE_PHASES:
            raise ValueError(f"phase must be one of {NODE_PHASES}, got {phase!r}")
        self._node_phases.labels(phase).observe(max(0.0, seconds))

    def retried(self, what: str) -> None:
        """A call is retried; ``what`` is the retry's description (its first word names the call)."""
        method = what.split(" ", 1)[0]
        self._retries.labels(method if method in RETRIED_METHODS else "other").inc()

    def serve(self, host: str = "0.0.0.0", port: int = 0) -> int:
        """Start the HTTP endpoint (``/metrics``) on ``host:port`` in a daemon thread; returns the bound port.

        Raises:
            RuntimeError: the address could not be bound.
        """
        try:
            self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise RuntimeError(f"could not bind the worker metrics endpoint {host}:{port}: {exc}") from None
        port = self._server.server_port
        log.info("worker metrics served on http://%s:%d/metrics", host, port)
        return port

    def close(self) -> None:
        """Stop the HTTP endpoint, if one was started (the metrics stay readable in ``registry``)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

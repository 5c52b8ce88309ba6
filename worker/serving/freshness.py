"""Freshness measured end to end: when each event of a stream became visible in a serving replica.

A replica notes, for every state it swaps in, the stream offset up to which every training shard's rows are in
that state (``ReplicaState.positions``: the shards hold the offsets they trained, ``exactly_once``) and when it
swapped the state in; ``Serving.States`` answers the last 256 states. :class:`FreshnessProbe` polls it and
keeps every state it saw, so an event of offset ``o`` became visible at the first state whose position reached
``o``; its freshness is that moment minus the event's own time (for a Redis stream, its entry's milliseconds:
``entry_seconds``). The moment is the replica's clock and the event time the broker's: both run on hosts whose
clocks agree (NTP), here one host.

Ekko (Sima et al., OSDI 2022) measures its model-update latency the same way, from an update's creation to its
visibility at the inference servers.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time

import grpc

from shardps.proto import shardps_pb2 as pb
from shardps.proto import shardps_pb2_grpc as pb_grpc

__all__ = ["FreshnessProbe", "entry_seconds", "quantile"]

log = logging.getLogger(__name__)


def entry_seconds(offset: int) -> float:
    """The time (seconds since the epoch) a Redis stream entry of ``offset`` (``ms << 20 | seq``,
    ``exactly_once.redis_offset``) entered the broker."""
    return (offset >> 20) / 1000.0


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank (NaN when empty)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered) + 0.5)) - 1))]


class FreshnessProbe:
    """Polls a replica's ``Serving.States`` every ``poll`` seconds in a daemon thread and keeps every state seen.

    Args:
        address: the replica's ``host:port``. partition: the stream partition measured.
        poll: seconds between two polls (a replica remembers 256 states, so any poll faster than 256 refresh
            periods misses none). channel: a gRPC channel to use instead (TLS, token), else plaintext.

    Attributes:
        states: ``{(replica restarts seen, state number): (made_at seconds, offset visible or None, when its dense
            parameters were read, seconds)}``;
        wire_bytes, payload_bytes: the replica's delta byte counters at the last poll (``StatesReply``);
        failures: polls that failed (the replica down or restarting; the probe goes on).
    """

    def __init__(self, address: str, partition: str, *, poll: float = 0.1, channel: grpc.Channel | None = None):
        self.partition, self.poll = partition, poll
        self._channel = channel or grpc.insecure_channel(address)
        self._stub = pb_grpc.ServingStub(self._channel)
        self.states: dict[tuple[int, int], tuple[float, int | None, float]] = {}
        self.wire_bytes = self.payload_bytes = self.failures = 0
        self._epoch = 0  # replica restarts seen: its state numbers start at 1 again
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shardps-freshness", daemon=True)

    def start(self) -> "FreshnessProbe":
        self._thread.start()
        return self

    def poll_once(self, timeout: float = 5.0) -> None:
        """Read the replica's recent states once.

        Raises:
            grpc.RpcError: the replica did not answer.
        """
        reply = self._stub.States(pb.StatesRequest(), timeout=timeout)
        with self._lock:
            mine = [n for e, n in self.states if e == self._epoch]
            if reply.states and reply.states[-1].state < max(mine, default=0):
                self._epoch += 1  # a restarted replica numbers its states from 1 again
                log.info("freshness: the replica restarted (its states start at 1 again)")
            for s in reply.states:
                held = [p.rows for p in s.positions if p.partition == self.partition and p.HasField("rows")]
                self.states.setdefault((self._epoch, s.state), (s.made_at_unix_seconds, held[0] if held else None,
                                                                s.dense_read_unix_seconds))
            self.wire_bytes, self.payload_bytes = reply.delta_wire_bytes, reply.delta_payload_bytes

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except grpc.RpcError as exc:
                self.failures += 1
                log.debug("freshness: States failed: %s", exc.code())
            self._stop.wait(self.poll)

    def _timeline(self) -> tuple[list[int], list[float]]:
        """The offset visible (running maximum) and when, in state order."""
        with self._lock:
            items = sorted(self.states.items())
        offsets, times, high = [], [], -1
        for _, (made_at, offset, _) in items:
            if offset is not None and offset > high:
                high = offset
                offsets.append(offset)
                times.append(made_at)
        return offsets, times

    def visible_at(self, offsets: list[int]) -> list[float | None]:
        """When each event offset first became visible (the replica's ``time.time()``; None: not yet)."""
        seen, times = self._timeline()
        out = []
        for o in offsets:
            k = bisect.bisect_left(seen, o)
            out.append(times[k] if k < len(seen) else None)
        return out

    def wait_visible(self, offset: int, timeout: float, dense_after: float | None = None) -> bool:
        """Wait until a state holds ``offset`` (and, given, dense parameters read at or after ``dense_after``,
        seconds since the epoch); False after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                done = any(o is not None and o >= offset and (dense_after is None or d >= dense_after)
                           for _, o, d in self.states.values())
            if done:
                return True
            time.sleep(min(self.poll, 0.05))
        return False

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        self._channel.close()

    def __enter__(self) -> "FreshnessProbe":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

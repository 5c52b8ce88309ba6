"""A serving replica: a read-only copy of a training job's tables and dense parameters, kept fresh by deltas.

Training shards record the sparse round each row was last pushed in, so a replica asks each shard for the rows
pushed since the round it last read, and the ids evicted since (``table_delta``, ``ExportRows(since_round=)``):
touched rows only, as Monolith's parameter sync ships them from training to serving parameter servers (Liu et
al., "Monolith: Real Time Recommendation System With Collisionless Embedding Table", 2022), with no state per
replica on the shards. The dense parameters are read whole (they are small) every ``dense_every`` seconds.

**Atomic.** Each refresh builds a new :class:`ReplicaState` (every table with its delta applied, the dense
parameters, the rounds and versions it holds) beside the one readers use, then swaps one reference: a reader
takes ``replica.state`` once and reads a whole state, never a half-applied delta. A state is what each shard
held when it was read: shards are read one after the other while training goes on, so two shards' parts may
be a round apart (``rounds`` says which), as any parameter-server replica that does not stop training.

**Failures.** A refresh that fails (a shard down or restarting) is logged, counted and retried at the next
period; readers keep the last state, so serving goes on from it. A delta that cannot be applied (a shard
restored an older checkpoint, or forgot its evictions) makes the replica read the whole table again (a
snapshot), as does its first refresh.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from shardps.common.addresses import parse_servers
from shardps.common.transport import DEFAULT_MAX_MESSAGE_BYTES
from shardps.worker.embedding.export import TableExport, table_delta
from shardps.worker.serving.direct import DirectRows, direct_rows
from shardps.worker.session.client import ShardClient

__all__ = ["HISTORY", "Replica", "ReplicaState"]

log = logging.getLogger(__name__)

#: States a replica remembers (``Replica.history``).
HISTORY = 256


@dataclass(frozen=True)
class ReplicaState:
    """One consistent state a replica serves (never changed once made: a refresh makes the next one).

    Attributes:
        tables: ``{name: TableExport}`` (sorted ids, float32 weights; ``lookup`` answers an id it does not hold
            with the id's initial row, as training does).
        dense: ``{name: tensor}`` of the dense parameters and buffers (empty until read, or when not asked).
        rounds: ``{table: [sparse round of each shard when read]}``; versions: each shard's dense version.
        number: states made so far (1: the first snapshot); made_at: ``time.time()`` when it was swapped in;
        incarnations: ``{table: [each shard's process incarnation when read]}`` (a restart reuses round numbers);
        positions: ``{stream partition: offset}``: every event up to the offset is in this state's tables on every
            shard (the lowest offset any shard's rows held before its pages were read, ``TableDelta.positions``; exactly-once stream training, ``shardps.worker.stream.exactly_once``), for measuring freshness;
        dense_at: ``time.time()`` when ``dense`` was read (0: never);
        direct: ``{table: DirectRows}`` of the tables whose ids are dense in a range (``worker.serving.direct``):
            a lookup inside the range is one gather, with the same answers as the table's.
    """

    tables: dict[str, TableExport]
    dense: dict[str, torch.Tensor] = field(default_factory=dict)
    rounds: dict[str, list[int]] = field(default_factory=dict)
    versions: list[int] = field(default_factory=list)
    number: int = 0
    made_at: float = 0.0
    incarnations: dict[str, list[str]] = field(default_factory=dict)
    positions: dict[str, int] = field(default_factory=dict)
    dense_at: float = 0.0
    direct: dict[str, DirectRows] = field(default_factory=dict)

    def lookup(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """float32 ``[*ids.shape, dim]`` rows of ``ids`` (int64; other integer dtypes are widened to int64, as
        training widens them) of ``table`` in this state: from its direct rows when every id is in their range,
        else from the table, the same values either way.

        Raises:
            KeyError: the replica does not serve ``table``.
        """
        if table not in self.tables:
            raise KeyError(f"this replica serves tables {sorted(self.tables)}, not {table!r}")
        direct = self.direct.get(table)
        if direct is not None and (rows := direct.lookup(ids.reshape(-1).to(torch.int64))) is not None:
            return rows.view(*ids.shape, rows.shape[-1])
        return self.tables[table].lookup(ids)


class Replica:
    """A read-only, refreshed copy of tables ``tables`` (and the dense parameters) of the job on ``servers``.

    Args:
        servers: the training shards' addresses, in shard order (a list or ``"host:port,..."``).
        tables: the tables to serve.
        period: seconds between two refreshes of the background thread (:meth:`start`), at least 0.05.
        dense_every: seconds between two reads of the dense parameters (0: every refresh; None: never).
        max_message_bytes, rpc_timeout, security: as the workers' (a page is at most half the message limit).

    Attributes:
        deltas, snapshots, failures: refreshes applied as deltas, whole reads, refreshes that failed;
        delta_bytes: row and id bytes received by refreshes (ids 8 bytes, rows ``4 * dim``), in total;
        wire_bytes: serialized bytes of the refreshes' replies (``ExportRows`` pages, pages read again);
        payload_bytes: the least bytes those refreshes needed (``TableDelta.payload_bytes``: distinct rows and
            evicted ids), so ``wire_bytes / payload_bytes`` is the deltas' overhead;
        history: ``(number, made_at, positions, versions, dense_at)`` of the last 256 states swapped in, oldest first
            (``Serving.States``: what each state made visible and when, for measuring freshness);
        last_error: the message of the last failed refresh ("" after a good one);
        watchers: callables each given every state just swapped in, on the refreshing thread (they return at
            once: ``EventFreshness.note`` queues it); one that raises fails that refresh after the swap.

    The replica connects to the shards at its first refresh (a shard down then fails that refresh only).

    Raises:
        ValueError: no tables, a period below 0.05 s, or ``security`` sends a token over plaintext to a host that
            is not loopback without allowing it.
    """

    def __init__(self, servers, tables: list[str], *, period: float = 0.5, dense_every: float | None = 5.0,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, rpc_timeout: float = 30.0,
                 security=None) -> None:
        if not tables or period < 0.05:
            raise ValueError(f"a replica needs tables to serve and a period of at least 0.05 s, got {tables!r}, "
                             f"{period}")
        self.servers = parse_servers(servers)
        self.names, self.period, self.dense_every = list(tables), period, dense_every
        self.max_message_bytes, self.security = max_message_bytes, security
        self.rpc_timeout = rpc_timeout
        if security is not None:  # a token refused over plaintext says so now (a channel connects when used)
            for a in self.servers:
                security.channel(a).close()
        self.clients: list[ShardClient] = []  # connected by the first refresh: the shards may not be up yet
        self.deltas = self.snapshots = self.failures = self.delta_bytes = self.wire_bytes = self.payload_bytes = 0
        self.last_error = ""
        self.watchers: list = []
        self.history: collections.deque[tuple] = collections.deque(maxlen=HISTORY)
        self._state: ReplicaState | None = None
        self._dense_at = float("-inf")
        self._lock = threading.Lock()  # one refresh at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def state(self) -> ReplicaState | None:
        """The state readers use now (None before the first refresh): take it once per query."""
        return self._state

    def lookup(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids`` of ``table`` in the current state (``ReplicaState.lookup``).

        Raises:
            RuntimeError: nothing read yet. KeyError: a table not served.
        """
        state = self._state
        if state is None:
            raise RuntimeError("the replica has not read the tables yet: call refresh() or start() first")
        return state.lookup(table, ids)

    def refresh(self) -> ReplicaState:
        """Read every table's delta (a snapshot the first time, or when a delta cannot be applied) and, when due,
        the dense parameters; swap the new state in at once.

        Raises:
            ShardRpcError: a shard could not be read (the current state stays).
        """
        with self._lock:
            old, n = self._state, len(self._connect())
            tables, rounds, incarnations, held, direct = {}, {}, {}, [], {}
            for name in self.names:
                since = old.rounds[name] if old is not None else [0] * n
                delta = self._counted(table_delta(self.clients, name, since, self.max_message_bytes,
                                                  old.incarnations[name] if old is not None else None))
                if old is None or delta.forgotten:
                    if old is not None:
                        log.warning("replica: table %r cannot take its delta (a shard restarted or forgot its "
                                    "evictions): reading it whole", name)
                        delta = self._counted(table_delta(self.clients, name, [0] * n, self.max_message_bytes))
                    self.snapshots += 1
                    base = TableExport(delta.spec, torch.empty(0, dtype=torch.int64),
                                       torch.empty(0, delta.spec.embedding_dim), {}, 0, [])
                    previous = ()
                else:
                    self.deltas += 1
                    base = old.tables[name]
                    # the previous rows are reused only for the same spec (its initial rows and shape)
                    previous = (old.direct.get(name), torch.cat([delta.ids, delta.evicted])) \
                        if base.spec == delta.spec else ()
                tables[name] = delta.apply(base)
                if (rows := direct_rows(tables[name], *previous)) is not None:
                    direct[name] = rows
                rounds[name], incarnations[name] = delta.rounds, delta.incarnations
                held += delta.positions
            if len({tuple(v) for v in incarnations.values()}) > 1:  # the next refresh reads the tables whole
                raise RuntimeError("a training shard restarted while the replica read it: this refresh is dropped")
            dense, versions, dense_at = (old.dense, old.versions, old.dense_at) if old is not None else ({}, [], 0.0)
            if self.dense_every is not None and time.monotonic() - self._dense_at >= self.dense_every:
                dense_at = time.time()
                dense, versions = self._read_dense()
                self._dense_at = time.monotonic()
            positions = {k: min(h[k] for h in held) for k in sorted(set.intersection(*map(set, held)))}
            state = ReplicaState(tables, dense, rounds, versions, (old.number if old is not None else 0) + 1,
                                 time.time(), incarnations, positions, dense_at, direct)
            self._state = state  # one reference: a reader sees the old state or this one, whole
            self.history.append((state.number, state.made_at, positions, list(versions), dense_at))
            for watch in self.watchers:
                watch(state)
            return state

    def _connect(self) -> list[ShardClient]:
        """The clients of every shard, connected now if not yet (within 10 s a shard).

        Raises:
            ConnectionError: a shard did not answer (nothing stays connected; the next refresh tries again).
        """
        if not self.clients:
            clients: list[ShardClient] = []
            try:
                for i, a in enumerate(self.servers):
                    clients.append(ShardClient(a, index=i, rpc_timeout=self.rpc_timeout, security=self.security,
                                               connect_timeout=10.0, max_message_bytes=self.max_message_bytes))
            except BaseException:
                for c in clients:
                    c.close()
                raise
            self.clients = clients
        return self.clients

    def _counted(self, delta):
        self.delta_bytes += 8 * (delta.ids.numel() + delta.evicted.numel()) + 4 * delta.weights.numel()
        self.wire_bytes += delta.wire_bytes
        self.payload_bytes += delta.payload_bytes()
        return delta

    def _read_dense(self) -> tuple[dict[str, torch.Tensor], list[int]]:
        from shardps.worker.export import from_servers

        with from_servers(self.servers, tables=[], allow_mixed_versions=True, security=self.security,
                          max_message_bytes=self.max_message_bytes) as export:
            return dict(export.state_dict), list(export.versions)

    def start(self) -> "Replica":
        """Refresh every ``period`` seconds in a daemon thread until :meth:`close` (a failed refresh is logged,
        counted and tried again; readers keep the last state)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="shardps-replica", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                self.refresh()
                self.last_error = ""
            except Exception as exc:  # noqa: BLE001 - a shard down: serve the last state, try again
                self.failures += 1
                self.last_error = str(exc)
                log.warning("replica: refresh failed (%s); serving state %s meanwhile", exc,
                            self._state.number if self._state is not None else "none")
            self._stop.wait(max(0.0, self.period - (time.monotonic() - began)))

    def close(self) -> None:
        """Stop refreshing (waits for a refresh in progress, at most 30 s) and close the connections."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        for c in self.clients:
            c.close()

    def __enter__(self) -> "Replica":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""The shard's counters: the ``Stats`` call (``shardps stats``, the tests) with its digest, and the metrics' values."""

from __future__ import annotations

import asyncio

from shardps.proto import shardps_pb2 as pb


class Stats:
    """The Stats call of one shard's store (``ShardStore.stats``); reads only the store's public names.

    The digest (SHA-256 of the version, parameters and optimizer state) is
    computed on the compute thread between rounds, once for every caller
    that asks while it is being computed.
    """

    def __init__(self, store) -> None:
        self._store = store
        self._digest: asyncio.Future | None = None  # the digest being computed, shared by callers

    def forget(self) -> None:
        """The job was reset: a later caller does not share a digest begun before."""
        self._digest = None

    async def reply(self, request: pb.StatsRequest) -> pb.StatsReply:
        """The shard's counters; with ``request.digest``, also the digest; with ``request.plan``, the plan."""
        digest = ""
        if request.digest and self._store.rounds.optimizer is not None:
            digest = await self._digest_of_current()
        return stats_reply(self._store, digest, request.plan)

    async def _digest_of_current(self) -> str:
        """SHA-256 of the version, parameters and optimizer state; one computation shared by concurrent callers."""
        store = self._store
        if self._digest is None:
            async def compute() -> str:
                try:
                    while store.rounds.applying:  # read the buffers between rounds only
                        await store.notifier.wait_for(lambda: not store.rounds.applying, store.config.max_wait_seconds)
                    return await store.run(store.rounds.optimizer.digest, store.version)
                finally:
                    self._digest = None

            self._digest = asyncio.ensure_future(compute())
        return await asyncio.shield(self._digest)


def stats_reply(store, digest: str = "", with_plan: bool = False) -> pb.StatsReply:
    """Build the Stats reply of ``store`` (a ``ShardStore``) now; ``digest`` as computed by the caller.

    Byte counts are bytes; ``checkpoint_unix_seconds`` is Unix time in seconds.
    """
    job, rounds, members = store.job, store.rounds, store.members
    return pb.StatsReply(
        shard_index=store.config.shard_index,
        num_shards=store.config.num_shards,
        version=store.version,
        members=members.ids(),
        min_workers=store.config.min_workers,
        initialised=job is not None and job.initialised,
        plan_fingerprint=job.fingerprint if job else "",
        optimizer=job.spec.class_name if job else "",
        num_chunks=len(job.table.chunks) if job else 0,
        param_bytes=4 * (job.table.numel if job else 0),
        optimizer_state_bytes=rounds.state_bytes,
        push_bytes_total=store.push_bytes,
        pull_bytes_total=store.pull_bytes,
        pushed=rounds.open_pushers(),
        job_id=job.job_id if job else "",
        waiting=store.waiting,
        max_workers=store.config.max_workers,
        digest=digest,
        rounds_skipped=rounds.skipped,
        membership_epoch=members.epoch,
        lease_expiries=members.expiries,
        last_round_contributors=rounds.last_contributors,
        checkpoint_version=store.checkpoints.latest[0],
        checkpoint_unix_seconds=store.checkpoints.latest[1],
        incarnation=store.incarnation,
        restored_version=store.checkpoints.restored,
        checkpoint_name=store.checkpoints.latest_name,
        checkpoint_sparse_round=store.checkpoints.latest_round,
        restored_checkpoint=store.checkpoints.restored_name,
        restored_sparse_round=store.checkpoints.restored_round,
        pushes_accepted=rounds.pushes_accepted,
        contributions_applied=rounds.contributions_applied,
        pushes_dropped=rounds.pushes_dropped,
        rejoining=sorted(rounds.rejoining),
        stream_positions=rounds.positions.positions(),
        plan=pb.PlanSpec.FromString(job.plan_bytes) if with_plan and job is not None else None,
        mode=job.mode.to_proto() if job is not None and job.mode is not None else None,
        staleness_histogram=rounds.staleness.counts,
        clocks=[] if rounds.mode.synchronous else [members.find(w).clock for w in members.ids()],
        tables=[t.spec.to_proto() for t in store.tables.tables.values()],
    )


def metric_values(store) -> dict[str, float]:
    """The numbers :class:`ShardMetrics` reads of ``store`` when scraped (from the metrics thread: plain reads only)."""
    members = store.members
    return {"received_bytes": store.push_bytes, "sent_bytes": store.pull_bytes, "joins": members.joins,
            "leaves": members.leaves, "lease_expiries": members.expiries, "version": store.rounds.version,
            "live_workers": len(members), "min_workers": store.config.min_workers,
            "last_checkpoint_timestamp_seconds": store.checkpoints.latest[1],
            "stream_batches_held": store.rounds.positions.skipped["held"],
            "stream_batches_owed": store.rounds.positions.skipped["gap"]}

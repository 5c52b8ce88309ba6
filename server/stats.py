"""The shard's ``Stats`` reply: counters an operator (``shardps stats``) and the tests read."""

from __future__ import annotations

from shardps.proto import shardps_pb2 as pb


def stats_reply(store, digest: str = "", with_plan: bool = False) -> pb.StatsReply:
    """Build the Stats reply of ``store`` (a ``ShardStore``) now; ``digest`` as computed by the caller.

    Byte counts are bytes; ``checkpoint_unix_seconds`` is Unix time in seconds.
    """
    job, rounds = store._job, store.rounds
    return pb.StatsReply(
        shard_index=store.config.shard_index,
        num_shards=store.config.num_shards,
        version=store.version,
        members=store._members.ids(),
        min_workers=store.config.min_workers,
        initialised=job is not None and job.initialised,
        plan_fingerprint=job.fingerprint if job else "",
        optimizer=job.spec.class_name if job else "",
        num_chunks=len(job.table.chunks) if job else 0,
        param_bytes=4 * (job.table.numel if job else 0),
        optimizer_state_bytes=rounds.state_bytes,
        push_bytes_total=store._push_bytes,
        pull_bytes_total=store._pull_bytes,
        pushed=sorted(rounds.pushed),
        job_id=job.job_id if job else "",
        waiting=store._waiting,
        max_workers=store.config.max_workers,
        digest=digest,
        rounds_skipped=rounds.skipped,
        membership_epoch=store._members.epoch,
        lease_expiries=store._members.expiries,
        last_round_contributors=rounds.last_contributors,
        checkpoint_version=store.checkpoints.latest[0],
        checkpoint_unix_seconds=store.checkpoints.latest[1],
        incarnation=store.incarnation,
        restored_version=store.checkpoints.restored,
        pushes_accepted=rounds.pushes_accepted,
        contributions_applied=rounds.contributions_applied,
        pushes_dropped=rounds.pushes_dropped,
        rejoining=sorted(rounds.rejoining),
        plan=pb.PlanSpec.FromString(job.plan_bytes) if with_plan and job is not None else None,
        mode=job.mode.to_proto() if job is not None and job.mode is not None else None,
        staleness_histogram=rounds.staleness.counts,
        clocks=[] if rounds.mode.synchronous else [store._members.find(w).clock for w in store._members.ids()],
    )

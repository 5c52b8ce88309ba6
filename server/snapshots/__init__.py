"""Snapshots of a shard on disk: checkpoints of its job, parameters, buffers and optimizer state, and restoring them."""

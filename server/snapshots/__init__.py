"""Snapshots of a shard's whole state: checkpoints on disk, and the calls that read or replace it between rounds."""

"""Sparse tables on the shard: rows of embedding tables, their row-wise optimizers, sync sparse rounds."""

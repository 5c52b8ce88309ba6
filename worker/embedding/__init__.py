"""Sharded embedding tables: modules whose rows live on the shards, the worker's table client, export."""

"""Helpers shared by the tests: forked shard clusters, worker processes, raw gRPC clients, certificates."""

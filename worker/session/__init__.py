"""A worker's session with the shards: connections, joining, leases, retries, recovery after a shard restart, and
leaving at interpreter exit."""

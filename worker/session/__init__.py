"""A worker's session with the shards: connections, joining, leases, retries and recovery after a shard restart."""

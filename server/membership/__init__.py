"""Who trains on a shard: the job its first joiner fixed, admission of workers, members and their leases."""

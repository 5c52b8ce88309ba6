"""Rounds and consistency modes of one shard: sync (BSP) rounds, async (ASP) applies on arrival,
and ssp's bounded-staleness wait."""

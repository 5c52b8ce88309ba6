"""Rounds and consistency modes of one shard: sync (BSP) rounds, async (ASP) applies on arrival
(``rounds.py``), the modes (``modes.py``), and ssp's bounded-staleness rule (``ssp.py``)."""

"""What both ends of the wire share in Python: the partition plan, the chunk codec, the optimizer spec,
the checkpoint format, channel options and security, shard addresses and consistency modes.

``shardps.server`` and ``shardps.worker`` import this package; it imports neither of them
(checked by the import-linter contracts in ``pyproject.toml``).
"""

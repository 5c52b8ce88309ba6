"""The commands: ``shardps`` (:mod:`shardps.cli.main`, operator commands in :mod:`shardps.cli.operator`)
and ``shardps-server`` (:mod:`shardps.cli.server`). They import the library; the library never imports them.
"""

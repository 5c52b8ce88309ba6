"""The installed shardps version, for ``--version`` and the metrics' ``shardps_*_info`` series."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def shardps_version() -> str:
    """The version of the installed ``shardps`` distribution, e.g. ``"0.1.0"``; ``"unknown"`` when not installed."""
    try:
        return version("shardps")
    except PackageNotFoundError:
        return "unknown"

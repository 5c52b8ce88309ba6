"""Shard addresses: the one parser of ``host:port,host:port,...`` lists, for the library and the commands."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["parse_servers"]


def parse_servers(servers: str | Iterable[str]) -> list[str]:
    """Shard addresses in shard-index order.

    Args:
        servers: a comma-separated string ``"host:port,host:port"`` or an
            iterable of ``"host:port"`` strings. Blank entries and surrounding
            spaces are dropped. IPv6 hosts keep their brackets (``"[::1]:50051"``).

    Returns:
        The addresses as a list of ``"host:port"`` strings, at least one.

    Raises:
        ValueError: no address at all, or an entry that is not ``host:port``
            with a decimal port in 0..65535 (the message names the entry).
    """
    items = servers.split(",") if isinstance(servers, str) else list(servers)
    out = []
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"a shard address must be a 'host:port' string, got {type(item).__name__}")
        address = item.strip()
        if not address:
            continue
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(f"shard address {address[:100]!r} is not host:port (e.g. 127.0.0.1:50051)")
        out.append(address)
    if not out:
        raise ValueError("servers must list at least one shard address host:port")
    return out

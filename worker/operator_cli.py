"""Operator commands of the ``shardps`` CLI that act on a job's state: ``checkpoint`` and ``export``.

    shardps checkpoint --servers host:port,...
    shardps export (--servers host:port,... | --checkpoint-dir DIR [--version V])
                   --out model.safetensors|model.pt [--allow-mixed-versions] [--wait-seconds S]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable


def add_commands(sub, servers_type: Callable[[str], tuple[str, ...]]) -> None:
    """Register ``checkpoint`` and ``export`` on the CLI's subparsers."""
    c = sub.add_parser("checkpoint", help="make every shard write a checkpoint now (needs --checkpoint-dir)")
    c.add_argument("--servers", type=servers_type, required=True, help="shards host:port,... in shard order")
    e = sub.add_parser("export", help="write the model's state_dict from live shards or their checkpoints")
    source = e.add_mutually_exclusive_group(required=True)
    source.add_argument("--servers", type=servers_type, help="live shards host:port,... in shard order")
    source.add_argument("--checkpoint-dir", type=Path,
                        help="the shards' --checkpoint-dir (holding shard-0, shard-1, ...)")
    e.add_argument("--out", type=Path, required=True, help="output file: *.safetensors, or *.pt (torch.save)")
    e.add_argument("--version", type=int, default=0,
                   help="with --checkpoint-dir: take every shard's checkpoint of this version (default: newest)")
    e.add_argument("--allow-mixed-versions", action="store_true",
                   help="export shards at different versions instead of refusing")
    e.add_argument("--wait-seconds", type=float, default=30.0,
                   help="with --servers: how long to wait for the shards to agree on a version (default 30)")


def each_shard(servers: tuple[str, ...], call, refused: str, rpc_timeout: float = 10.0) -> int:
    """Run ``call(client) -> line`` on every shard in turn, printing a line per shard.

    A shard that refuses (``ShardRpcError``) gets ``"<refused>: <details>"`` on
    stderr and the others are still asked.

    Returns:
        The exit code: 1 if any shard refused, else 0.
    """
    from shardps.worker.client import ShardClient, ShardRpcError

    failed = 0
    for i, address in enumerate(servers):
        client = ShardClient(address, index=i, connect_timeout=10.0, rpc_timeout=rpc_timeout)
        try:
            print(f"shard {i} ({address}): {call(client)}")
        except ShardRpcError as exc:
            failed += 1
            print(f"shard {i} ({address}): {refused}: {exc.details}", file=sys.stderr)
        finally:
            client.close()
    return 1 if failed else 0


def checkpoint(args: argparse.Namespace) -> int:
    """Ask every shard for a checkpoint; a line per shard; exit 1 if any refused."""
    def call(client) -> str:
        reply = client.checkpoint()
        return f"checkpoint of version {reply.version} in {reply.path}"

    return each_shard(args.servers, call, "no checkpoint", rpc_timeout=300.0)


def export(args: argparse.Namespace) -> int:
    """Assemble the state_dict and write it to ``args.out`` (nothing is written when refused)."""
    from shardps.worker import export as exporting

    if args.servers:
        if args.version:
            raise ValueError("--version picks a checkpoint: use it with --checkpoint-dir")
        result = exporting.from_servers(list(args.servers), wait_seconds=args.wait_seconds,
                                        allow_mixed_versions=args.allow_mixed_versions)
    else:
        try:
            result = exporting.from_checkpoints(args.checkpoint_dir, version=args.version,
                                                allow_mixed_versions=args.allow_mixed_versions)
        except FileNotFoundError as exc:
            raise RuntimeError(str(exc)) from None
    path = result.save(args.out)
    versions = sorted(set(result.versions))
    at = f"version {versions[0]}" if len(versions) == 1 else f"versions {result.versions} (mixed)"
    print(f"exported {len(result.state_dict)} tensors of job {result.job_id} at {at} to {path}")
    return 0

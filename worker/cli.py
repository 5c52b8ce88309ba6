"""``shardps``: the worker-side command line.

    shardps train digits [--workers 2] [--shards 2] [--epochs 40] [--lr 3e-3]
                         [--servers host:port,...] [--report PATH]
    shardps stats --servers host:port,...
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


def _servers(text: str) -> tuple[str, ...]:
    servers = tuple(s.strip() for s in text.split(",") if s.strip())
    for s in servers:
        host, _, port = s.rpartition(":")
        if not host or not port.isdigit():
            raise argparse.ArgumentTypeError(f"{s!r} is not host:port")
    if not servers:
        raise argparse.ArgumentTypeError("give at least one host:port")
    return servers


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardps", description="shardps: a sharded parameter server for PyTorch.")
    sub = p.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run a training job").add_subparsers(dest="job", required=True)
    d = train.add_parser("digits", help="MLP on scikit-learn's handwritten digits, sync (BSP)")
    d.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    d.add_argument("--shards", type=int, default=2, help="shards to start when --servers is not given (default 2)")
    d.add_argument("--servers", type=_servers, default=(), help="running shards host:port,... in shard order")
    d.add_argument("--epochs", type=int, default=40, help="epochs (default 40)")
    d.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (default 3e-3)")
    d.add_argument("--batch-size", type=int, default=32, help="samples per worker per step (default 32)")
    d.add_argument("--seed", type=int, default=0, help="seed of split, shuffles and init (default 0)")
    d.add_argument("--chunk-bytes", type=int, default=1 << 20, help="largest chunk in bytes (default 1 MiB)")
    d.add_argument("--push-dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="gradient wire type")
    d.add_argument("--pull-dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="parameter wire type")
    d.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    d.add_argument("--report", type=Path, help="write a JSON report to this path")
    s = sub.add_parser("stats", help="print each shard's Stats as JSON")
    s.add_argument("--servers", type=_servers, required=True, help="shards host:port,... in shard order")
    r = sub.add_parser("reset", help="drop the job held by idle shards (parameters and optimizer state)")
    r.add_argument("--servers", type=_servers, required=True, help="shards host:port,... in shard order")
    r.add_argument("--job-id", default="", help="reset only shards that hold this job")
    return p


def _train_digits(args: argparse.Namespace) -> int:
    from shardps.worker.digits import DigitsConfig, run

    config = DigitsConfig(
        workers=args.workers, shards=args.shards, servers=args.servers, epochs=args.epochs, lr=args.lr,
        batch_size=args.batch_size, seed=args.seed, chunk_bytes=args.chunk_bytes,
        push_dtype=args.push_dtype, pull_dtype=args.pull_dtype, progress=not args.no_progress,
    )
    report = run(config)
    print(
        f"digits: test accuracy {report['test_accuracy']:.4f}, final loss {report['final_loss']:.4f}, "
        f"{report['steps']} steps in {report['wall_seconds']:.1f}s "
        f"({report['workers']} workers, {report['shards']} shards, {report['mode']})"
    )
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(report, indent=2) + "\n")
        print(f"report written to {args.report}")
    return 0


def _stats(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    from shardps.worker.client import ShardClient

    for i, address in enumerate(args.servers):
        client = ShardClient(address, index=i, connect_timeout=10.0, rpc_timeout=10.0)
        try:
            print(json.dumps(MessageToDict(client.stats(), always_print_fields_with_no_presence=True)))
        finally:
            client.close()
    return 0


def _reset(args: argparse.Namespace) -> int:
    """Reset every shard; a line per shard; exit 1 if any refused (a busy shard is left as it was)."""
    from shardps.worker.client import ShardClient, ShardRpcError

    failed = 0
    for i, address in enumerate(args.servers):
        client = ShardClient(address, index=i, connect_timeout=10.0, rpc_timeout=10.0)
        try:
            reply = client.reset(args.job_id)
            print(f"shard {i} ({address}): " + (f"job {reply.job_id} dropped at version {reply.version}"
                                               if reply.job_id else "held no job"))
        except ShardRpcError as exc:
            failed += 1
            print(f"shard {i} ({address}): not reset: {exc.details}", file=sys.stderr)
        finally:
            client.close()
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "train":
            return _train_digits(args)
        if args.command == "reset":
            return _reset(args)
        return _stats(args)
    except (ValueError, RuntimeError, ConnectionError) as exc:
        print(f"shardps: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

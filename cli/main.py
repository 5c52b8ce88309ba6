"""``shardps``: the worker-side command line.

    shardps train digits [--workers 2] [--shards 2] [--epochs 40] [--lr 3e-3]
                         [--servers host:port,... [--fresh-job]] [--report PATH]
    shardps train digits --servers host:port,... --workers N --worker-index I   # one worker: I of N
    torchrun --nproc-per-node 2 --max-restarts 1 -m shardps.cli.main \
        train digits --servers host:port,... --worker-index env             # rank and size from the launcher
    shardps stats --servers host:port,... [--timeout 10]                    # one JSON array, a shard per object
    shardps health --servers host:port,... [--timeout 5] [--service NAME]   # exit 0 only if all SERVING
    shardps reset --servers host:port,... [--job-id ID] [--timeout 30]
    shardps checkpoint --servers host:port,... [--timeout 120]
    shardps export (--servers host:port,... | --checkpoint-dir DIR [--version V]) --out model.safetensors
    shardps --version

Every command that calls shards takes ``--tls-ca``, ``--tls-cert``,
``--tls-key``, ``--auth-token-file`` and ``--allow-token-over-plaintext``
(``operator_cli.add_security_flags``);
``train digits`` also ``--metrics-port``. The operator commands live in
``shardps.cli.operator``, which also holds the output rule: a reader
that closes stdout early (``| head``) is not an error.

This module is the edge: it alone reads the environment (a launcher's
``RANK``/``WORLD_SIZE``/``JOB_COMPLETION_INDEX``); the library takes
explicit arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from shardps.common.addresses import parse_servers
from shardps.common.version import shardps_version
from shardps.cli import operator as operator_cli
from shardps.cli import serve as serve_cli
from shardps.cli.untrusted import MAX_TEXT_CHARS, printable


def _servers(text: str) -> tuple[str, ...]:
    try:
        return tuple(parse_servers(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _worker_index(text: str) -> int | str:
    if text == "env":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is neither a worker index (0, 1, ...) nor 'env'")
    return int(text)


def _env_int(environ: Mapping[str, str], name: str) -> int:
    value = environ[name].strip()
    if not value.isdigit():
        raise ValueError(f"environment variable {name}={environ[name]!r} is not a non-negative integer")
    return int(value)


def launcher_rank(environ: Mapping[str, str]) -> tuple[int, int | None, int]:
    """This process's place in a job started by a launcher: ``(rank, world_size, restart_count)``.

    torchrun (``torch.distributed.run``) sets ``RANK`` and ``WORLD_SIZE``
    (and ``TORCHELASTIC_RESTART_COUNT``, how many times it restarted the
    workers); a Kubernetes indexed Job sets ``JOB_COMPLETION_INDEX``, and
    ``WORLD_SIZE`` only if the pod spec does (``world_size`` is None then).
    ``RANK`` wins when both are set.

    Args:
        environ: the environment to read (``os.environ`` at the command line).

    Raises:
        ValueError: neither ``RANK`` nor ``JOB_COMPLETION_INDEX`` is set, ``RANK``
            comes without ``WORLD_SIZE``, a value is not a non-negative integer,
            or the rank is not below the world size.
    """
    if "RANK" in environ:
        if "WORLD_SIZE" not in environ:
            raise ValueError("RANK is set but WORLD_SIZE is not: start the workers with torchrun, or set both")
        rank, world = _env_int(environ, "RANK"), _env_int(environ, "WORLD_SIZE")
    elif "JOB_COMPLETION_INDEX" in environ:
        rank = _env_int(environ, "JOB_COMPLETION_INDEX")
        world = _env_int(environ, "WORLD_SIZE") if "WORLD_SIZE" in environ else None
    else:
        raise ValueError("--worker-index env needs RANK and WORLD_SIZE (torchrun) or JOB_COMPLETION_INDEX "
                         "(a Kubernetes indexed Job) in the environment")
    if world is not None and rank >= world:
        raise ValueError(f"rank {rank} is not below the world size {world}")
    restarts = _env_int(environ, "TORCHELASTIC_RESTART_COUNT") if "TORCHELASTIC_RESTART_COUNT" in environ else 0
    return rank, world, restarts


def _node_group(rank: int, world: int, local_ranks: int):
    """torchrun with ``--nproc-per-node L``: ``(node, nodes, local rank, the node's Gloo group)``.

    torchrun numbers the ranks of a node consecutively (``GROUP_RANK * L +
    LOCAL_RANK``), so node ``n`` is ranks ``[n L, (n + 1) L)``; every rank
    joins the default group (env://) and ``new_subgroups`` cuts it per node.

    Raises:
        ValueError: the world size is not a multiple of ``local_ranks``.
    """
    import torch.distributed as torch_dist

    if world % local_ranks:
        raise ValueError(f"the launcher's WORLD_SIZE {world} is not a multiple of --local-ranks {local_ranks}")
    torch_dist.init_process_group("gloo")
    group, _ = torch_dist.new_subgroups(group_size=local_ranks)
    return rank // local_ranks, world // local_ranks, rank % local_ranks, group


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port in [0, 65535] (0: a free one)")
    return int(text)


#: ``--fresh-job`` of ``shardps train``: ``resume="refuse"`` (``shardps.worker.job``).
FRESH_JOB_HELP = ("refuse to continue a job the running --servers already hold past version 0 (exit 1, naming "
                  "`shardps reset`) instead of continuing it with a WARNING 'continuing job J at version V'; "
                  "checked once before the workers start")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardps", description="shardps: a sharded parameter server for PyTorch.")
    p.add_argument("--version", action="version", version=f"shardps {shardps_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run a training job").add_subparsers(dest="job", required=True)
    d = train.add_parser("digits", help="MLP on scikit-learn's handwritten digits, sync (BSP)")
    d.add_argument("--workers", type=int, default=None,
                   help="workers in the job (default 2; with --worker-index env the launcher's WORLD_SIZE)")
    d.add_argument("--worker-index", type=_worker_index, default=None,
                   help="run only worker I of --workers in this process, against running --servers; 'env' takes "
                        "I and --workers from the launcher (torchrun's RANK and WORLD_SIZE, or a Kubernetes indexed "
                        "Job's JOB_COMPLETION_INDEX)")
    d.add_argument("--job-name", default="digits",
                   help="worker I joins as <job-name>-rank<I>, so a restarted worker is the same member (default digits)")
    d.add_argument("--connect-timeout", type=float, default=30.0,
                   help="with --worker-index: seconds to wait for the shards, and for a crashed predecessor's "
                        "lease on this worker's id (default 30)")
    d.add_argument("--wait-for-workers", type=float, default=30.0,
                   help="with --worker-index: after joining, wait up to S seconds until --workers workers are members, "
                        "so that ranks restarted together take up the job together (default 30; 0: start at once)")
    d.add_argument("--log-every", type=int, default=10,
                   help="with --worker-index: print a progress line every N steps, 0 never (default 10)")
    d.add_argument("--shards", type=int, default=2, help="shards to start when --servers is not given (default 2)")
    d.add_argument("--servers", type=_servers, default=(), help="running shards host:port,... in shard order")
    d.add_argument("--epochs", type=int, default=40, help="epochs (default 40)")
    d.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (default 3e-3)")
    d.add_argument("--batch-size", type=int, default=32, help="samples per worker per step (default 32)")
    d.add_argument("--seed", type=int, default=0, help="seed of split, shuffles and init (default 0)")
    d.add_argument("--chunk-bytes", type=int, default=1 << 20, help="largest chunk in bytes (default 1 MiB)")
    d.add_argument("--push-dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="gradient wire type")
    d.add_argument("--pull-dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="parameter wire type")
    d.add_argument("--mode", choices=["sync", "async", "ssp"], default="sync",
                   help="consistency mode (default sync: the exact equivalent of one process on the whole batch)")
    d.add_argument("--staleness", type=int, default=None, help="ssp: clocks a worker may run ahead of the slowest")
    d.add_argument("--local-ranks", type=int, default=1,
                   help="processes per worker (node): they reduce with torch.distributed (Gloo) first and push as "
                        "one contributor (default 1); with --worker-index env, torchrun's --nproc-per-node")
    d.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    d.add_argument("--report", type=Path, help="write a JSON report to this path")
    d.add_argument("--metrics-port", type=_port, default=None, metavar="P",
                   help="serve Prometheus metrics over HTTP: worker process K (rank x local ranks + local rank) "
                        "on port P + K, or each on a free port when P is 0; every process prints "
                        "'worker K metrics on HOST:PORT' (default: no metrics endpoint)")
    d.add_argument("--fresh-job", action="store_true", help=FRESH_JOB_HELP + "; with --worker-index, each worker "
                   "when it joins, unless the launcher restarted it (TORCHELASTIC_RESTART_COUNT > 0), which continues")
    operator_cli.add_security_flags(d)
    d.set_defaults(run=_train_digits)
    m = train.add_parser("movielens", help="matrix factorisation on MovieLens-100K, user and item tables on the "
                                           "shards, sync (BSP)")
    m.add_argument("--data-dir", required=True,
                   help="the ml-100k folder (u1.base, u1.test), from https://grouplens.org/datasets/movielens/100k/")
    m.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    m.add_argument("--shards", type=int, default=2, help="shards to start when --servers is not given (default 2)")
    m.add_argument("--servers", type=_servers, default=(), help="running shards host:port,... in shard order")
    m.add_argument("--epochs", type=int, default=25, help="passes over u1.base (default 25)")
    m.add_argument("--batch-size", type=int, default=512, help="ratings per worker per step (default 512)")
    m.add_argument("--dim", type=int, default=64, help="values per user and item vector (default 64)")
    m.add_argument("--lr", type=float, default=0.02, help="Adagrad learning rate of the vector tables (default 0.02)")
    m.add_argument("--seed", type=int, default=0, help="seed of the shuffles (default 0)")
    m.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    m.add_argument("--report", type=Path, help="write a JSON report to this path")
    m.add_argument("--fresh-job", action="store_true", help=FRESH_JOB_HELP)
    m.add_argument("--online", action="store_true",
                   help="stream training (docs/online.md): warm start on the first --warm ratings of u.data in time "
                        "order, then the rest through a Redis stream, each batch scored before it is trained; "
                        "1 worker, --shards shards started here")
    m.add_argument("--redis-url", default="", help="--online: the broker (default: a redis-server started here)")
    m.add_argument("--rate", type=float, default=2000.0, help="--online: events per second published (default 2000)")
    m.add_argument("--warm", type=int, default=50_000, help="--online: ratings of the warm start (default 50000)")
    m.add_argument("--warm-epochs", type=int, default=5, help="--online: epochs of the warm start (default 5)")
    m.add_argument("--limit", type=int, default=0, help="--online: streamed events at most (default 0: all)")
    m.add_argument("--plot", default="", help="--online: draw the progressive RMSE curve to this PNG file")
    m.add_argument("--ttl-days", type=float, default=0.0,
                   help="--online: evict rows unseen for this many days of event time (default 0: never)")
    m.add_argument("--item-ttl-days", type=float, default=None,
                   help="--online: evict item rows unseen for this many days instead (default: --ttl-days)")
    m.add_argument("--serve", action="store_true",
                   help="--online: run `shardps serve` beside the job, query it and report its freshness")
    m.add_argument("--serve-period", type=float, default=0.5,
                   help="--online --serve: the replica's refresh period in seconds (default 0.5)")
    m.add_argument("--serve-qps", type=float, default=200.0,
                   help="--online --serve: queries per second sent to the replica (default 200; 0: none)")
    m.add_argument("--serve-nice", type=int, default=0,
                   help="--online --serve: the replica's `shardps serve --nice` (default 0; -10 puts its queries "
                        "before training's work on shared cores; a negative value needs CAP_SYS_NICE)")
    m.add_argument("--serve-client-nice", type=int, default=0,
                   help="--online --serve: the query client's nice value (default 0; the replica's value keeps the "
                        "client's own wait for a core out of the latency it measures on shared cores)")
    m.add_argument("--serve-realtime", type=int, default=0,
                   help="--online --serve: the replica's `shardps serve --realtime` (default 0: off; a SCHED_FIFO "
                        "priority 1-99 lets its queries take a core from training at once; needs CAP_SYS_NICE)")
    m.add_argument("--serve-client-realtime", type=int, default=0,
                   help="--online --serve: the query client's SCHED_FIFO priority (default 0: off; keeps its own "
                        "wait for a core out of what it measures, as for a caller on another host)")
    m.add_argument("--serve-client-api", choices=("unary", "stream"), default="unary",
                   help="--online --serve: the query client sends a Lookup or Score call per query (unary, the "
                        "default) or every query on one Query stream (stream: less CPU per query on both sides)")
    m.set_defaults(run=_train_movielens)
    operator_cli.add_commands(sub, _servers)
    serve_cli.add_command(sub, _servers)
    return p


_say = operator_cli.say


def _write_report(path: Path | None, report: dict) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
        _say(f"report written to {path}")


def _check_apps_extra() -> None:
    """The main jobs need the ``apps`` extra (scikit-learn, tqdm); the library does not.

    Raises:
        SystemExit: with the install command, when a package of the extra is missing.
    """
    import importlib.util

    missing = [m for m in ("sklearn", "tqdm") if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"shardps train needs the apps extra ({', '.join(missing)} missing): "
                         "pip install 'shardps[apps]' (from a clone: pip install -e \".[apps]\")")


def _stop_on_sigterm() -> None:
    """SIGTERM (a launcher, ``timeout``, Kubernetes) ends the command like Ctrl-C: the shards it started stop."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def _train_digits(args: argparse.Namespace) -> int:
    _check_apps_extra()
    _stop_on_sigterm()
    from shardps.apps.digits import DigitsConfig, run

    if args.worker_index is not None:
        return _train_digits_worker(args)
    config = DigitsConfig(
        workers=2 if args.workers is None else args.workers, shards=args.shards, servers=args.servers,
        epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, seed=args.seed, chunk_bytes=args.chunk_bytes,
        push_dtype=args.push_dtype, pull_dtype=args.pull_dtype, progress=not args.no_progress,
        job_name=args.job_name, mode=args.mode, staleness=args.staleness, local_ranks=args.local_ranks,
        security=operator_cli.security_from_args(args), metrics_port=args.metrics_port,
        resume="refuse" if args.fresh_job else "allow",
    )
    report = run(config)
    _say(
        f"digits: test accuracy {report['test_accuracy']:.4f}, final loss {report['final_loss']:.4f}, "
        f"{report['steps']} steps in {report['wall_seconds']:.1f}s "
        f"({report['workers']} workers x {report['local_ranks']} local ranks, {report['shards']} shards, "
        f"{report['mode']})"
    )
    _write_report(args.report, report)
    return 0


def _train_movielens(args: argparse.Namespace) -> int:
    _check_apps_extra()
    _stop_on_sigterm()
    from shardps.apps.movielens import MovieLensConfig, run

    if args.online:
        return _train_movielens_online(args)
    config = MovieLensConfig(data_dir=args.data_dir, workers=args.workers, shards=args.shards, servers=args.servers,
                             epochs=args.epochs, batch_size=args.batch_size, dim=args.dim, lr=args.lr,
                             seed=args.seed, progress=not args.no_progress,
                             resume="refuse" if args.fresh_job else "allow")
    try:
        report = run(config)
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from None
    _say(f"movielens: test RMSE {report['test_rmse']:.4f} on u1.test, train MSE {report['train_loss']:.4f}, "
         f"{report['steps']} steps in {report['wall_seconds']:.1f}s ({report['workers']} workers, "
         f"{report['shards']} shards)")
    _write_report(args.report, report)
    return 0


def _train_movielens_online(args: argparse.Namespace) -> int:
    from shardps.apps.movielens_online import OnlineConfig, run_online

    if args.servers:
        raise ValueError("--online starts its own shards: leave out --servers")
    config = OnlineConfig(data_dir=args.data_dir, shards=args.shards, redis_url=args.redis_url, warm=args.warm,
                          warm_epochs=args.warm_epochs, rate=args.rate, limit=args.limit, dim=args.dim, lr=args.lr,
                          seed=args.seed, plot=args.plot, ttl_days=args.ttl_days,
                          item_ttl_days=-1.0 if args.item_ttl_days is None else args.item_ttl_days,
                          serve=args.serve, serve_period=args.serve_period, serve_qps=args.serve_qps,
                          serve_nice=args.serve_nice, serve_client_nice=args.serve_client_nice,
                          serve_realtime=args.serve_realtime, serve_client_realtime=args.serve_client_realtime,
                          serve_client_api=args.serve_client_api)
    try:
        report = run_online(config, say=_say)
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from None
    _write_report(args.report, report)
    return 0


def _train_digits_worker(args: argparse.Namespace) -> int:
    """One worker of a job whose processes a launcher (or a test) starts: ``--worker-index I`` or ``env``.

    Prints ``key=value`` lines on stdout for people and tests: ``start``
    (pid, worker id, rank, workers, restart count), ``joined`` (the version
    pulled, whether the job was resumed), ``step`` every ``--log-every``
    steps (steps of this process, the shards' version, loss, Unix time),
    ``done`` (final version, test accuracy, final loss).
    """
    from dataclasses import asdict

    _check_apps_extra()
    from shardps.apps.digits import DigitsConfig, rank_worker_id, train_worker

    if not args.servers:
        raise ValueError("--worker-index runs one worker against running shards: give --servers host:port,...")
    if args.log_every < 0:
        raise ValueError(f"--log-every must be >= 0, got {args.log_every}")
    if not args.wait_for_workers >= 0:
        raise ValueError(f"--wait-for-workers must be >= 0 seconds, got {args.wait_for_workers}")
    restarts = 0
    if args.worker_index == "env":
        index, world, restarts = launcher_rank(os.environ)
        if world is None and args.workers is None:
            raise ValueError("the launcher sets no WORLD_SIZE: give --workers")
        if world is not None and args.workers is not None and args.workers != world:
            raise ValueError(f"--workers {args.workers} differs from the launcher's WORLD_SIZE {world}")
        workers = world if world is not None else args.workers
    else:
        index, workers = args.worker_index, 2 if args.workers is None else args.workers
    local_rank, group = 0, None
    if args.local_ranks > 1:
        index, workers, local_rank, group = _node_group(index, workers, args.local_ranks)
    config = DigitsConfig(
        workers=workers, servers=args.servers, epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
        seed=args.seed, chunk_bytes=args.chunk_bytes, push_dtype=args.push_dtype, pull_dtype=args.pull_dtype,
        progress=False, job_name=args.job_name, mode=args.mode, staleness=args.staleness,
        local_ranks=args.local_ranks, security=operator_cli.security_from_args(args), metrics_port=args.metrics_port,
        resume="refuse" if args.fresh_job and restarts == 0 else "allow",  # a restarted rank continues its job
    )
    if not 0 <= index < workers:
        raise ValueError(f"worker index {index} is outside [0, {workers})")
    wid, pid = rank_worker_id(config.job_name, index), os.getpid()
    if args.local_ranks > 1:
        wid = f"{config.job_name}-node{index}"  # the node's contributor id, stable across torchrun restarts
    _say(f"start pid={pid} worker_id={wid} rank={index} workers={workers} restart={restarts} t={time.time():.3f}")

    def joined(version: int, resumed: bool, members: list[str]) -> None:
        _say(f"joined pid={pid} worker_id={wid} version={version} resumed={resumed} members={','.join(members)} "
             f"t={time.time():.3f}")

    def step(steps: int, version: int, loss: float) -> None:
        if args.log_every and steps % args.log_every == 0:
            _say(f"step local_step={steps} version={version} loss={loss:.4f} t={time.time():.3f} pid={pid} "
                 f"worker_id={wid}")

    start = time.perf_counter()
    result = train_worker(config, index, worker_id=wid, connect_timeout=args.connect_timeout,
                          wait_for_workers=args.wait_for_workers, on_join=joined, on_step=step,
                          local_rank=local_rank, group=group)
    wall = time.perf_counter() - start
    _say(f"done pid={pid} worker_id={wid} version={result['version']} local_steps={result['local_steps']} "
         f"test_accuracy={result['test_accuracy']:.4f} final_loss={result['final_loss']:.4f}")
    _say(f"digits worker {index}/{workers} ({wid}): test accuracy {result['test_accuracy']:.4f}, final loss "
         f"{result['final_loss']:.4f}, shards at version {result['version']} of {result['steps']}, "
         f"{result['local_steps']} steps in this process in {wall:.1f}s"
         + (f" (resumed at version {result['joined_version']})" if result["resumed"] else ""))
    settings = asdict(config)
    settings.pop("security", None)  # certificates, key and token: never into a report
    _write_report(args.report, {
        **result, "wall_seconds": wall, "shards": config.shards, "mode": config.mode, "servers": ",".join(args.servers),
        "restart": restarts, "pid": pid, "config": settings,
    })
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    ``ValueError``, ``RuntimeError``, ``ConnectionError`` and ``TimeoutError``
    become one ``shardps: error: ...`` line on stderr (control characters
    escaped: it may quote a shard) and status 1. A closed stdout is
    never a traceback: output goes through :func:`operator_cli.say`, and a
    ``BrokenPipeError`` from anywhere else points stdout at /dev/null and
    exits 1 (the Python documentation's recipe for SIGPIPE).
    """
    try:
        args = _parser().parse_args(argv)
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        try:
            return args.run(args)
        except BrokenPipeError:  # a ConnectionError too: must come first
            raise
        except (ValueError, RuntimeError, ConnectionError, TimeoutError) as exc:
            # the message may quote a shard's reply: control characters escaped (shardps.cli.untrusted)
            print(f"shardps: error: {printable(str(exc), one_line=False, limit=MAX_TEXT_CHARS)}", file=sys.stderr)
            return 1
    except BrokenPipeError:
        operator_cli.stdout_to_devnull()
        return 1
    finally:  # also for argparse's --help/--version exits, whose output is still buffered
        operator_cli.flush_stdout()


if __name__ == "__main__":
    sys.exit(main())

"""Operator commands of the ``shardps`` CLI: ``stats``, ``health``, ``reset``, ``checkpoint`` and ``export``.

    shardps stats --servers host:port,... [--timeout S]
    shardps health --servers host:port,... [--timeout S] [--service NAME]
    shardps reset --servers host:port,... [--job-id ID] [--timeout S]
    shardps checkpoint --servers host:port,... [--timeout S]
    shardps export (--servers host:port,... | --checkpoint-dir DIR [--version V])
                   --out model.safetensors|model.pt [--allow-mixed-versions] [--wait-seconds S]
                   [--num-shards N] [--model-state FILE] [--tables NAME,...] [--max-message-bytes B]
                   [--timeout S]

Every command that talks to shards takes the security flags of
:func:`add_security_flags` (``--tls-ca``, ``--tls-cert``, ``--tls-key``,
``--auth-token-file``, ``--allow-token-over-plaintext``), matching the shards' own.

A stuck or hostile server cannot hang or flood a command: ``--timeout S``
(default per command, :data:`TIMEOUTS`) bounds the whole command, every
shard being asked at once, and replies go through
``shardps.cli.untrusted`` (sizes checked against the protocol's limits,
control characters escaped before printing).

Output goes through :func:`say`: a reader that closes stdout early
(``shardps stats ... | head -c 10``) is not an error. As the Python
documentation advises for ``BrokenPipeError``, stdout is then pointed at
``/dev/null``; unlike its example the command does not stop there but
finishes what it does (a reset or checkpoint still reaches every shard,
``health`` still exits with its verdict), with no traceback.
``shardps.cli.main.main`` catches any other ``BrokenPipeError`` the same
way and exits 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from shardps.cli.untrusted import bound, check_stats, checked_text, export_live, json_chunks, printable
from shardps.common.security import INSECURE_FLAG, ChannelSecurity
from shardps.common.transport import DEFAULT_MAX_MESSAGE_BYTES

#: Exit status of ``health`` when some shard is not SERVING (0 when every shard is).
UNHEALTHY = 1
#: Default ``--timeout`` of each command, seconds: the whole command, every shard asked at once.
TIMEOUTS = {"stats": 10.0, "health": 5.0, "reset": 30.0, "checkpoint": 120.0, "export": 300.0}
#: Seconds a shard's thread gets past the deadline before the command reports it as not answering.
_GRACE = 2.0


def stdout_to_devnull() -> None:
    """Point stdout at ``/dev/null`` after its reader went away (what the Python docs do on ``BrokenPipeError``)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # stdout is not a file descriptor (replaced in-process)
        sys.stdout = open(os.devnull, "w")
    finally:
        os.close(devnull)


def flush_stdout() -> None:
    """Flush stdout; a closed pipe sends the rest to ``/dev/null`` instead of raising (at exit, for instance)."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        stdout_to_devnull()


def say(text: str) -> None:
    """Print ``text`` and a newline with one write, flushed at once.

    One write because the processes of a launcher often share one stdout and
    lines must not mix. When stdout's reader has gone (``| head``), the rest
    of the output goes to ``/dev/null`` and the caller carries on.
    """
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        stdout_to_devnull()


def say_chunks(chunks) -> None:
    """Print the text pieces ``chunks`` and a newline, in writes of about 1 MiB (a long document is never whole).

    A closed stdout sends the rest to ``/dev/null``, as :func:`say`.
    """
    pending, size = [], 0
    try:
        for piece in chunks:
            pending.append(piece)
            size += len(piece)
            if size >= 1 << 20:
                sys.stdout.write("".join(pending))
                pending, size = [], 0
        sys.stdout.write("".join(pending) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        stdout_to_devnull()


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--tls-ca``, ``--tls-cert``, ``--tls-key``, ``--auth-token-file`` and ``--allow-token-over-plaintext``
    to a command that calls shards."""
    g = parser.add_argument_group("security (match the shards' --tls-* and --auth-token-file)")
    g.add_argument("--tls-ca", default="", metavar="FILE",
                   help="PEM CA certificate that signed the shards' certificates; given: connect with TLS")
    g.add_argument("--tls-cert", default="", metavar="FILE",
                   help="PEM certificate of this client, for shards that require client certificates (with --tls-key)")
    g.add_argument("--tls-key", default="", metavar="FILE", help="PEM private key of --tls-cert")
    g.add_argument("--auth-token-file", default="", metavar="FILE",
                   help="file holding the bearer token the shards require (sent as 'authorization: Bearer ...')")
    g.add_argument(INSECURE_FLAG, action="store_true",
                   help="send --auth-token-file without --tls-ca to shards that are not on a loopback address "
                        "(refused otherwise: anyone on the path could read and replay the token); logs a WARNING")


def _security_files(args: argparse.Namespace) -> dict[str, str]:
    return {name: getattr(args, name, "") or "" for name in ("tls_ca", "tls_cert", "tls_key", "auth_token_file")}


def security_from_args(args: argparse.Namespace) -> ChannelSecurity | None:
    """The ``ChannelSecurity`` the security flags ask for; None (plaintext, no token) when none is given.

    Raises:
        ValueError: a file is missing or unreadable, or a certificate comes without its key
            (``ChannelSecurity.from_files`` names the flag).
    """
    files = _security_files(args)
    allow = bool(getattr(args, "allow_token_over_plaintext", False))
    return ChannelSecurity.from_files(**files, allow_token_over_plaintext=allow) if any(files.values()) else None


def add_commands(sub, servers_type: Callable[[str], tuple[str, ...]]) -> None:
    """Register ``stats``, ``health``, ``reset``, ``checkpoint`` and ``export`` on the CLI's subparsers.

    Each parser's ``run`` default is the function that runs the command (``args -> exit status``).
    """
    s = sub.add_parser(
        "stats", help="print every shard's Stats as one JSON document",
        description="Print one JSON array with an object per shard, in --servers order. Each object's keys are "
                    "'address', then every field of StatsReply in the order proto/shardps.proto declares them "
                    "(snake_case field names), so the key order is the same on every call. Integers, including "
                    "64-bit counters, are JSON numbers; an unset message field (plan) is null; enums are names.")
    s.add_argument("--servers", type=servers_type, required=True, help="shards host:port,... in shard order")
    s.set_defaults(run=stats)
    h = sub.add_parser(
        "health", help="ask every shard's gRPC health service; exit 0 only if all are SERVING",
        description="Call grpc.health.v1.Health/Check on every shard (at once) and print one line per shard, "
                    "'shard I (HOST:PORT): STATE [(details)]', STATE being SERVING, NOT_SERVING (e.g. a shard "
                    f"stopping), SERVICE_UNKNOWN, UNKNOWN, UNKNOWN(N) (a status this command does not know), "
                    "UNREACHABLE (no answer within --timeout) or ERROR. "
                    f"Exit status 0 if every shard is SERVING, {UNHEALTHY} otherwise. The health service needs no "
                    "token; a shard's --health-port is plaintext (no --tls-* flags for it).")
    h.add_argument("--servers", type=servers_type, required=True, help="shards host:port,... in shard order")
    h.add_argument("--service", default="",
                   help="service to ask about (default '': the whole server; or shardps.v1.Shard)")
    h.set_defaults(run=health)
    r = sub.add_parser("reset", help="drop the job held by idle shards (parameters and optimizer state)")
    r.add_argument("--servers", type=servers_type, required=True, help="shards host:port,... in shard order")
    r.add_argument("--job-id", default="", help="reset only shards that hold this job")
    r.set_defaults(run=reset)
    c = sub.add_parser("checkpoint", help="make every shard write a checkpoint now (needs --checkpoint-dir)",
                       description="Print per shard the checkpoint holding its state now (written, or unchanged "
                                   "since). Exit 0: all are; 1: a shard refused or did not answer; "
                                   f"{NOTHING_TO_CHECKPOINT}: a shard held no initialised job.")
    c.add_argument("--servers", type=servers_type, required=True, help="shards host:port,... in shard order")
    c.set_defaults(run=checkpoint)
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
    e.add_argument("--num-shards", type=int, default=None,
                   help="with --checkpoint-dir: refuse checkpoints of a job with another shard count "
                        "(default: the count their plan records)")
    e.add_argument("--model-state", type=Path, default=None, metavar="FILE",
                   help="a state_dict of the model to export for (*.safetensors, or *.pt read with "
                        "weights_only=True), e.g. its initial weights: refuse a plan whose parameters or buffers "
                        "it lacks or holds with other shapes; its other entries fill in what the shards do not hold")
    e.add_argument("--tables", type=_names, default=None, metavar="NAME,...",
                   help="the sparse tables to export (their names on the shards: by default each module's path in "
                        "the model); default: every table the shards hold (--servers: as their Stats list them; "
                        "--checkpoint-dir: as the checkpoints record them)")
    e.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES, metavar="B",
                   help="with --servers: the gRPC message limit (match the shards' --max-message-bytes); a page of "
                        f"table rows is at most half of it (default {DEFAULT_MAX_MESSAGE_BYTES})")
    e.set_defaults(run=export)
    for name, command in (("stats", s), ("health", h), ("reset", r), ("checkpoint", c), ("export", e)):
        command.add_argument("--timeout", type=float, default=TIMEOUTS[name],
                             help=f"seconds the whole command may take: connecting, calls and retries, every shard "
                                  f"asked at once{', waiting included' if name == 'export' else ''}; a shard that "
                                  f"has not answered by then is reported and the command exits 1 "
                                  f"(default {TIMEOUTS[name]:g})")
        add_security_flags(command)


def _deadline(args: argparse.Namespace) -> float:
    """``time.monotonic()`` at which the command gives up (``--timeout`` from now).

    Raises:
        ValueError: ``--timeout`` is not a positive number of seconds.
    """
    if not args.timeout > 0 or args.timeout == float("inf"):
        raise ValueError(f"--timeout must be > 0 seconds, got {args.timeout}")
    return time.monotonic() + args.timeout


def connect(index: int, address: str, deadline: float, security: ChannelSecurity | None,
            max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
    """A ``ShardClient`` to shard ``index`` whose connect, calls and retries end by ``deadline``.

    Raises:
        ConnectionError: the shard did not answer by then. ValueError: the security settings refuse the address,
            or ``max_message_bytes`` is out of range.
    """
    from shardps.worker.session.client import ShardClient

    left = max(0.001, deadline - time.monotonic())
    return bound(ShardClient(address, index=index, connect_timeout=left, security=security,
                             max_message_bytes=max_message_bytes), deadline)


def ask_all(servers: tuple[str, ...], ask: Callable[[int, str], object], deadline: float) -> list[tuple]:
    """Run ``ask(index, address)`` for every shard at once, each in a daemon thread; ``[(result, error)]``.

    A thread still running ``_GRACE`` seconds past ``deadline`` is left behind (daemon: it cannot keep the
    process alive) and reported as a ``TimeoutError``.
    """
    results: list[tuple] = [(None, None)] * len(servers)

    def run(i: int, address: str) -> None:
        try:
            results[i] = (ask(i, address), None)
        except Exception as exc:  # reported per shard by the caller
            results[i] = (None, exc)

    threads = [threading.Thread(target=run, args=(i, a), daemon=True) for i, a in enumerate(servers)]
    for t in threads:
        t.start()
    for i, t in enumerate(threads):
        t.join(max(0.0, deadline + _GRACE - time.monotonic()))
        if t.is_alive():
            results[i] = (None, TimeoutError(f"shard {i} ({servers[i]}) did not answer within --timeout"))
    return results


def _why(exc: BaseException, timeout: float) -> str:
    """One safe line saying why a shard's call failed (its details escaped and cut)."""
    details = getattr(exc, "details", None)
    code = getattr(exc, "code", None)
    if details is not None and code is not None and not callable(code):  # ShardRpcError
        if code.name == "DEADLINE_EXCEEDED":
            return f"no answer within --timeout {timeout:g}s (DEADLINE_EXCEEDED)"
        return f"{code.name}: {printable(details)}"
    return printable(str(exc))


def stats(args: argparse.Namespace) -> int:
    """Print every shard's Stats as one JSON array (see the ``stats`` parser's description).

    Raises:
        ProtocolError, ShardRpcError, ConnectionError, TimeoutError: the first shard (in order) whose reply
            is outside the protocol or that failed; nothing is printed then.
    """
    deadline, security = _deadline(args), security_from_args(args)

    def ask(i: int, address: str):
        client = connect(i, address, deadline, security)
        try:
            reply = client.stats()
        finally:
            client.close()
        check_stats(reply, i, address)
        return reply

    results = ask_all(args.servers, ask, deadline)
    for reply, error in results:
        if error is not None:
            raise error
    say_chunks(json_chunks([(a, reply) for a, (reply, _) in zip(args.servers, results)]))
    return 0


def _health_line(call, timeout: float) -> tuple[bool, str]:
    """``(serving, STATE [(details)])`` of one finished or pending Health/Check call."""
    import grpc
    from grpc_health.v1 import health_pb2

    try:
        status = call.result()
    except grpc.RpcError as exc:
        code, details = exc.code(), printable(" ".join((exc.details() or "").split()))
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return False, f"UNREACHABLE (no answer within {timeout:g}s)"
        if code == grpc.StatusCode.UNAVAILABLE:
            return False, f"UNREACHABLE ({details})"
        if code == grpc.StatusCode.NOT_FOUND:  # the health service knows no such service name
            return False, f"SERVICE_UNKNOWN ({details})"
        return False, f"ERROR ({code.name}: {details})"
    names = health_pb2.HealthCheckResponse.ServingStatus
    name = names.Name(status.status) if status.status in names.values() else f"UNKNOWN({status.status})"
    return status.status == health_pb2.HealthCheckResponse.SERVING, name


def health(args: argparse.Namespace) -> int:
    """Check every shard's gRPC health; a line per shard; 0 if all are SERVING, else :data:`UNHEALTHY`.

    The token is never sent: the health service needs none.

    Raises:
        ValueError: ``--timeout`` is not positive, or a security flag is wrong.
    """
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from shardps.common.transport import channel_options

    _deadline(args)
    security = dataclasses.replace(security_from_args(args) or ChannelSecurity(), token=None)
    request = health_pb2.HealthCheckRequest(service=args.service)
    channels, calls = [], []
    try:
        for address in args.servers:  # every Check in flight at once: the whole command takes one --timeout
            channel = security.channel(address, channel_options())
            channels.append(channel)
            calls.append(health_pb2_grpc.HealthStub(channel).Check.future(request, timeout=args.timeout))
        results = [_health_line(call, args.timeout) for call in calls]
    finally:
        for channel in channels:
            channel.close()
    say("\n".join(f"shard {i} ({address}): {line}"
                  for i, (address, (_, line)) in enumerate(zip(args.servers, results))))
    return 0 if all(serving for serving, _ in results) else UNHEALTHY


def each_shard(args: argparse.Namespace, call: Callable, refused: str) -> int:
    """Run ``call(client, index, address) -> line`` on every shard of ``args.servers`` at once, within
    ``args.timeout``; print a line per shard in shard order.

    A shard that refuses, answers outside the protocol or does not answer in time gets
    ``"shard I (ADDRESS): <refused>: <why>"`` on stderr (its text escaped); the others are still asked.

    Returns:
        The exit code: 1 if any shard failed, else 0.
    """
    deadline, security = _deadline(args), security_from_args(args)

    def ask(i: int, address: str) -> str:
        client = connect(i, address, deadline, security)
        try:
            return call(client, i, address)
        finally:
            client.close()

    results = ask_all(args.servers, ask, deadline)
    for i, (address, (line, error)) in enumerate(zip(args.servers, results)):
        if error is None:
            say(f"shard {i} ({address}): {line}")
        else:
            print(f"shard {i} ({address}): {refused}: {_why(error, args.timeout)}", file=sys.stderr)
    return 1 if any(error is not None for _, error in results) else 0


def reset(args: argparse.Namespace) -> int:
    """Reset every shard; a line per shard; exit 1 if any refused (a busy shard is left as it was)."""
    def call(client, i: int, address: str) -> str:
        reply = client.reset(args.job_id)
        job = printable(checked_text(reply.job_id, "job id", i, address))
        return f"job {job} dropped at version {reply.version}" if reply.job_id else "held no job"

    return each_shard(args, call, "not reset")


#: Exit status of ``checkpoint`` when no shard failed but one held no initialised job (nothing to checkpoint there).
NOTHING_TO_CHECKPOINT = 3


def checkpoint(args: argparse.Namespace) -> int:
    """Ask every shard to checkpoint its state now; a line per shard: ``wrote <manifest> (dense version V, sparse
    round R) in <dir>``, ``unchanged since <manifest> (...) in <dir>: nothing written``, or ``nothing to
    checkpoint: ...``. Returns 0 (every shard's state is in a checkpoint), 1 (a shard refused, answered outside
    the protocol or did not answer) or :data:`NOTHING_TO_CHECKPOINT` (none failed; a shard held no initialised job).
    """
    nothing: list[int] = []

    def call(client, i: int, address: str) -> str:
        reply = client.checkpoint()
        path = printable(checked_text(reply.path, "checkpoint path", i, address), limit=len(reply.path))
        if reply.no_job:
            nothing.append(i)
            return "nothing to checkpoint: the shard holds no initialised job (nothing written)"
        if not reply.name:  # a shard from before checkpoint names
            return f"checkpoint of version {reply.version} in {path}"
        name = printable(checked_text(reply.name, "checkpoint name", i, address), limit=len(reply.name))
        what = f"{name} (dense version {reply.version}, sparse round {reply.sparse_round}) in {path}"
        return f"wrote {what}" if reply.written else f"unchanged since {what}: nothing written"

    code = each_shard(args, call, "no checkpoint")
    return NOTHING_TO_CHECKPOINT if code == 0 and nothing else code


def _model_state(path: Path) -> dict:
    """The state_dict in ``path`` (``--model-state``): safetensors, or ``torch.load(weights_only=True)``.

    Raises:
        ValueError: the file cannot be read as a state_dict (the message names it).
    """
    import torch

    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # missing file, not safetensors, pickle refused by weights_only: one message
        raise ValueError(f"--model-state {path}: cannot be read as a state_dict "
                         f"({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"--model-state {path}: not a state_dict of tensors")
    return state


def _names(text: str) -> tuple[str, ...]:
    """``--tables``: comma-separated table names (``""``: none).

    Raises:
        argparse.ArgumentTypeError: an empty or repeated name.
    """
    names = tuple(n.strip() for n in text.split(",")) if text.strip() else ()
    if any(not n for n in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"--tables takes distinct comma-separated names, got {text!r}")
    return names


def release_freed_memory() -> str:
    """Have glibc's malloc hand freed buffers of 1 MiB or more back at once (a fixed mmap threshold, one arena):
    an export's resident memory then follows the few pages it holds, not all it ever allocated (the opposite of
    ``shardps.common.memory.retain_freed_memory``). Skipped where malloc is not glibc's or one of
    ``shardps.common.memory.GLIBC_ENV`` is set; never raises. Returns what was done (``"released"``) or why not.
    """
    import ctypes
    import ctypes.util
    import platform

    from shardps.common.memory import GLIBC_ENV, M_ARENA_MAX, M_MMAP_THRESHOLD

    if platform.libc_ver()[0] != "glibc":
        return "not glibc"
    if any(name in os.environ for name in GLIBC_ENV):
        return "malloc settings come from the environment"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(M_MMAP_THRESHOLD, 1 << 20) and libc.mallopt(M_ARENA_MAX, 1)
    except (OSError, AttributeError) as exc:
        return f"malloc left as it is: {exc}"
    return "released" if ok else "mallopt refused"


class ExportProgress:
    """``progress(table, rows written, rows)``: ``export: table T: 120000/300000 rows (40%)`` on stderr at most
    every ``every`` seconds, and when a table that took that long is done."""

    def __init__(self, every: float = 2.0) -> None:
        self.every, self.last, self.table, self.since = every, time.monotonic(), None, time.monotonic()

    def __call__(self, table: str, done: int, total: int) -> None:
        now = time.monotonic()
        if table != self.table:
            self.table, self.since = table, now
        if now - self.last >= self.every or (done >= total and now - self.since >= self.every):
            self.last = now
            share = f" ({100 * done // total}%)" if total else ""
            print(f"export: table {printable(table)}: {done}/{total} rows{share}", file=sys.stderr, flush=True)


def export(args: argparse.Namespace) -> int:
    """Assemble the state_dict and every sparse table and write them to ``args.out`` (nothing is written when
    refused).

    From ``--servers``: ``shardps.cli.untrusted.export_live`` (torch is imported, and the model allocated,
    only once every shard's chunks arrived and checked out), all within ``--timeout``; the tables are those of
    ``--tables``, or every table the shards list in their Stats. From ``--checkpoint-dir``: every table the
    checkpoints hold (or ``--tables``). Tables are streamed into the
    ``.safetensors`` file a page at a time (``shardps.worker.table_file``); ``.pt`` refuses them.
    """
    deadline = _deadline(args)
    release_freed_memory()  # before any channel: gRPC's threads then allocate in the one arena
    tables = getattr(args, "tables", None)
    message_bytes = getattr(args, "max_message_bytes", DEFAULT_MAX_MESSAGE_BYTES)
    model = _model_state(args.model_state) if args.model_state else None
    if args.servers:
        if args.version or args.num_shards is not None:
            raise ValueError("--version and --num-shards are about checkpoints: use them with --checkpoint-dir")
        security = security_from_args(args)
        result = export_live(args.servers, connect=lambda i, a: connect(i, a, deadline, security, message_bytes),
                             deadline=deadline, wait_seconds=args.wait_seconds,
                             allow_mixed_versions=args.allow_mixed_versions, model=model,
                             max_message_bytes=message_bytes, tables=tables)
    else:
        from shardps.worker import export as exporting

        if any(_security_files(args).values()):
            raise ValueError("--tls-*/--auth-token-file secure calls to shards: use them with --servers")
        try:
            result = exporting.from_checkpoints(args.checkpoint_dir, args.num_shards, version=args.version,
                                                model=model, allow_mixed_versions=args.allow_mixed_versions,
                                                tables=tables)
        except FileNotFoundError as exc:
            raise RuntimeError(str(exc)) from None
    with result:
        try:
            path = result.save(args.out, progress=ExportProgress())
        except OSError as exc:
            raise RuntimeError(f"cannot write {args.out}: {exc}") from None
        rows = result.table_rows()
    versions = sorted(set(result.versions))
    at = f"version {versions[0]}" if len(versions) == 1 else f"versions {result.versions} (mixed)"
    what = f"{len(result.state_dict)} tensors"
    if result.tables:
        what += f" and {len(result.tables)} table{'s' if len(result.tables) != 1 else ''} ({rows} trained rows)"
    say(f"exported {what} of job {printable(result.job_id)} at {at} to {path}")
    return 0

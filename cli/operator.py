"""Operator commands of the ``shardps`` CLI: ``stats``, ``health``, ``reset``, ``checkpoint`` and ``export``.

    shardps stats --servers host:port,...
    shardps health --servers host:port,... [--timeout S] [--service NAME]
    shardps reset --servers host:port,... [--job-id ID]
    shardps checkpoint --servers host:port,...
    shardps export (--servers host:port,... | --checkpoint-dir DIR [--version V])
                   --out model.safetensors|model.pt [--allow-mixed-versions] [--wait-seconds S]

Every command that talks to shards takes the security flags of
:func:`add_security_flags` (``--tls-ca``, ``--tls-cert``, ``--tls-key``,
``--auth-token-file``), matching the shards' own.

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
import json
import math
import os
import sys
from pathlib import Path
from typing import Callable

from shardps.common.security import ChannelSecurity

#: Exit status of ``health`` when some shard is not SERVING (0 when every shard is).
UNHEALTHY = 1


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


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--tls-ca``, ``--tls-cert``, ``--tls-key`` and ``--auth-token-file`` to a command that calls shards."""
    g = parser.add_argument_group("security (match the shards' --tls-* and --auth-token-file)")
    g.add_argument("--tls-ca", default="", metavar="FILE",
                   help="PEM CA certificate that signed the shards' certificates; given: connect with TLS")
    g.add_argument("--tls-cert", default="", metavar="FILE",
                   help="PEM certificate of this client, for shards that require client certificates (with --tls-key)")
    g.add_argument("--tls-key", default="", metavar="FILE", help="PEM private key of --tls-cert")
    g.add_argument("--auth-token-file", default="", metavar="FILE",
                   help="file holding the bearer token the shards require (sent as 'authorization: Bearer ...')")


def _security_files(args: argparse.Namespace) -> dict[str, str]:
    return {name: getattr(args, name, "") or "" for name in ("tls_ca", "tls_cert", "tls_key", "auth_token_file")}


def security_from_args(args: argparse.Namespace) -> ChannelSecurity | None:
    """The ``ChannelSecurity`` the security flags ask for; None (plaintext, no token) when none is given.

    Raises:
        ValueError: a file is missing or unreadable, or a certificate comes without its key
            (``ChannelSecurity.from_files`` names the flag).
    """
    files = _security_files(args)
    return ChannelSecurity.from_files(**files) if any(files.values()) else None


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
    s.add_argument("--timeout", type=float, default=10.0,
                   help="seconds each shard has to connect, and to answer (retries included) (default 10)")
    s.set_defaults(run=stats)
    h = sub.add_parser(
        "health", help="ask every shard's gRPC health service; exit 0 only if all are SERVING",
        description="Call grpc.health.v1.Health/Check on every shard (at once) and print one line per shard, "
                    "'shard I (HOST:PORT): STATE [(details)]', STATE being SERVING, NOT_SERVING (e.g. a shard "
                    f"stopping), SERVICE_UNKNOWN, UNKNOWN, UNREACHABLE (no answer within --timeout) or ERROR. "
                    f"Exit status 0 if every shard is SERVING, {UNHEALTHY} otherwise. The health service needs no "
                    "token; a shard's --health-port is plaintext (no --tls-* flags for it).")
    h.add_argument("--servers", type=servers_type, required=True, help="shards host:port,... in shard order")
    h.add_argument("--timeout", type=float, default=5.0,
                   help="seconds each shard has to answer (default 5); the shards are asked in parallel")
    h.add_argument("--service", default="",
                   help="service to ask about (default '': the whole server; or shardps.v1.Shard)")
    h.set_defaults(run=health)
    r = sub.add_parser("reset", help="drop the job held by idle shards (parameters and optimizer state)")
    r.add_argument("--servers", type=servers_type, required=True, help="shards host:port,... in shard order")
    r.add_argument("--job-id", default="", help="reset only shards that hold this job")
    r.set_defaults(run=reset)
    c = sub.add_parser("checkpoint", help="make every shard write a checkpoint now (needs --checkpoint-dir)")
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
    e.set_defaults(run=export)
    for command in (s, h, r, c, e):
        add_security_flags(command)


def _json_scalar(field, value):
    """One protobuf scalar as a JSON value: integers stay numbers, enums become names, bytes base64."""
    if field.type == field.TYPE_ENUM:
        entry = field.enum_type.values_by_number.get(value)
        return entry.name if entry is not None else value
    if field.type == field.TYPE_BYTES:
        import base64

        return base64.b64encode(value).decode()
    if field.type == field.TYPE_MESSAGE:
        return message_dict(value)
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")  # protobuf's JSON names
    return value


def message_dict(message) -> dict:
    """A protobuf message as a dict ready for ``json.dumps``, keys in the order the .proto declares the fields.

    Unlike ``MessageToDict``, 64-bit integers stay ``int`` (JSON numbers, not
    strings) and every field is present: scalars and repeated fields at their
    value (defaults included), a message or ``optional`` field that is not set
    as None. Non-finite floats become ``"NaN"``/``"Infinity"``/``"-Infinity"``
    (as protobuf's JSON mapping writes them), so the result is strict JSON.
    """
    out = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            out[field.name] = {str(k): _json_scalar(value_field, v) for k, v in value.items()}
        elif field.is_repeated:
            out[field.name] = [_json_scalar(field, v) for v in value]
        elif field.has_presence and not message.HasField(field.name):
            out[field.name] = None
        else:
            out[field.name] = _json_scalar(field, value)
    return out


def stats(args: argparse.Namespace) -> int:
    """Print every shard's Stats as one JSON array (see the ``stats`` parser's description)."""
    from shardps.worker.session.client import ShardClient
    from shardps.worker.session.retry import RetryPolicy

    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {args.timeout}")
    security = security_from_args(args)
    shards = []
    for i, address in enumerate(args.servers):
        client = ShardClient(address, index=i, connect_timeout=args.timeout, rpc_timeout=args.timeout,
                             retry=RetryPolicy(total_seconds=args.timeout), security=security)
        try:
            shards.append({"address": address, **message_dict(client.stats())})
        finally:
            client.close()
    say(json.dumps(shards, indent=2, allow_nan=False))
    return 0


def _health_line(call, timeout: float) -> tuple[bool, str]:
    """``(serving, STATE [(details)])`` of one finished or pending Health/Check call."""
    import grpc
    from grpc_health.v1 import health_pb2

    try:
        status = call.result()
    except grpc.RpcError as exc:
        code, details = exc.code(), " ".join((exc.details() or "").split())
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return False, f"UNREACHABLE (no answer within {timeout:g}s)"
        if code == grpc.StatusCode.UNAVAILABLE:
            return False, f"UNREACHABLE ({details})"
        if code == grpc.StatusCode.NOT_FOUND:  # the health service knows no such service name
            return False, f"SERVICE_UNKNOWN ({details})"
        return False, f"ERROR ({code.name}: {details})"
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status.status)
    return status.status == health_pb2.HealthCheckResponse.SERVING, name


def health(args: argparse.Namespace) -> int:
    """Check every shard's gRPC health; a line per shard; 0 if all are SERVING, else :data:`UNHEALTHY`.

    Raises:
        ValueError: ``--timeout`` is not positive, or a security flag is wrong.
    """
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from shardps.common.transport import channel_options

    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {args.timeout}")
    security = security_from_args(args) or ChannelSecurity()
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


def each_shard(servers: tuple[str, ...], call, refused: str, rpc_timeout: float = 10.0,
               security: ChannelSecurity | None = None) -> int:
    """Run ``call(client) -> line`` on every shard in turn, printing a line per shard.

    A shard that refuses (``ShardRpcError``) gets ``"<refused>: <details>"`` on
    stderr and the others are still asked.

    Returns:
        The exit code: 1 if any shard refused, else 0.
    """
    from shardps.worker.session.client import ShardClient, ShardRpcError

    failed = 0
    for i, address in enumerate(servers):
        client = ShardClient(address, index=i, connect_timeout=10.0, rpc_timeout=rpc_timeout, security=security)
        try:
            say(f"shard {i} ({address}): {call(client)}")
        except ShardRpcError as exc:
            failed += 1
            print(f"shard {i} ({address}): {refused}: {exc.details}", file=sys.stderr)
        finally:
            client.close()
    return 1 if failed else 0


def reset(args: argparse.Namespace) -> int:
    """Reset every shard; a line per shard; exit 1 if any refused (a busy shard is left as it was)."""
    def call(client) -> str:
        reply = client.reset(args.job_id)
        return f"job {reply.job_id} dropped at version {reply.version}" if reply.job_id else "held no job"

    return each_shard(args.servers, call, "not reset", security=security_from_args(args))


def checkpoint(args: argparse.Namespace) -> int:
    """Ask every shard for a checkpoint; a line per shard; exit 1 if any refused."""
    def call(client) -> str:
        reply = client.checkpoint()
        return f"checkpoint of version {reply.version} in {reply.path}"

    return each_shard(args.servers, call, "no checkpoint", rpc_timeout=300.0, security=security_from_args(args))


def export(args: argparse.Namespace) -> int:
    """Assemble the state_dict and write it to ``args.out`` (nothing is written when refused)."""
    from shardps.worker import export as exporting

    if args.servers:
        if args.version:
            raise ValueError("--version picks a checkpoint: use it with --checkpoint-dir")
        result = exporting.from_servers(list(args.servers), wait_seconds=args.wait_seconds,
                                        allow_mixed_versions=args.allow_mixed_versions,
                                        security=security_from_args(args))
    else:
        if any(_security_files(args).values()):
            raise ValueError("--tls-*/--auth-token-file secure calls to shards: use them with --servers")
        try:
            result = exporting.from_checkpoints(args.checkpoint_dir, version=args.version,
                                                allow_mixed_versions=args.allow_mixed_versions)
        except FileNotFoundError as exc:
            raise RuntimeError(str(exc)) from None
    path = result.save(args.out)
    versions = sorted(set(result.versions))
    at = f"version {versions[0]}" if len(versions) == 1 else f"versions {result.versions} (mixed)"
    say(f"exported {len(result.state_dict)} tensors of job {result.job_id} at {at} to {path}")
    return 0

"""The operator commands of the ``shardps`` CLI, run as an operator runs them: real shards, the CLI as a process.

``stats`` prints one JSON document with numbers as numbers and a stable key
order; ``health`` exits 0 only when every shard is SERVING; a reader that
closes stdout early is never a traceback; ``--version``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from shardps.proto import shardps_pb2 as pb
from shardps.worker import DistributedOptimizer, WireOptions
from shardps.worker.session.client import ShardClient
from tests.support.procs import run_module, shard_stats
from tests.support.raw import RawWorker, plan_and_spec

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "shardps.cli.main"]


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return run_module("shardps.cli.main", *args, timeout=timeout)


def assert_no_pipe_error(stderr: str) -> None:
    for bad in ("Traceback", "Errno 32", "Broken pipe", "BrokenPipeError", "Exception ignored"):
        assert bad not in stderr, stderr


def train_one_step(servers: str) -> None:
    """One sync step of a tiny model, then leave: the shards hold a job at version 1 with bytes counted."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    with DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), servers=servers,
                              wire=WireOptions(connect_timeout=10.0)) as dist:
        dist.zero_grad()
        model(torch.randn(8, 4)).square().mean().backward()
        dist.step()


def free_port() -> int:
    """A port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_stats_prints_one_json_document_with_numbers_in_proto_order(start_cluster) -> None:
    cluster = start_cluster(2)
    train_one_step(cluster.servers)
    first, second = cli("stats", "--servers", cluster.servers), cli("stats", "--servers", cluster.servers)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    shards, again = json.loads(first.stdout), json.loads(second.stdout)
    fields = ["address", *(f.name for f in pb.StatsReply.DESCRIPTOR.fields)]
    assert [list(s) for s in shards] == [list(s) for s in again] == [fields, fields]  # proto order, every call
    replies = shard_stats(cluster.addresses)
    for i, (shard, reply) in enumerate(zip(shards, replies)):
        assert shard["address"] == cluster.addresses[i] and shard["shard_index"] == i
        for name in ("version", "push_bytes_total", "pull_bytes_total", "param_bytes", "contributions_applied"):
            assert type(shard[name]) is int, (name, shard[name])  # uint64: a JSON number, not a string
            assert shard[name] == getattr(reply, name)
        assert shard["version"] == 1 and shard["push_bytes_total"] > 0
        assert all(type(n) is int for n in shard["staleness_histogram"]) and shard["staleness_histogram"][0] == 1
        assert shard["members"] == [] and shard["initialised"] is True and shard["optimizer"] == "SGD"
        assert shard["plan"] is None  # not asked for
        assert shard["mode"] == {"mode": "sync", "staleness": 0, "scale_lr_by_staleness": False}
        assert isinstance(shard["checkpoint_unix_seconds"], float)


def test_a_closed_stdout_is_no_error(start_cluster) -> None:
    """``| head`` in a real shell; then stdout closed before the CLI writes a byte, for several commands."""
    cluster = start_cluster(2)
    train_one_step(cluster.servers)
    shell = subprocess.run(
        ["bash", "-c", 'set -o pipefail; "$@" | head -c 1; echo " ${PIPESTATUS[*]}"', "bash",
         *CLI, "stats", "--servers", cluster.servers],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert shell.returncode == 0 and shell.stdout == "[ 0 0\n", (shell.stdout, shell.stderr)
    assert_no_pipe_error(shell.stderr)

    def closed_stdout(*args: str) -> subprocess.CompletedProcess:
        read_end, write_end = os.pipe()
        os.close(read_end)  # every write of the CLI gets EPIPE
        try:
            proc = subprocess.run([*CLI, *args], cwd=REPO, stdout=write_end, stderr=subprocess.PIPE, text=True,
                                  timeout=60)
        finally:
            os.close(write_end)
        assert_no_pipe_error(proc.stderr)
        return proc

    assert closed_stdout("stats", "--servers", cluster.servers).returncode == 0
    assert closed_stdout("health", "--servers", cluster.servers).returncode == 0
    assert closed_stdout("--version").returncode == 0
    assert closed_stdout("health", "--servers", f"127.0.0.1:{free_port()}", "--timeout", "2").returncode == 1
    # an action goes on to every shard after its reader went away: both shards drop the job
    assert [s.job_id != "" for s in shard_stats(cluster.addresses)] == [True, True]
    assert closed_stdout("reset", "--servers", cluster.servers).returncode == 0
    assert [s.job_id for s in shard_stats(cluster.addresses)] == ["", ""]


def test_health_of_running_unreachable_and_frozen_shards(start_cluster) -> None:
    cluster = start_cluster(2)
    ok = cli("health", "--servers", cluster.servers)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.splitlines() == [f"shard {i} ({a}): SERVING" for i, a in enumerate(cluster.addresses)]
    assert cli("health", "--servers", cluster.servers, "--service", "shardps.v1.Shard").returncode == 0
    unknown = cli("health", "--servers", cluster.servers, "--service", "no.such.Service")
    assert unknown.returncode == 1 and unknown.stdout.count("SERVICE_UNKNOWN") == 2, unknown.stdout

    nobody = f"127.0.0.1:{free_port()}"
    mixed = cli("health", "--servers", f"{cluster.addresses[0]},{nobody}", "--timeout", "2")
    assert mixed.returncode == 1, mixed.stdout + mixed.stderr
    lines = mixed.stdout.splitlines()
    assert lines[0] == f"shard 0 ({cluster.addresses[0]}): SERVING"
    assert lines[1].startswith(f"shard 1 ({nobody}): UNREACHABLE"), lines

    frozen = cluster.processes[1]
    frozen.send_signal(signal.SIGSTOP)  # the port accepts connections, nobody answers
    try:
        started = time.monotonic()
        hung = cli("health", "--servers", cluster.servers, "--timeout", "1")
        took = time.monotonic() - started
    finally:
        frozen.send_signal(signal.SIGCONT)
    assert hung.returncode == 1, hung.stdout + hung.stderr
    lines = hung.stdout.splitlines()  # gRPC reports either the deadline or the connect attempt's timeout
    assert lines[0] == f"shard 0 ({cluster.addresses[0]}): SERVING" and lines[1].startswith(f"shard 1 ({cluster.addresses[1]}): UNREACHABLE (")
    assert took < 30  # the CLI's start (torch's import) plus one --timeout, not a hang


def test_health_of_a_stopping_then_stopped_shard(start_cluster, tmp_path: Path) -> None:
    """SIGTERM turns health NOT_SERVING while the final checkpoint is written; once the shard is gone: UNREACHABLE.

    The final checkpoint's temporary tensor file is made a FIFO that nobody reads, so the
    shard stays in that state (writing it) for as long as the test needs.
    """
    cluster = start_cluster(1, extra_args=("--checkpoint-dir", str(tmp_path)))
    address = cluster.addresses[0]
    client = ShardClient(address, index=0)
    try:
        model = nn.Linear(4, 2)
        member = RawWorker(client, "w0", *plan_and_spec(model, torch.optim.SGD(model.parameters(), lr=0.1)))
        member.join()
        member.init(0, dict(model.named_parameters()))  # an initialised job: SIGTERM writes a final checkpoint
    finally:
        client.close()
    (tmp_path / "shard-0").mkdir(exist_ok=True)
    shard = cluster.processes[0]  # the first checkpoint's tensor file is streamed into this temporary file:
    stem = "checkpoint-00000001-v000000000000-r000000000000"
    os.mkfifo(tmp_path / "shard-0" / f".{stem}.safetensors.{shard.pid}.partial")
    shard.send_signal(signal.SIGTERM)
    try:
        stopping = cli("health", "--servers", address, "--timeout", "5")
        assert stopping.returncode == 1, stopping.stdout + stopping.stderr
        assert stopping.stdout == f"shard 0 ({address}): NOT_SERVING\n"
        assert shard.poll() is None  # still stopping: blocked in the final checkpoint
    finally:
        shard.kill()
        shard.wait(timeout=15)
    stopped = cli("health", "--servers", address, "--timeout", "2")
    assert stopped.returncode == 1 and stopped.stdout.startswith(f"shard 0 ({address}): UNREACHABLE"), stopped.stdout


def test_version_and_bad_flags() -> None:
    from importlib.metadata import version

    proc = cli("--version")
    assert proc.returncode == 0 and proc.stdout == f"shardps {version('shardps')}\n", proc.stdout + proc.stderr
    bad = cli("health", "--servers", "127.0.0.1:1", "--timeout", "0")
    assert bad.returncode == 1 and "--timeout must be > 0" in bad.stderr
    missing = cli("stats", "--servers", "127.0.0.1:1", "--auth-token-file", "/nonexistent/token")
    assert missing.returncode == 1 and "--auth-token-file /nonexistent/token" in missing.stderr, missing.stderr


def test_security_flags_reach_tls_and_token_shards(start_cluster, tmp_path: Path) -> None:
    """Mutual TLS and a bearer token on the shard: the flags make every command work, and their absence fails."""
    from tests.support.pki import make_pki

    pki = make_pki(tmp_path)
    cluster = start_cluster(1, extra_args=("--tls-cert", pki.path("server.pem"), "--tls-key", pki.path("server.key"),
                                           "--tls-ca", pki.path("ca.pem"), "--auth-token-file", pki.path("token")))
    tls = ("--tls-ca", pki.path("ca.pem"), "--tls-cert", pki.path("client.pem"), "--tls-key", pki.path("client.key"))
    servers = ("--servers", cluster.servers)
    stats = cli("stats", *servers, *tls, "--auth-token-file", pki.path("token"))
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)[0]["shard_index"] == 0
    no_token = cli("stats", *servers, *tls)
    assert no_token.returncode == 1 and "UNAUTHENTICATED" in no_token.stderr, no_token.stderr
    reset = cli("reset", *servers, *tls, "--auth-token-file", pki.path("token"))
    assert reset.returncode == 0 and reset.stdout == f"shard 0 ({cluster.addresses[0]}): held no job\n", reset.stderr
    health = cli("health", *servers, *tls)  # the health service needs TLS here, never the token
    assert health.returncode == 0 and health.stdout.endswith(": SERVING\n"), health.stdout + health.stderr
    plaintext = cli("health", *servers, "--timeout", "2")
    assert plaintext.returncode == 1 and ": UNREACHABLE (" in plaintext.stdout, plaintext.stdout

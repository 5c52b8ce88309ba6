"""The operator commands against a server that lies, floods or never answers (``tests.support.hostile_server``).

Every command runs as a real ``python -m shardps.cli.main`` process, started
cold (not forked from pytest or the forkserver) by a small measuring process,
so that its peak RSS (``os.wait4``) is its own. Against
each mode each command must exit 1 within its ``--timeout`` plus 5 s, stay
under 200 MB (torch alone is more: the export must refuse before importing
it), say why, and print no ESC byte: the server's escapes show up escaped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from shardps.proto import shardps_pb2 as pb
from shardps.cli.untrusted import json_chunks, printable
from tests.support.hostile_server import ESCAPES, HostileServer

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 4.0
MAX_RSS_BYTES = 200 << 20
COMMANDS = ("stats", "health", "reset", "checkpoint", "export")
ESCAPED = "\\x1b[2J\\x1b]0;pwned\\x07"  # how ESCAPES' start must show up
#: (mode, command) -> what the command must say (stdout and stderr together).
SAYS = {
    ("oversized", "stats"): "its Stats lists",
    ("oversized", "health"): "UNKNOWN(7)",
    ("oversized", "reset"): "its job id has 1048",
    ("oversized", "checkpoint"): "its checkpoint path has 1048",
    ("oversized", "export"): "declares 1099511627776 elements",
    **{("abort", c): f"INTERNAL: {ESCAPED}" for c in COMMANDS},
    ("stuck", "stats"): "DEADLINE_EXCEEDED",
    ("stuck", "health"): "UNREACHABLE (no answer within 4s)",
    ("stuck", "reset"): "no answer within --timeout 4s",
    ("stuck", "checkpoint"): "no answer within --timeout 4s",
    ("stuck", "export"): "DEADLINE_EXCEEDED",
}


@pytest.fixture(scope="module", params=("oversized", "abort", "stuck"))
def server(request):
    with HostileServer(request.param) as hostile:
        yield hostile


#: Runs the command as its child and writes "<exit status> <peak RSS in KiB>" to argv[1]. The CLI is not a
#: direct child of pytest: Linux carries a process's peak RSS over exec, and a child of pytest would start
#: its count at pytest's own size.
MEASURE = """
import os, subprocess, sys
child = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(child.pid, 0)
child.returncode = os.waitstatus_to_exitcode(status)
with open(sys.argv[1], "w") as f:
    f.write(f"{child.returncode} {usage.ru_maxrss}")
"""


def run_cold(args: list[str], bound: float, tmp_path: Path) -> tuple[int, float, int, bytes, bytes]:
    """Run ``python -m shardps.cli.main args`` to its end: ``(status, seconds, peak RSS bytes, stdout, stderr)``.

    Killed (and the test failed) if it runs past ``bound`` seconds.
    """
    report = tmp_path / "rusage"
    command = [sys.executable, "-c", MEASURE, str(report), sys.executable, "-m", "shardps.cli.main", *args]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.monotonic()
        proc = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=err, start_new_session=True)
        try:
            proc.wait(timeout=bound)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the measuring process and the command: their own group
            proc.wait()
            pytest.fail(f"shardps {' '.join(args)} still ran after {bound:.0f}s")
        took = time.monotonic() - started
        status, rss_kib = map(int, report.read_text().split())
        out.seek(0)
        err.seek(0)
        return status, took, rss_kib * 1024, out.read(), err.read()


@pytest.mark.parametrize("command", COMMANDS)
def test_a_hostile_or_stuck_server_cannot_hang_flood_or_drive_the_terminal(server, command: str, tmp_path) -> None:
    args = [command, "--servers", server.address, "--timeout", str(TIMEOUT)]
    if command == "export":
        args += ["--out", str(tmp_path / "model.safetensors")]
    status, took, rss, out, err = run_cold(args, TIMEOUT + 60, tmp_path)
    said = (out + err).decode("utf-8", "replace")
    assert status == 1, said
    assert took <= TIMEOUT + 5, f"{command} took {took:.1f}s with --timeout {TIMEOUT:g}"
    assert rss < MAX_RSS_BYTES, f"{command} peaked at {rss >> 20} MB"
    assert b"\x1b" not in out + err and "\x9b" not in said and "\x07" not in said, said
    assert SAYS[(server.mode, command)] in said, said
    assert "Traceback" not in said, said
    assert not (tmp_path / "model.safetensors").exists()
    assert server.calls > 0  # it was asked, not skipped


def test_printable_escapes_control_characters_and_cuts_long_text() -> None:
    assert printable(ESCAPES + "ok\tfine\nnext") == ESCAPED + "\\x1b[31m\\x9b1Aok\\x09fine\\x0anext"
    assert printable("a\tb\nc\x1b", one_line=False) == "a\tb\nc\\x1b"
    assert printable("\u202egnp.exe\u2028") == "\\u202egnp.exe\\u2028"
    assert printable("x" * 5000, limit=10) == "x" * 10 + "... (5000 characters)"


def test_stats_json_escapes_what_a_shard_sends_and_streams_every_field() -> None:
    reply = pb.StatsReply(members=[ESCAPES + "w"], clocks=[2**64 - 1], checkpoint_unix_seconds=float("nan"),
                          mode=pb.ModeSpec(mode="sync"))
    text = "".join(json_chunks([("127.0.0.1:1", reply), ("127.0.0.1:2", pb.StatsReply())]))
    assert "\x1b" not in text and "\x9b" not in text
    first, second = json.loads(text)
    assert list(first) == ["address", *(f.name for f in pb.StatsReply.DESCRIPTOR.fields)]
    assert first["members"] == [ESCAPES + "w"] and first["clocks"] == [2**64 - 1]
    assert first["checkpoint_unix_seconds"] == "NaN" and first["plan"] is None and first["mode"]["mode"] == "sync"
    assert second["members"] == [] and second["address"] == "127.0.0.1:2"

"""A ``shardps serve`` process for tests: its output lines read in a thread, every wait bounded."""

from __future__ import annotations

import queue
import subprocess
import threading
import time

import grpc
import pytest

from tests.support.procs import start_module

TIMEOUT = 60.0  # seconds one wait may take


def code_of(call) -> tuple[grpc.StatusCode, str]:
    """The status code and details ``call()`` ended with (OK and "" when it returned)."""
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


class Serve:
    """``shardps serve *args``, its stdout and stderr lines read in a thread (every wait is bounded)."""

    def __init__(self, *args: str) -> None:
        self.proc = start_module("shardps.cli.main", "serve", *args, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in iter(self.proc.stdout.readline, ""):
            self.lines.put(line)

    def expect(self, prefix: str, timeout: float = TIMEOUT) -> str:
        """The rest of the first line (from now on) starting with ``prefix``; fails after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    break
                continue
            self.seen.append(line)
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        pytest.fail(f"shardps serve printed no {prefix!r} line within {timeout:g} s (exit {self.proc.poll()}): "
                    f"{''.join(self.seen)[-3000:]}")

    def stop(self) -> int:
        """SIGTERM, and the exit status (SIGKILL after 30 s)."""
        self.proc.terminate()
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

"""``LocalRedis``: a ``redis-server`` (Debian's package) on a free loopback port, started and stopped here.

For a job or a test that needs a broker and was given none (``shardps train movielens --online`` without
``--redis-url``; the stream tests): its append-only file in ``directory``, so a restart keeps the streams.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

__all__ = ["LocalRedis"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRedis:
    """``redis-server`` on 127.0.0.1 with its append-only file in ``directory`` (so a restart keeps the
    streams; every write is synced); :meth:`stop` and :meth:`start` again on the same port.

    Raises:
        RuntimeError: no ``redis-server`` on PATH (``apt-get install redis-server``), or it did not answer in 20 s.
    """

    def __init__(self, directory: Path) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not on PATH: apt-get install -y redis-server (.ci/run does)")
        self.directory, self.port = directory, _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "LocalRedis":
        self.directory.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.directory),
             "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
            if self.proc.poll() is not None:
                break
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer in 20 s")

    def stop(self) -> None:
        """SIGTERM (it writes its append-only file and exits), bounded; SIGKILL after 10 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def __enter__(self) -> "LocalRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

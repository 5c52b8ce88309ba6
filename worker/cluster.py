"""``LocalCluster``: shard processes on 127.0.0.1 free ports, for jobs and tests on one machine.

Shards run as ``python -m shardps.cli.server`` subprocesses (the worker package
never imports the server package).

The shards end with the script that started them, however it ends:
``stop()`` (the ``with`` block's end), or, for a script that never called
it, at interpreter exit (``shardps.worker.session.exit``: after the script's
optimizers have left them), or, when the script is killed by a signal (no
exit handler runs: SIGTERM without a handler, SIGKILL, the OOM killer), by
the kernel: on Linux each shard is started with ``PR_SET_PDEATHSIG``
(``prctl(2)``) set to SIGTERM, so it gets SIGTERM, its clean shutdown, as soon
as the thread that started it ends. That is why the signal is armed only for
shards started from the main thread (whose end is the process's end); a shard
started from another thread (``restart`` called from a helper thread) relies
on ``stop()`` and the exit handler alone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from shardps.common.cores import usable_cores
from shardps.worker.session.exit import close_at_exit, forget

log = logging.getLogger(__name__)

#: ``prctl(2)``'s option that sends the child a signal when the thread that forked it ends (linux/prctl.h).
PR_SET_PDEATHSIG = 1


def die_with_parent() -> Callable[[], None] | None:
    """A ``subprocess.Popen`` ``preexec_fn`` that makes the child get SIGTERM when this process ends, or None.

    Linux only, and only when called from the main thread (the kernel signals
    the child when the *thread* that forked it ends). The C function is
    looked up here, before the fork; the child only calls it, then checks
    that this process did not end before the signal was armed (the child then
    sends the signal to itself). None where ``prctl`` is not available: the caller's
    ``stop()`` and exit handler still stop the child.
    """
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent, sig = os.getpid(), int(signal.SIGTERM)

    def arm() -> None:  # runs in the child between fork and exec
        prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # the parent ended before the signal was armed: as if it had come
            os.kill(os.getpid(), sig)

    return arm



class LocalCluster:
    """Start ``num_shards`` shard processes; use as a context manager.

    A cluster never stopped is stopped when the script that started it ends,
    however it ends (see the module docstring).

    Args:
        num_shards: shard processes to start.
        min_workers: passed to every shard (rounds wait for this many workers).
        host: interface to bind.
        extra_args: more ``shardps-server`` flags for every shard.
        threads: torch threads of each shard's optimizer step (``shardps-server --threads``). None (the
            default): the cores this process may use (:func:`~shardps.common.cores.usable_cores`) split
            evenly among the shards and this process, at least 1 each; a ``--threads`` in ``extra_args``
            wins. The shards share this host with the worker: a shard pod's own default (every usable core)
            would start ``num_shards`` x cores OpenMP threads that spin between the optimizer's kernels on
            the cores the worker's forward, backward and gRPC threads need (torchrun, for the same reason,
            starts several local processes with ``OMP_NUM_THREADS=1``).
        start_timeout: seconds to wait for every shard to print its address.

    Attributes:
        addresses: ``host:port`` of each shard, in shard order.
        endpoints: per shard, the other endpoints it reported (``{"metrics": "host:port",
            "health": "host:port"}`` with ``--metrics-port`` / ``--health-port`` in ``extra_args``).

    Raises:
        RuntimeError: a shard exited or did not report its address in time
            (the message holds the end of its log).
    """

    #: The line a shard prints on stdout once it serves.
    LISTENING = re.compile(r"listening on (\S+:\d+)")
    #: Lines a shard prints before it serves: ``<name> on host:port``.
    ENDPOINT = re.compile(r"shard \d+/\d+ (metrics|health) on (\S+:\d+)")

    def __init__(
        self,
        num_shards: int = 2,
        *,
        min_workers: int = 1,
        host: str = "127.0.0.1",
        extra_args: tuple[str, ...] = (),
        threads: int | None = None,
        start_timeout: float = 60.0,
    ) -> None:
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1 (or None: the usable cores split among the shards), got {threads}")
        if threads is None:
            threads = max(1, usable_cores() // (num_shards + 1))
        self.threads = threads
        self.num_shards, self.min_workers, self.host = num_shards, min_workers, host
        self.extra_args, self.start_timeout = tuple(extra_args), start_timeout
        self.addresses: list[str] = []
        self.endpoints: list[dict[str, str]] = []
        self.processes: list[subprocess.Popen] = []
        self._log_dir: Path | None = None
        self._exit_key = 0  # stop() at interpreter exit while started (shardps.worker.session.exit)

    @property
    def metrics_addresses(self) -> list[str]:
        """``host:port`` of each shard's Prometheus endpoint; empty unless shards run with ``--metrics-port``."""
        return [e["metrics"] for e in self.endpoints] if all("metrics" in e for e in self.endpoints) else []

    @property
    def servers(self) -> str:
        """Comma-separated addresses, as ``--servers`` takes them."""
        return ",".join(self.addresses)

    def log_path(self, shard: int) -> Path:
        assert self._log_dir is not None
        return self._log_dir / f"shard-{shard}.log"

    def log_tail(self, shard: int, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path(shard).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def shard_args(self, shard: int, port: int = 0) -> list[str]:
        """The ``shardps-server`` arguments of shard ``shard`` listening on ``port`` (0: a free one)."""
        return ["--host", self.host, "--port", str(port), "--shard-index", str(shard),
                "--num-shards", str(self.num_shards), "--min-workers", str(self.min_workers),
                "--threads", str(self.threads), *self.extra_args]  # (a --threads in extra_args comes last: it wins)

    def _spawn(self, shard: int, port: int = 0) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "shardps.cli.server", *self.shard_args(shard, port)]
        with open(self.log_path(shard), "ab") as err:
            # unbuffered: select() must see every line the shard printed (a buffered readline could swallow two)
            return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, bufsize=0,
                                    preexec_fn=die_with_parent())  # SIGTERM when this process is killed

    def start(self) -> "LocalCluster":
        """Start the shards and wait until each serves; they are stopped at interpreter exit if ``stop()`` was not
        called (and when this process is killed: see the module docstring).

        Raises:
            RuntimeError: a shard exited or did not report its address in time (every shard is stopped then).
        """
        self._log_dir = Path(tempfile.mkdtemp(prefix="shardps-cluster-"))
        self._exit_key = close_at_exit(self.stop)
        try:
            for i in range(self.num_shards):
                self.processes.append(self._spawn(i))
            deadline = time.monotonic() + self.start_timeout
            self.endpoints = [{} for _ in range(self.num_shards)]
            self.addresses = [self._wait_address(i, deadline) for i in range(self.num_shards)]
        except BaseException:
            self.stop()
            raise
        log.info("local cluster: %s", self.servers)
        return self

    def _wait_address(self, shard: int, deadline: float) -> str:
        proc = self.processes[shard]
        while (remaining := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([proc.stdout], [], [], remaining)  # blocking wait for the line
            if not ready:
                break
            line = proc.stdout.readline().decode(errors="replace")
            if not line:
                raise RuntimeError(
                    f"shard {shard} exited with code {proc.wait()} before serving:\n{self.log_tail(shard)}"
                )
            if address := self.read_line(shard, line):
                return address
        raise RuntimeError(f"shard {shard} did not report its address in {self.start_timeout:.0f}s:\n"
                           f"{self.log_tail(shard)}")

    def read_line(self, shard: int, line: str) -> str | None:
        """Take in a line shard ``shard`` printed: records its endpoints; returns its address once it serves."""
        if m := self.ENDPOINT.search(line):
            self.endpoints[shard][m.group(1)] = m.group(2)
        elif m := self.LISTENING.search(line):
            return m.group(1)
        return None

    def restart(self, shard: int, *, same_port: bool = False) -> str:
        """Kill shard ``shard`` (SIGKILL: no shutdown; what it did not checkpoint is lost) and start it again.

        Args:
            same_port: start the new process on the old address (workers reconnect
                to it on their own); else on a new free port.

        Returns:
            The new shard's address; ``addresses`` is updated.

        Raises:
            RuntimeError: the new process did not report its address in time.
        """
        old = self.processes[shard]
        old.kill()
        old.wait()
        if old.stdout:
            old.stdout.close()
        port = int(self.addresses[shard].rpartition(":")[2]) if same_port else 0
        self.processes[shard] = self._spawn(shard, port)
        self.endpoints[shard] = {}
        self.addresses[shard] = self._wait_address(shard, time.monotonic() + self.start_timeout)
        return self.addresses[shard]

    def stop(self, timeout: float = 15.0) -> list[int | None]:
        """SIGTERM every shard, wait up to ``timeout`` seconds, SIGKILL the rest.

        Returns:
            Each shard's exit code (0 is a clean shutdown).
        """
        forget(self._exit_key)
        for proc in self.processes:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        codes = []
        for proc in self.processes:
            try:
                codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(proc.wait())
            if proc.stdout:
                proc.stdout.close()
        self.processes = []
        if self._log_dir is not None:
            shutil.rmtree(self._log_dir, ignore_errors=True)
            self._log_dir = None
        return codes

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

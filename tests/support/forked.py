"""Real shard and worker processes for tests, forked from a preloaded interpreter instead of started cold.

A process that imports torch spends ~3 s of CPU on it. The test suite
starts about a hundred shards and dozens of worker and CLI processes, so
they start from Python's ``multiprocessing`` forkserver: one server process
imports torch and the shard's modules once, and every process is a fresh
``fork`` of it, ready in tens of milliseconds:

- :class:`ForkedCluster`: shards running the same ``shardps.cli.server.main``
  as ``shardps-server`` (own process, own port, own log, real signals and
  exit codes);
- :class:`ForkedPopen`: ``python -m module args`` (a test worker, the
  ``shardps`` CLI) as a ``subprocess.Popen`` with real pipes, signals and
  exit codes (``tests.support.procs.start_module``).

Nothing gRPC or asyncio exists in the forkserver before the fork: both are
created in the child.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from multiprocessing import forkserver, popen_forkserver, reduction, spawn, util

from shardps.worker.cluster import LocalCluster

_CONTEXT = multiprocessing.get_context("forkserver")
# torch._dynamo: what the first torch.optim optimizer of a process imports (~2 s)
_CONTEXT.set_forkserver_preload(["torch", "torch._dynamo", "shardps.cli.server"])


class _Popen(popen_forkserver.Popen):
    """The forkserver launch of the standard library, minus re-importing the parent's ``__main__``.

    The child's target lives in this module, so the child needs nothing from
    ``__main__`` (under pytest, importing it again costs a second per shard).
    """

    def _launch(self, process_obj) -> None:
        prep_data = spawn.get_preparation_data(process_obj._name)
        prep_data.pop("init_main_from_name", None)
        prep_data.pop("init_main_from_path", None)
        buf = io.BytesIO()
        popen_forkserver.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            popen_forkserver.set_spawning_popen(None)
        self.sentinel, w = forkserver.connect_to_new_process(self._fds)
        _parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class _Process(_CONTEXT.Process):
    @staticmethod
    def _Popen(process_obj) -> _Popen:
        return _Popen(process_obj)


def start_process(target, args: tuple = ()) -> multiprocessing.Process:
    """Start ``target(*args)`` (a module-level function) in a process forked from the preloaded forkserver."""
    process = _Process(target=target, args=args, daemon=True)
    process.start()
    return process


class _LinesTo(io.TextIOBase):
    """A text stream that sends each write over a multiprocessing connection (the child's stdout)."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.conn.send(text)
        return len(text)


def _run_shard(argv: list[str], log_path: str, conn) -> None:
    """Child process: stderr to the shard's log, stdout lines to the parent, then the real CLI."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 2)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    sys.stdout = _LinesTo(conn)
    from shardps.cli.server import main

    sys.exit(main(argv))


class ForkedShard:
    """The parts of ``subprocess.Popen`` that ``LocalCluster`` and the tests use, for a forked shard."""

    def __init__(self, argv: list[str], log_path: str) -> None:
        self.lines, child_end = _CONTEXT.Pipe(duplex=False)
        self._process = _Process(target=_run_shard, args=(argv, log_path, child_end), daemon=True)
        self._process.start()
        child_end.close()
        self.pid = self._process.pid
        self.stdout = None

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired("shard", timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # it exited already: the forkserver reaped it before exitcode said so
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkedCluster(LocalCluster):
    """:class:`LocalCluster` whose shard processes are forked from the preloaded forkserver."""

    def _spawn(self, shard: int, port: int = 0) -> ForkedShard:
        return ForkedShard(self.shard_args(shard, port), str(self.log_path(shard)))

    def _wait_address(self, shard: int, deadline: float) -> str:
        proc = self.processes[shard]
        while (remaining := deadline - time.monotonic()) > 0:
            if not proc.lines.poll(min(remaining, 0.5)):  # blocking wait for the "listening on" line
                if proc.poll() is not None:
                    break
                continue
            try:
                line = proc.lines.recv()
            except EOFError:
                break
            if address := self.read_line(shard, line):
                return address
        raise RuntimeError(f"shard {shard} did not report its address (exit code {proc.poll()}):\n"
                           f"{self.log_tail(shard)}")

    def reset(self) -> None:
        """``shardps reset`` of every shard: a fresh job for the next test sharing this cluster."""
        from shardps.worker.session.client import ShardClient

        for address in self.addresses:
            client = ShardClient(address, index=0)
            try:
                client.reset()
            finally:
                client.close()


def cluster_fixture(num_shards: int, **kwargs):
    """A module-scoped pytest fixture yielding a started :class:`ForkedCluster` of ``num_shards`` shards
    (``kwargs`` as ``LocalCluster``'s), stopped after the module: ``shards = cluster_fixture(2, min_workers=2)``.
    Tests sharing it start from a fresh job with ``shards.reset()``."""
    import pytest

    @pytest.fixture(scope="module")
    def cluster():
        with ForkedCluster(num_shards, **kwargs) as started:
            yield started
    return cluster


class _InheritedFd:
    """A file descriptor handed to a forked child (``multiprocessing``'s fd passing); the child gets its own copy."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup) -> int:
    return dup.detach()


def _run_module(module: str, argv: list[str], cwd: str, fds: tuple[int, int, int]) -> None:
    """Child process: the given fds become stdin, stdout and stderr, then ``python -m module argv`` as it would run."""
    import runpy

    multiprocessing.current_process().daemon = False  # a CLI may start processes of its own (daemon is the parent's
    # cleanup flag: a daemonic process may not have children)
    for target, fd in enumerate(fds):
        if fd >= 0:
            os.dup2(fd, target)
            os.close(fd)
    os.chdir(cwd)
    sys.stdin = os.fdopen(0, "r", closefd=False) if fds[0] >= 0 else sys.stdin
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)  # its sys.exit(code) is the exit code


class ForkedPopen(subprocess.Popen):
    """``subprocess.Popen([sys.executable, "-m", module, *argv], ...)`` whose process is forked from the forkserver.

    The same ``Popen`` object (pipes, ``communicate``, signals, ``returncode``;
    a signal's death is ``-signum``) for a process that starts in
    milliseconds instead of paying torch's import (~3 s of CPU). Only
    ``stdin``/``stdout``/``stderr``, ``text`` and ``cwd`` are supported.
    """

    def __init__(self, module: str, argv: list[str], **kwargs) -> None:
        if unsupported := sorted(set(kwargs) - {"stdin", "stdout", "stderr", "text", "cwd"}):
            raise TypeError(f"ForkedPopen does not support {unsupported}")
        self._module, self._argv, self._process = module, list(argv), None
        super().__init__([sys.executable, "-m", module, *argv], **kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags,
                       shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *rest) -> None:
        child = (p2cread, c2pwrite, errwrite)
        try:
            fds = tuple(_InheritedFd(fd) if fd != -1 else -1 for fd in child)
            self._process = _Process(target=_run_module, args=(self._module, self._argv, str(cwd or os.getcwd()), fds),
                                     daemon=True)
            self._process.start()
            self.pid = self._process.pid
        finally:  # the child has its copies: close the child's ends of the pipes Popen made (as Popen does)
            for fd, ours in ((p2cread, p2cwrite), (c2pwrite, c2pread), (errwrite, errread)):
                if fd != -1 and ours != -1:
                    os.close(fd)
            if hasattr(self, "_devnull"):
                os.close(self._devnull)

    def _internal_poll(self, _deadstate=None, _waitpid=None, _WNOHANG=None, _ECHILD=None) -> int | None:
        if self.returncode is None and self._process is not None:
            self.returncode = self._process.exitcode
        return self.returncode

    def _wait(self, timeout: float | None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        self.returncode = self._process.exitcode
        return self.returncode

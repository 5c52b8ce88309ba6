"""Starting a job's processes (its workers; a `shardps serve` whose lines say where it listens) and turning their
failures into one clear error."""

from __future__ import annotations

import logging
import time

import torch.multiprocessing as mp

#: How the worker processes log, as the ``shardps`` command does (``shardps.cli.main``): WARNING and above on
#: stderr, so that a worker continuing a job the shards already hold says so on the terminal.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _logged(index: int, target, *args) -> None:
    """One worker process: log as the command does (unless logging is set up already), then ``target(index, *args)``."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    target(index, *args)


def run_workers(target, args: tuple, nprocs: int, job: str) -> None:
    """Run ``target(index, *args)`` in ``nprocs`` spawned processes and wait for all of them.

    Each process logs WARNING and above on stderr in :data:`LOG_FORMAT` (a
    spawned process starts with no logging set up). If this process is
    stopped meanwhile (SIGTERM turned into ``SystemExit``, Ctrl-C), the
    workers are terminated before the exception goes on.

    Raises:
        RuntimeError: a worker raised (its traceback included) or died (its exit code or signal), naming ``job``.
    """
    context = mp.start_processes(_logged, args=(target, *args), nprocs=nprocs, join=False, start_method="spawn")
    try:
        while not context.join():  # blocking wait; a failed worker makes torch stop the others and raise
            pass
    except mp.ProcessRaisedException as exc:
        raise RuntimeError(f"a {job} worker failed:\n{exc}") from None
    except mp.ProcessExitedException as exc:
        raise RuntimeError(f"a {job} worker died: {exc}") from None
    except BaseException:  # this process is stopped (SIGTERM, Ctrl-C): so are its workers
        for process in context.processes:
            if process.is_alive():
                process.terminate()
        for process in context.processes:
            process.join(10)
        raise


def wait_for(lines, prefix: str, timeout: float = 60.0) -> str:
    """The first of ``lines`` (an iterator of text lines) starting with ``prefix``, within ``timeout`` seconds
    (for launchers and tests reading ``serving on HOST:PORT``).

    Raises:
        TimeoutError: none came in time.
    """
    deadline = time.monotonic() + timeout
    for line in lines:
        if line.startswith(prefix):
            return line[len(prefix):].strip()
        if time.monotonic() > deadline:
            break
    raise TimeoutError(f"no {prefix!r} line within {timeout:g} s")

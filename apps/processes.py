"""Starting a main job's worker processes and turning their failures into one clear error."""

from __future__ import annotations

import torch.multiprocessing as mp


def run_workers(target, args: tuple, nprocs: int, job: str) -> None:
    """Run ``target(index, *args)`` in ``nprocs`` spawned processes and wait for all of them.

    If this process is stopped meanwhile (SIGTERM turned into ``SystemExit``, Ctrl-C), the workers are
    terminated before the exception goes on.

    Raises:
        RuntimeError: a worker raised (its traceback included) or died (its exit code or signal), naming ``job``.
    """
    context = mp.start_processes(target, args=args, nprocs=nprocs, join=False, start_method="spawn")
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

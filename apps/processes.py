"""Starting a main job's worker processes and turning their failures into one clear error."""

from __future__ import annotations

import torch.multiprocessing as mp


def run_workers(target, args: tuple, nprocs: int, job: str) -> None:
    """Run ``target(index, *args)`` in ``nprocs`` spawned processes and wait for all of them.

    Raises:
        RuntimeError: a worker raised (its traceback included) or died (its exit code or signal), naming ``job``.
    """
    try:
        mp.start_processes(target, args=args, nprocs=nprocs, join=True, start_method="spawn")
    except mp.ProcessRaisedException as exc:
        raise RuntimeError(f"a {job} worker failed:\n{exc}") from None
    except mp.ProcessExitedException as exc:
        raise RuntimeError(f"a {job} worker died: {exc}") from None

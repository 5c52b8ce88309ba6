"""A worker and a shard reuse the data plane's freed buffers: rounds do not fault their pages in again.

Every chunk on the wire is a fresh buffer on both ends; with glibc's
defaults a round's freed chunks go back to the kernel and the next round
faults them in again (about one fault per 4 KiB page moved: several times
the cost of the copy). Counted with the processes' own minor-fault
counters in each of 7 rounds of a 16 MiB model after 3 of warm-up, the
median round judged (``tests.support.page_faults`` says why the median); a
round moves the model out and back.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.page_faults import environment_without_malloc_settings
from tests.support.procs import REPO


def faults_per_round(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "tests.support.page_faults", *args], cwd=REPO,
                         env=environment_without_malloc_settings(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_rounds_reuse_freed_chunk_buffers_in_worker_and_shard() -> None:
    retained = faults_per_round()
    pages = retained["pages"]
    # tens remain (threads that had arenas of their own before the worker set malloc up); without reuse it is
    # more than one per page of the model
    assert retained["worker"] < pages / 8, retained
    assert retained["shard"] < pages / 8, retained
    # and not every other round: a new heap high-water mark faults a few hundred pages in one round (657 seen)
    assert retained["worker_mean"] < pages / 2 and retained["shard_mean"] < pages / 2, retained
    unset = faults_per_round("--no-retain")  # the worker's WireOptions(retain_freed_memory=False)
    assert unset["worker"] > pages * 0.8, unset
    assert unset["worker"] > 3 * retained["worker"], (retained, unset)
    assert unset["shard"] < pages / 8, unset  # the shard retains whatever its workers ask

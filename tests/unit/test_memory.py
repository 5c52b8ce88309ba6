"""``shardps.common.memory``: freed chunk-sized buffers are reused instead of faulted in again.

Each case runs in a fresh interpreter (malloc's settings are per process
and cannot be undone) and counts minor page faults while it makes and frees
8 buffers of 4 MiB, 10 times over: with the settings, the pages of the
first round are reused and nothing faults; without them, glibc hands the
freed buffers back to the kernel and every page faults again.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.page_faults import environment_without_malloc_settings
from tests.support.procs import REPO

PAGES = 10 * 8 * (4 << 20) // 4096  # pages written over the 10 counted rounds

SCRIPT = """
import json, resource, sys
from shardps.common.memory import retain_freed_memory
done = retain_freed_memory() if sys.argv[1] == "1" else "not asked"
source = bytearray(4 << 20)
def round_():
    held = [bytes(source) for _ in range(8)]  # copies: every page is written
    del held
round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    round_()
print(json.dumps({"done": done, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def run(retain: bool, **env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, "1" if retain else "0"], cwd=REPO,
                         env={**environment_without_malloc_settings(), **env},
                         capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_freed_buffers_are_reused_without_page_faults() -> None:
    retained, default = run(True), run(False)
    assert retained["done"] == "retained"
    assert retained["faults"] < PAGES // 50, retained  # 0 here; 2% leaves room for the interpreter's own
    # the control: glibc's defaults fault the buffers in again (so the count above measures what it should)
    assert default["faults"] > PAGES // 2, default


def test_the_operators_malloc_settings_win() -> None:
    out = run(True, MALLOC_TRIM_THRESHOLD_="131072")
    assert out["done"] == "malloc settings come from the environment"
    assert out["faults"] > PAGES // 2, out  # left as the operator set it

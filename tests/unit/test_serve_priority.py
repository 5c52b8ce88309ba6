"""``shardps serve --nice``: a priority the process may not take is refused naming what it needs, and changes nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shardps.cli.serve import set_priority

CHILD = """
import os, sys, threading
from shardps.cli.serve import set_priority
if os.geteuid() == 0:
    os.setuid(65534)  # root may lower any nice value: try as an ordinary user (after the imports: /root)
ready, done = threading.Event(), threading.Event()
def helper():  # a second thread at nice 5: set_priority(3) must lower it, which an ordinary user may not
    os.setpriority(os.PRIO_PROCESS, 0, 5)
    ready.set()
    done.wait(30)
threading.Thread(target=helper).start()
ready.wait(30)
def priorities():
    out = {}
    for t in os.listdir("/proc/self/task"):
        out[int(t)] = os.getpriority(os.PRIO_PROCESS, int(t))
    return out
before = priorities()
assert sorted(before.values()) == [0, 5], before
code = 2
for nice in (-5, 3):
    try:
        set_priority(nice)
    except ValueError as exc:
        print(exc)
        code = 0 if priorities() == before else 3
        if code:
            break
    else:
        code = 4
        break
done.set()
sys.exit(code)
"""


def test_a_priority_the_process_may_not_take_is_refused_and_changes_no_thread():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    assert "CAP_SYS_NICE" in proc.stdout and "--nice -5" in proc.stdout and "--nice 3" in proc.stdout, proc.stdout


@pytest.mark.parametrize("nice", [-21, 20])
def test_a_priority_out_of_range_is_refused(nice):
    with pytest.raises(ValueError, match=r"--nice must be in \[-20, 19\]"):
        set_priority(nice)

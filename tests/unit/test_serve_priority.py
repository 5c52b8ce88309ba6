"""``shardps serve --nice``: a priority the process may not take is refused naming what it needs, and changes nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shardps.cli.serve import set_priority

CHILD = """
import os, sys
from shardps.cli.serve import set_priority
if os.geteuid() == 0:
    os.setuid(65534)  # root may lower any nice value: try as an ordinary user (after the imports: /root)
before = os.getpriority(os.PRIO_PROCESS, 0)
try:
    set_priority(-5)
except ValueError as exc:
    print(exc)
    sys.exit(0 if os.getpriority(os.PRIO_PROCESS, 0) == before else 3)
sys.exit(2)
"""


def test_a_priority_the_process_may_not_take_is_refused_naming_cap_sys_nice():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    assert "CAP_SYS_NICE" in proc.stdout and "--nice -5" in proc.stdout, proc.stdout


@pytest.mark.parametrize("nice", [-21, 20])
def test_a_priority_out_of_range_is_refused(nice):
    with pytest.raises(ValueError, match=r"--nice must be in \[-20, 19\]"):
        set_priority(nice)

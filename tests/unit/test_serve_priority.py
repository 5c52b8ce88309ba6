"""``shardps serve --nice`` / ``--realtime`` (``shardps.worker.serving.priority``): a priority reaches every
thread, later threads included; one the process may not take is refused naming what it needs, and changes nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shardps.worker.serving.priority import set_nice, set_realtime

CHILD = """
import os, sys, threading
from shardps.worker.serving.priority import set_nice
if os.geteuid() == 0:
    os.setuid(65534)  # root may lower any nice value: try as an ordinary user (after the imports: /root)
ready, done = threading.Event(), threading.Event()
def helper():  # a second thread at nice 5: set_nice(3) must lower it, which an ordinary user may not
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
        set_nice(nice)
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

# Threads before and after set_realtime, each reporting (policy, priority) from /proc; AS_NOBODY drops root first.
REALTIME_CHILD = """
import os, sys, threading, json
from shardps.worker.serving.priority import set_realtime
if {as_nobody} and os.geteuid() == 0:
    os.setuid(65534)  # root may take any real-time priority: try as an ordinary user (RLIMIT_RTPRIO 0)
ready, done = threading.Event(), threading.Event()
def helper():
    ready.set()
    done.wait(30)
threading.Thread(target=helper).start()
ready.wait(30)
def policies():
    out = {{}}
    for t in os.listdir("/proc/self/task"):
        fields = open(f"/proc/self/task/{{t}}/stat").read().rsplit(")", 1)[1].split()
        out[t] = [int(fields[37]), int(fields[38])]  # rt_priority, policy (proc(5): fields 40 and 41)
    return out
before = policies()
try:
    set_realtime({priority})
    error = ""
except ValueError as exc:
    error = str(exc)
after = policies()
seen = []
def newcomer():
    seen.append(policies()[str(threading.get_native_id())])
t = threading.Thread(target=newcomer); t.start(); t.join(30)
done.set()
print(json.dumps({{"before": before, "after": after, "newcomer": seen[0], "error": error}}))
"""


def _realtime_child(priority: int, as_nobody: bool) -> dict:
    import json

    proc = subprocess.run([sys.executable, "-c", REALTIME_CHILD.format(priority=priority, as_nobody=as_nobody)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_priority_the_process_may_not_take_is_refused_and_changes_no_thread():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    assert "CAP_SYS_NICE" in proc.stdout and "--nice -5" in proc.stdout and "--nice 3" in proc.stdout, proc.stdout


@pytest.mark.parametrize("nice", [-21, 20])
def test_a_priority_out_of_range_is_refused(nice):
    with pytest.raises(ValueError, match=r"--nice must be in \[-20, 19\]"):
        set_nice(nice)


def test_a_realtime_priority_reaches_every_thread_and_the_threads_started_later():
    got = _realtime_child(7, as_nobody=False)  # the suite runs as root (CAP_SYS_NICE), as .ci/run does
    assert got["error"] == "", got
    assert all(policy == [0, 0] for policy in got["before"].values()), got  # SCHED_OTHER before
    assert len(got["after"]) >= 2 and all(policy == [7, 1] for policy in got["after"].values()), got  # SCHED_FIFO 7
    assert got["newcomer"] == [7, 1], got


def test_a_realtime_priority_the_process_may_not_take_is_refused_and_changes_no_thread():
    got = _realtime_child(7, as_nobody=True)
    assert "--realtime 7" in got["error"] and "CAP_SYS_NICE" in got["error"] and "RLIMIT_RTPRIO" in got["error"], got
    assert got["after"] == got["before"] and all(policy == [0, 0] for policy in got["after"].values()), got


@pytest.mark.parametrize("priority", [0, 100])
def test_a_realtime_priority_out_of_range_is_refused(priority):
    with pytest.raises(ValueError, match=r"--realtime must be in \[1, 99\]"):
        set_realtime(priority)

"""A process's scheduling priority, for every one of its threads: a nice value, or a real-time priority.

A serving replica (``shardps serve --nice``, ``--realtime``) and the query client of the serving benchmark set
theirs here. On Linux a priority belongs to a thread, not to a process, so each function sets every thread the
process has now (threads started later inherit the priority of the thread that starts them) and, when the
kernel refuses one, puts back the threads it had changed: a refusal changes nothing.
"""

from __future__ import annotations

import os

__all__ = ["REALTIME_MAX", "set_nice", "set_realtime"]

#: The highest ``SCHED_FIFO`` priority Linux gives (``chrt -f``: 1 lowest .. 99 highest).
REALTIME_MAX = 99

_CAPABILITY = ("needs CAP_SYS_NICE: run as root, or add the capability SYS_NICE to the container; or a {limit} "
               "that allows it")


def _threads() -> list[int]:
    """This process's thread ids (``[0]``, this thread, where ``/proc`` lists none)."""
    return [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]


def set_nice(nice: int, flag: str = "--nice") -> None:
    """Give every thread of this process the nice value ``nice`` (-20 first .. 19 last, as ``nice(1)``).

    ``flag`` names the setting in messages. Under training load a lower value lets a replica's queries run
    before training's work (2 cores, 2 shards and a trainer: a 2,000-id lookup's p99 5.8 ms at nice 0, 4.5 ms
    at -10; docs/serving.md).

    Raises:
        ValueError: ``nice`` outside [-20, 19], or lower than the process may set (the message names
            CAP_SYS_NICE and RLIMIT_NICE); every thread keeps its nice value then.
    """
    if not -20 <= nice <= 19:
        raise ValueError(f"{flag} must be in [-20, 19], got {nice}")
    before = {}
    for thread in _threads():
        try:
            before[thread] = os.getpriority(os.PRIO_PROCESS, thread)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    # the threads to lower first: the one change that may be refused (raising a nice value never is), and the
    # same floor holds for every thread of a process, so a refusal comes before anything changed
    done: list[tuple[int, int]] = []  # (thread, its nice value before), restored on a refusal
    try:
        for thread in sorted(before, key=lambda t: before[t] <= nice):
            try:
                os.setpriority(os.PRIO_PROCESS, thread, nice)
            except ProcessLookupError:
                continue
            done.append((thread, before[thread]))
    except PermissionError:
        for thread, old in reversed(done):
            try:
                os.setpriority(os.PRIO_PROCESS, thread, old)
            except OSError:  # ended meanwhile
                pass
        raise ValueError(f"{flag} {nice}: this process may not lower its nice value ("
                         f"{_CAPABILITY.format(limit='RLIMIT_NICE, `ulimit -e`,')}); leave {flag} at 0, or start "
                         "the training processes with a higher nice value instead") from None


def set_realtime(priority: int, flag: str = "--realtime") -> None:
    """Run every thread of this process under the real-time policy ``SCHED_FIFO`` at ``priority`` (1 lowest ..
    99 highest, as ``chrt -f``): a thread woken by a query then takes a core from any ordinary (``SCHED_OTHER``)
    thread at once, where a nice value only weighs its share of the core. ``flag`` names the setting in
    messages.

    Such a thread runs until it blocks or a higher real-time thread wakes, so it suits a process that mostly
    waits, as a replica does between queries and refreshes. The kernel's real-time throttling
    (``kernel.sched_rt_runtime_us``, 0.95 s of every second by default) still leaves the other processes a
    share should one spin.

    Raises:
        ValueError: ``priority`` outside [1, 99], or a real-time policy the process may not take (the message
            names CAP_SYS_NICE and RLIMIT_RTPRIO); every thread keeps its policy then.
    """
    if not 1 <= priority <= REALTIME_MAX:
        raise ValueError(f"{flag} must be in [1, {REALTIME_MAX}], got {priority}")
    done: list[tuple[int, int, int]] = []  # (thread, its policy and priority before), restored on a refusal
    try:
        for thread in _threads():
            try:
                old = (os.sched_getscheduler(thread), os.sched_getparam(thread).sched_priority)
                os.sched_setscheduler(thread, os.SCHED_FIFO, os.sched_param(priority))
            except ProcessLookupError:
                continue
            done.append((thread, *old))
    except PermissionError:
        for thread, policy, old in reversed(done):
            try:
                os.sched_setscheduler(thread, policy, os.sched_param(old))
            except OSError:  # ended meanwhile
                pass
        raise ValueError(f"{flag} {priority}: this process may not take a real-time priority ("
                         f"{_CAPABILITY.format(limit='RLIMIT_RTPRIO, `ulimit -r`,')}; in a container, the real-time "
                         f"time its cgroup allows); leave {flag} out") from None

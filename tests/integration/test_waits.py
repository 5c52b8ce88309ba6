"""Waits that speak: a survivor whose partner was SIGKILLed says, within 3 s, what its round waits for."""

from __future__ import annotations

import os
import queue
import signal
import threading
import time

from tests.support.procs import start_worker, wait_until

LEASE = 10.0  # seconds: the survivor waits this long for the dead member, and must say so within 3 s


def _lines(stream, into: queue.Queue) -> None:
    for line in stream:
        into.put((time.monotonic(), line.rstrip("\n")))


def test_a_survivor_names_the_lost_member_within_3_seconds(start_cluster) -> None:
    cluster = start_cluster(2, min_workers=2, extra_args=("--lease-seconds", str(LEASE)))
    procs = [start_worker(cluster.servers, f"w{i}", "--index", str(i), "--workers", "2", "--steps", "400",
                          "--sleep", "0.05", "--log-info") for i in range(2)]
    out: queue.Queue = queue.Queue()
    err: queue.Queue = queue.Queue()
    readers = [threading.Thread(target=_lines, args=(procs[0].stdout, out), daemon=True),
               threading.Thread(target=_lines, args=(procs[0].stderr, err), daemon=True)]
    for r in readers:
        r.start()
    try:
        seen = []

        def survivor_stepped() -> bool:
            while not out.empty():
                seen.append(out.get()[1])
            return sum(line.startswith("step ") for line in seen) >= 5

        wait_until(survivor_stepped, 90, "5 steps of both workers")
        os.kill(procs[1].pid, signal.SIGKILL)
        killed = time.monotonic()
        deadline = killed + 8.0
        said, heard = None, []
        while said is None and time.monotonic() < deadline:
            try:
                at, line = err.get(timeout=0.2)
            except queue.Empty:
                continue
            heard.append(line)
            if "waits for worker(s) w1" in line:
                said = (at, line)
        assert said is not None, f"the survivor never said what it waits for; its stderr: {heard[-10:]}"
        assert said[0] - killed <= 3.0, f"said after {said[0] - killed:.1f} s: {said[1]}"
        assert "INFO" in said[1] and f"lease of {LEASE:g} s runs out by" in said[1], said[1]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)

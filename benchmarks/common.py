"""Helpers shared by the benchmarks: argument parsing, machine description, tables, JSON output."""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
from pathlib import Path

import torch


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", type=Path, help="write the figures as JSON to this path")
    return p


def machine() -> dict:
    """CPU model, core count, memory (bytes), Python and torch versions."""
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem, "python": platform.python_version(),
            "torch": torch.__version__}


def current_rss_bytes() -> int:
    """Resident set size of this process now, bytes (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far, bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*["-" * w for w in widths])]
    lines += [fmt.format(*[str(c) for c in r]) for r in rows]
    return "\n".join(lines)


def emit(result: dict, path: Path | None) -> None:
    result = {**result, "machine": machine()}
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"figures written to {path}")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int | None = None) -> float | None:
    """User + system CPU seconds process ``pid`` used so far (all its threads); None without it or Linux's /proc.

    ``None``: this process, from ``getrusage`` (microseconds). Another process: from ``/proc/<pid>/stat``, in
    clock ticks (10 ms on most kernels), so sum it over many calls before dividing.
    """
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

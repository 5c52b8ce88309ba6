"""One prepared run of every GPU check, for a host lent for a few minutes: the CUDA tests and the GPU and wire benchmarks.

    # where the project is set up (has internet): the wheels the GPU host lacks, for its Python
    python benchmarks/gpu_session.py prepare --wheels wheelhouse [--python-version 3.12]
    # on the GPU host, in a checkout that carries wheelhouse/:
    python benchmarks/gpu_session.py run --out OUT [--wheels wheelhouse] [--budget-seconds 540] [--smoke]

``prepare`` downloads binary wheels of shardps' runtime and test
dependencies (not torch: a GPU host brings its own CUDA build) for the
given Python version into ``--wheels``, and builds a wheel of shardps
itself there.

``run`` does, in order, each step a subprocess whose output goes to
``OUT/<step>.log``:

1. ``install`` (only with ``--wheels``): ``pip install --no-index`` of those
   wheels, shardps without its dependencies (torch stays the host's);
2. ``gpu_tests``: the tests marked ``gpu`` (the CUDA data plane against
   the single-process oracle, the node reduction over NCCL);
3. ``gpu``: ``benchmarks/gpu.py --shards 2 --streamed on,off --repeats 2
   --json OUT/gpu.json`` (shardps against plain single-GPU PyTorch, where
   each step's time goes, streamed rounds and push then pull);
4. ``gpu_stream_processes``: the transformer rows again (32 and 256
   sequences, fp32 and bf16 gradients) with each shard's streams carried
   by a helper process (``--stream-processes on``, rows ``..._procs``,
   ``OUT/gpu_stream_processes.json``; plain PyTorch rerun beside them);
5. ``gpu_shard_cores``: the 256-sequence transformer rows again, fp32, with
   each shard's optimizer on every core the host has (``--shard-threads``,
   a shard pod's default) instead of ``LocalCluster``'s split of the cores
   among the shards and the worker (``OUT/gpu_shard_cores.json``): whether
   the shards' OpenMP threads slowed the worker's backward on the H200;
6. ``wire``: ``benchmarks/wire.py --json OUT/wire.json`` (push+pull against
   the raw gRPC ceilings, CPU time per process, stream processes too).

Each step gets what is left of ``--budget-seconds`` (default 540, under
the 10 minutes one device call may run) less a reserve for the steps after
it, and is killed at its share; a failed or killed step does not stop the
next. ``OUT/session.json`` records the device, the versions, and each
step's command, exit status and seconds, written after every step, so that
a call cut short still brings back what ran. ``--smoke`` runs the same
steps at sizes a CPU finishes in a minute (CI runs it: the GPU tests are
skipped there, which pytest counts as success). Exit status: 0 when every
step exited 0, else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _requirements() -> tuple[str, ...]:
    """shardps' dependencies as pyproject.toml states them, torch left out (a GPU host brings its CUDA build), and
    what its GPU tests need: pip installs or upgrades only what the host does not already satisfy."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    runtime = [r for r in project["dependencies"] if not r.replace(" ", "").startswith("torch")]
    tests = [r for r in project["optional-dependencies"]["dev"] if r.split(">")[0].split("=")[0] in
             ("pytest", "pytest-timeout")]
    return (*runtime, *tests)


#: What shardps needs besides torch at run time and for its GPU tests.
WHEELS = _requirements()
#: The tests a GPU host runs: the CUDA data plane and the node reduction over NCCL.
GPU_TESTS = ("tests/integration/test_cuda_data_plane.py", "tests/integration/test_node_reduction.py")
#: Seconds kept back for each later step when a step's time limit is set.
RESERVE = {"install": 5, "gpu_tests": 60, "gpu": 120, "gpu_stream_processes": 60, "gpu_shard_cores": 40, "wire": 60}


def steps(out: Path, wheels: Path | None, smoke: bool) -> list[tuple[str, list[str]]]:
    """The ``(name, command)`` of each step of ``run``, in order."""
    py = sys.executable
    plan = []
    if wheels is not None:
        plan.append(("install", [py, "-m", "pip", "install", "--no-index", "--find-links", str(wheels), *WHEELS]))
        plan.append(("install_shardps", [py, "-m", "pip", "install", "--no-index", "--no-deps", "--force-reinstall",
                                         *map(str, sorted(wheels.glob("shardps-*.whl")))]))
    plan.append(("gpu_tests", [py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-rs", *GPU_TESTS]))
    gpu = [py, "benchmarks/gpu.py", "--json", str(out / "gpu.json")]
    wire = [py, "benchmarks/wire.py", "--json", str(out / "wire.json")]
    gpu += ["--shards", "2", "--streamed", "on,off"]  # 4 shards changed nothing on the H200; both round kinds
    # the same shards at a shard pod's default, every usable core each (gpu.py's LocalCluster splits the cores)
    cores = [py, "benchmarks/gpu.py", "--json", str(out / "gpu_shard_cores.json"), "--shards", "2",
             "--streamed", "on,off", "--shard-threads", str(len(os.sched_getaffinity(0)))]
    # the same shards with each one's streams through a helper process (WireOptions(stream_processes=True))
    procs = [py, "benchmarks/gpu.py", "--json", str(out / "gpu_stream_processes.json"), "--shards", "2",
             "--streamed", "on,off", "--stream-processes", "on"]
    if smoke:
        tiny = ["--device", "cpu", "--tiny", "--steps", "3", "--warmup", "1", "--workloads", "mlp:4", "--wire", "fp32"]
        gpu += tiny
        cores += tiny
        procs += tiny
        wire += ["--repeats", "1", "--channels", "1"]
    else:
        gpu += ["--repeats", "2"]
        cores += ["--repeats", "2", "--workloads", "transformer:256", "--wire", "fp32"]
        procs += ["--repeats", "2", "--workloads", "transformer:32,transformer:256", "--wire", "fp32,bf16"]
    plan += [("gpu", gpu), ("gpu_stream_processes", procs), ("gpu_shard_cores", cores), ("wire", wire)]
    return plan


def device() -> dict:
    """The accelerator and versions this host has, read in a subprocess (a broken torch fails only this)."""
    probe = ("import json, torch, platform; c = torch.cuda.is_available(); print(json.dumps({"
             "'torch': torch.__version__, 'cuda': torch.version.cuda, 'python': platform.python_version(), "
             "'device': torch.cuda.get_device_name(0) if c else 'cpu', 'gpus': torch.cuda.device_count()}))")
    try:
        proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
        return json.loads(proc.stdout) if proc.returncode == 0 else {"error": proc.stderr[-2000:]}
    except (subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
        return {"error": repr(exc)}


def run(out: Path, wheels: Path | None, budget: float, smoke: bool) -> int:
    """Run every step within ``budget`` seconds; returns 0 when each exited 0, else 1."""
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + budget
    session = {"host": platform.node(), "cpu_count": os.cpu_count(), "smoke": smoke, "budget_seconds": budget,
               "device": None, "steps": []}
    plan = steps(out, wheels, smoke)
    for i, (name, command) in enumerate(plan):
        if session["device"] is None and not name.startswith("install"):  # once shardps' dependencies are in
            session["device"] = device()
            (out / "session.json").write_text(json.dumps(session, indent=2) + "\n")
        later = sum(RESERVE.get(n, 0) for n, _ in plan[i + 1:])
        limit = deadline - time.monotonic() - later
        record = {"name": name, "command": command, "limit_seconds": round(limit, 1)}
        if limit < 5:
            record.update(returncode=None, seconds=0.0, skipped="no time left in --budget-seconds")
        else:
            print(f"[gpu_session] {name}: up to {limit:.0f} s: {' '.join(command)}", flush=True)
            start = time.monotonic()
            with open(out / f"{name}.log", "w") as log:
                record["returncode"] = _run_step(command, log, limit, record)
                if record["returncode"] is None:
                    record["killed"] = f"ran past its {limit:.0f} s"
            record["seconds"] = round(time.monotonic() - start, 1)
            print(f"[gpu_session] {name}: exit {record['returncode']} after {record['seconds']} s", flush=True)
        session["steps"].append(record)
        (out / "session.json").write_text(json.dumps(session, indent=2) + "\n")
    skipped = [s["name"] for s in session["steps"] if s.get("skipped")]
    failed = [s["name"] for s in session["steps"] if s.get("returncode") != 0 and not s.get("skipped")]
    verdict = "; ".join([*(["failed: " + ", ".join(failed)] if failed else []),
                         *(["skipped: " + ", ".join(skipped)] if skipped else [])]) or "every step exited 0"
    print(f"[gpu_session] {verdict}; device: {session['device']}; figures in {out}", flush=True)
    return 1 if failed or skipped else 0


def _run_step(command: list[str], log, limit: float, record: dict) -> int | None:
    """Run ``command`` in a session of its own (``record["session"]``: its id), output to ``log``; its exit status,
    or None when it ran past ``limit`` seconds: then the whole group is killed (the shards and servers a benchmark
    started too)."""
    proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    record["session"] = proc.pid
    try:
        return proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        _wait_group_gone(proc.pid)
        return None
    finally:
        if proc.poll() is None:  # interrupted (Ctrl-C): take the group down with it
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait_group_gone(pgid: int, seconds: float = 10.0) -> None:
    """Wait (up to ``seconds``) until no process of group ``pgid`` is left: SIGKILLed processes take a moment to
    exit (the shards and stream processes a benchmark started; unreaped zombies may stay, and are harmless)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def prepare(wheels: Path, python_version: str) -> int:
    """Download the wheels of :data:`WHEELS` for ``python_version`` (manylinux, x86_64) and build shardps' wheel."""
    wheels.mkdir(parents=True, exist_ok=True)
    download = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--python-version", python_version,
                "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64",
                "--platform", "manylinux_2_28_x86_64", "-d", str(wheels), *WHEELS]
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(wheels), str(REPO)]
    for command in (download, build):
        print(f"[gpu_session] {' '.join(command)}", flush=True)
        if subprocess.run(command).returncode != 0:
            return 1
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run", help="run every check here, figures into --out")
    r.add_argument("--out", type=Path, required=True, help="folder for session.json, the logs and the benchmarks' JSON")
    r.add_argument("--wheels", type=Path, help="install these wheels first (from `prepare`), without an index")
    r.add_argument("--budget-seconds", type=float, default=540.0, help="the whole run's time limit, s (default 540)")
    r.add_argument("--smoke", action="store_true", help="sizes a CPU finishes in about a minute (CI)")
    w = sub.add_parser("prepare", help="download the wheels a GPU host lacks, and build shardps' wheel")
    w.add_argument("--wheels", type=Path, required=True, help="folder to put them in")
    w.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}",
                   help="the GPU host's Python, e.g. 3.12 (default: this one's)")
    args = p.parse_args()
    if args.what == "run":
        if args.wheels is not None and not args.wheels.is_dir():
            p.error(f"--wheels {args.wheels}: no such folder (make it with `prepare`)")
        if args.wheels is not None and not any(args.wheels.glob("shardps-*.whl")):
            p.error(f"--wheels {args.wheels}: holds no shardps wheel (make the folder with `prepare`)")
        if args.budget_seconds <= 0:
            p.error(f"--budget-seconds must be > 0, got {args.budget_seconds}")
        sys.exit(run(args.out, args.wheels, args.budget_seconds, args.smoke))
    sys.exit(prepare(args.wheels, args.python_version))


if __name__ == "__main__":
    main()

"""Churn soak: many workers on three shards for hundreds of rounds, some SIGKILLed and others joining all along.

Three real shard processes (``--lease-seconds 2``) and ``SHARDPS_SOAK_WORKERS``
real worker processes (``tests.support.soak_worker``, forked from the preloaded
forkserver of ``tests.support.forked`` so that none pays torch's import; with
``SHARDPS_SOAK_EXEC=1`` each is a cold ``python -m tests.support.soak_worker``)
train until every shard reached ``SHARDPS_SOAK_ROUNDS``. Churn, all the
while:

- every ``SHARDPS_SOAK_KILL_EVERY`` rounds one running worker is killed with
  SIGKILL, every second time two at once (one that has pushed the open round
  and one that has not, so the first one's accepted push must be dropped),
  and a replacement starts at once for each, alternately with the same
  ``worker_id`` (its Join waits until the dead process's lease runs out: the
  same member coming back) and with a new one;
- a quarter of the first workers (and half of those that replace them)
  leave cleanly after a random number of steps (``--max-steps``); a new
  worker (new id) takes each one's place.

So ``SHARDPS_SOAK_WORKERS`` processes run nearly all the time. A thread
polls every shard's Stats every 0.1 s. Asserted:

1. No round waits past lease + 5 s: on every shard, the longest time
   between two version changes while training (first round to the target)
   is below that; so is the longest time between two steps of any worker.
   Not vacuous: the kills make rounds wait, so the longest gap is at least
   half a lease.
2. Versions only go up: every shard's polled version (and epoch and
   counters) never decreases, and every worker's step ``k`` reports version
   ``v + k + 1`` on each shard, ``v`` being what it pulled when it joined.
3. The counters add up, on every shard, at every poll and at the end:
   ``pushes_accepted == contributions_applied + pushes_dropped + len(pushed)``;
   and they match what the workers report. A worker's step that returned
   is one contribution applied by every shard; a worker killed after
   reporting ``n`` steps contributed ``n`` or ``n + 1`` (the push it was in
   when killed may or may not have counted). So at every poll, with
   ``R(V)`` the reported steps that reached version ``<= V`` on the shard and
   ``E(V)`` the killed workers whose unreported push was of a round before
   ``V``: ``R(V) <= contributions_applied <= R(V) + E(V)``, and the same per
   round for ``last_round_contributors``. At the end (every worker done or
   killed, every lease run out: no members, nothing pushed):
   ``R <= contributions_applied`` and ``pushes_accepted - R <= kills``,
   ``pushes_dropped <= kills``, ``contributions_applied >= version``, and
   on average at least ``SHARDPS_SOAK_WORKERS - 1`` contributors per round
   (forked workers only: cold ones miss rounds while they start).
4. ``lease_expiries`` equals the number of SIGKILLs on every shard (a live
   worker never expires); ``membership_epoch`` lies between
   ``joins + leaves + 1`` and ``joins + leaves + kills``.

Environment (defaults in brackets): ``SHARDPS_SOAK_WORKERS`` [16],
``SHARDPS_SOAK_ROUNDS`` [150], ``SHARDPS_SOAK_KILL_EVERY`` [10 rounds],
``SHARDPS_SOAK_DOUBLE_KILLS`` [1; 0: one victim at a time],
``SHARDPS_SOAK_SEED`` [0], ``SHARDPS_SOAK_SECONDS`` [240: the training phase
fails past this], ``SHARDPS_SOAK_EXEC`` [0; 1: cold ``python -m`` worker
processes, ~2.5 s of CPU each]. With the defaults it takes about 75-85 s
on an idle 2-core machine: ~4 rounds/s with 16 workers, plus about 2.5 s of
waiting for a lease at each of the 14 kill events; ~10 s to start.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from shardps.worker.session.client import ShardClient
from shardps.worker.session.retry import RetryPolicy
from tests.support import soak_worker
from tests.support.forked import start_process
from tests.support.procs import REPO, shard_stats, wait_until

LEASE = 2.0
NUM_SHARDS = 3
WORKERS = int(os.environ.get("SHARDPS_SOAK_WORKERS", "16"))
ROUNDS = int(os.environ.get("SHARDPS_SOAK_ROUNDS", "150"))
KILL_EVERY = int(os.environ.get("SHARDPS_SOAK_KILL_EVERY", "10"))
SEED = int(os.environ.get("SHARDPS_SOAK_SEED", "0"))
SECONDS = float(os.environ.get("SHARDPS_SOAK_SECONDS", "240"))
EXEC = os.environ.get("SHARDPS_SOAK_EXEC", "0") == "1"
DOUBLE_KILLS = os.environ.get("SHARDPS_SOAK_DOUBLE_KILLS", "1") == "1"
MAX_WAIT = LEASE + 5  # the longest a round may wait
POLL = 0.1  # Stats period of the monitor
KILL_MARGIN = 3  # no kill in the last rounds: every worker ends by reaching the target


# ---------------------------------------------------------------- workers
@dataclass
class Step:
    n: int
    versions: list[int]
    t: float


@dataclass
class Worker:
    """One worker process and what it printed."""

    worker_id: str
    out: Path
    err: Path
    max_steps: int
    proc: object = None
    killed: bool = False
    exit_code: int | None = None
    joined: list[int] | None = None
    joined_t: float = 0.0
    steps: list[Step] = field(default_factory=list)
    done: bool = False

    def poll(self) -> int | None:
        return self.proc.exitcode if not EXEC else self.proc.poll()

    def wait(self, timeout: float) -> int | None:
        if not EXEC:
            self.proc.join(timeout)
            return self.proc.exitcode
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def read(self) -> None:
        """Parse the whole lines of its output (one write each: a SIGKILL leaves no half line)."""
        text = self.out.read_text() if self.out.exists() else ""
        self.joined, self.steps, self.done = None, [], False
        for line in text.split("\n")[:-1]:
            words = dict(w.split("=", 1) for w in line.split() if "=" in w)
            if line.startswith("joined "):
                self.joined = [int(v) for v in words["versions"].split(",")]
                self.joined_t = float(words["t"])
            elif line.startswith("step "):
                versions = [int(v) for v in words["versions"].split(",")]
                assert int(words["version"]) == min(versions), f"{self.worker_id}: {line}"
                self.steps.append(Step(int(line.split()[1]), versions, float(words["t"])))
            elif line.startswith("done "):
                assert int(words["steps"]) == len(self.steps), f"{self.worker_id}: {line}"
                self.done = True

    def has_joined(self) -> bool:
        if self.joined is None:
            self.read()
        return self.joined is not None

    def pending(self, shard: int) -> int:
        """The round of its push that may or may not have counted when it was killed, on ``shard``."""
        return self.steps[-1].versions[shard] if self.steps else self.joined[shard]

    def stderr_tail(self, chars: int = 3000) -> str:
        return self.err.read_text(errors="replace")[-chars:] if self.err.exists() else ""


class Launcher:
    def __init__(self, servers: str, directory: Path) -> None:
        self.servers, self.directory = servers, directory
        self.workers: list[Worker] = []

    def launch(self, worker_id: str, max_steps: int = 0) -> Worker:
        n = len(self.workers)
        w = Worker(worker_id, self.directory / f"{n:03d}-{worker_id}.out", self.directory / f"{n:03d}-{worker_id}.err",
                   max_steps)
        argv = ["--servers", self.servers, "--worker-id", worker_id, "--target-version", str(ROUNDS),
                "--max-steps", str(max_steps), "--time-limit", str(SECONDS + 60)]
        if EXEC:
            with open(w.out, "wb") as out, open(w.err, "wb") as err:
                w.proc = subprocess.Popen([sys.executable, "-m", "tests.support.soak_worker", *argv], cwd=REPO, stdout=out,
                                          stderr=err, stdin=subprocess.DEVNULL)
        else:
            w.proc = start_process(soak_worker.forked_main, (argv, str(w.out), str(w.err)))
        self.workers.append(w)
        return w

    def running(self) -> list[Worker]:
        return [w for w in self.workers if not w.killed and w.exit_code is None]

    def kill_all(self) -> None:
        for w in self.workers:
            if w.proc is not None and w.poll() is None:
                os.kill(w.proc.pid, signal.SIGKILL)
                w.wait(10)


# ---------------------------------------------------------------- the monitor
@dataclass(frozen=True)
class Sample:
    t: float
    version: int
    epoch: int
    members: int
    expiries: int
    accepted: int
    applied: int
    dropped: int
    pushed: int
    contributors: int


class Monitor(threading.Thread):
    """Polls every shard's Stats every ``POLL`` seconds (bounded by ``limit`` seconds) into ``samples``."""

    def __init__(self, addresses: list[str], limit: float) -> None:
        super().__init__(name="soak-monitor", daemon=True)
        self.clients = [ShardClient(a, index=i, rpc_timeout=5.0, connect_timeout=10.0,
                                    retry=RetryPolicy(total_seconds=0)) for i, a in enumerate(addresses)]
        self.samples: list[list[Sample]] = [[] for _ in addresses]
        self.changed = [0.0] * len(addresses)  # when each shard's version last changed (monotonic seconds)
        self.errors: list[str] = []
        self.limit = limit
        self._halt = threading.Event()

    def run(self) -> None:
        end = time.monotonic() + self.limit
        while not self._halt.is_set() and time.monotonic() < end:
            for i, client in enumerate(self.clients):
                try:
                    s = client.stats(timeout=2.0, retried=False)
                except Exception as exc:  # recorded; the test fails on it
                    self.errors.append(f"shard {i}: {exc!r}")
                    continue
                now = time.monotonic()
                if not self.samples[i] or self.samples[i][-1].version != s.version:
                    self.changed[i] = now
                self.samples[i].append(Sample(now, s.version, s.membership_epoch, len(s.members),
                                              s.lease_expiries, s.pushes_accepted, s.contributions_applied,
                                              s.pushes_dropped, len(s.pushed), s.last_round_contributors))
            self._halt.wait(POLL)

    def version(self) -> int:
        """The lowest version over the shards at their latest poll (0 before the first)."""
        return min((s[-1].version if s else 0) for s in self.samples)

    def stalled(self) -> float:
        """The longest time any shard's version has not changed, until now (seconds)."""
        return time.monotonic() - min(self.changed)

    def describe(self) -> str:
        """Every shard's version, members and pushes now (for failure messages)."""
        out = []
        for i, client in enumerate(self.clients):
            try:
                s = client.stats(timeout=2.0, retried=False)
            except Exception as exc:  # a failure message must not fail
                out.append(f"shard {i}: Stats failed: {exc!r}")
                continue
            strangers = sorted(set(s.pushed) - set(s.members))
            out.append(f"shard {i}: version {s.version}, members {list(s.members)}, pushed {list(s.pushed)}"
                       f"{f' (by non-members {strangers})' if strangers else ''}, lease_expiries {s.lease_expiries}, "
                       f"accepted {s.pushes_accepted}, applied {s.contributions_applied}, dropped {s.pushes_dropped}")
        return "\n".join(out)

    def stop(self) -> None:
        self._halt.set()
        self.join(10)
        for c in self.clients:
            c.close()


# ---------------------------------------------------------------- the churn
def pick_victims(candidates: list[Worker], n: int, monitor: Monitor, rng: random.Random) -> list[Worker]:
    """``n`` workers to kill. Two: if possible one that has not pushed the open round on shard 0 and one that has
    (the round then waits for the first, and the second's accepted push must be dropped with it)."""
    if len(candidates) < n:
        return candidates
    if n == 2:
        try:
            pushed = set(monitor.clients[0].stats(timeout=2.0, retried=False).pushed)
        except Exception:  # then any two
            pushed = set()
        waited = [w for w in candidates if w.worker_id not in pushed]
        done = [w for w in candidates if w.worker_id in pushed]
        if waited and done:
            return [rng.choice(waited), rng.choice(done)]
    return rng.sample(candidates, n)


def churn(launcher: Launcher, monitor: Monitor, rng: random.Random) -> dict:
    """Start the workers, kill and replace them until the shards reach ``ROUNDS``; returns figures."""
    fresh = iter(range(10**6))

    def leaver_steps() -> int:  # how many steps a worker that leaves on its own takes
        return rng.randint(max(2, ROUNDS // 10), max(3, ROUNDS // 3))

    for i in range(WORKERS):  # a quarter of them leave cleanly after a random number of steps
        launcher.launch(f"w{i:02d}", max_steps=leaver_steps() if i % 4 == 3 else 0)
    wait_until(lambda: monitor.version() >= 1, 90, "the first round (every worker joined)")
    figures = {"events": 0, "kills": 0, "double_kills": 0, "restarts": 0, "new_ids": 0, "leaves": 0,
               "t_first_round": time.monotonic()}
    next_kill = KILL_EVERY
    deadline = time.monotonic() + SECONDS
    for _ in range(int(SECONDS / 0.05) + 1):  # bounded; the deadline ends it first
        version = monitor.version()
        if version >= ROUNDS:
            break
        assert time.monotonic() < deadline, f"the shards reached only version {version} of {ROUNDS} in {SECONDS}s"
        assert len(monitor.errors) < 10, f"Stats failed: {monitor.errors[-3:]}"
        assert monitor.stalled() < MAX_WAIT + 1, (  # fail now rather than at the deadline
            f"a round has waited {monitor.stalled():.1f}s (> lease + 5 s) after {figures['kills']} kills (the last: "
            f"{[w.worker_id for w in launcher.workers if w.killed][-4:]}):\n{monitor.describe()}")
        for w in launcher.running():
            code = w.poll()
            if code is None:
                continue
            w.exit_code = code
            assert code == 0, f"worker {w.worker_id} exited with {code}:\n{w.stderr_tail()}"
            w.read()
            if w.max_steps and len(w.steps) == w.max_steps and monitor.version() < ROUNDS - 1:
                figures["leaves"] += 1
                launcher.launch(f"n{next(fresh):03d}", max_steps=leaver_steps() if rng.random() < 0.5 else 0)
                figures["new_ids"] += 1
        # the next kill once the replacements of the last ones joined (else a cold start could empty the job)
        if next_kill <= version <= ROUNDS - KILL_MARGIN and all(w.has_joined() for w in launcher.running()):
            # victims: joined every shard, and will not leave on their own (a leave half-done would blur the counts)
            candidates = [w for w in launcher.running() if w.max_steps == 0 and w.has_joined()]
            figures["events"] += 1
            victims = pick_victims(candidates, 2 if DOUBLE_KILLS and figures["events"] % 2 == 0 else 1, monitor, rng)
            for victim in victims:  # all signals first: the victims die together
                victim.killed = True
                os.kill(victim.proc.pid, signal.SIGKILL)
            for victim in victims:
                victim.exit_code = victim.wait(10)
                assert victim.exit_code == -signal.SIGKILL, f"{victim.worker_id}: exit code {victim.exit_code}"
                figures["kills"] += 1
                if figures["kills"] % 2:
                    launcher.launch(victim.worker_id)  # the same member coming back
                    figures["restarts"] += 1
                else:
                    launcher.launch(f"n{next(fresh):03d}")
                    figures["new_ids"] += 1
            figures["double_kills"] += len(victims) == 2
            next_kill = version + KILL_EVERY
        time.sleep(0.05)
    else:
        raise AssertionError("the churn loop ran out of iterations")
    figures["t_target"] = time.monotonic()
    for w in launcher.workers:
        if not w.killed and w.exit_code is None:
            w.exit_code = w.wait(max(1.0, figures["t_target"] + 60 - time.monotonic()))
            assert w.exit_code == 0, f"worker {w.worker_id} ended with {w.exit_code}:\n{w.stderr_tail()}"
        w.read()
    return figures


# ---------------------------------------------------------------- checks
def check_workers(workers: list[Worker], final_versions: list[int]) -> float:
    """Per worker: versions +1 per step on every shard, the end it should have; returns the longest step gap."""
    longest = 0.0
    for w in workers:
        assert w.joined is not None, f"{w.worker_id} never joined:\n{w.stderr_tail()}"
        assert len(w.joined) == NUM_SHARDS
        previous_t = w.joined_t if min(w.joined) >= 1 else None  # the first round waits for every worker to join
        for k, step in enumerate(w.steps):
            assert step.n == k
            assert step.versions == [v + k + 1 for v in w.joined], (
                f"{w.worker_id} step {k}: versions {step.versions} after joining at {w.joined}")
            if previous_t is not None:
                longest = max(longest, step.t - previous_t)
            previous_t = step.t
        if w.killed:
            assert not w.done, f"{w.worker_id} was killed but printed done"
            continue
        assert w.exit_code == 0 and w.done, f"{w.worker_id}: exit {w.exit_code}\n{w.stderr_tail()}"
        if w.max_steps and len(w.steps) == w.max_steps:
            continue  # it left on its own
        last = w.steps[-1].versions if w.steps else w.joined
        assert ROUNDS <= min(last) and all(v <= f for v, f in zip(last, final_versions)), (
            f"{w.worker_id} stopped at {last}, the target is {ROUNDS} and the shards are at {final_versions}")
    return longest


def check_shard(shard: int, samples: list[Sample], workers: list[Worker], final) -> dict:
    """Versions and counters of one shard, polled and final, against what the workers reported."""
    killed = [w for w in workers if w.killed]
    reported: dict[int, int] = {}  # version reached on this shard -> steps reporting it
    for w in workers:
        for step in w.steps:
            reported[step.versions[shard]] = reported.get(step.versions[shard], 0) + 1
    pending: dict[int, int] = {}  # round -> killed workers whose unreported push was of it
    for w in killed:
        pending[w.pending(shard)] = pending.get(w.pending(shard), 0) + 1

    def up_to(table: dict[int, int], bound: int) -> int:
        return sum(n for v, n in table.items() if v <= bound)

    assert samples, f"no Stats from shard {shard}"
    for a, b in zip(samples, samples[1:]):
        for name in ("version", "epoch", "expiries", "accepted", "applied", "dropped"):
            assert getattr(b, name) >= getattr(a, name), f"shard {shard}: {name} went down: {a} then {b}"
    checked_rounds = set()
    for s in samples:
        assert s.accepted == s.applied + s.dropped + s.pushed, f"shard {shard}: counters do not add up: {s}"
        low = up_to(reported, s.version)
        assert low <= s.applied <= low + up_to(pending, s.version - 1), (
            f"shard {shard} at version {s.version}: {s.applied} contributions applied, the workers reported {low} "
            f"and {up_to(pending, s.version - 1)} killed ones may have counted one more")
        if s.version >= 1:
            low = reported.get(s.version, 0)
            assert low <= s.contributors <= low + pending.get(s.version - 1, 0), (
                f"shard {shard}: round {s.version - 1} averaged {s.contributors} contributions, the workers reported "
                f"{low} and {pending.get(s.version - 1, 0)} killed ones may have counted one more")
            checked_rounds.add(s.version - 1)

    window = []  # when the polls saw the version change, from the first round to the target
    for a, s in zip(samples, samples[1:]):
        if s.version != a.version and s.version >= 1:
            window.append(s.t)
            if s.version >= ROUNDS:
                break
    gaps = [b - a for a, b in zip(window, window[1:])]
    polls = [b.t - a.t for a, b in zip(samples, samples[1:])]

    total = sum(reported.values())
    assert final.version == max(reported), (
        f"shard {shard} is at version {final.version}, the workers reported up to {max(reported)}")
    assert list(final.members) == [] and list(final.pushed) == [], f"shard {shard}: {final}"
    assert final.pushes_accepted == final.contributions_applied + final.pushes_dropped, f"shard {shard}: {final}"
    assert total <= final.contributions_applied and final.pushes_accepted - total <= len(killed), (
        f"shard {shard}: {final.pushes_accepted} pushes accepted, {final.contributions_applied} applied, "
        f"{final.pushes_dropped} dropped; the workers reported {total} steps and {len(killed)} were killed")
    assert final.pushes_dropped <= len(killed)
    assert final.contributions_applied >= final.version
    if not EXEC:  # (a cold start takes seconds: replacements miss many rounds)
        assert final.contributions_applied >= (WORKERS - 1) * final.version, (
            f"shard {shard}: {final.contributions_applied / final.version:.2f} contributors per round on average")
    assert final.lease_expiries == len(killed), (
        f"shard {shard}: {final.lease_expiries} lease expiries for {len(killed)} SIGKILLs")
    joins = len(workers)  # every process joined (checked by check_workers)
    leaves = sum(1 for w in workers if not w.killed)
    assert joins + leaves + min(1, len(killed)) <= final.membership_epoch <= joins + leaves + len(killed), (
        f"shard {shard}: membership epoch {final.membership_epoch} for {joins} joins, {leaves} leaves and "
        f"{len(killed)} expiries")
    return {"max_gap": max(gaps), "long_gaps": sum(g > LEASE / 2 for g in gaps), "max_poll": max(polls),
            "polls": len(samples), "rounds_checked": len(checked_rounds), "reported": total,
            "accepted": final.pushes_accepted, "applied": final.contributions_applied,
            "dropped": final.pushes_dropped, "expiries": final.lease_expiries, "epoch": final.membership_epoch,
            "version": final.version, "per_round": final.contributions_applied / final.version}


# ---------------------------------------------------------------- the test
def test_churn_soak(start_cluster, tmp_path) -> None:
    began = time.monotonic()
    cluster = start_cluster(NUM_SHARDS, min_workers=WORKERS, extra_args=("--lease-seconds", str(LEASE)))
    launcher = Launcher(cluster.servers, tmp_path)
    monitor = Monitor(cluster.addresses, limit=SECONDS + 200)
    try:
        try:
            monitor.start()
            figures = churn(launcher, monitor, random.Random(SEED))
            # every worker is done or killed; the killed ones' leases run out, then nothing is left on the shards
            try:
                wait_until(lambda: all(not s.members and not s.pushed for s in shard_stats(cluster.addresses)),
                           MAX_WAIT + 10, "every lease to run out")
            except AssertionError as exc:
                raise AssertionError(f"{exc}:\n{monitor.describe()}") from None
            time.sleep(3 * POLL)
        finally:
            monitor.stop()
            launcher.kill_all()
        final = shard_stats(cluster.addresses)
        workers = launcher.workers
        assert not monitor.errors, f"Stats failed: {monitor.errors[:3]}"
        versions = [s.version for s in final]  # a worker that joined between two shards' applies is ahead on some
        assert ROUNDS <= min(versions) and max(versions) - min(versions) <= 1, f"the shards ended at {versions}"
        longest_step = check_workers(workers, versions)
        shards = [check_shard(i, monitor.samples[i], workers, final[i]) for i in range(NUM_SHARDS)]
    except AssertionError as exc:
        logs = "\n".join(f"--- shard {i} log (end):\n{cluster.log_tail(i, 25)}" for i in range(NUM_SHARDS))
        raise AssertionError(f"{exc}\n{logs}") from None

    summary = {
        "seconds": round(time.monotonic() - began, 1),
        "to_first_round": round(figures["t_first_round"] - began, 1),
        "training_seconds": round(figures["t_target"] - figures["t_first_round"], 1),
        "processes": len(workers), **{k: v for k, v in figures.items() if not k.startswith("t_")},
        "longest_step_gap": round(longest_step, 2),
        "shards": [{k: round(v, 2) if isinstance(v, float) else v for k, v in s.items()} for s in shards],
    }
    print(f"soak: {summary}")
    kills = figures["kills"]
    assert kills >= max(1, (ROUNDS - KILL_MARGIN) // KILL_EVERY - 2), f"only {kills} kills: {summary}"
    assert figures["restarts"] >= 1 and figures["new_ids"] >= 1 and figures["leaves"] >= 1, summary
    for i, s in enumerate(shards):
        assert s["max_gap"] < MAX_WAIT, f"shard {i}: a round waited {s['max_gap']:.1f}s: {summary}"
        assert s["max_gap"] >= LEASE / 2, f"shard {i}: no round waited for a killed worker: {summary}"
        assert s["rounds_checked"] >= ROUNDS // 4, summary
    assert longest_step < MAX_WAIT, f"a worker waited {longest_step:.1f}s for a step: {summary}"

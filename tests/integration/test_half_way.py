"""The rule for a round whose member dies half-way, checked with a real process killed with SIGKILL.

Rule (README, "Failures and elasticity"): each shard decides alone. On a
shard, a member's push counts in round ``r`` if the shard accepted all of it
(its trailer included) and the member was still a member when the round
closed; a round closes once every member has pushed. So a member that
pushed to shard 0 and died before pushing to shard 1 (and before pulling):

- shard 0 had its push: the round closes as soon as the survivors push, and
  averages all three gradients (its push counts although it never pulls);
- shard 1 never had it: the round waits until the dead member's lease runs
  out, drops it, and averages the survivors' two gradients.

The survivors see one completed round on every shard (version 1 everywhere),
within lease + 5 s, whose update averaged different sets of workers on the
two shards. Exact oracle with SGD, lr 1: shard 0's part moves by the mean of
(1, 2, 6), shard 1's part by the mean of (1, 2).
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time

import torch
from torch import nn

from shardps.worker.session.client import ShardClient
from shardps.worker.export import from_servers
from tests.support.procs import shard_stats, start_module
from tests.support.raw import RawWorker, plan_and_spec

LEASE = 3.0


def job():
    """The model, its 2-shard plan and the optimizer spec (SGD, lr 1) every party of the test uses."""
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    plan, spec = plan_and_spec(model, torch.optim.SGD(model.parameters(), lr=1.0), num_shards=2, chunk_bytes=128)
    return model, plan, spec


def heartbeats(workers: list[RawWorker], stop: threading.Event) -> None:
    """Keep the survivors' leases (as the worker library's heartbeat thread does) until ``stop``."""
    while not stop.wait(LEASE / 6):
        for w in workers:
            w.client.heartbeat(w.worker_id, w.session, timeout=LEASE)


def test_a_member_dying_half_way_counts_on_the_shards_that_had_its_push(start_cluster) -> None:
    model, plan, spec = job()
    assert plan.shard_chunks(0) and plan.shard_chunks(1)
    cluster = start_cluster(2, min_workers=2, extra_args=("--lease-seconds", str(LEASE)))
    clients = [ShardClient(a, index=i) for i, a in enumerate(cluster.addresses)]
    dying = None
    stop = threading.Event()
    try:
        survivors = []
        for wid in ("w0", "w1"):
            ws = [RawWorker(c, wid, plan, spec) for c in clients]
            ws[1].session = ws[0].session
            view = ws[0].join().job
            ws[1].join(job=view)
            survivors.append(ws)
        for shard, w in enumerate(survivors[0]):  # w0 was named initialiser
            w.init(shard, dict(model.named_parameters()))
        beating = threading.Thread(target=heartbeats, args=([w for ws in survivors for w in ws], stop), daemon=True)
        beating.start()
        dying = start_module("tests.support.half_push_proc", "--servers", cluster.servers, "--worker-id", "w2", "--fill", "6",
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert dying.stdout.readline().strip() == "pushed", dying.stderr.read()[-2000:]
        assert [list(s.pushed) for s in shard_stats(cluster.addresses)] == [["w2"], []]
        dying.send_signal(signal.SIGKILL)
        dying.wait(timeout=10)
        killed = time.monotonic()

        errors: list[BaseException] = []

        def step(ws: list[RawWorker], fill: float) -> None:
            try:
                for shard, w in enumerate(ws):
                    w.push(shard, fill=fill, lrs=[1.0])
                for w in ws:
                    w.pull(min_version=1)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=step, args=(ws, fill)) for ws, fill in zip(survivors, (1.0, 2.0))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=LEASE + 30)
        waited = time.monotonic() - killed
        assert not errors, errors
        assert LEASE - 1 < waited < LEASE + 5, f"the survivors' round took {waited:.1f}s"  # shard 1 waited for w2
    finally:
        stop.set()
        if dying is not None and dying.poll() is None:
            dying.kill()
            dying.wait()
        for c in clients:
            c.close()

    s0, s1 = shard_stats(cluster.addresses)
    assert (s0.version, s1.version) == (1, 1)
    assert (s0.last_round_contributors, s1.last_round_contributors) == (3, 2)
    assert s1.lease_expiries == 1 and s1.pushes_dropped == 0  # shard 1 never had w2's push
    state = from_servers(cluster.servers).state_dict
    initial = dict(model.named_parameters())
    for shard, moved in ((0, (1 + 2 + 6) / 3), (1, (1 + 2) / 2)):
        for c in plan.shard_chunks(shard):
            got = state[c.key].reshape(-1)[c.offset : c.offset + c.numel]
            want = initial[c.key].detach().reshape(-1)[c.offset : c.offset + c.numel] - moved
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)

"""A member that dies half-way through a round: ``python -m tests.support.half_push_proc --servers A,B --worker-id w2``.

Joins every shard, pushes round 0 (every element ``--fill``, lr 1) to shard 0
only, prints ``pushed`` and keeps its leases until it is killed: it never pushes to the
other shards and never pulls. The model, plan and optimizer are
:func:`tests.integration.test_half_way.job`'s.
"""

from __future__ import annotations

import argparse
import sys
import time

from shardps.worker.session.client import ShardClient
from tests.integration.test_half_way import job
from tests.support.raw import RawWorker


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--servers", required=True)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--fill", type=float, required=True)
    a = p.parse_args()
    _, plan, spec = job()
    clients = [ShardClient(s, index=i) for i, s in enumerate(a.servers.split(","))]
    workers = [RawWorker(c, a.worker_id, plan, spec) for c in clients]
    for w in workers[1:]:
        w.session = workers[0].session  # one process, one session
    view = workers[0].join().job
    for w in workers[1:]:
        w.join(job=view)
    workers[0].push(0, fill=a.fill, lrs=[1.0])
    print("pushed", flush=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:  # a live member (its lease renewed) until the test kills it
        for w in workers:
            w.client.heartbeat(w.worker_id, w.session, timeout=5.0)
        time.sleep(0.3)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A shard SIGKILLed and restarted on the same port with its checkpoint directory: workers carry on by themselves.

Two real worker processes train (the same batch every step, so the loss
must fall) on two real shards that checkpoint every 5 rounds. Shard 1 is
killed twice:

1. with both workers stopped (SIGSTOP) right after ``shardps checkpoint``'s
   RPC: the restarted shard holds that checkpoint's version, parameters and
   optimizer state bit for bit (the Stats digest), and waits for both
   checkpointed members to come back;
2. while they train: the rounds shard 1 applied after its newest checkpoint
   are lost, and the workers' per-shard versions follow shard 1 back.

Neither worker is restarted; both finish every step and the loss falls.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest

from shardps.worker.export import from_servers
from tests.support.procs import shard_stats, start_worker, wait_until

STEPS = 70


class Lines:
    """Collect a process's stdout lines from a thread (reads never block the test)."""

    def __init__(self, proc) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc) -> None:
        for line in proc.stdout:
            self.lines.append(line.strip())

    def join(self, timeout: float = 10.0) -> None:
        """Wait until every line is read (after the process exited)."""
        self._thread.join(timeout)

    def steps(self) -> list[dict]:
        out = []
        for line in list(self.lines):
            if line.startswith("step "):
                fields = dict(f.split("=") for f in line.split()[2:])
                out.append({"step": int(line.split()[1]), "loss": float(fields["loss"]),
                            "versions": [int(v) for v in fields["versions"].split(",")]})
        return out

    def wait_step(self, step: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.steps() and self.steps()[-1]["step"] >= step:
                return
            time.sleep(0.05)
        raise AssertionError(f"no step {step} within {timeout}s: {self.lines[-5:]}")


def test_a_restarted_shard_is_rejoined_without_restarting_workers(start_cluster, tmp_path: Path) -> None:
    args = ("--checkpoint-dir", str(tmp_path), "--checkpoint-every-rounds", "5", "--lease-seconds", "10")
    cluster = start_cluster(2, min_workers=2, extra_args=args)
    procs = [start_worker(cluster.servers, f"w{i}", "--steps", str(STEPS), "--workers", "2", "--index", str(i),
                          "--fixed-data", "--sleep", "0.05") for i in range(2)]
    out = [Lines(p) for p in procs]
    try:
        # 1. Workers stopped, an on-demand checkpoint, then SIGKILL: the restore is bit for bit.
        out[0].wait_step(12)
        for p in procs:
            p.send_signal(signal.SIGSTOP)
        time.sleep(0.5)  # a round whose pushes were all in is applied meanwhile
        from shardps.worker.session.client import ShardClient

        client = ShardClient(cluster.addresses[1], index=1)
        try:
            written = client.checkpoint()
            before = client.stats(digest=True)
        finally:
            client.close()
        assert written.version == before.version > 0 and before.checkpoint_version == written.version
        cluster.restart(1, same_port=True)
        after = shard_stats(cluster.addresses, digest=True)[1]
        assert after.incarnation != before.incarnation
        assert after.version == after.restored_version == before.version
        assert after.digest == before.digest, "the restored parameters and optimizer state differ"
        assert list(after.rejoining) == ["w0", "w1"] and list(after.members) == []
        for p in procs:
            p.send_signal(signal.SIGCONT)

        # 2. SIGKILL while training: the rounds after shard 1's newest checkpoint are lost.
        out[0].wait_step(35)
        seen = shard_stats(cluster.addresses)[1]
        cluster.restart(1, same_port=True)
        restored = shard_stats(cluster.addresses)[1]
        assert seen.checkpoint_version <= restored.restored_version  # no older than what was on disk before it

        for p, lines in zip(procs, out):
            assert p.wait(timeout=180) == 0, p.stderr.read()[-3000:]
            lines.join()
        logs = [p.stderr.read() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()
    for lines, log in zip(out, logs):
        steps = lines.steps()
        assert [s["step"] for s in steps] == list(range(STEPS)), "every step completed, none repeated"
        assert "rejoined shard 1" in log and "the shard restarted" in log, log[-3000:]
        assert steps[-1]["loss"] < steps[0]["loss"] / 4, (steps[0]["loss"], steps[-1]["loss"])
        # per-shard versions: shard 0 counted every round; on shard 1 the round in flight at each kill did not
        # count, and the second kill took it back to its newest checkpoint: the worker followed it
        versions = [s["versions"] for s in steps]
        assert all(b[0] == a[0] + 1 for a, b in zip(versions, versions[1:]))
        irregular = [(a[1], b[1]) for a, b in zip(versions, versions[1:]) if b[1] != a[1] + 1]
        assert len(irregular) == 2, irregular  # one step per restart did not count on shard 1
        assert irregular[1][1] <= irregular[1][0], "shard 1's version did not go back to its checkpoint"
        # and no newer than the shard was at the kill: the workers' last version there, or the round in flight
        # (not a Stats read before the kill: the workers kept training between that read and the kill)
        assert restored.restored_version <= irregular[1][0] + 1, (restored.restored_version, irregular)
    final = shard_stats(cluster.addresses)
    assert [s.version for s in final] == out[0].steps()[-1]["versions"] == out[1].steps()[-1]["versions"]
    # the shards now differ by the rounds shard 1 lost: an export says so instead of mixing them
    with pytest.raises(RuntimeError, match=rf"versions \[{final[0].version}, {final[1].version}\].*allow-mixed"):
        from_servers(cluster.servers, wait_seconds=1.0)
    mixed = from_servers(cluster.servers, allow_mixed_versions=True)
    assert mixed.versions == [s.version for s in final]
    assert [list(s.members) for s in final] == [[], []]  # both left at the end


def test_calls_retry_with_backoff_while_a_shard_restarts_then_give_up_naming_it(start_cluster) -> None:
    import grpc

    from shardps.worker.session.client import ShardClient, ShardRpcError
    from shardps.worker.session.retry import RetryPolicy

    cluster = start_cluster(1)
    before = shard_stats(cluster.addresses)[0].incarnation
    client = ShardClient(cluster.addresses[0], index=0, rpc_timeout=5.0, retry=RetryPolicy(total_seconds=30.0))
    try:
        result: list = []
        cluster.processes[0].kill()
        cluster.processes[0].wait()
        call = threading.Thread(target=lambda: result.append(client.stats()))
        call.start()  # retried while the shard is down...
        time.sleep(1.0)
        cluster.restart(0, same_port=True)  # ...and answered by the new process
        call.join(timeout=30)
        assert result and result[0].incarnation != before

        cluster.processes[0].kill()
        cluster.processes[0].wait()
        client.retry = RetryPolicy(total_seconds=2.0)
        started = time.monotonic()
        with pytest.raises(ShardRpcError, match=r"shard 0 \(127\.0\.0\.1:\d+\): stats failed: UNAVAILABLE") as err:
            client.stats()
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert 1.0 < time.monotonic() - started < 6.0  # the bounded total time, not one attempt and not forever
    finally:
        client.close()


def test_a_shard_that_comes_back_empty_is_refused_loudly(start_cluster) -> None:
    """Shard 1 restarted without a checkpoint directory: the worker's rejoin is refused naming the fix, and the
    empty shard is left as it was (it never adopts half of a trained job)."""
    cluster = start_cluster(2)
    proc = start_worker(cluster.servers, "w0", "--steps", "200", "--sleep", "0.05", "--retry-seconds", "20")
    out = Lines(proc)
    try:
        out.wait_step(5)
        cluster.restart(1, same_port=True)
        assert proc.wait(timeout=60) == 3  # ShardRpcError
        out.join()
        error = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "holds no state" in error and "lost its partition" in error and "--checkpoint-dir" in error, error
    assert out.steps()[-1]["step"] < 199  # it stopped instead of training on half a model
    s0, s1 = shard_stats(cluster.addresses)
    assert s0.version > 5 and s1.plan_fingerprint == "" and not s1.initialised and list(s1.members) == []


def test_a_shard_down_past_the_retry_budget_fails_steps_until_it_is_back(start_cluster, tmp_path: Path) -> None:
    """One worker, shard 1 SIGKILLed and left down past the worker's 1.5 s retry budget, then restarted.

    Each step while it is down raises ShardRpcError (UNAVAILABLE: the rejoin
    at the end of the step gave up), and shard 0's part of each round counts,
    as after any shard failure: the worker's per-shard versions follow both
    shards, and the job is not marked diverged. Once shard 1 is back from
    its checkpoint (version 3), the next step's push to it finds a new
    process, the worker rejoins it within that step and the step succeeds;
    every later step counts on both shards, and the model equals the
    shards'. (Before, the versions of the failed step were dropped and every
    later step failed on shard 0.)
    """
    import grpc
    import torch

    from shardps.worker import DistributedOptimizer, WireOptions
    from shardps.worker.session.client import ShardRpcError

    args = ("--checkpoint-dir", str(tmp_path), "--checkpoint-every-rounds", "1")
    cluster = start_cluster(2, min_workers=1, extra_args=args)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))

    def step() -> float:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model.named_parameters(),
                               servers=cluster.servers, worker_id="w0",
                               wire=WireOptions(chunk_bytes=1024, retry_seconds=1.5, rpc_timeout=10.0))
    try:
        assert min(opt.plan.shard_bytes()) > 0  # both shards hold parameters
        first = [step() for _ in range(3)]
        assert opt.versions == [3, 3]
        wait_until(lambda: shard_stats(cluster.addresses)[1].checkpoint_version == 3, 30, "shard 1's checkpoint")
        cluster.processes[1].kill()
        cluster.processes[1].wait()
        for k in range(2):
            with pytest.raises(ShardRpcError, match="shard 1") as err:
                step()
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
            assert opt.versions == [4 + k, 3] == [shard_stats(cluster.addresses[:1])[0].version, 3]
        cluster.restart(1, same_port=True)
        assert shard_stats(cluster.addresses)[1].restored_version == 3
        last = [step() for _ in range(3)]
        assert opt.versions == [s.version for s in shard_stats(cluster.addresses)] == [8, 5]
        assert last[-1] < first[0]
        held = from_servers(cluster.servers, allow_mixed_versions=True).state_dict
        for key, value in model.state_dict().items():
            assert torch.equal(value, held[key]), f"{key}: the worker's model differs from the shards'"
    finally:
        opt.close()

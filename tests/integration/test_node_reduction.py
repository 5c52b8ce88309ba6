"""Reduction within a node first: 2 nodes x 2 local ranks equal single-process training (sync mode).

Each node's two local ranks average their gradients with torch.distributed
(Gloo on CPU, NCCL on CUDA) and push as one contributor: by chunk ownership
(the default; each local rank pushes and pulls the shard it owns, checked
from the bytes each rank pushed) and by the leader alone (``split=False``).
The shards average the two nodes. With equal quarter batches that is the
mean gradient of the whole batch, so after 20 steps every rank's parameters
must equal one process training on the whole batch within 1e-5, with AdamW
and with SGD (Nesterov momentum), both with two param groups and an LR
scheduler; the leader's ``state_dict()`` equals the single process's
optimizer state. Failures: a leader that cannot join, a shard SIGKILLed
under a split node, a shard restarted from its checkpoint under a split node
(rejoined inside the step that found it: no step fails, both ranks equal the
shards' model), rounds refused by every shard or by one shard only (the job
diverged: every later step raises on every rank), split with clipping.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from shardps.worker.session.client import ShardClient
from tests.support import node_proc
from tests.integration.test_sync_oracle import STEPS, make_model, train_single_with_optimizer

#: The local ranks are forked from the preloaded forkserver of ``tests.support.forked`` (conftest imports it): real
#: processes and real Gloo groups, without torch's ~3 s import in each.
START = "forkserver"
NAMES = ("adamw", "sgd_nesterov", "adamw:leader")  # ":leader": split=False, the leader pushes every shard


def run_nodes(start_cluster, tmp_path: Path, device: str, local_ranks: int = 2, stream_processes: bool = False) -> None:
    """2 nodes x ``local_ranks`` local ranks on ``device`` for every optimizer of :data:`NAMES`: the oracle
    (``stream_processes``: every rank's shard streams through helper processes)."""
    processes = 2 * local_ranks
    clusters = {name: start_cluster(2, min_workers=2) for name in NAMES}
    mp.start_processes(node_proc.run, args=({n: c.servers for n, c in clusters.items()}, str(tmp_path), device,
                                            local_ranks, stream_processes),
                       nprocs=processes, join=True, start_method=START)
    initial = make_model()
    for name, cluster in clusters.items():
        expected, reference = train_single_with_optimizer(name.split(":")[0])
        want_state = reference.state_dict()["state"]
        for leader in range(0, processes, local_ranks):  # the node's optimizer state, read from the shards
            state = torch.load(tmp_path / f"{name}-{leader}.state.pt")["state"]
            assert state.keys() == want_state.keys(), (name, state.keys())
            for index, entries in want_state.items():
                assert entries.keys() == state[index].keys(), (name, index)
                for entry, want in entries.items():
                    assert torch.allclose(state[index][entry], want, rtol=1e-4, atol=1e-6), (name, index, entry)
        for i in range(processes):
            got = torch.load(tmp_path / f"{name}-{i}.pt")
            for (key, want), init in zip(expected.named_parameters(), initial.parameters()):
                assert (want - init).abs().max() > 1e-3, "training did not move the parameters"
                diff = (want - got[key]).abs().max().item()
                assert diff < 1e-5, f"{name}, process {i}, {key}: max |single - node-reduced| = {diff}"
        for shard, address in enumerate(cluster.addresses):
            client = ShardClient(address, index=shard)
            stats = client.stats()
            client.close()
            # one contributor per node: 2 pushes per round, never one per process
            assert stats.version == STEPS and stats.contributions_applied == 2 * STEPS
            assert stats.last_round_contributors == 2 and list(stats.members) == []
        # by chunk ownership each local rank pushes only its own shards (shard s: local rank s % local_ranks)
        for i in range(processes):
            pushed = json.loads((tmp_path / f"{name}-{i}.pushed.json").read_text())
            if name.endswith(":leader"):
                assert pushed == {}, pushed
            else:
                own = [str(s) for s in range(2) if s % local_ranks == i % local_ranks]
                assert list(pushed) == own and all(pushed[s] > 0 for s in own), (name, i, pushed)


def test_two_nodes_of_two_local_ranks_match_single_process_gloo(start_cluster, tmp_path: Path) -> None:
    run_nodes(start_cluster, tmp_path, "cpu")


def test_two_nodes_with_stream_processes_match_single_process_gloo(start_cluster, tmp_path: Path) -> None:
    """The same oracle with every rank's PushPull streams through its helper processes (the leader's and,
    split by chunk ownership, each local rank's)."""
    run_nodes(start_cluster, tmp_path, "cpu", stream_processes=True)


def test_two_nodes_of_one_local_rank_match_single_process_gloo(start_cluster, tmp_path: Path) -> None:
    """The CPU twin of the one-GPU test below: a node of one local rank owns every shard."""
    run_nodes(start_cluster, tmp_path, "cpu", local_ranks=1)


@pytest.mark.gpu
def test_two_nodes_of_two_local_ranks_match_single_process_nccl(start_cluster, tmp_path: Path) -> None:
    """The same oracle on CUDA tensors with NCCL (each node's two ranks on GPUs 0 and 1)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs a GPU per local rank: this machine has fewer than 2 GPUs (the one-rank test runs)")
    run_nodes(start_cluster, tmp_path, "cuda")


@pytest.mark.gpu
def test_two_nodes_of_one_local_rank_match_single_process_nccl(start_cluster, tmp_path: Path) -> None:
    """The oracle on CUDA tensors with NCCL on a single GPU: each node is one rank on GPU 0 (NCCL allows one rank
    per GPU in a communicator, and each node has its own). It covers the CUDA tensors, their copies to and from the
    wire and the NCCL calls of a step, but with groups of one the collectives move nothing between processes: the
    2x2 test above (2 GPUs) covers that."""
    run_nodes(start_cluster, tmp_path, "cuda", local_ranks=1)


def test_a_leader_that_cannot_join_fails_every_local_rank(tmp_path: Path) -> None:
    """The leader's failure is broadcast: the other rank raises too instead of waiting in a collective."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    mp.start_processes(node_proc.leader_fails, args=(dead, str(tmp_path)), nprocs=2, join=True, start_method=START)
    leader = (tmp_path / "failing-0.txt").read_text()
    other = (tmp_path / "failing-1.txt").read_text()
    assert leader.startswith(("ConnectionError", "ShardRpcError")) and dead in leader, leader
    assert other.startswith("RuntimeError: the node leader (local rank 0) failed"), other


def test_a_shard_killed_under_a_split_node_fails_every_local_rank(start_cluster, tmp_path: Path) -> None:
    """SIGKILL the shard owned by local rank 1: the next step raises on both ranks (naming rank and shard), and so
    does the one after (the leader tries to rejoin the dead shard in each, within its 2 s retry budget); nobody
    waits forever."""
    cluster = start_cluster(2, min_workers=1)
    pid = cluster.processes[1].pid
    mp.start_processes(node_proc.shard_dies, args=(cluster.servers, pid, str(tmp_path)), nprocs=2, join=True,
                       start_method=START)
    leader = (tmp_path / "dies-0.txt").read_text().splitlines()
    other = (tmp_path / "dies-1.txt").read_text().splitlines()
    assert leader[:2] == ["ok", "ok"] and other[:2] == ["ok", "ok"], (leader, other)
    assert other[2].startswith("ShardRpcError: shard 1") and "UNAVAILABLE" in other[2], other
    assert leader[2].startswith("RuntimeError: the node's round failed on local rank 1, shard 1"), leader
    assert "UNAVAILABLE" in leader[2], leader
    assert leader[3].startswith("ShardRpcError: shard 1") and other[3].startswith(
        "RuntimeError: the node leader (local rank 0) failed: ShardRpcError: shard 1"), (leader, other)


def test_split_refuses_clipping(tmp_path: Path) -> None:
    """max_grad_norm needs every shard's report before any applies the round: split=True with it is refused."""
    mp.start_processes(node_proc.split_with_clipping, args=(str(tmp_path),), nprocs=1, join=True,
                       start_method=START)
    outcome = (tmp_path / "clip.txt").read_text()
    assert outcome.startswith("ValueError: split=True cannot clip"), outcome


def test_a_shard_restarted_from_its_checkpoint_under_a_split_node_is_rejoined_within_the_step(
        start_cluster, tmp_path: Path) -> None:
    """Shard 1 (owned by local rank 1) is SIGKILLed between steps and restarted on its port from its checkpoint.

    Shard 1 checkpoints every 3 rounds and is killed at version 4, so it comes
    back at version 3, behind the model every rank holds. The shards' lease
    is 300 s, so the leader's heartbeat (every 100 s) does not see the new
    process first: the next round's push to shard 1 fails on local rank 1,
    and the leader rejoins the shard inside that same step, pulls its
    restored partition and broadcasts the model, as a
    ``DistributedOptimizer`` recovers inside its step. Checked: no step
    raises on either rank; right after that step both ranks hold bit for bit
    the model the shards hold (shard 1's range at version 3: the leader's
    pull and its broadcast both happened); the round of that step counted on
    shard 0 only (final versions [10, 8]); both ranks end bit for bit equal
    to each other and to the shards' model; the loss falls.
    """
    from shardps.worker.export import from_servers
    from tests.support.procs import shard_stats, wait_until

    def same_model(params: list[dict], when: str) -> None:
        held = from_servers(cluster.servers, allow_mixed_versions=True).state_dict
        for key, value in params[0].items():
            assert torch.equal(value, params[1][key]), f"{when}, {key}: the local ranks differ"
            assert torch.equal(value, held[key]), f"{when}, {key}: the node's model differs from the shards'"

    every = node_proc.RESTART_CHECKPOINT_EVERY
    cluster = start_cluster(2, extra_args=("--checkpoint-dir", str(tmp_path / "ckpt"),
                                           "--checkpoint-every-rounds", str(every), "--lease-seconds", "300"))
    context = mp.start_processes(node_proc.shard_restarts, args=(cluster.servers, str(tmp_path)), nprocs=2,
                                 join=False, start_method=START)
    checkpointed = node_proc.RESTART_AT // every * every
    try:
        wait_until(lambda: (tmp_path / "restart-now").exists(), 120, "the node to reach the restart step")
        wait_until(lambda: (lambda s: (s.checkpoint_version, s.version) == (checkpointed, node_proc.RESTART_AT))(
            shard_stats(cluster.addresses)[1]), 30, f"shard 1's checkpoint of round {checkpointed}")
        cluster.restart(1, same_port=True)
        restored = shard_stats(cluster.addresses)[1]
        (tmp_path / "restarted").touch()
        wait_until(lambda: (tmp_path / "stepped").exists(), 60, "the step after the restart")
        same_model([torch.load(tmp_path / f"restart-at-{i}.pt") for i in range(2)], "after the restart's step")
        (tmp_path / "checked").touch()
        deadline = time.monotonic() + 180
        while not context.join(timeout=1):
            assert time.monotonic() < deadline, "the node did not finish within 180 s"
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
    assert restored.restored_version == checkpointed < node_proc.RESTART_AT
    assert list(restored.rejoining) == ["node0"]
    runs = [json.loads((tmp_path / f"restart-{i}.json").read_text()) for i in range(2)]
    for r in runs:
        assert r["outcomes"] == ["ok"] * node_proc.RESTART_STEPS, r["outcomes"]
        assert r["losses"][-1] < r["losses"][0] / 2, r["losses"]
    final = shard_stats(cluster.addresses)
    # the round of step RESTART_AT is not sent again to the restarted shard (as DistributedOptimizer does)
    after = node_proc.RESTART_STEPS - node_proc.RESTART_AT - 1
    assert [s.version for s in final] == runs[0]["versions"] == [node_proc.RESTART_STEPS, checkpointed + after]
    same_model([torch.load(tmp_path / f"restart-{i}.pt") for i in range(2)], "at the end")


def test_refused_rounds_under_a_split_node_and_a_round_applied_by_one_shard_only(start_cluster, tmp_path: Path
                                                                                ) -> None:
    """The node's rule for refused rounds is DistributedOptimizer's (test_round_checks): a round every shard
    refused changes nothing and training goes on; a round that shard 1 refused but shard 0 applied raises on
    both ranks, and every later step raises on both ranks naming the divergence. Both ranks hold the same
    parameters after every step, and nobody waits for the other."""
    cluster = start_cluster(2, min_workers=1)
    mp.start_processes(node_proc.refused_rounds, args=(cluster.servers, str(tmp_path)), nprocs=2, join=True,
                       start_method=START)
    leader, other = (json.loads((tmp_path / f"refused-{i}.json").read_text()) for i in (0, 1))
    assert len(leader) == len(other) == 4, (leader, other)
    for mine, theirs in zip(leader, other):
        assert (mine["a"], mine["b"]) == (theirs["a"], theirs["b"]), (mine, theirs)
    # 1. both shards refused round 0: each rank raises the error of the shard it pushed to; nothing changed
    assert leader[0]["outcome"].startswith("ShardRpcError: shard 0") and "round 0 was refused" in leader[0]["outcome"]
    assert other[0]["outcome"].startswith("ShardRpcError: shard 1") and "round 0 was refused" in other[0]["outcome"]
    assert leader[0]["versions"] == [0, 0] and leader[0]["a"] == [1.0] * 8 and leader[0]["b"] == [1.0] * 8
    # 2. a good round is applied by both
    assert leader[1]["outcome"] == other[1]["outcome"] == "ok"
    assert leader[1]["versions"] == [1, 1]
    assert leader[1]["a"] == pytest.approx([1.1] * 8) and leader[1]["b"] == pytest.approx([1.1] * 8)
    # 3. shard 1 refused round 1, shard 0 applied it: both ranks raise, the leader naming local rank 1's failure
    assert other[2]["outcome"].startswith("ShardRpcError: shard 1") and "round 1 was refused" in other[2]["outcome"]
    assert leader[2]["outcome"].startswith("RuntimeError: the node's round failed on local rank 1, shard 1"), leader
    assert leader[2]["versions"] == [2, 1] and leader[2]["b"] == leader[1]["b"]
    # 4. the job diverged: every later step raises on both ranks, and no shard takes the round
    diverged = "shard(s) [0] applied round 1 but shard 1 failed it"
    assert leader[3]["outcome"].startswith("RuntimeError: " + diverged), leader[3]
    assert other[3]["outcome"].startswith("RuntimeError: the node leader (local rank 0) failed: RuntimeError: "
                                          + diverged), other[3]
    assert leader[3]["versions"] == [2, 1] and (leader[3]["a"], leader[3]["b"]) == (leader[2]["a"], leader[2]["b"])
    for shard, address in enumerate(cluster.addresses):
        client = ShardClient(address, index=shard)
        assert client.stats().version == [2, 1][shard]
        client.close()


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_nodes_train_in_async_and_ssp_modes(start_cluster, tmp_path: Path, mode: str) -> None:
    """2 nodes x 2 local ranks (chunk ownership) in async and in ssp (s=1): each node's push is applied on arrival
    as one contributor, so the shards count one version per push of a node (2 x STEPS), both ranks of a node hold
    the same parameters after every step, no step fails, the loss falls, and no rank's LR scheduler warns that
    the optimizer never stepped."""
    cluster = start_cluster(2, min_workers=1)
    mp.start_processes(node_proc.async_nodes, args=(cluster.servers, str(tmp_path), mode), nprocs=4, join=True,
                       start_method=START)
    records = [json.loads((tmp_path / f"{mode}-{i}.json").read_text()) for i in range(4)]
    for i, record in enumerate(records):
        assert record["outcomes"] == ["ok"] * STEPS, (i, record["outcomes"])
        assert record["warnings"] == [], (i, record["warnings"])  # the LR scheduler's "before optimizer.step()"
        # the node's version after its last step counts at least its own STEPS pushes, at most both nodes'
        assert record["versions"] == sorted(record["versions"]) and STEPS <= record["versions"][-1] <= 2 * STEPS
    for node in (0, 1):  # the ranks of a node see the same versions (the node's, broadcast by its leader)
        assert records[2 * node]["versions"] == records[2 * node + 1]["versions"]
    first, last = (sum(sum(r["losses"][k]) for r in records) for k in (slice(0, 4), slice(-4, None)))
    assert last < 0.8 * first, (first, last)
    for shard, address in enumerate(cluster.addresses):
        client = ShardClient(address, index=shard)
        stats = client.stats()
        client.close()
        assert stats.mode.mode == mode and stats.version == stats.contributions_applied == 2 * STEPS, stats
        assert sum(stats.staleness_histogram) == 2 * STEPS and list(stats.members) == []


def test_reduce_scatter_averages_each_range_on_its_owner_in_rank_order(tmp_path: Path) -> None:
    """3 Gloo ranks: each owned range equals the rank-order sum / 3 bit for bit; ranges a rank does not own are untouched."""
    size = 3
    mp.start_processes(node_proc.reduce_scatter_ranks, args=(str(tmp_path), size), nprocs=size, join=True,
                       start_method=START)
    for case, segments in enumerate(node_proc.SCATTER_CASES):
        numel = max(a + n for runs in segments for a, n in runs)
        grads = [node_proc.scatter_grad(r, numel) for r in range(size)]
        total = grads[0].clone()
        for g in grads[1:]:
            total += g
        total /= size
        for rank in range(size):
            got = torch.load(tmp_path / f"scatter-{rank}-{case}.pt")
            want = grads[rank].clone()
            for s, runs in enumerate(segments):
                if s % size == rank:
                    for a, n in runs:
                        want[a : a + n] = total[a : a + n]
            assert torch.equal(got, want), (case, rank, (got - want).abs().max())


def test_reduce_scatter_raises_when_a_local_rank_is_killed(tmp_path: Path) -> None:
    """A local rank SIGKILLed before a reduce_scatter: the other rank raises (Gloo sees the closed connection)
    within seconds, it does not hang until the group's 60 s timeout."""
    context = mp.start_processes(node_proc.reduce_scatter_peer_dies, args=(str(tmp_path),), nprocs=2, join=False,
                                 start_method=START)
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "peer-dies.json").exists():
            assert time.monotonic() < deadline, "rank 0 neither raised nor finished within 90 s"
            time.sleep(0.2)
        for p in context.processes:
            p.join(timeout=30)
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
    assert context.processes[1].exitcode == -signal.SIGKILL
    result = json.loads((tmp_path / "peer-dies.json").read_text())
    assert result["error"], "rank 0's reduce_scatter returned although its peer was dead"
    assert result["seconds"] < 30, result

"""One local rank of a 2 nodes x L local ranks job for the node-reduction oracle (run with torch.multiprocessing).

Process ``i`` is local rank ``i % L`` of node ``i // L``; each node has its
own process group (Gloo on CPU, NCCL on CUDA: local rank ``r`` on GPU ``r``)
and joins the shards as one contributor ``node<n>``. Each rank trains on its
``1 / (2 L)`` of the global batch and saves its final parameters to ``<out>/<name>-<i>.pt`` and the bytes it
pushed to each shard in its last step to ``<out>/<name>-<i>.pushed.json``. A
name ``<optimizer>:leader`` runs the leader path (``split=False``).
"""

from __future__ import annotations

import json
import os
import signal
import warnings

import torch
import torch.distributed as dist
from torch import nn

from shardps.worker.config import ConsistencyOptions, WireOptions
from shardps.worker.node.optimizer import NodeOptimizer
from tests.integration.test_sync_oracle import BATCH, CHUNK_BYTES, STEPS, data, make_model, make_optimizer


def run(i: int, servers: dict[str, str], out: str, device: str, local_ranks: int = 2,
        stream_processes: bool = False) -> None:
    node, local = divmod(i, local_ranks)
    torch.set_num_threads(1)
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(local)
    dist.init_process_group(backend, init_method=f"file://{out}/node{node}.rendezvous", rank=local,
                            world_size=local_ranks)
    try:
        x, y = data()
        per = BATCH // (2 * local_ranks)
        part = slice(i * per, (i + 1) * per)
        for name, address in servers.items():
            model = make_model().to(device)
            opt, sched = make_optimizer(name.split(":")[0], model)
            with NodeOptimizer(opt, model.named_parameters(), servers=address, node_id=f"node{node}",
                               split=not name.endswith(":leader"),
                               wire=WireOptions(chunk_bytes=CHUNK_BYTES, rpc_timeout=60.0,
                                                stream_processes=stream_processes)) as node_opt:
                for step in range(STEPS):
                    node_opt.zero_grad()
                    xb, yb = x[step, part].to(device), y[step, part].to(device)
                    nn.functional.cross_entropy(model(xb), yb).backward()
                    node_opt.step()
                    sched.step()
                assert node_opt.version == STEPS, node_opt.version
                assert not opt.state, "the local optimizer must never allocate state"
                try:  # on every rank its own step would update this rank's replica behind the node's back
                    opt.step()
                    raise AssertionError("the wrapped optimizer's step() must refuse on every local rank")
                except RuntimeError as exc:
                    assert "wrapped by a NodeOptimizer" in str(exc), exc
                with open(f"{out}/{name}-{i}.pushed.json", "w") as f:
                    json.dump(node_opt.last_pushed_bytes, f)
                if local == 0:  # the leader times each phase of a split step; the leader path has none
                    registry = node_opt.metrics.registry
                    for phase in ("reduce_scatter", "push_pull", "all_gather"):
                        count = registry.get_sample_value("shardps_worker_node_phase_seconds_count", {"phase": phase})
                        total = registry.get_sample_value("shardps_worker_node_phase_seconds_sum", {"phase": phase})
                        split = not name.endswith(":leader")
                        assert count == (STEPS if split else 0) and (total > 0) == split, (name, phase, count, total)
                if local == 0:  # the node's optimizer state lives on the shards; its leader reads it
                    state = node_opt.state_dict()
                    torch.save(state, f"{out}/{name}-{i}.state.pt")
                else:
                    try:
                        node_opt.state_dict()
                        raise AssertionError("state_dict() on a non-leader rank must refuse")
                    except RuntimeError as exc:
                        assert "local rank 0" in str(exc), exc
                    state = opt.state_dict()
                # the usual resume call on every rank: the leader loads (its own state: accepted between rounds),
                # the other ranks do nothing
                node_opt.load_state_dict(state)
            opt.zero_grad()
            opt.step()  # closed: the optimizer is its own again (no gradients: it changes nothing)
            torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, f"{out}/{name}-{i}.pt")
    finally:
        dist.destroy_process_group()


def leader_fails(i: int, dead_server: str, out: str) -> None:
    """Local rank ``i`` of one node whose leader cannot reach the shards: every rank must raise, none wait."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/failing.rendezvous", rank=i, world_size=2)
    try:
        _construct(f"{out}/failing-{i}.txt", servers=dead_server,
                   wire=WireOptions(connect_timeout=1.0, retry_seconds=1.0))
    finally:
        dist.destroy_process_group()


def _construct(path: str, **kwargs) -> None:
    """Build a NodeOptimizer expected to fail; write ``"constructed"`` or ``"<error type>: <message>"`` to ``path``."""
    model = make_model()
    opt, _ = make_optimizer("adamw", model)
    try:
        NodeOptimizer(opt, model.named_parameters(), node_id="node0", **kwargs)
        outcome = "constructed"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    with open(path, "w") as f:
        f.write(outcome)


def _join_node(i: int, out: str, name: str) -> None:
    """Local rank ``i`` of a one-node, two-rank Gloo group (rendezvous ``<out>/<name>.rendezvous``)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/{name}.rendezvous", rank=i, world_size=2)


def _split_node(address: str, retry_seconds: float):
    """A split NodeOptimizer of the node's group on ``address``: ``(model, node_opt, x, y)``."""
    model = make_model()
    opt, _ = make_optimizer("adamw", model)
    x, y = data()
    node_opt = NodeOptimizer(opt, model.named_parameters(), servers=address, node_id="node0",
                             wire=WireOptions(chunk_bytes=CHUNK_BYTES, rpc_timeout=10.0, retry_seconds=retry_seconds))
    return model, node_opt, x, y


def _step(node_opt: NodeOptimizer) -> str:
    """One ``step()``: ``"ok"`` or ``"<error type>: <message>"`` (the loop carries on, as one that catches would)."""
    try:
        node_opt.step()
        return "ok"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def shard_dies(i: int, address: str, shard_pid: int, out: str) -> None:
    """Local rank ``i`` of one split node whose shard 1 (owned by local rank 1) is SIGKILLed after two steps.

    Writes ``<out>/dies-<i>.txt``: each outcome of the two steps after the kill
    (both must raise on every rank, none may wait for the other).
    """
    _join_node(i, out, "dies")
    outcomes = []
    try:
        model, node_opt, x, y = _split_node(address, retry_seconds=2.0)
        for step in range(4):
            if step == 2:
                dist.barrier()
                if i == 1:
                    os.kill(shard_pid, signal.SIGKILL)
                dist.barrier()
            node_opt.zero_grad()
            nn.functional.cross_entropy(model(x[step, i * 6:(i + 1) * 6]), y[step, i * 6:(i + 1) * 6]).backward()
            outcomes.append(_step(node_opt))
        node_opt.close()
    finally:
        with open(f"{out}/dies-{i}.txt", "w") as f:
            f.write("\n".join(outcomes))
        dist.destroy_process_group()


def split_with_clipping(i: int, out: str) -> None:
    """A one-rank node asked for split=True with max_grad_norm: refused before touching any shard."""
    dist.init_process_group("gloo", init_method=f"file://{out}/clip.rendezvous", rank=0, world_size=1)
    try:
        _construct(f"{out}/clip.txt", servers="127.0.0.1:1", split=True, max_grad_norm=1.0)
    finally:
        dist.destroy_process_group()


RESTART_STEPS = 10
RESTART_AT = 4
#: shard 1 checkpoints every 3 rounds: killed at version 4, it comes back at version 3
RESTART_CHECKPOINT_EVERY = 3


def _pause(i: int, out: str, tell: str, wait_for: str) -> None:
    """Every rank: the leader writes ``<out>/<tell>``, then all wait (60 s at most) for ``<out>/<wait_for>``."""
    import time

    dist.barrier()
    if i == 0:
        open(f"{out}/{tell}", "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(f"{out}/{wait_for}") and time.monotonic() < deadline:
        time.sleep(0.05)
    dist.barrier()


def shard_restarts(i: int, address: str, out: str) -> None:
    """Local rank ``i`` of one split node whose shard 1 is SIGKILLed and restarted from its checkpoint.

    Before step ``RESTART_AT`` the leader writes ``<out>/restart-now`` and every
    rank waits for ``<out>/restarted`` (the test restarts the shard meanwhile);
    after it, each rank writes its parameters to ``<out>/restart-at-<i>.pt``,
    the leader writes ``<out>/stepped`` and every rank waits for
    ``<out>/checked``. Training goes on with the same batch every step; a
    step that raises (none should: the leader rejoins the shard inside the
    step) is recorded and the loop carries on, as a training loop that
    catches the error would. Writes ``<out>/restart-<i>.json`` (each step's
    outcome and loss, the leader's per-shard versions) and
    ``<out>/restart-<i>.pt`` (the final parameters).
    """
    _join_node(i, out, "restart")
    outcomes, losses, versions = [], [], []
    try:
        model, node_opt, x, y = _split_node(address, retry_seconds=30.0)
        for step in range(RESTART_STEPS):
            if step == RESTART_AT:
                _pause(i, out, "restart-now", "restarted")
            node_opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x[0, i * 6:(i + 1) * 6]), y[0, i * 6:(i + 1) * 6])
            loss.backward()
            losses.append(loss.item())
            outcomes.append(_step(node_opt))
            if step == RESTART_AT:  # the test compares both ranks' model with the shards' now
                torch.save({k: v.detach().clone() for k, v in model.named_parameters()}, f"{out}/restart-at-{i}.pt")
                _pause(i, out, "stepped", "checked")
        versions = list(node_opt.inner.versions) if node_opt.inner is not None else []
        node_opt.close()
        torch.save({k: v.detach().clone() for k, v in model.named_parameters()}, f"{out}/restart-{i}.pt")
    finally:
        with open(f"{out}/restart-{i}.json", "w") as f:
            json.dump({"outcomes": outcomes, "losses": losses, "versions": versions}, f)
        dist.destroy_process_group()


def refused_rounds(i: int, address: str, out: str) -> None:
    """Local rank ``i`` of one split node whose rounds the shards refuse (an update that overflows fp32).

    The model has two keys, ``a`` on shard 0 (owned by local rank 0) and ``b``
    on shard 1 (local rank 1); SGD, and the lr set on every rank before each
    step. Four steps: both shards refuse; a good step; only shard 1 refuses
    while shard 0 applies (the partitions now differ in version); a good
    step, which must be refused by the node because the job diverged.
    Writes ``<out>/refused-<i>.json``: each step's outcome, the parameters
    after it, and the leader's per-shard versions after it.
    """
    from tests.integration.test_round_checks import TwoKeys

    _join_node(i, out, "refused")
    record: list[dict] = []
    try:
        model = TwoKeys()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        node_opt = NodeOptimizer(opt, model.named_parameters(), servers=address, node_id="node0",
                                 wire=WireOptions(chunk_bytes=64, rpc_timeout=10.0, retry_seconds=2.0))
        for lr, loss in [(1e38, lambda: -(model.a.sum() + model.b.sum()) * 1e30),  # both shards overflow
                         (0.1, lambda: -(model.a.sum() + model.b.sum())),
                         (1e38, lambda: -model.b.sum() * 1e30),  # only b (shard 1) overflows
                         (0.1, lambda: -(model.a.sum() + model.b.sum()))]:
            opt.param_groups[0]["lr"] = lr
            node_opt.zero_grad()
            loss().backward()
            outcome = _step(node_opt)
            record.append({"outcome": outcome, "a": model.a.tolist(), "b": model.b.tolist(),
                           "versions": list(node_opt.inner.versions) if node_opt.inner is not None else []})
        node_opt.close()
    finally:
        with open(f"{out}/refused-{i}.json", "w") as f:
            json.dump(record, f)
        dist.destroy_process_group()


def async_nodes(i: int, address: str, out: str, mode: str) -> None:
    """Local rank ``i % 2`` of node ``i // 2``, 2 nodes x 2 local ranks by chunk ownership, in ``mode`` (async or
    ssp with s=1): ``STEPS`` steps each on its quarter of the batch, the nodes never waiting for each other except
    at ssp's bound. After every step both ranks of a node must hold the same parameters (checked on every rank by
    an all-gather, and the step's error recorded otherwise). Writes ``<out>/<mode>-<i>.json``: each step's outcome
    and loss, the node's version after each step, and the LR scheduler's warnings (none expected)."""
    node, local = divmod(i, 2)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/{mode}-node{node}.rendezvous", rank=local,
                            world_size=2)
    outcomes, losses, versions, warned = [], [], [], ["did not finish"]
    try:
        x, y = data()
        per = BATCH // 4
        part = slice(i * per, (i + 1) * per)
        model = make_model()
        opt, sched = make_optimizer("adamw", model)
        with NodeOptimizer(opt, model.named_parameters(), servers=address, node_id=f"node{node}",
                           consistency=ConsistencyOptions(mode=mode, staleness=1 if mode == "ssp" else None),
                           wire=WireOptions(chunk_bytes=CHUNK_BYTES, rpc_timeout=60.0)) as node_opt:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                for step in range(STEPS):
                    node_opt.zero_grad()
                    loss = nn.functional.cross_entropy(model(x[step % 4, part]), y[step % 4, part])
                    loss.backward()
                    losses.append(loss.item())
                    outcome = _step(node_opt)
                    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
                    both = [torch.empty_like(flat) for _ in range(2)]
                    dist.all_gather(both, flat)
                    if outcome == "ok" and not torch.equal(both[0], both[1]):
                        outcome = "the local ranks hold different parameters"
                    outcomes.append(outcome)
                    versions.append(node_opt.version)
                    sched.step()  # no warning: the node's step() tells the scheduler a step happened
            warned = [str(w.message) for w in seen if "lr_scheduler" in str(w.message)]
    finally:
        with open(f"{out}/{mode}-{i}.json", "w") as f:
            json.dump({"outcomes": outcomes, "losses": losses, "versions": versions, "warnings": warned}, f)
        dist.destroy_process_group()


#: reduce_scatter test: 3 local ranks, 4 shards (rank 0 owns shards 0 and 3), shard 1 in two ranges, and
#: 2 shards (rank 2 owns nothing); numel 23 and 10.
SCATTER_CASES = ([[(0, 4)], [(4, 3), (15, 5)], [(7, 8)], [(20, 3)]], [[(0, 6)], [(6, 4)]])


def scatter_grad(rank: int, numel: int) -> torch.Tensor:
    """Local rank ``rank``'s vector for the reduce_scatter test (float32, shape ``(numel,)``, not exact sums)."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 + rank)) / 3


def reduce_scatter_ranks(rank: int, out: str, size: int) -> None:
    """Run ``shares.reduce_scatter`` twice per case (reusing the scratch), save the vectors to ``<out>/scatter-<rank>-<case>.pt``."""
    from shardps.worker.node.shares import reduce_scatter

    dist.init_process_group("gloo", init_method=f"file://{out}/scatter.rendezvous", rank=rank, world_size=size)
    try:
        for case, segments in enumerate(SCATTER_CASES):
            numel = max(a + n for runs in segments for a, n in runs)
            scratch = None
            for _ in range(2):
                flat = scatter_grad(rank, numel)
                scratch = reduce_scatter(flat, segments, rank, size, None, scratch)
            torch.save(flat, f"{out}/scatter-{rank}-{case}.pt")
    finally:
        dist.destroy_process_group()


def reduce_scatter_peer_dies(rank: int, out: str) -> None:
    """2 Gloo ranks: rank 1 SIGKILLs itself instead of taking part in the second reduce_scatter; rank 0 writes
    ``<out>/peer-dies.json`` with what its reduce_scatter raised and after how many seconds."""
    import datetime
    import time

    from shardps.worker.node.shares import reduce_scatter

    dist.init_process_group("gloo", init_method=f"file://{out}/peer-dies.rendezvous", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    segments = [[(0, 4096)], [(4096, 4096)]]
    flat = scatter_grad(rank, 8192)
    reduce_scatter(flat, segments, rank, 2, None)  # a good one first: the pair is connected
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    began = time.monotonic()
    try:
        reduce_scatter(flat, segments, rank, 2, None)
        error = ""
    except RuntimeError as exc:
        error = f"{type(exc).__name__}: {exc}"
    with open(f"{out}/peer-dies.json", "w") as f:
        json.dump({"error": error, "seconds": time.monotonic() - began}, f)

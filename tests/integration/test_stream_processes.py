"""``WireOptions(stream_processes=True)``: every shard's PushPull stream goes through a helper process.

The helper forwards the same frames, so a job must end with the same bits
as the same job with the streams in the worker's own process (2 workers:
the shards' sums do not depend on arrival order), and within the sync
oracle's 1e-5 of single-process training. A helper killed between two
rounds is started again for the next round and the job's result does not
change; one killed while its round is in flight fails that round as a lost
connection does, with a message naming the stream process. Closing the
optimizer ends every helper.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from torch import nn

from shardps.worker.config import WireOptions
from shardps.worker.optimizer import DistributedOptimizer
from tests.integration.test_sync_oracle import train_sharded, train_single
from tests.support.procs import alive, wait_until


def _same_bits(a: list[nn.Module], b: list[nn.Module]) -> None:
    for ra, rb in zip(a, b):
        for (key, pa), pb in zip(ra.named_parameters(), rb.parameters()):
            assert torch.equal(pa, pb), f"{key}: max |in-process - stream processes| = {(pa - pb).abs().max()}"


@pytest.mark.parametrize("streamed", [True, False])
def test_stream_processes_give_the_same_bits(start_cluster, streamed: bool) -> None:
    cluster = start_cluster(2, min_workers=2)
    helpers: dict[int, list[int]] = {}

    def record(worker: int, step: int, dist) -> None:
        pids = dist.stream_process_pids
        assert all(pid is not None and alive(pid) for pid in pids), pids
        assert helpers.setdefault(worker, pids) == pids  # the same helpers, round after round

    relayed = train_sharded("adamw", 2, cluster.addresses, overlap=True, streamed=streamed, stream_processes=True,
                            between_steps=record)
    assert len({pid for pids in helpers.values() for pid in pids}) == 4  # 2 workers x 2 shards, one each
    for pids in helpers.values():  # closing the optimizer ended them
        for pid in pids:
            assert not alive(pid), f"stream process {pid} outlived its optimizer"
    direct = train_sharded("adamw", 2, start_cluster(2, min_workers=2).addresses, overlap=True, streamed=streamed)
    _same_bits(relayed, direct)
    for (key, want), got in zip(train_single("adamw").named_parameters(), relayed[0].parameters()):
        assert (want - got).abs().max().item() < 1e-5, key


def test_a_helper_killed_between_rounds_is_started_again(start_cluster) -> None:
    cluster = start_cluster(2, min_workers=2)
    killed: list[int] = []

    def kill(worker: int, step: int, dist) -> None:
        if worker == 0 and step in (4, 11):
            pid = dist.stream_process_pids[step % 2]
            killed.append(pid)
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda: dist.stream_process_pids[step % 2] is None, 10, "the worker to see its helper exit")
        elif worker == 0 and step in (5, 12):  # the round after: a new helper carried it
            assert dist.stream_process_pids[(step - 1) % 2] not in (None, *killed)

    relayed = train_sharded("sgd_nesterov", 2, cluster.addresses, stream_processes=True, between_steps=kill)
    assert len(killed) == 2
    _same_bits(relayed, train_sharded("sgd_nesterov", 2, start_cluster(2, min_workers=2).addresses))


@pytest.mark.timeout(120)
def test_a_helper_killed_during_a_round_is_recovered_as_a_lost_connection(start_cluster, caplog) -> None:
    """The round's stream to the shard is lost mid-round (the shard waits for a second member that never
    joins): the worker's recovery rejoins the shard as after any lost connection (the round is dropped, with
    a warning naming the stream process, and the model goes on from the shard's version), and nothing hangs."""
    cluster = start_cluster(1, min_workers=2)
    model = nn.Linear(8, 4)
    initial = [p.detach().clone() for p in model.parameters()]
    wire = WireOptions(chunk_bytes=64, rpc_timeout=60.0, stream_processes=True, streamed=False)
    with DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                              servers=cluster.addresses, worker_id="alone", wire=wire) as dist:
        model(torch.randn(2, 8)).sum().backward()
        started = time.monotonic()
        killed: list[int] = []

        def kill_soon() -> None:  # the helper starts with the round's stream
            while dist.stream_process_pids[0] is None and time.monotonic() - started < 20:
                time.sleep(0.05)
            time.sleep(1.0)
            killed.append(dist.stream_process_pids[0])
            os.kill(killed[0], signal.SIGKILL)

        threading.Thread(target=kill_soon, daemon=True).start()
        dist.step()
        assert killed and time.monotonic() - started < 30
    assert "stream process of shard" in caplog.text and "exited (status -9)" in caplog.text, caplog.text
    assert "rejoined shard 0" in caplog.text and dist.version == 0
    assert all(torch.equal(a, b) for a, b in zip(initial, model.parameters()))  # the shard's version 0


class _Server:
    """A gRPC server in this process whose ``/shardps.v1.Shard/PushPull`` echoes each frame, or never answers."""

    def __init__(self, answer: bool) -> None:
        from concurrent import futures

        import grpc

        self.release = threading.Event()

        def push_pull(requests, context):
            for frame in requests:
                if not answer:
                    self.release.wait(30)  # blocking: a shard that holds the round
                    return
                yield frame

        from shardps.common.transport import channel_options

        self.server = grpc.server(futures.ThreadPoolExecutor(4), options=channel_options())
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "shardps.v1.Shard", {"PushPull": grpc.stream_stream_rpc_method_handler(push_pull)}),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def close(self) -> None:
        self.release.set()
        self.server.stop(0)


def _relay(address: str):
    from shardps.common.security import ChannelSecurity
    from shardps.common.transport import channel_options
    from shardps.worker.session.relay import StreamRelay

    return StreamRelay(address, {"security": ChannelSecurity(), "options": channel_options()})


PATH = "/shardps.v1.Shard/PushPull"


@pytest.mark.timeout(60)
def test_relayed_calls_behave_as_grpc_calls() -> None:
    """Frames come back as sent (large ones too); a cancel, a request iterator that raises and the shard's
    deadline each end the call with gRPC's status code; the relay's helper serves one call after another."""
    import grpc

    echo, silent = _Server(answer=True), _Server(answer=False)
    relay, held = _relay(echo.address), _relay(silent.address)
    try:
        frames = [bytes([i]) * n for i, n in enumerate((1, 1000, 5 << 20, 0, 7))]
        assert list(relay.stream(PATH, iter(frames), 10.0)) == frames
        payload = torch.arange(6, dtype=torch.float32)  # a frame in parts, the payload a tensor's own memory
        parts = (b"head", memoryview(payload.numpy()), b"", memoryview(b"tail"))
        assert list(relay.stream(PATH, iter([parts]), 10.0)) == [b"head" + payload.numpy().tobytes() + b"tail"]
        assert list(relay.stream(PATH, iter(frames[:2]), 10.0)) == frames[:2]  # the same helper again

        def broken():
            yield b"first"
            raise ValueError("a bad frame")

        call = relay.stream(PATH, broken(), 10.0)
        with pytest.raises(grpc.RpcError) as caught:
            list(call)
        assert caught.value.code() == grpc.StatusCode.UNKNOWN and "a bad frame" in caught.value.details()
        assert call.done()

        call = held.stream(PATH, iter([b"x"]), 1.0)  # the shard holds it: the deadline ends it
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as caught:
            next(call)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - started < 5

        call = held.stream(PATH, iter([b"y"]), 20.0)
        time.sleep(0.3)
        assert call.cancel() and not call.cancel()
        with pytest.raises(grpc.RpcError) as caught:
            next(call)
        assert caught.value.code() == grpc.StatusCode.CANCELLED
    finally:
        relay.close()
        held.close()
        echo.close()
        silent.close()
    for r in (relay, held):  # each one saw its socket close and exited cleanly, calls in flight or not
        assert r.proc.returncode == 0, f"the stream process ended with {r.proc.returncode}"
    with pytest.raises(RuntimeError, match="closed"):
        relay.stream(PATH, iter([]), 1.0)


@pytest.mark.timeout(60)
def test_a_stopped_helper_cannot_hang_the_worker() -> None:
    """A helper that stops answering (SIGSTOP) fails the call here once its deadline and the grace are over."""
    import grpc

    from shardps.worker.session.relay import DEADLINE_GRACE_SECONDS

    echo = _Server(answer=True)
    relay = _relay(echo.address)
    try:
        assert list(relay.stream(PATH, iter([b"a"]), 10.0)) == [b"a"]
        os.kill(relay.proc.pid, signal.SIGSTOP)
        started = time.monotonic()
        call = relay.stream(PATH, iter([b"b"]), 0.5)
        with pytest.raises(grpc.RpcError) as caught:
            next(call)
        waited = time.monotonic() - started
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "gave no answer" in caught.value.details()
        assert 0.5 + DEADLINE_GRACE_SECONDS - 0.5 < waited < 0.5 + DEADLINE_GRACE_SECONDS + 5
    finally:
        if relay.proc is not None:
            os.kill(relay.proc.pid, signal.SIGCONT)
        relay.close()
        echo.close()

"""The CUDA data plane: gradient chunks copied off the device on a side stream, parameters back through pinned memory.

On CUDA, a gradient chunk's copy waits for that gradient's own event (recorded
by its hook), not for the rest of the backward pass, and goes into pinned
memory (``shardps.worker.pipeline.device``); pulled chunks reach the model
through a pinned scratch (``copy_payload``). The CPU tests here run the same
code path on CPU tensors in CI; the ``gpu`` tests need CUDA (skipped without
it, since there is nothing to copy off a device there).
"""

from __future__ import annotations

import pytest
import torch
from shardps.proto import shardps_pb2 as pb
from shardps.common.codec import copy_payload, decode_frame, encode_chunk
from shardps.worker.pipeline.device import HostCopies, mark_ready
from tests.integration.test_sync_oracle import train_sharded, train_single


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_host_copies_of_cpu_chunks_are_only_narrowed(dtype: torch.dtype) -> None:
    values = torch.randn(1000, dtype=torch.float32)[100:600]
    assert mark_ready(values) is None
    host = HostCopies()(values, dtype)
    assert host.dtype == dtype and host.is_contiguous() and host.shape == (500,)
    assert torch.equal(host, values.to(dtype))


def test_the_cpu_twin_of_the_cuda_oracle_matches_single_process(start_cluster) -> None:
    cluster = start_cluster(2, min_workers=2)
    expected = train_single("adamw")
    for replica in train_sharded("adamw", 2, cluster.addresses, overlap=True, streamed=True):
        for (key, want), got in zip(expected.named_parameters(), replica.parameters()):
            assert (want - got).abs().max().item() < 1e-5, key


@pytest.mark.gpu
def test_sync_on_cuda_matches_single_process(start_cluster) -> None:
    """Two workers on CUDA, 2 shards, streamed rounds and overlapped pulls: the single-process oracle (on the CPU:
    the shards run the optimizer there) to 1e-5, as on the CPU."""
    cluster = start_cluster(2, min_workers=2)
    expected = train_single("adamw")
    for replica in train_sharded("adamw", 2, cluster.addresses, overlap=True, streamed=True,
                                 device="cuda"):
        for (key, want), got in zip(expected.named_parameters(), replica.parameters()):
            assert got.is_cuda
            assert (want - got.cpu()).abs().max().item() < 1e-5, key


@pytest.mark.gpu
def test_a_chunk_copy_waits_for_its_gradient_not_for_later_kernels() -> None:
    """The copy sees every kernel queued before its event (a chain of 200 in-place updates), and returns while a
    kernel queued after the event still runs on the default stream (a copy there would wait for it)."""
    x = torch.randn(1 << 22, device="cuda")
    expected = x.double()
    for _ in range(200):
        x.mul_(1.001).add_(0.5)
        expected = expected * 1.001 + 0.5
    ready = mark_ready(x)
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time, queued after the event
    host = HostCopies()(x, torch.float32, ready)
    still_running = not torch.cuda.current_stream().query()
    assert host.device.type == "cpu" and host.is_pinned()
    assert torch.allclose(host.double(), expected.cpu(), rtol=1e-5)
    assert still_running, "the copy waited for a kernel queued after the gradient's event"
    torch.cuda.synchronize()
    bf16 = HostCopies()(x, torch.bfloat16, mark_ready(x))
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, x.to(torch.bfloat16).cpu())


@pytest.mark.gpu
def test_a_pulled_chunk_reaches_a_cuda_parameter_exactly() -> None:
    values = torch.randn(1000)
    for dtype in (torch.float32, torch.bfloat16):
        frame = decode_frame(encode_chunk("w", 0, values.to(dtype), 3))
        dst = torch.zeros(1000, device="cuda")
        copy_payload(frame.header, frame.payload, dst)
        assert torch.equal(dst.cpu(), values.to(dtype).float())
    assert pb.FLOAT32 == frame.header.dtype or pb.BFLOAT16 == frame.header.dtype

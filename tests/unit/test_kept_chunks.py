"""Gradients read where they arrived: a shard reads each float32 chunk from the received frame
(``Receiver(keep=True)``) instead of a staging copy, and steps a lone push from there
(``ShardOptimizer.apply(unit_grads=)``); the rounds' exactness is tested end to end in
tests/integration/test_streamed_rounds.py and test_sync_oracle.py."""

import numpy as np
import pytest
import torch
from torch import nn

from shardps.common.codec import decode_frame, encode_chunk
from shardps.server.dense.chunks import ChunkTable
from shardps.server.dense.optimizer import ShardOptimizer
from tests.support.raw import plan_and_spec

#: Every optimizer a shard runs, with the options that change how torch treats the gradient (fused kernels for
#: SGD, Adam, AdamW and Adagrad; foreach for RMSprop, as the shard builds them).
OPTIMIZERS = [
    (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}), (torch.optim.SGD, {"momentum": 0.9, "weight_decay": 0.1,
                                                                            "maximize": True}),
    (torch.optim.Adam, {"amsgrad": True, "weight_decay": 0.1, "maximize": True}), (torch.optim.AdamW, {}),
    (torch.optim.Adagrad, {"weight_decay": 0.1, "lr_decay": 0.01, "maximize": True}),
    (torch.optim.RMSprop, {"momentum": 0.9, "centered": True, "weight_decay": 0.1}), (torch.optim.RMSprop, {}),
]


def table_and_frames(dtype=torch.float32):
    torch.manual_seed(0)
    model = nn.Linear(20, 10)
    plan, spec = plan_and_spec(model, torch.optim.SGD(model.parameters(), lr=0.1))
    table = ChunkTable(plan, 0)
    grads = {c: torch.randn(c.numel) for c in table.chunks}
    frames = [encode_chunk(c.key, c.offset, g.to(dtype), 1) for c, g in grads.items()]
    return model, table, grads, frames


def address_range(raw: bytes) -> tuple[int, int]:
    start = np.frombuffer(raw, np.uint8).ctypes.data
    return start, start + len(raw)


def test_kept_chunks_are_the_received_bytes_and_the_staging_is_not_written() -> None:
    _, table, grads, frames = table_and_frames()
    staging = {g: torch.full_like(t, float("nan")) for g, t in table.allocate().items()}
    rx = table.receiver(1, staging, None, what="push", reject_nonfinite=True, keep=True)
    for raw in frames:
        rx.add(raw)
    assert sorted(rx.kept) == list(range(len(table.chunks)))
    for (i, view), raw, want in zip(sorted(rx.kept.items()), frames, grads.values()):
        lo, hi = address_range(raw)
        assert lo <= view.data_ptr() and view.data_ptr() + view.numel() * 4 <= hi  # no copy
        assert torch.equal(view, want)
        assert rx.chunk_bounds[i] >= want.abs().max().item()  # the finite proof's bound, from the frame
    assert all(torch.isnan(t).all() for t in staging.values())
    rx.finish()


def test_chunks_in_another_wire_type_are_staged_as_before() -> None:
    _, table, grads, frames = table_and_frames(torch.bfloat16)
    staging = table.allocate()
    rx = table.receiver(1, staging, None, what="push", keep=True)
    for raw in frames:
        rx.add(raw)
    assert rx.kept == {}
    for c, g in grads.items():
        assert torch.equal(table.view(staging, c), g.bfloat16().float())


@pytest.mark.parametrize("cls, hyper", OPTIMIZERS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_stepping_from_the_frames_matches_the_staged_copy_and_never_writes_them(cls, hyper) -> None:
    """Bit for bit the step from the staged copy; the frames (torch cannot make their tensors read-only) hold
    the bytes they arrived with after three rounds of every optimizer a shard runs."""
    model, table, _, _ = table_and_frames()
    spec = plan_and_spec(model, cls(model.parameters(), lr=0.01, **hyper))[1]
    params = table.allocate()
    for c in table.chunks:
        table.view(params, c).copy_(dict(model.named_parameters())[c.key].detach().reshape(-1)[
            c.offset : c.offset + c.numel])
    staged_params = {g: t.clone() for g, t in params.items()}
    kept_opt = ShardOptimizer(spec, params, {}, table.units())
    staged_opt = ShardOptimizer(spec, staged_params, {}, table.units())
    present = {c.key_index for c in table.chunks}
    for step in range(3):
        torch.manual_seed(step)
        frames = [encode_chunk(c.key, c.offset, torch.randn(c.numel), 1) for c in table.chunks]
        sent = [bytes(bytearray(raw)) for raw in frames]  # copies made before the step
        staging = table.allocate()
        rx = table.receiver(1, staging, None, what="push", reject_nonfinite=True, keep=True)
        for raw in frames:
            rx.add(raw)
        staged = table.allocate()
        for c, raw in zip(table.chunks, frames):
            table.view(staged, c).copy_(torch.frombuffer(bytearray(decode_frame(raw).payload), dtype=torch.float32))
        kept_opt.apply(staging, present, [0.01], grad_bound=rx.grad_bound, unit_grads=rx.kept)
        staged_opt.apply(staged, present, [0.01], grad_bound=rx.grad_bound)
        assert all(torch.equal(params[g], staged_params[g]) for g in params)
        assert frames == sent, "the optimizer wrote to a gradient stepped where it arrived"


def test_unit_grads_need_the_bound_that_proves_the_round_finite() -> None:
    model, table, _, frames = table_and_frames()
    spec = plan_and_spec(model, torch.optim.SGD(model.parameters(), lr=0.1))[1]
    opt = ShardOptimizer(spec, table.allocate(), {}, table.units())
    rx = table.receiver(1, table.allocate(), None, what="push", keep=True)
    for raw in frames:
        rx.add(raw)
    with pytest.raises(ValueError, match="grad_bound"):
        opt.apply(table.allocate(), {0, 1}, [0.1], unit_grads=rx.kept)

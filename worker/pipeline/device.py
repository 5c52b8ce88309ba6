"""Gradient chunks off the device: CUDA copies on a side stream into pinned host memory, in the wire type.

A gradient hook fires once the kernels that produce the gradient are
queued, not run. The hook records a CUDA event on the stream they were
queued on (:func:`mark_ready`); the push stream's thread later makes a side
stream wait for that event alone, narrows the chunk to the wire type on the
device there (bf16 and fp16 halve the bytes over PCIe too), and copies it
into pinned (page-locked) host memory with a non-blocking copy, which the
GPU's copy engine runs while the rest of the backward pass computes. A
copy on the default stream instead waits for every kernel queued before it
(the rest of the backward pass as far as the CPU has queued it), and a copy
into pageable memory goes through the driver's own staging buffer at a
fraction of the bus's rate. Pinned blocks come from PyTorch's caching host
allocator, so a step allocates none after the first.

It is the pattern PyTorch DDP uses for its all-reduce: the collective
runs on NCCL's own stream, which waits on an event recorded where the
bucket became ready, so communication overlaps the rest of the backward
pass. On the CPU nothing is copied: the chunk is only narrowed.
"""

from __future__ import annotations

import torch


def mark_ready(t: torch.Tensor) -> torch.cuda.Event | None:
    """An event on the current stream of ``t``'s device, recorded now (after the kernels producing ``t`` were
    queued); None for a CPU tensor. Called where ``t`` becomes ready (a gradient hook, ``step()``)."""
    if not t.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(t.device))
    return event


class HostCopies:
    """One push stream's copies of gradient chunks to host memory, in the wire type (see the module docstring).

    Not thread-safe: one instance per push stream (each runs on one gRPC thread).
    """

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def __call__(self, values: torch.Tensor, dtype: torch.dtype, ready: torch.cuda.Event | None = None) -> torch.Tensor:
        """``values`` in ``dtype``, in host memory (contiguous; the caller encodes it, then drops it).

        Args:
            values: a 1-D chunk of a gradient, shape ``[numel]``, any floating dtype, on the CPU or CUDA.
            dtype: the wire type (``torch.float32``, ``torch.bfloat16`` or ``torch.float16``).
            ready: :func:`mark_ready`'s event for ``values`` (CUDA); None: wait for the work queued on this
                thread's current stream so far (what a plain ``values.to("cpu")`` waits for).

        Returns:
            A CPU tensor of shape ``[numel]`` and dtype ``dtype`` (pinned when ``values`` is on CUDA).
        """
        if not values.is_cuda:
            return values.to(dtype).contiguous()
        device = values.device
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        if ready is None:
            ready = mark_ready(values)
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            narrowed = values.to(dtype)  # on the side stream: after the producing kernels, beside the rest
            host = torch.empty(values.shape, dtype=dtype, pin_memory=True)
            host.copy_(narrowed, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()  # blocks this push thread only; values and narrowed stay referenced until here
        return host

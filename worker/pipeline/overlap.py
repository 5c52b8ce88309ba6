"""Overlapped pulls: each submodule's forward waits for its own parameters and buffers, no more.

With ``DistributedOptimizer(..., model=model)``, ``step()`` returns once the
gradients are handed to the network and the new parameters stream in while
the next forward runs; the shards send them first layers first
(BytePS-style priority: Jiang et al., "A Unified Architecture for
Accelerating Distributed DNN Training in Heterogeneous GPU/CPU Clusters",
OSDI 2020), and a forward pre-hook on every submodule waits for exactly the
tensors that submodule reads.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from shardps.worker.pipeline.streams import Round


class ForwardWaits:
    """Forward pre-hooks on every submodule of ``model`` that wait for the pending pull's tensors.

    Args:
        model: the module whose parameters and buffers are pulled.
        keys: ``{id(tensor): key}`` of the parameters and buffers in the plan.
        pending: the round whose tensors are still arriving, or None.
        finish: waits for the whole pending pull (and raises its error).
        timeout: seconds a forward waits for its own tensors before it waits for the whole pull instead
            (``finish``: its error raised, or a restarted shard's partition pulled again by the recovery).
    """

    def __init__(self, model: torch.nn.Module, keys: dict[int, str], pending: Callable[[], Round | None],
                 finish: Callable[[], None], timeout: float) -> None:
        self.model, self.keys, self.pending, self.finish, self.timeout = model, keys, pending, finish, timeout
        self.called: set[int] = set()
        self.wait_keys: dict[int, list[str]] | None = None
        self.hooks = [m.register_forward_pre_hook(self._wait) for m in model.modules()]

    def learn(self) -> None:
        """Give each tensor to the nearest module around it whose forward ran in the first step.

        Some modules read a child's parameters without calling the child
        (``nn.MultiheadAttention`` uses ``out_proj.weight`` directly), so a
        tensor is waited for by its own module only if that module's forward
        runs; otherwise by the nearest ancestor whose forward does. The first
        forward, before anything is learned, waits for the whole pull.
        """
        if self.wait_keys is not None or not self.called:
            return
        keys: dict[int, list[str]] = {}

        def assign(module: torch.nn.Module, owner: torch.nn.Module) -> None:
            if id(module) in self.called:
                owner = module
            for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
                if id(t) in self.keys:
                    keys.setdefault(id(owner), []).append(self.keys[id(t)])
            for child in module.children():
                assign(child, owner)

        assign(self.model, self.model)
        self.wait_keys = keys

    def _wait(self, module: torch.nn.Module, args) -> None:
        if self.wait_keys is None:
            self.called.add(id(module))
        rnd = self.pending()
        if rnd is None:
            return
        if self.wait_keys is None:
            self.finish()  # nothing learned yet: wait for everything
            return
        deadline = time.monotonic() + self.timeout
        for key in self.wait_keys.get(id(module), ()):
            event = rnd.ready.get(key)  # None for an empty tensor: nothing to wait for
            while event is not None and not event.wait(0.05):  # blocking wait for this module's chunks
                if rnd.failed() is not None or time.monotonic() > deadline:
                    # the whole pull's outcome: its error raised, or (a shard restarted and was rejoined) the
                    # partition pulled again by the recovery, so every tensor is in place without its event
                    self.finish()
                    return

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []

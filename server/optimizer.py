"""The shard's optimizer: one ``torch.optim`` step over each flat fp32 buffer per round."""

from __future__ import annotations

import torch

from shardps.proto import shardps_pb2 as pb
from shardps.proto.optim import build_optimizer


class ShardOptimizer:
    """Runs the workers' optimizer class over a shard's flat buffers.

    Args:
        spec: class and per-group hyperparameters from the first worker's Join.
        params: ``{group index: 1-D float32 tensor}``, the shard's master weights
            (updated in place).

    One fused kernel (SGD, Adam, AdamW, Adagrad) or one foreach call (RMSprop)
    per round over all groups: no Python loop over chunks.

    Raises:
        shardps.proto.optim.OptimizerSpecError: from :func:`build_optimizer`.
    """

    def __init__(self, spec: pb.OptimizerSpec, params: dict[int, torch.Tensor]) -> None:
        self.groups = sorted(params)
        self.params = params
        self.optimizer = build_optimizer(spec, [(g, params[g]) for g in self.groups])

    def step(self, grads: dict[int, torch.Tensor], lrs: list[float]) -> None:
        """Apply one update.

        Args:
            grads: ``{group: 1-D float32 tensor}`` shaped like ``params``; read, not kept.
            lrs: learning rate of every param group of the model (indexed by group).
        """
        if self.optimizer is None:
            return
        for local, g in enumerate(self.groups):
            self.params[g].grad = grads[g]
            self.optimizer.param_groups[local]["lr"] = lrs[g]
        self.optimizer.step()
        for g in self.groups:
            self.params[g].grad = None

    def state_bytes(self) -> int:
        """Bytes of optimizer state (moments, momentum buffers, step counters)."""
        if self.optimizer is None:
            return 0
        return sum(
            v.numel() * v.element_size()
            for st in self.optimizer.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor)
        )

"""What a worker sends besides gradients: buffers, a digest of the parameters it does not send, hyperparameters.

- Buffers (``model.named_buffers()``: BatchNorm statistics, counters) are in
  the partition plan when ``broadcast_buffers`` is on: every worker pushes
  its buffers each round and the shards send back the lowest worker id's,
  so every worker starts each forward with the same buffers, as DDP's
  ``broadcast_buffers=True`` gives every rank rank 0's.
- Parameters outside the optimizer are never sent; every worker must hold
  the same values, which the shards check with a SHA-256 of them at Join.
- Every round carries each param group's hyperparameters when any changed
  (schedulers move ``betas`` and ``momentum`` too, not only ``lr``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable

import torch

from shardps.common.codec import WIRE_DTYPES
from shardps.common.optim import group_hyperparams
from shardps.common.plan import BufferInfo


def buffer_infos(named_buffers: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[BufferInfo], dict[str, torch.Tensor]]:
    """The plan entries of ``named_buffers`` and the tensors by name.

    Raises:
        ValueError: a buffer of a dtype that cannot travel, or not contiguous.
    """
    infos, tensors = [], {}
    for name, b in named_buffers:
        if b.dtype not in WIRE_DTYPES:
            raise ValueError(f"buffer {name!r} has dtype {b.dtype}, which shardps cannot send; pass "
                             "broadcast_buffers=False, or keep it out of named_buffers")
        if not b.is_contiguous():
            raise ValueError(f"buffer {name!r} must be contiguous")
        infos.append(BufferInfo(name, tuple(b.shape), WIRE_DTYPES[b.dtype]))
        tensors[name] = b
    return infos, tensors


def static_digest(named: dict[str, torch.Tensor], names: Iterable[str]) -> str:
    """SHA-256 (hex) of the named parameters' names, dtypes, shapes and values (read once, at construction)."""
    h = hashlib.sha256()
    for name in sorted(names):
        t = named[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest() if names else ""


class HyperparamChanges:
    """Tells when a param group's hyperparameters (other than ``lr``) changed since the last round sent."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._sent = self._current()

    def _current(self) -> list[dict]:
        return [{k: v for k, v in group_hyperparams(g, i).items() if k != "lr"}
                for i, g in enumerate(self.optimizer.param_groups)]

    def changed(self) -> list[str]:
        """Every group's hyperparameters as JSON if any changed since the last call that returned them, else []."""
        current = self._current()
        if current == self._sent:
            return []
        self._sent = current
        return [json.dumps({**hp, "lr": float(g["lr"])}, sort_keys=True)
                for hp, g in zip(current, self.optimizer.param_groups)]

    def resend(self) -> None:
        """A round failed: the shards may not have taken what it carried, so the next round sends every group's."""
        self._sent = None

"""Model, data and a DDP reference for the recipe oracles (``tests/integration/test_recipes.py``).

``Net`` has what everyday recipes meet: a layer that can be frozen, a
branch that some batches never call (its gradient stays None, like an MoE
expert that got no tokens), an optional BatchNorm whose running statistics
are buffers, and a head. ``batch(step)`` routes the branch per step: every
row (step % 4 == 0), no row (odd steps) or only the second half of the
batch, i.e. worker 1's rows (step % 4 == 2).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as torch_dist
from torch import nn

BATCH = 8
WORKERS = 2


class Net(nn.Module):
    def __init__(self, batch_norm: bool = False) -> None:
        super().__init__()
        self.body = nn.Linear(8, 24)
        self.norm = nn.BatchNorm1d(24) if batch_norm else nn.Identity()
        self.frozen = nn.Linear(24, 24)
        self.branch = nn.Linear(24, 24)
        self.head = nn.Linear(24, 4)
        # from a generator of its own: replicas built in worker threads at once must get the same values
        # (torch.manual_seed and the layers' init share one global generator between threads)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * p.numel() ** -0.25 * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.body(x)))
        h = h + torch.tanh(self.frozen(h))
        use = (x[:, :1] > 0).to(h.dtype)
        if use.any():  # not called at all otherwise: its gradient stays None
            h = h + use * torch.tanh(self.branch(h))
        return self.head(h)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` of global batch ``step``: float32 ``(BATCH, 8)`` and int64 ``(BATCH,)``."""
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randn(BATCH, 8, generator=g)
    y = torch.randint(0, 4, (BATCH,), generator=g)
    x[:, 0] = x[:, 0].abs() + 0.1
    if step % 2 == 1:
        x[:, 0] *= -1
    elif step % 4 == 2:
        x[: BATCH // 2, 0] *= -1
    return x, y


def part(worker: int, workers: int = WORKERS) -> slice:
    """Worker ``worker``'s rows of every global batch."""
    per = BATCH // workers
    return slice(worker * per, (worker + 1) * per)


def loss_of(model: nn.Module, step: int, rows: slice = slice(None), weight: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy of ``model`` on ``rows`` of batch ``step``, each row's loss times ``weight[row]``."""
    x, y = batch(step)
    losses = nn.functional.cross_entropy(model(x[rows]), y[rows], reduction="none")
    if weight is not None:
        losses = losses * weight[rows]
    return losses.mean()


def ddp_rank(rank: int, world: int, init_file: str, out: str, steps: int) -> None:
    """One rank of real DDP (Gloo, ``broadcast_buffers=True``) training ``Net(batch_norm=True)``; saves its state."""
    torch.set_num_threads(1)
    torch_dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = Net(batch_norm=True)
        ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        for step in range(steps):
            opt.zero_grad()
            loss_of(ddp, step, part(rank, world)).backward()
            opt.step()
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out + ".partial")
        os.replace(out + ".partial", out)  # the file exists only once it is whole
    finally:
        torch_dist.destroy_process_group()

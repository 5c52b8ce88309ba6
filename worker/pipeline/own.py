"""Clipping and loss scaling in async and ssp modes: each worker unscales, checks and clips its own gradient.

In sync mode a round averages every member's push, so clipping and a
GradScaler act on the average: each shard measures its part and every
worker commits one decision (``commit.py``). In async and ssp modes a push
is applied on its own, so the gradient that is clipped or unscaled is this
worker's own one, which the worker holds whole. It therefore decides
alone, at ``step()``, before anything is sent (:class:`OwnGradient`):

1. the gradients are copied to fp32 (``p.grad`` is left as backward made
   it, as in sync mode) and, with an enabled GradScaler, unscaled with
   GradScaler's own kernel and the same float32 ``1 / scale``;
2. if any is Inf or NaN the step is *skipped*: the push carries no
   gradient at all (every key absent), which the shards apply as
   ``torch.optim`` skips parameters without ``grad``: parameters and
   optimizer state untouched. The push still counts: the shard's version
   advances (as a skipped sync round's does), this worker's ssp clock
   advances, so a worker whose scaler backs off never holds the others at
   the staleness bound, its buffers travel and it pulls the newest
   parameters (what the others applied meanwhile). Not pushing at all
   would leave its clock one behind per overflow, and in ssp every other
   worker would wait for it at the bound;
3. with ``max_grad_norm`` the gradients are clipped with
   ``clip_grad_norm_``'s arithmetic (``get_total_norm``, then the float32
   coefficient ``clamp(max_norm / (norm + 1e-6), max=1)``);
4. the result is pushed as a plain async/ssp push (no report, no commit:
   the shards apply it at once), in the wire dtype.

Doing this on the shards instead would need every shard's part of the norm
and found-inf of one push before any shard applies it, which the
one-push-at-a-time apply of async/ssp cannot wait for without stalling the
shard for every other worker. The result is the same numbers: the shards
would unscale and clip this one push with the same kernels.

Because the whole gradient is needed first, gradients are not pushed from
the backward hooks in this combination (the push starts at ``step()``).
"""

from __future__ import annotations

import math

import torch

from shardps.worker.pipeline.commit import RoundOptions


class OwnGradient:
    """Unscale, check and clip one worker's gradient before its async/ssp push (module docstring).

    Args:
        options: the clipping and GradScaler this worker was given.

    Attributes:
        skipped: whether the last :meth:`prepare` found Inf/NaN (nothing pushed for it).
        norm: the last total norm of the unscaled gradient (NaN when not finite or
            not measured: no ``max_grad_norm``).
    """

    def __init__(self, options: RoundOptions) -> None:
        self.options = options
        self.skipped = False
        self.norm = math.nan

    def prepare(self, grads: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
        """The gradients to push: ``{key: fp32 tensor of the gradient's shape}``, None where there is none.

        Args:
            grads: ``{key: p.grad}`` of every parameter in the plan (None: no gradient).

        Returns:
            Unscaled and clipped fp32 copies, keyed as ``grads``; every value None when
            the step is skipped (Inf/NaN found: :attr:`skipped` is True).
        """
        keys = [k for k, g in grads.items() if g is not None]
        copies = [grads[k].detach().to(torch.float32, copy=True) for k in keys]
        self.skipped, self.norm = False, math.nan
        found = False
        if self.options.scaled:
            inv_scale = torch.tensor(self.options.grad_scaler.get_scale(), dtype=torch.float64).reciprocal().float()
            by_device: dict[torch.device, list[torch.Tensor]] = {}
            for c in copies:
                by_device.setdefault(c.device, []).append(c)
            for device, tensors in by_device.items():
                found_inf = torch.zeros((), dtype=torch.float32, device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, inv_scale.to(device))
                found = found or bool(found_inf.item())
        if not found and self.options.max_grad_norm is not None:
            total = torch.nn.utils.get_total_norm(copies, self.options.norm_type) if copies else torch.tensor(0.0)
            self.norm = float(total.item())
            if math.isfinite(self.norm):
                coef = torch.clamp(self.options.max_grad_norm / (total.float() + 1e-6), max=1.0)
                for c in copies:
                    c.mul_(coef.to(c.device))
            else:
                found = True
        if found:
            self.skipped = True
            return dict.fromkeys(grads)
        prepared = dict.fromkeys(grads)
        prepared.update(zip(keys, copies))
        return prepared

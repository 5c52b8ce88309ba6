"""The shard's optimizer: average a round's gradients and step once over each flat fp32 buffer, or refuse.

A round is applied all-or-nothing. Before the real step, a dry run steps
copies of the parameters and optimizer state, a segment at a time
(``SEGMENT`` elements, cache-sized), and checks every result: the averaged
gradient, the new parameters and the new optimizer state must all be
finite, and torch must not raise. Only then does the real step run, one
fused (or foreach) call over each flat buffer. A refused round leaves the
parameters and optimizer state untouched. The optimizers are element-wise,
so stepping a segment computes exactly the elements the whole-buffer step
computes; the segment length is a multiple of every vector width, so both
take the same kernel path. The dry run costs about one more step per round
(``benchmarks/update.py`` measures it).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch

from shardps.proto import shardps_pb2 as pb
from shardps.proto.optim import OptimizerSpecError, build_optimizer

#: Elements per dry-run segment (1 MiB of fp32: a parameter, a gradient and
#: the state segments stay in cache while they are checked).
SEGMENT = 1 << 18
#: Elements of each scratch parameter the join-time trial step runs on.
TRIAL_ELEMENTS = 64


class RoundRefused(Exception):
    """A round whose update would not be finite, or that torch refused to step.

    ``group``, ``start`` and ``end`` locate the first offending elements in the
    shard's flat buffer of that param group (all -1 when not element-specific).
    """

    def __init__(self, reason: str, group: int = -1, start: int = -1, end: int = -1) -> None:
        super().__init__(reason)
        self.reason, self.group, self.start, self.end = reason, group, start, end


def _finite(t: torch.Tensor) -> bool:
    """True if every element of ``t`` is finite: a cache-hot sum, the exact test only if the sum is not finite."""
    return t.numel() == 0 or math.isfinite(t.sum().item()) or bool(torch.isfinite(t).all())


def _full_state(state: dict, numel: int) -> dict:
    """The entries of one parameter's optimizer state that hold one value per element."""
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.numel() == numel and v.dim() == 1}


def average_(grads: Sequence[dict[int, torch.Tensor]]) -> dict[int, torch.Tensor]:
    """Average the workers' gradients in place into ``grads[0]``, summing in the order given.

    Args:
        grads: one ``{group: 1-D float32}`` per worker, in worker-id order.

    Returns:
        ``grads[0]``, now holding the average (it may be non-finite if the
        sum overflows; :meth:`ShardOptimizer.apply` refuses such a round).
    """
    out = grads[0]
    if len(grads) > 1:
        for g, grad in out.items():
            for other in grads[1:]:
                grad.add_(other[g])
            grad.mul_(1.0 / len(grads))
    return out


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
        self.spec = spec
        self.groups = sorted(params)
        self.params = params
        self.optimizer = build_optimizer(spec, [(g, params[g]) for g in self.groups])
        self._trials: dict[int, torch.optim.Optimizer] = {}
        # one scratch parameter and one scratch buffer per state name, shared by every group's dry run:
        # (1 + state buffers) x SEGMENT x 4 bytes whatever the number of groups
        self._scratch = torch.empty(SEGMENT)
        self._state_scratch: dict[str, torch.Tensor] = {}

    @staticmethod
    def trial(spec: pb.OptimizerSpec) -> int:
        """Build ``spec``'s optimizer over small scratch tensors and run one step.

        Catches settings torch accepts at construction but refuses at
        ``step()`` (Adam ``betas=(0.9,)``, a string ``eps``) or that give
        non-finite values, before any state exists.

        Returns:
            How many optimizer-state buffers the class keeps per element (for
            the shard's memory bound).

        Raises:
            OptimizerSpecError: what torch said, or that the trial was not finite.
        """
        params = [torch.zeros(TRIAL_ELEMENTS) for _ in spec.group_hyperparams_json]
        optimizer = build_optimizer(spec, list(enumerate(params)))
        for p in params:
            p.grad = torch.full_like(p, 0.5)
        try:
            optimizer.step()
        except Exception as exc:  # torch raises TypeError, ValueError, ... for settings it accepted earlier
            raise OptimizerSpecError(f"a trial step of torch.optim.{spec.class_name} failed: {exc}") from None
        buffers = 0
        for p in params:
            state = _full_state(optimizer.state.get(p, {}), TRIAL_ELEMENTS)
            if not _finite(p) or not all(_finite(v) for v in state.values()):
                raise OptimizerSpecError(
                    f"a trial step of torch.optim.{spec.class_name} with these hyperparameters gives NaN or Inf"
                )
            buffers = max(buffers, len(state))
        return buffers

    def apply(self, grads: Sequence[dict[int, torch.Tensor]], lrs: Sequence[float], check: bool = True) -> None:
        """Average ``grads`` (worker-id order) and step, or refuse and change nothing.

        Args:
            grads: one ``{group: 1-D float32}`` per worker, shaped like ``params``,
                each already checked finite; ``grads[0]`` is overwritten with the average.
            lrs: learning rate of every param group of the model (indexed by group).
            check: run the dry run first (off only when the shard accepts
                non-finite values, ``--allow-nonfinite``).

        Raises:
            RoundRefused: the average, the new parameters or the new optimizer
                state would not be finite, or torch raised in the dry run.
        """
        if self.optimizer is None:
            return
        mean = average_(grads)
        if check:
            self._dry_run(mean, lrs, check_grads=len(grads) > 1)  # one worker's chunks were checked on arrival
        self._step(mean, lrs)

    def _step(self, grads: dict[int, torch.Tensor], lrs: Sequence[float]) -> None:
        for local, g in enumerate(self.groups):
            self.params[g].grad = grads[g]
            self.optimizer.param_groups[local]["lr"] = lrs[g]
        try:
            self.optimizer.step()
        finally:
            for g in self.groups:
                self.params[g].grad = None

    def _trial_optimizer(self, local: int) -> torch.optim.Optimizer:
        """The scratch optimizer the dry run steps for group ``local`` (made once, over the shared scratch)."""
        trial = self._trials.get(local)
        if trial is None:
            hyper = {k: v for k, v in self.optimizer.param_groups[local].items() if k not in ("params", "fused", "foreach")}
            impl = {"fused": True} if self.optimizer.defaults.get("fused") else {"foreach": True}
            trial = self._trials[local] = type(self.optimizer)([{"params": [self._scratch], **hyper}], **impl)
        return trial

    def _dry_run(self, grads: dict[int, torch.Tensor], lrs: Sequence[float], check_grads: bool) -> None:
        for local, g in enumerate(self.groups):
            param, grad = self.params[g], grads[g]
            trial, scratch = self._trial_optimizer(local), self._scratch
            group = trial.param_groups[0]
            live = self.optimizer.param_groups[local]
            group.update({k: v for k, v in live.items() if k not in ("params", "fused", "foreach")})
            group["lr"] = lrs[g]
            state = self.optimizer.state.get(param, {})
            full = _full_state(state, param.numel())
            buffers = {k: self._state_scratch.setdefault(k, torch.empty(SEGMENT)) for k in full}
            for start in range(0, param.numel(), SEGMENT):
                end = min(param.numel(), start + SEGMENT)
                n = end - start
                if check_grads and not _finite(grad[start:end]):
                    raise RoundRefused("the averaged gradient is not finite (float32 overflow)", g, start, end)
                p = scratch[:n]
                p.copy_(param[start:end])
                p.grad = grad[start:end]
                group["params"] = [p]
                trial.state.clear()
                if state:
                    trial.state[p] = {
                        k: (buffers[k][:n].copy_(v[start:end]) if k in full else v.clone() if isinstance(v, torch.Tensor)
                            else v)
                        for k, v in state.items()
                    }
                try:
                    trial.step()
                except Exception as exc:
                    raise RoundRefused(f"torch.optim.{type(trial).__name__}.step() raised: {exc}") from None
                if not _finite(p):
                    raise RoundRefused("the update would make the parameters non-finite", g, start, end)
                if not all(_finite(v) for v in _full_state(trial.state[p], n).values()):
                    raise RoundRefused("the update would make the optimizer state non-finite", g, start, end)
            p.grad = None
            trial.state.clear()

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

    def digest(self, version: int) -> str:
        """SHA-256 (hex) of ``version``, every parameter byte and every optimizer-state value."""
        h = hashlib.sha256(version.to_bytes(8, "little"))
        for g in self.groups:
            p = self.params[g]
            h.update(p.numpy().tobytes())
            state = self.optimizer.state.get(p, {}) if self.optimizer is not None else {}
            for k in sorted(state):
                v = state[k]
                h.update(k.encode())
                h.update(v.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if isinstance(v, torch.Tensor)
                         else repr(v).encode())
        return h.hexdigest()

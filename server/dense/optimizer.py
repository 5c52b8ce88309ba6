"""The shard's optimizer: per-parameter torch.optim semantics over flat buffers, all-or-nothing rounds.

The shard keeps its parameters as one flat fp32 buffer per param group, but
the ``torch.optim`` optimizer sees one view per key (a key's elements on a
shard are one contiguous slice). So every parameter has its own optimizer
state and step count, exactly as in one process: a parameter whose gradient
is None in a round is given ``grad = None`` and torch skips it (no weight
decay, no momentum, no state change). One fused (or foreach) call still
steps every view of a group.

A round is applied all-or-nothing: one that would write a non-finite value
into the parameters or the optimizer state is refused before anything
changes (parameters, state, step counts, learning rates). Most rounds are
*proved* finite at the cost of one pass over the averaged gradient:

1. :func:`~shardps.server.dense.bounds.grad_bound` bounds ``|g|`` (a dot
   product per 16 M elements; NaN, Inf or a gradient too large to square
   make it infinite), unless the caller passes a bound it made with the gradient.
2. :func:`~shardps.server.dense.bounds.propagate` runs the optimizer's
   formulas on magnitude bounds of the parameters and state that the shard
   carries from round to round (measured from the buffers when first needed,
   after ``load_state``, and when the buffer's ``_version`` shows a torch
   in-place write outside ``apply``; the buffers are filled before the
   optimizer is built, and nothing else may write them): every intermediate
   value of the torch kernel, for every element, is at most 2**100 and no
   denominator or square root can go wrong, so every value written is finite.
3. The real step runs: the same torch call as always.

When the bounds prove nothing (a huge gradient or learning rate, ``eps`` of
0, centered RMSprop, a non-finite average...), the exact test decides, so a
refusal and its message are what they always were: a dry run steps copies
of the parameters and state, up to ``SEGMENT`` elements at a time in shared
scratch buffers, and checks every result (finite, and torch must not
raise); then the real step runs. The optimizers are element-wise, so the
copies get exactly the values the real step writes. The two are
equivalent: a proved round is finite, so the dry run would accept it too,
and the step is the same call; the proof only decides which rounds skip
the dry run.

If torch raises in the real step anyway (a state that does not fit the
settings), the step counts it incremented and the state it created for
first-time keys are put back and the round is refused; the fused kernels
check their arguments before they write.

Clipping and loss scaling follow ``torch.nn.utils.clip_grad_norm_`` and
``torch.amp.GradScaler`` over the averaged gradient: :meth:`ShardOptimizer.report`
unscales it with the same kernel GradScaler uses and returns this shard's
part of the norm; every worker combines all shards' parts into the same
clip coefficient, which :meth:`ShardOptimizer.apply` multiplies in.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace

import torch

from shardps.proto import shardps_pb2 as pb
from shardps.common.optim import OptimizerSpecError, build_optimizer
from shardps.server.dense import bounds
from shardps.server.dense.unit_state import IMPL_KEYS as _IMPL_KEYS
from shardps.server.dense.unit_state import TRIAL_ELEMENTS, StateError, UnitState  # noqa: F401 (StateError: re-exported)
from shardps.server.dense.unit_state import finite as _finite
from shardps.server.dense.unit_state import per_element_entries as _per_element

#: Elements per dry-run batch (1 MiB of fp32: parameters, gradients and state stay in cache).
SEGMENT = 1 << 18


class RoundRefused(Exception):
    """A round whose update would not be finite, or that torch refused to step.

    ``key`` is the plan index of the first offending parameter, -1 when not key-specific.
    """

    def __init__(self, reason: str, key: int = -1) -> None:
        super().__init__(reason)
        self.reason, self.key = reason, key


def average_(grads: Sequence[dict[int, torch.Tensor]]) -> dict[int, torch.Tensor]:
    """Average the workers' gradients in place into ``grads[0]``, summing in the order given.

    Args:
        grads: one ``{group: 1-D float32}`` per worker, in worker-id order; a
            key a worker had no gradient for holds zeros (DDP averages the same way).

    Returns:
        ``grads[0]``, now holding the average (it may be non-finite if the sum overflows).
    """
    out = grads[0]
    if len(grads) > 1:
        for g, grad in out.items():
            for other in grads[1:]:
                grad.add_(other[g])
            grad.mul_(1.0 / len(grads))
    return out


class ShardOptimizer(UnitState):
    """Runs the workers' optimizer class over a shard's parameters, one tensor per key.

    Args:
        spec: class and per-group hyperparameters from the first worker's Join.
        params: ``{group index: 1-D float32 tensor}``, the shard's master weights
            (updated in place).
        slices: ``{key index: (group, start, end)}``, each key's slice of its group's buffer.
        units: ``{unit: (key index, group, start, end)}``: the tensors torch.optim steps, each a
            contiguous piece of one key's slice (the shard passes one per chunk, so a round can be
            applied a chunk at a time: :meth:`apply`'s ``units``); None: one per key. The optimizers
            a shard runs are element-wise (``shardps.common.optim.SHARDABLE``) and every piece of a
            key is stepped in the same rounds, so each element gets the values one tensor per key
            would give, up to the last bit where a piece's end moves an element between a fused
            kernel's vectorised body and its scalar tail (AVX2/AVX-512); state goes in and out per key (:meth:`get_state`, :meth:`load_state`).

    Raises:
        shardps.common.optim.OptimizerSpecError: from :func:`build_optimizer`.
    """

    def __init__(self, spec: pb.OptimizerSpec, params: dict[int, torch.Tensor],
                 slices: dict[int, tuple[int, int, int]],
                 units: dict[int, tuple[int, int, int, int]] | None = None) -> None:
        self.spec, self.params, self.slices = spec, params, slices
        self.groups = sorted(params)
        if units is None:
            units = {k: (k, g, start, end) for k, (g, start, end) in slices.items()}
        self.unit_key = {u: k for u, (k, _, _, _) in units.items()}
        self.units_of_key: dict[int, list[int]] = {}
        for u in sorted(units, key=lambda u: units[u][1:]):
            self.units_of_key.setdefault(units[u][0], []).append(u)
        self.units_of = {g: sorted((u for u, (_, ug, _, _) in units.items() if ug == g), key=lambda u: units[u][2])
                         for g in self.groups}
        #: ``{unit: 1-D view of its group's buffer}``: the tensors torch.optim steps
        self.unit_slices = {u: (g, start, end) for u, (_, g, start, end) in units.items()}
        self.views = {u: params[g][start:end] for u, (_, g, start, end) in units.items()}
        self.optimizer = build_optimizer(spec, [(g, [self.views[u] for u in self.units_of[g]]) for g in self.groups])
        self._trials: dict[int, torch.optim.Optimizer] = {}
        # scratch shared by every group's dry run: (1 + state buffers) x SEGMENT x 4 bytes
        self._scratch = torch.empty(SEGMENT)
        self._state_scratch: dict[str, torch.Tensor] = {}
        self._bounds: dict[int, bounds.Bounds] = {}  # per group; missing: measure before the next proof
        #: Rounds proved finite / decided by the exact dry run (for tests and benchmarks).
        self.proved = self.dry_runs = 0

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
        optimizer = build_optimizer(spec, [(g, [p]) for g, p in enumerate(params)])
        for p in params:
            p.grad = torch.full_like(p, 0.5)
        try:
            optimizer.step()
        except Exception as exc:  # torch raises TypeError, ValueError, ... for settings it accepted earlier
            raise OptimizerSpecError(f"a trial step of torch.optim.{spec.class_name} failed: {exc}") from None
        buffers = 0
        for p in params:
            state = _per_element(optimizer.state.get(p, {}), TRIAL_ELEMENTS)
            if not _finite(p) or not all(_finite(v) for v in state.values()):
                raise OptimizerSpecError(
                    f"a trial step of torch.optim.{spec.class_name} with these hyperparameters gives NaN or Inf"
                )
            buffers = max(buffers, len(state))
        return buffers

    # ------------------------------------------------------------------ a round
    def set_hyperparams(self, groups: Sequence[dict]) -> None:
        """Every group's hyperparameters from now on (``lr`` too; it is set again each round)."""
        if self.optimizer is None:
            return
        for local, g in enumerate(self.groups):
            self.optimizer.param_groups[local].update({k: v for k, v in groups[g].items() if k not in _IMPL_KEYS})

    def saved_hyperparams(self) -> dict[int, dict]:
        """``{group: {name: value}}`` exactly as the optimizer holds them, for :meth:`set_hyperparams` to put back."""
        if self.optimizer is None:
            return {}
        return {g: {k: v for k, v in self.optimizer.param_groups[local].items() if k not in _IMPL_KEYS}
                for local, g in enumerate(self.groups)}

    def hyperparams(self) -> dict[int, dict]:
        """``{group: {name: value}}`` of the groups this shard steps, as the next round would use them (JSON-able)."""
        if self.optimizer is None:
            return {}
        return {g: {k: list(v) if isinstance(v, tuple) else v for k, v in self.optimizer.param_groups[local].items()
                    if k not in _IMPL_KEYS}
                for local, g in enumerate(self.groups)}

    def _present_grads(self, grads: dict[int, torch.Tensor], present: Collection[int]) -> list[torch.Tensor]:
        return [grads[self.slices[k][0]][self.slices[k][1]:self.slices[k][2]] for k in sorted(present)
                if k in self.slices]

    def report(self, grads: dict[int, torch.Tensor], present: Collection[int], inv_scale: float,
               norm_type: float) -> tuple[float, bool]:
        """Unscale the averaged gradient in place and measure this shard's part of its norm.

        Args:
            grads: the average, ``{group: 1-D float32}``.
            present: plan indices of the keys with a gradient this round.
            inv_scale: GradScaler's ``1/scale``; 0 when the gradients are not scaled.
            norm_type: the norm's order ``p`` (2 for clip_grad_norm_'s default, inf allowed).

        Returns:
            ``(part, found_inf)``: ``sum |g|^p`` over the present elements (their
            max ``|g|`` when ``p`` is inf), and whether the (unscaled) average
            holds Inf or NaN (then ``part`` is meaningless).
        """
        present_grads = self._present_grads(grads, present)
        if not present_grads:
            return 0.0, False
        if inv_scale:
            found = torch.zeros(1)
            torch._amp_foreach_non_finite_check_and_unscale_(present_grads, found, torch.tensor(inv_scale))
            if found.item():
                return math.nan, True
        elif not all(_finite(g) for g in present_grads):
            return math.nan, True
        norms = torch.stack(torch._foreach_norm(present_grads, norm_type)).double()
        if math.isinf(norm_type):
            return norms.max().item(), False
        return norms.pow(norm_type).sum().item(), False

    def apply(self, grads: dict[int, torch.Tensor], present: Collection[int], lrs: Sequence[float],
              clip_coef: float = 1.0, check: bool = True, grad_bound: float | None = None,
              units: Collection[int] | None = None, unit_grads: Mapping[int, torch.Tensor] | None = None) -> None:
        """Step the keys in ``present`` with the averaged ``grads`` (times ``clip_coef``), or refuse.

        Args:
            grads: the average, ``{group: 1-D float32}`` shaped like ``params``
                (the slices of keys not in ``present`` hold zeros, or anything finite).
            present: plan indices of the keys with a gradient this round; the others
                get ``grad = None`` and torch leaves them and their state alone.
            lrs: learning rate of every param group of the model (indexed by group).
            clip_coef: clip_grad_norm_'s clamped coefficient (1 when not clipping).
            check: prove the update finite, or run the dry run, first (off only
                with ``--allow-nonfinite``).
            grad_bound: an upper bound on ``|g|`` over the present slices of
                ``grads`` (before ``clip_coef``), from where the gradient was made
                (:func:`~shardps.server.dense.bounds.average_bound`); None: one pass
                over ``grads`` measures it.
            units: step only these units (a round applied a chunk at a time; each unit
                of a present key exactly once per round); None: every unit.
            unit_grads: ``{unit: 1-D float32}``, a unit's gradient held somewhere
                else than its slice of ``grads`` (a chunk stepped where it was
                received); it is only read. Needs ``grad_bound`` when ``check``.

        Raises:
            RoundRefused: the new parameters or optimizer state would not be
                finite, or torch raised; nothing changed.
        """
        if self.optimizer is None:  # this shard holds no parameter elements
            return
        unit_grads = unit_grads or {}
        if unit_grads and (clip_coef != 1.0 or (check and grad_bound is None)):
            raise ValueError("unit_grads needs clip_coef 1 and, with check, a grad_bound")
        if clip_coef != 1.0:
            torch._foreach_mul_(self._present_grads(grads, present), clip_coef)
        param_groups = self.optimizer.param_groups
        lrs_before = [pg["lr"] for pg in param_groups]
        for local, g in enumerate(self.groups):
            param_groups[local]["lr"] = lrs[g]
        stepped = set()
        for u, view in self.views.items():
            k = self.unit_key[u]
            if k in present and (units is None or u in units):
                group, start, end = self.unit_slices[u]
                view.grad = unit_grads[u] if u in unit_grads else grads[group][start:end]
                stepped.add(group)
            else:
                view.grad = None
        try:
            if not check:
                self._bounds.clear()
                self.optimizer.step()
                return
            if grad_bound is not None:
                grad_bound *= max(1.0, abs(clip_coef)) * (1.0 + 2.0**-20)
            proved = self._prove(grads, stepped, grad_bound)
            if proved is None:
                self._dry_run()
            self._step()
            if proved is None:
                self._bounds.clear()  # the bounds did not hold: measure again next round
                self.dry_runs += 1
            else:
                self._bounds.update({g: replace(b, version=self.params[g]._version) for g, b in proved.items()})
                self.proved += 1
        except BaseException:
            for pg, lr in zip(param_groups, lrs_before):
                pg["lr"] = lr
            raise
        finally:
            for view in self.views.values():
                view.grad = None

    def _prove(self, grads: dict[int, torch.Tensor], stepped: Collection[int],
               grad: float | None) -> dict[int, bounds.Bounds] | None:
        """Each stepped group's bounds after this round, or None if they do not prove it finite."""
        cls = type(self.optimizer).__name__
        groups = [(local, g) for local, g in enumerate(self.groups) if g in stepped]
        if grad is None:
            grad = bounds.grad_bound(grads[g] for _, g in groups)
        proved = {}
        for local, g in groups:
            hyper = self.optimizer.param_groups[local]
            try:  # with all-zero parameters and state: if even that fails, measuring cannot help
                bounds.propagate(cls, bounds.Bounds(p=0.0, nonneg=bounds.NONNEG, k=0.0), grad, hyper)
            except bounds.Unprovable:
                return None
            b = self._bounds.get(g)
            for _ in range(2):
                if b is None or b.version != self.params[g]._version:
                    b = bounds.measure(self.optimizer, (self.views[u] for u in self.units_of[g]), self.params[g],
                                       hyper.get("eps"))
                    self._bounds[g] = b
                try:
                    proved[g] = bounds.propagate(cls, b, grad, hyper)
                    break
                except bounds.Unprovable:
                    if b.fresh:
                        return None
                    b = None  # bounds grown over many rounds: measure the buffers and try once more
        return proved

    def _step(self) -> None:
        """``optimizer.step()``; if torch raises, put back the step counts and first-time state, and refuse."""
        state = self.optimizer.state
        stepped = [v for v in self.views.values() if v.grad is not None]
        fresh = [v for v in stepped if not state.get(v)]
        steps = [st["step"] for v in stepped if isinstance((st := state.get(v, {})).get("step"), torch.Tensor)]
        saved = [s.clone() for s in steps] if len(steps) < 64 else torch.stack(steps)
        try:
            self.optimizer.step()
        except Exception as exc:
            for view in fresh:
                state.pop(view, None)
            for s, old in zip(steps, saved):
                s.copy_(old)
            self._bounds.clear()
            raise RoundRefused(f"torch.optim.{type(self.optimizer).__name__}.step() raised: {exc}") from None

    def _trial_optimizer(self, local: int) -> torch.optim.Optimizer:
        """The scratch optimizer the dry run steps for group ``local``, hyperparameters as the live group's."""
        trial = self._trials.get(local)
        if trial is None:
            impl = {"fused": True} if self.optimizer.defaults.get("fused") else {"foreach": True}
            trial = self._trials[local] = type(self.optimizer)([{"params": [self._scratch]}], **impl)
        live = self.optimizer.param_groups[local]
        trial.param_groups[0].update({k: v for k, v in live.items() if k not in _IMPL_KEYS})
        return trial

    def _dry_run(self) -> None:
        """Step copies of every view that has a gradient, a batch of up to SEGMENT elements at a time."""
        for local, g in enumerate(self.groups):
            items = []  # (key, view slice, gradient slice, state)
            for u in self.units_of[g]:
                k, view = self.unit_key[u], self.views[u]
                if view.grad is None:
                    continue
                state = self.optimizer.state.get(view, {})
                for start in range(0, view.numel(), SEGMENT):
                    end = min(view.numel(), start + SEGMENT)
                    items.append((k, start, end, view, state))
            batch, size = [], 0
            for item in items:
                if size + item[2] - item[1] > SEGMENT and batch:
                    self._dry_batch(local, batch)
                    batch, size = [], 0
                batch.append(item)
                size += item[2] - item[1]
            if batch:
                self._dry_batch(local, batch)

    def _dry_batch(self, local: int, batch: list) -> None:
        trial = self._trial_optimizer(local)
        params, states, at = [], {}, 0
        for k, start, end, view, state in batch:
            n = end - start
            p = self._scratch[at : at + n]
            p.copy_(view[start:end])
            p.grad = view.grad[start:end]
            per_element = _per_element(state, view.numel())
            st = {}
            for name, value in state.items():
                if name in per_element:
                    buf = self._state_scratch.setdefault(name, torch.empty(SEGMENT))[at : at + n]
                    st[name] = buf.copy_(value[start:end])
                else:
                    st[name] = value.clone() if isinstance(value, torch.Tensor) else value
            params.append(p)
            states[p] = st
            at += n
        trial.param_groups[0]["params"] = params
        trial.state.clear()
        trial.state.update(states)
        try:
            trial.step()
        except Exception as exc:
            raise RoundRefused(f"torch.optim.{type(trial).__name__}.step() raised: {exc}") from None
        finally:
            for p in params:
                p.grad = None
        for (k, start, end, view, _), p in zip(batch, params):
            state_finite = all(_finite(v) for v in _per_element(trial.state[p], end - start).values())
            if _finite(p) and state_finite:
                continue
            # why (only on this failure path: a finite round pays for no extra pass over the gradient)
            if not _finite(view.grad[start:end]):
                raise RoundRefused("the averaged gradient is not finite (the workers' sum overflows float32)", k)
            what = "optimizer state" if _finite(p) else "parameters"
            raise RoundRefused(f"the update would make the {what} non-finite", k)
        trial.state.clear()

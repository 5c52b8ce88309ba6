"""Magnitude bounds that prove a round's update finite before it is applied.

:class:`~shardps.server.dense.optimizer.ShardOptimizer` keeps, per param
group, a :class:`Bounds`: upper bounds on ``|x|`` of the parameters and of
every per-element optimizer-state buffer (plus, for Adam, a bound on
``|exp_avg| / (sqrt(exp_avg_sq) + e)``). Each round it measures one number
over the averaged gradient, an upper bound ``G`` on ``|g|`` (one fused pass,
:func:`grad_bound`, which also finds NaN/Inf), and :func:`propagate` runs the
optimizer's formulas on the bounds instead of on the tensors: every
intermediate value the torch kernel computes for any element is bounded by
at most ``LIMIT`` = 2**100, eight orders of magnitude below float32's
largest finite value, or the proof fails. A proof also needs the structural
facts torch's formulas rely on: ``eps`` >= 2**-100 (a denominator bounded
away from 0), the buffers whose square root is taken known >= 0, ``betas``
and ``alpha`` in [0, 1), Adam step counts >= 0, ``lr_decay`` >= 0, no
centered RMSprop (its ``square_avg - grad_avg**2`` may round below 0).

Why a bound is a proof: with every input finite and every intermediate
magnitude <= 2**100, no float32 operation of the step overflows, no
denominator is 0 and no square root is taken of a negative number, so every
value written is finite. Rounding is covered by multiplying each bound by
``SLACK`` = 1 + 2**-16 (a step's longest chain has about ten float32
roundings of 2**-24 each); values below 2**-50 are covered by absolute
floors. The bounds after the step are the proof's outputs (never below the
old bounds: keys without a gradient keep their values), so they stay valid
round after round without reading the buffers again; they only grow, and
when a proof fails on grown bounds the shard measures the buffers afresh
(``measure``) and tries again before falling back to the exact dry run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

LIMIT = 2.0**100  # largest intermediate magnitude a proof allows (float32 overflows at ~2**128)
SLACK = 1.0 + 2.0**-16  # rounding of one step's chain of float32 operations, with a wide margin
TINY = 2.0**-50  # |g| below this may square to 0 (underflow): ratios g/sqrt(g*g) are bounded by TINY/eps
E_FLOOR = 2.0**-40  # smallest e of Adam's |m| <= K (sqrt(v) + e) bound (absorbs underflow)
PIECE = 1 << 24  # elements per dot product in grad_bound (bounds the summation depth)
_DOT_FACTOR = (1.0 - 2.0**-24) ** -(PIECE + 1) * (1.0 + 2.0**-20)  # true sum of squares <= computed * this
NONNEG = {"exp_avg_sq", "max_exp_avg_sq", "sum", "square_avg"}  # buffers torch takes the square root of


class Unprovable(Exception):
    """The bounds do not prove this round finite (the exact dry run decides)."""


@dataclass
class Bounds:
    """Upper bounds on one param group's magnitudes; see the module docstring.

    Attributes:
        p: bound on ``|param|`` over the group's whole buffer.
        state: ``{name: bound on |value|}`` of each per-element buffer (a missing
            name: no key holds it yet; torch creates it as zeros, or as the gradient).
        nonneg: names of the buffers known to hold no negative value.
        k, e: Adam only: ``|exp_avg| <= k * (sqrt(exp_avg_sq) + e)`` everywhere (k None: unknown).
        steps_ok: every step count is >= 0 (Adam, Adagrad); ``step_max`` bounds them.
        version: the parameter buffer's ``_version`` these bounds describe.
        fresh: measured from the buffers (not propagated).
    """

    p: float
    state: dict[str, float] = field(default_factory=dict)
    nonneg: frozenset[str] = frozenset()
    k: float | None = None
    e: float = E_FLOOR
    steps_ok: bool = True
    step_max: float = 0.0
    version: int = -1
    fresh: bool = False


def _check(*values: float) -> None:
    for v in values:
        if not v <= LIMIT:  # NaN too
            raise Unprovable


def _absmax(t: torch.Tensor) -> tuple[float, float]:
    """``(max |t|, min t)``; inf when ``t`` holds NaN or Inf."""
    if t.numel() == 0:
        return 0.0, 0.0
    lo, hi = (v.item() for v in torch.aminmax(t))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return math.inf, lo
    return max(-lo, hi), lo


def grad_bound(buffers: Iterable[torch.Tensor]) -> float:
    """An upper bound on ``|g|`` over ``buffers``; inf if any element is NaN or Inf (or too large to square).

    One pass: a dot product of each piece of up to ``PIECE`` elements with
    itself, last piece first (the step that follows starts where this pass
    ended, so its first gradient elements may still be in cache). A float32
    sum of ``n`` non-negative terms is at least the true sum times
    ``(1 - 2**-24)**(n + 1)`` whatever the summation order, and the true sum
    is at least ``max g**2``. (``torch.dot``, not a matmul: a reduced
    ``float32_matmul_precision`` never applies to it.)
    """
    worst = 0.0
    for buf in reversed(list(buffers)):
        for start in reversed(range(0, buf.numel(), PIECE)):
            piece = buf[start : start + PIECE]
            d = torch.dot(piece, piece).item()
            if not math.isfinite(d):
                return math.inf
            worst = max(worst, d)
    return math.sqrt(worst * _DOT_FACTOR) * (1.0 + 2.0**-20) + 2.0**-60


def average_bound(worker_bounds: Sequence[float], inv_scale: float = 0.0) -> float:
    """A bound on ``|g|`` of the average of the workers' gradients, from a bound on each worker's.

    Each worker's bound is what :func:`grad_bound` gives over the chunks it
    pushed (for instance as the receiver copies each chunk, while it is in
    cache). The sum of ``W`` values cannot overflow when ``W * max`` is at
    most ``LIMIT``, and then ``|average| <= max`` up to rounding. ``inv_scale``:
    GradScaler's ``1/scale`` when the average is unscaled (0: not scaled).
    """
    if not worker_bounds:
        return 0.0
    top = max(worker_bounds)
    if not len(worker_bounds) * top <= LIMIT:
        return math.inf
    return top * (1.0 + len(worker_bounds) * 2.0**-22) * (abs(inv_scale) if inv_scale else 1.0) * (1.0 + 2.0**-22)


def measure(optimizer: torch.optim.Optimizer, views: Iterable[torch.Tensor], buffer: torch.Tensor,
            eps: object) -> Bounds:
    """Bounds read from the buffers themselves (a pass over the group's parameters and state).

    Args:
        views: the group's parameter views (one per key).
        buffer: the group's flat parameter buffer.
        eps: the group's ``eps`` (Adam's ``e`` is ``max(eps, E_FLOOR)``).
    """
    p, _ = _absmax(buffer)
    b = Bounds(p=p, fresh=True, version=buffer._version)
    negative: set[str] = set()
    steps = []
    adam = []
    for view in views:
        st = optimizer.state.get(view)
        if not st:
            continue
        for name, value in st.items():
            if not isinstance(value, torch.Tensor):
                continue
            if name == "step":
                steps.append(value)
            elif value.dim() == 1 and value.numel() == view.numel():
                top, low = _absmax(value)
                b.state[name] = max(b.state.get(name, 0.0), top)
                if not low >= 0:
                    negative.add(name)
        if isinstance(st.get("exp_avg"), torch.Tensor) and isinstance(st.get("exp_avg_sq"), torch.Tensor):
            adam.append((st["exp_avg"], st["exp_avg_sq"]))
    b.nonneg = frozenset(set(b.state) - negative | (NONNEG - set(b.state)))
    if steps:
        lo, hi = (v.item() for v in torch.aminmax(torch.stack([s.reshape(()).double() for s in steps])))
        b.steps_ok, b.step_max = lo >= 0 and math.isfinite(hi), hi
    if isinstance(eps, (int, float)) and not isinstance(eps, bool) and math.isfinite(eps):
        b.e = max(float(eps), E_FLOOR)
    b.k = None if "exp_avg_sq" in negative else 0.0  # no Adam state yet: every |m| is 0
    for m, v in adam:
        for start in range(0, m.numel(), 1 << 20):  # bounded scratch
            if b.k is None:
                break
            ms, vs = m[start : start + (1 << 20)], v[start : start + (1 << 20)]
            ratio = (ms.abs() / (vs.sqrt() + b.e)).max().item()
            b.k = max(b.k, ratio * SLACK) if math.isfinite(ratio) else None
    return b


# ------------------------------------------------------------------ hyperparameters, strictly typed
def _num(group: dict, name: str) -> float:
    v = group.get(name)
    if type(v) not in (int, float) or not math.isfinite(v) or abs(v) > LIMIT:
        raise Unprovable
    return float(v)


def _flag(group: dict, name: str) -> bool:
    v = group.get(name)
    if type(v) is not bool:
        raise Unprovable
    return v


def _eps(group: dict) -> float:
    eps = _num(group, "eps")
    if not eps >= 2.0**-100:
        raise Unprovable
    return eps


def _plain(group: dict) -> None:
    """Options this proof does not model (never set by a shard) must be off."""
    for name in ("capturable", "differentiable"):
        if group.get(name):
            raise Unprovable


# ------------------------------------------------------------------ one round, per optimizer class
def propagate(class_name: str, b: Bounds, grad: float, group: dict) -> Bounds:
    """The bounds after one step of ``class_name`` with gradient bound ``grad``.

    Raises:
        Unprovable: some intermediate value could exceed ``LIMIT``, a structural
            condition is not known to hold, or a hyperparameter is not a plain
            finite number (bool for flags) -- torch might raise or produce NaN.
    """
    _plain(group)
    _check(grad)
    step = _STEPS.get(class_name)
    if step is None:
        raise Unprovable
    out = step(b, grad, group)
    out.version, out.fresh = b.version, False
    return out


def _decayed(b: Bounds, grad: float, group: dict) -> tuple[float, float]:
    """``(lr, bound on |g + weight_decay * p|)``."""
    lr, wd = abs(_num(group, "lr")), abs(_num(group, "weight_decay"))
    _flag(group, "maximize")
    g1 = (grad + wd * b.p) * SLACK
    _check(g1)
    return lr, g1


def _sgd(b: Bounds, grad: float, group: dict) -> Bounds:
    lr, g1 = _decayed(b, grad, group)
    momentum, dampening = _num(group, "momentum"), _num(group, "dampening")
    nesterov = _flag(group, "nesterov")
    state = dict(b.state)
    step = g1
    if momentum != 0:
        mom, buf = abs(momentum), b.state.get("momentum_buffer", 0.0)
        new = max(buf, (mom * buf + abs(1.0 - dampening) * g1) * SLACK, g1)  # g1: a key's first step
        _check(new)
        state["momentum_buffer"] = new
        step = (g1 + mom * new) * SLACK if nesterov else new
    update = lr * step * SLACK
    p = max(b.p, (b.p + update) * SLACK)
    _check(update, p)
    return Bounds(p=p, state=state, nonneg=b.nonneg, steps_ok=b.steps_ok, step_max=b.step_max)


def _adam_k(beta1: float, beta2: float) -> float | None:
    """The fixed point ``K*`` of Adam's ``|m| <= K (sqrt(v) + e)`` (None if it has none), for float32-cast betas."""
    d = 2.0**-20
    b1, c1 = beta1 * (1 + d), (1.0 - beta1) * (1 + d)
    b2, c2 = beta2 * (1 - d), (1.0 - beta2) * (1 - d)
    if b2 <= 0 or c2 <= 0:
        return None
    shrink = 1.0 - b1 / math.sqrt(b2)
    if shrink <= 2.0**-20:
        return None
    return c1 / math.sqrt(c2) / shrink


def _adam(b: Bounds, grad: float, group: dict) -> Bounds:
    lr, wd = abs(_num(group, "lr")), abs(_num(group, "weight_decay"))
    eps = _eps(group)
    betas = group.get("betas")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise Unprovable
    beta1, beta2 = _num({"b": betas[0]}, "b"), _num({"b": betas[1]}, "b")
    amsgrad, decoupled = _flag(group, "amsgrad"), _flag(group, "decoupled_weight_decay")
    _flag(group, "maximize")
    if not (0 <= beta1 < 1 and 0 <= beta2 < 1 and b.steps_ok and b.step_max < 2.0**31
            and "exp_avg_sq" in b.nonneg):
        raise Unprovable
    step_size = lr / (1.0 - beta1) * SLACK  # bias correction 1 - beta1**t is smallest at t = 1
    if decoupled:
        p1, g1 = b.p * abs(1.0 - lr * wd) * SLACK, grad
    else:
        p1, g1 = b.p, (grad + wd * b.p) * SLACK
    m, v = b.state.get("exp_avg", 0.0), b.state.get("exp_avg_sq", 0.0)
    m_new, v_new = max(m, g1) * SLACK, max(v, g1 * g1) * SLACK  # convex combinations of old and new
    denom_max = max(v_new, b.state.get("max_exp_avg_sq", 0.0)) if amsgrad else v_new
    _check(step_size, p1, g1, g1 * g1, g1 + m, m_new, v_new, step_size * m_new, m_new / (1.0 - beta1) * SLACK,
           math.sqrt(denom_max) / math.sqrt(1.0 - beta2) * SLACK)  # sqrt(v) / sqrt(1 - beta2**t)
    ratio = m_new / eps * SLACK  # |m| / (sqrt(v)/bc + eps): the denominator is at least eps
    k_star = _adam_k(beta1, beta2)
    k = None
    if b.k is not None and k_star is not None:
        k = max(b.k, k_star, 1.0) * SLACK
        ratio = min(ratio, k * max(1.0, b.e / eps) * SLACK)
    update = step_size * ratio * SLACK  # (step_size * m) / denom, or step_size * (m / denom): both bounded
    p = max(b.p, (p1 + update) * SLACK)
    _check(ratio, update, p)
    state = {**b.state, "exp_avg": m_new, "exp_avg_sq": v_new}
    if amsgrad:
        state["max_exp_avg_sq"] = denom_max
    return Bounds(p=p, state=state, nonneg=b.nonneg, k=k, e=b.e, steps_ok=True, step_max=b.step_max + 1)


def _adagrad(b: Bounds, grad: float, group: dict) -> Bounds:
    lr, g1 = _decayed(b, grad, group)
    eps = _eps(group)
    if not (_num(group, "lr_decay") >= 0 and b.steps_ok and "sum" in b.nonneg):
        raise Unprovable  # clr = lr / (1 + (t - 1) * lr_decay) <= lr for t >= 1
    _check(g1 * g1)
    total = (b.state.get("sum", 0.0) + g1 * g1) * SLACK
    ratio = max(1.0, TINY / eps) * SLACK  # |g| / (sqrt(sum + g*g) + eps)
    update = lr * ratio * SLACK
    p = max(b.p, (b.p + update) * SLACK)
    _check(total, lr * g1 * SLACK, update, p)
    return Bounds(p=p, state={**b.state, "sum": total}, nonneg=b.nonneg, steps_ok=True, step_max=b.step_max + 1)


def _rmsprop(b: Bounds, grad: float, group: dict) -> Bounds:
    lr, g1 = _decayed(b, grad, group)
    eps, alpha, momentum = _eps(group), _num(group, "alpha"), _num(group, "momentum")
    if _flag(group, "centered") or not (0 <= alpha <= 1 and "square_avg" in b.nonneg):
        raise Unprovable
    _check(g1 * g1)
    square = max(b.state.get("square_avg", 0.0), g1 * g1) * SLACK
    ratio = g1 / eps * SLACK  # |g| / (sqrt(square_avg) + eps)
    if alpha < 1:
        ratio = min(ratio, max(1.0, TINY / eps) / math.sqrt(1.0 - alpha) * SLACK)
    state = {**b.state, "square_avg": square}
    step = ratio
    if momentum > 0:
        buf = b.state.get("momentum_buffer", 0.0)
        step = state["momentum_buffer"] = max(buf, (momentum * buf + ratio) * SLACK)
    update = lr * step * SLACK
    p = max(b.p, (b.p + update) * SLACK)
    _check(square, ratio, step, update, p, lr * g1 * SLACK)  # addcdiv computes (-lr * g) / avg
    return Bounds(p=p, state=state, nonneg=b.nonneg, steps_ok=b.steps_ok, step_max=b.step_max)


_STEPS = {"SGD": _sgd, "Adam": _adam, "AdamW": _adam, "Adagrad": _adagrad, "RMSprop": _rmsprop}

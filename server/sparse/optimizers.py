"""Row-wise optimizers: one update of the rows a round touched, with torch's sparse semantics.

Each function updates ``weights`` (float32 ``[n, dim]``, the touched rows,
gathered) and ``state`` (``{name: float32 [n, width]}``) in place from the
averaged gradient ``grad`` (float32 ``[n, dim]``, one row per unique id),
with the same operations, in the same order, as torch's own optimizer on
a sparse gradient, so sync training matches one process running
``nn.Embedding(sparse=True)`` with it:

- ``sgd``: ``torch.optim.SGD`` (no momentum, no weight decay);
- ``adagrad``: ``torch.optim.Adagrad`` (Duchi et al., JMLR 2011), ``step`` the table's optimizer steps;
- ``rowwise_adagrad``: one accumulator per row, the mean of the squared
  gradient over the row (FBGEMM's ``EXACT_ROWWISE_ADAGRAD``; Gupta et
  al., "Training recommender systems at scale", 2014); no torch oracle;
- ``sparse_adam``: ``torch.optim.SparseAdam`` (moments updated only for the rows in the gradient);
- ``adam``: ``torch.optim.Adam``/``AdamW``'s update (Kingma and Ba, ICLR 2015; eps added after the bias
  correction, unlike SparseAdam) on the touched rows only: lazy Adam, the table's step count for the
  bias corrections.

``weight_decay`` acts as torch's optimizers apply it to a parameter whose gradient is dense, restricted to
the touched rows: ``grad + weight_decay * row`` before the update (L2), or, with
``decoupled_weight_decay`` (AdamW), ``row *= 1 - lr * weight_decay`` first. A row the round does not touch
is not decayed (as FBGEMM's fused table optimizers and torch's sparse optimizers leave it).
"""

from __future__ import annotations

import math

import torch


def initial_values(optimizer: str, hyper: dict[str, float]) -> dict[str, float]:
    """The value every element of a new row's state starts from: ``{state name: value}``."""
    if optimizer in ("adagrad", "rowwise_adagrad"):
        return {"sum": float(hyper["initial_accumulator_value"])}
    if optimizer in ("sparse_adam", "adam"):
        return {"exp_avg": 0.0, "exp_avg_sq": 0.0}
    return {}


def update(optimizer: str, hyper: dict[str, float], weights: torch.Tensor, state: dict[str, torch.Tensor],
           grad: torch.Tensor, lr: float, step: int) -> None:
    """Apply one step (``step``: the table's optimizer steps so far, this one included; 1-based)."""
    decay = hyper.get("weight_decay", 0.0)
    if decay and hyper.get("decoupled_weight_decay"):
        weights.mul_(1 - lr * decay)
    elif decay:
        grad = grad.add(weights, alpha=decay)
    if optimizer == "sgd":
        weights.add_(grad, alpha=-lr)
    elif optimizer == "adagrad":
        clr = lr / (1 + (step - 1) * hyper["lr_decay"])
        state["sum"].add_(grad.pow(2))
        std = state["sum"].sqrt().add_(hyper["eps"])
        weights.add_(grad / std, alpha=-clr)
    elif optimizer == "rowwise_adagrad":
        state["sum"].add_(grad.pow(2).mean(dim=1, keepdim=True))
        std = state["sum"].sqrt().add_(hyper["eps"])
        weights.add_(grad / std, alpha=-lr)
    elif optimizer == "sparse_adam":
        beta1, beta2, eps = hyper["beta1"], hyper["beta2"], hyper["eps"]
        old_avg, old_sq = state["exp_avg"].clone(), state["exp_avg_sq"].clone()
        avg_update = grad.sub(old_avg).mul_(1 - beta1)
        state["exp_avg"].add_(avg_update)
        sq_update = grad.pow(2).sub_(old_sq).mul_(1 - beta2)
        state["exp_avg_sq"].add_(sq_update)
        numer = avg_update.add_(old_avg)
        sq_update.add_(old_sq)
        denom = sq_update.sqrt_().add_(eps)
        step_size = lr * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)
        weights.add_(-step_size * numer.div_(denom))
    elif optimizer == "adam":  # torch.optim.adam._single_tensor_adam's operations, in its order
        beta1, beta2, eps = hyper["beta1"], hyper["beta2"], hyper["eps"]
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = lr / (1 - beta1 ** step)
        denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
        weights.addcdiv_(state["exp_avg"], denom, value=-step_size)
    else:  # TableSpec refuses any other name
        raise AssertionError(optimizer)

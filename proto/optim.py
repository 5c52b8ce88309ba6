"""Optimizer spec: which ``torch.optim`` class the shards run, and with what.

Only element-wise optimizers can be sharded by chunk: each element's update
depends on that element's gradient and state alone, so running the class
over a shard's flat slice gives bit-for-bit the math of running it over the
whole model (the ZeRO observation, Rajbhandari et al., SC 2020). Optimizers
with per-tensor quantities (LAMB, LARS, LBFGS, Adafactor, ...) are rejected.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import torch

from shardps.proto import shardps_pb2 as pb

#: Classes a shard may run, and whether torch has a fused CPU kernel for them.
SHARDABLE: dict[str, bool] = {"SGD": True, "Adam": True, "AdamW": True, "Adagrad": True, "RMSprop": False}

# Keys of a param group that are implementation choices the shard makes itself
# (or scheduler bookkeeping), not hyperparameters.
_IMPLEMENTATION_KEYS = {"params", "foreach", "fused", "capturable", "differentiable", "initial_lr"}


class OptimizerSpecError(ValueError):
    """The optimizer cannot run on the shards (the message says what to use instead)."""


def check_shardable(class_name: str) -> None:
    """Raise :class:`OptimizerSpecError` unless ``class_name`` is an element-wise optimizer we shard."""
    if class_name not in SHARDABLE:
        raise OptimizerSpecError(
            f"optimizer {class_name} cannot be sharded by chunk: shardps runs only element-wise "
            f"optimizers ({', '.join(sorted(SHARDABLE))}); per-tensor optimizers such as LAMB or LARS "
            "need whole-tensor norms"
        )


def _jsonable(value: object, where: str) -> object:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise OptimizerSpecError(f"{where} is a tensor of {value.numel()} elements; use a number")
        return value.item()  # host sync: once per step, outside any hook
    if isinstance(value, (tuple, list)):
        return [_jsonable(v, where) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise OptimizerSpecError(f"{where} is {value}; hyperparameters must be finite")
        return value
    raise OptimizerSpecError(f"{where} has type {type(value).__name__}, which cannot be sent to the shards")


def group_hyperparams(group: dict, index: int) -> dict:
    """The hyperparameters of one param group as a JSON-able dict (no ``params``)."""
    return {
        k: _jsonable(v, f"param_groups[{index}][{k!r}]")
        for k, v in sorted(group.items())
        if k not in _IMPLEMENTATION_KEYS
    }


def optimizer_spec(optimizer: torch.optim.Optimizer) -> pb.OptimizerSpec:
    """Describe ``optimizer`` (class and per-group hyperparameters) for the shards.

    Raises:
        OptimizerSpecError: the class is not shardable or a hyperparameter cannot be sent.
    """
    name = type(optimizer).__name__
    check_shardable(name)
    if type(optimizer) is not getattr(torch.optim, name):
        raise OptimizerSpecError(
            f"{type(optimizer).__module__}.{name} is not torch.optim.{name}; shards run torch.optim classes only"
        )
    return pb.OptimizerSpec(
        class_name=name,
        group_hyperparams_json=[
            json.dumps(group_hyperparams(g, i), sort_keys=True) for i, g in enumerate(optimizer.param_groups)
        ],
    )


def current_lrs(optimizer: torch.optim.Optimizer) -> list[float]:
    """The current ``lr`` of each param group (what LR schedulers change), as floats."""
    return [float(g["lr"]) for g in optimizer.param_groups]


def build_optimizer(
    spec: pb.OptimizerSpec, flat_params: Sequence[tuple[int, torch.Tensor]]
) -> torch.optim.Optimizer | None:
    """Construct ``spec``'s optimizer over a shard's flat fp32 buffers.

    Args:
        spec: from :func:`optimizer_spec`.
        flat_params: ``(group_index, flat fp32 leaf tensor)`` for each param
            group the shard holds elements of.

    Returns:
        The optimizer (fused kernel where torch has one, foreach otherwise),
        or ``None`` when the shard holds no elements.

    Raises:
        OptimizerSpecError: unknown class, malformed hyperparameters, or torch rejects them.
    """
    check_shardable(spec.class_name)
    groups = []
    for g, tensor in flat_params:
        if g >= len(spec.group_hyperparams_json):
            raise OptimizerSpecError(
                f"the partition plan uses param group {g} but the optimizer spec has "
                f"{len(spec.group_hyperparams_json)} group(s)"
            )
        try:
            hp = json.loads(spec.group_hyperparams_json[g])
        except json.JSONDecodeError as exc:
            raise OptimizerSpecError(f"hyperparameters of param group {g} are not valid JSON: {exc}") from exc
        if not isinstance(hp, dict):
            raise OptimizerSpecError(f"hyperparameters of param group {g} must be a JSON object")
        hp = {k: tuple(v) if isinstance(v, list) else v for k, v in hp.items() if k not in _IMPLEMENTATION_KEYS}
        groups.append({"params": [tensor], **hp})
    if not groups:
        return None
    cls = getattr(torch.optim, spec.class_name)
    impl = {"fused": True} if SHARDABLE[spec.class_name] else {"foreach": True}
    try:
        return cls(groups, **impl)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise OptimizerSpecError(f"torch.optim.{spec.class_name} rejected the hyperparameters: {exc}") from exc

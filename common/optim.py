"""Optimizer spec: which ``torch.optim`` class the shards run, and with what.

Only element-wise optimizers can be sharded by chunk: each element's update
depends on that element's gradient and state alone, so running the class
over a shard's flat slice gives the math of running it over the whole model
(the ZeRO observation, Rajbhandari et al., SC 2020): the same operations per
element, equal to float32 rounding. Bit for bit only where both cut the
tensors at the same places: torch's fused CPU kernels round the last few
elements of each tensor (their scalar tail) differently from the vectorised
body on AVX2/AVX-512, and shard boundaries fall anywhere. Optimizers
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

#: Limits on one param group's hyperparameters as the shard reads them.
MAX_HYPERPARAMS_JSON_CHARS = 4096
MAX_HYPERPARAMS = 32
MAX_HYPERPARAM_NAME_CHARS = 64
MAX_HYPERPARAM_LIST = 8


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


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a finite number")


def _check_value(value: object, where: str) -> object:
    if value is None or isinstance(value, (bool, str)):
        if isinstance(value, str):
            raise OptimizerSpecError(f"{where} is the string {value[:40]!r}; hyperparameters are numbers or booleans")
        return value
    if isinstance(value, (int, float)):
        if isinstance(value, int) and abs(value) > 2**53:  # beyond this an int is not a float's worth
            raise OptimizerSpecError(f"{where} is an integer of {len(str(value))} digits; hyperparameters must be "
                                     "numbers a float holds exactly")
        if not math.isfinite(value):
            raise OptimizerSpecError(f"{where} is {value}; hyperparameters must be finite")
        return value
    if isinstance(value, list):
        if not 0 < len(value) <= MAX_HYPERPARAM_LIST or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
        ):
            raise OptimizerSpecError(f"{where} must be a list of 1 to {MAX_HYPERPARAM_LIST} numbers")
        for v in value:
            _check_value(v, where)
        return tuple(value)
    raise OptimizerSpecError(f"{where} has type {type(value).__name__}; hyperparameters are numbers or booleans")


def parse_hyperparams(spec: pb.OptimizerSpec) -> list[dict]:
    """Each param group's hyperparameters from ``spec``, checked strictly.

    Every group must be a JSON object of at most ``MAX_HYPERPARAMS`` entries
    (``MAX_HYPERPARAMS_JSON_CHARS`` characters) whose values are finite
    numbers, booleans, null, or short lists of finite numbers (``betas``).
    ``NaN``/``Infinity`` literals and strings are refused. Implementation
    keys (``fused``, ``foreach``, ...) are dropped: the shard picks those.

    Returns:
        One dict per param group, lists turned into tuples.

    Raises:
        OptimizerSpecError: the first violation, naming the group and key.
    """
    groups = []
    for g, text in enumerate(spec.group_hyperparams_json):
        where = f"hyperparameters of param group {g}"
        if len(text) > MAX_HYPERPARAMS_JSON_CHARS:
            raise OptimizerSpecError(f"{where} are {len(text)} characters long (at most {MAX_HYPERPARAMS_JSON_CHARS})")
        try:
            hp = json.loads(text, parse_constant=_reject_constant)
        except ValueError as exc:  # JSONDecodeError is a ValueError
            raise OptimizerSpecError(f"{where} are not valid JSON: {exc}") from None
        if not isinstance(hp, dict):
            raise OptimizerSpecError(f"{where} must be a JSON object")
        if len(hp) > MAX_HYPERPARAMS:
            raise OptimizerSpecError(f"{where} has {len(hp)} entries (at most {MAX_HYPERPARAMS})")
        out = {}
        for name, value in hp.items():
            if not name or len(name) > MAX_HYPERPARAM_NAME_CHARS:
                raise OptimizerSpecError(f"{where}: a name must have 1 to {MAX_HYPERPARAM_NAME_CHARS} characters")
            if name not in _IMPLEMENTATION_KEYS:
                out[name] = _check_value(value, f"param_groups[{g}][{name!r}]")
        groups.append(out)
    return groups


def build_optimizer(
    spec: pb.OptimizerSpec, group_params: Sequence[tuple[int, Sequence[torch.Tensor]]]
) -> torch.optim.Optimizer | None:
    """Construct ``spec``'s optimizer over a shard's parameters.

    Args:
        spec: from :func:`optimizer_spec`.
        group_params: ``(group_index, [1-D fp32 tensors])`` for each param group
            the shard holds elements of (one tensor per key).

    Returns:
        The optimizer (fused kernel where torch has one, foreach otherwise),
        or ``None`` when the shard holds no elements.

    Raises:
        OptimizerSpecError: unknown class, malformed hyperparameters, or torch rejects them.
    """
    check_shardable(spec.class_name)
    hyperparams = parse_hyperparams(spec)
    groups = []
    for g, tensors in group_params:
        if g >= len(hyperparams):
            raise OptimizerSpecError(
                f"the partition plan uses param group {g} but the optimizer spec has {len(hyperparams)} group(s)"
            )
        groups.append({"params": list(tensors), **hyperparams[g]})
    if not groups:
        return None
    cls = getattr(torch.optim, spec.class_name)
    impl = {"fused": True} if SHARDABLE[spec.class_name] else {"foreach": True}
    try:
        return cls(groups, **impl)
    except Exception as exc:  # torch raises TypeError, ValueError, IndexError, ... for bad settings
        raise OptimizerSpecError(f"torch.optim.{spec.class_name} rejected the hyperparameters: {exc}") from exc

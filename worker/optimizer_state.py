"""The optimizer state, gathered from the shards into ``torch.optim``'s own ``state_dict`` format and back.

A checkpoint saved from :meth:`DistributedOptimizer.state_dict` loads into a
plain ``torch.optim`` optimizer of the same class over the same parameters,
and a plain optimizer's ``state_dict()`` loads into a new job through
:meth:`DistributedOptimizer.load_state_dict`:

    {"state": {index: {"step": tensor(), "exp_avg": tensor(shape), ...}},
     "param_groups": [{"lr": ..., ..., "params": [index, ...]}, ...]}

where ``index`` counts the optimizer's parameters group by group, as
``torch.optim.Optimizer.state_dict`` does. Per-element entries have the
parameter's shape and are fp32 (the shards' precision); ``step`` is a
0-dimensional fp32 tensor. Parameters that were never stepped have no entry.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from shardps.proto import shardps_pb2 as pb
from shardps.common.codec import FrameError, copy_payload, decode_frame, encode_chunk, encode_round
from shardps.common.plan import PartitionPlan
from shardps.worker.session.client import ShardClient

#: State entries that hold one value per parameter (the rest hold one per element).
SCALAR_STATE = frozenset({"step"})


_ROUTED = ("state_dict", "load_state_dict", "step")


def refusing_step(wrapper: str = ""):
    """A ``step`` for a wrapped optimizer that raises, naming what to call instead.

    ``wrapper``: ``"NodeOptimizer"`` for the node's advice; ``""``: DistributedOptimizer's.
    LR schedulers see it as their own wrapped step (the wrapper's step tells them a step happened).
    """
    def step(*args, **kwargs):
        raise RuntimeError(
            f"this optimizer is wrapped by a {wrapper}, whose shards run the update: call node_opt.step() on "
            "every local rank" if wrapper else
            "this optimizer is wrapped by a DistributedOptimizer, whose shards run the update: call dist.step() "
            "(with a GradScaler: DistributedOptimizer(..., grad_scaler=scaler), then dist.step(); scaler.update())"
        )

    step._wrapped_by_lr_sched = True  # what LR schedulers look for
    return step


#: The GradScaler method that reads an optimizer's ``param_groups`` to unscale its gradients in place (``unscale_``,
#: and ``step`` through it). Recognised by name: the guard below never calls it.
_SCALER_UNSCALES = "_unscale_grads_"


class GuardedGroups(list):
    """A wrapped optimizer's ``param_groups`` (the same dicts) that a ``GradScaler`` may not unscale.

    ``scaler.unscale_(opt)`` and ``scaler.step(opt)`` (which unscales first)
    iterate ``opt.param_groups`` and unscale every ``p.grad`` in place, one
    worker at a time; then ``clip_grad_norm_`` would clip each worker's own
    gradient and a worker that found Inf would skip a round the others run.
    None of that is what the shards do (the supported ``grad_scaler=`` path
    unscales and clips the averaged gradient and skips on every worker
    alike), so the first such call raises instead, before any gradient
    changed. Everything else (LR schedulers, ``zero_grad``, the wrapper)
    iterates it as the plain list it is. The same guard covers the wrapper,
    whose ``param_groups`` is this list.
    """

    advice = ""

    def __iter__(self):
        caller = inspect.currentframe().f_back
        if (caller is not None and caller.f_code.co_name == _SCALER_UNSCALES
                and isinstance(caller.f_locals.get("self"), torch.amp.GradScaler)):
            raise RuntimeError(self.advice)
        return super().__iter__()


def scaler_advice(wrapper: str) -> str:
    """What ``scaler.unscale_(x)`` / ``scaler.step(x)`` raise for an optimizer wrapped by ``wrapper``."""
    if wrapper:
        return (f"GradScaler.unscale_/step on an optimizer wrapped by a {wrapper}: its shards run the update, and "
                f"a {wrapper} takes no grad_scaler=; use DistributedOptimizer(..., grad_scaler=scaler) on every rank, "
                "or bf16 autocast (no GradScaler)")
    return ("GradScaler.unscale_/step on a DistributedOptimizer or the optimizer it wraps: the shards run the update, "
            "so a scaler cannot unscale or step it here (each worker would unscale, clip and skip on its own, unlike "
            "one process). Pass DistributedOptimizer(..., grad_scaler=scaler) (and max_grad_norm=... instead of "
            "clip_grad_norm_), then: scaler.scale(loss).backward(); dist.step(); scaler.update()")


def redirect(optimizer: torch.optim.Optimizer, state_dict, load_state_dict, wrapper: str = "") -> dict:
    """Replace the wrapped optimizer's ``state_dict``/``load_state_dict`` by the given ones; make its ``step`` raise.

    A DistributedOptimizer routes them to the shards: the optimizer's own
    state would be empty (the shards hold it), and its own ``step`` would
    update the model locally, behind the shards' back, so code that calls
    ``opt.state_dict()`` or ``scaler.step(opt)`` must not silently do either.
    A NodeOptimizer's other local ranks keep their own methods and only
    lose ``step`` (:func:`refusing_step` with ``wrapper``). Its ``param_groups``
    become a :class:`GuardedGroups` (same dicts), so that ``scaler.unscale_``
    and ``scaler.step`` raise at once instead of unscaling behind the shards' back.

    Returns:
        What :func:`restore` needs to undo this (the instance attributes replaced).
    """
    saved = {name: optimizer.__dict__[name] for name in _ROUTED if name in optimizer.__dict__}
    optimizer.state_dict, optimizer.load_state_dict = state_dict, load_state_dict
    optimizer.step = refusing_step(wrapper)
    groups = optimizer.param_groups
    if not isinstance(groups, GuardedGroups):
        guarded = GuardedGroups(groups)
        guarded.advice = scaler_advice(wrapper)
        saved["param_groups"] = (groups, guarded)
        optimizer.param_groups = guarded
    return saved


def restore(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Undo :func:`redirect`: the optimizer's own methods (or what was patched before) come back, and its own
    ``param_groups`` list (holding any group added meanwhile)."""
    saved = dict(saved)
    groups = saved.pop("param_groups", None)
    if groups is not None:
        own, guarded = groups
        own[:] = list.__iter__(guarded)  # (list's own iteration: no guard)
        optimizer.param_groups = own
    for name in _ROUTED:
        optimizer.__dict__.pop(name, None)
    optimizer.__dict__.update(saved)


def _indices(optimizer: torch.optim.Optimizer, key_of: dict[int, str]) -> list[str]:
    """The key of each optimizer parameter, in ``state_dict`` index order."""
    return [key_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _groups_without_params(optimizer: torch.optim.Optimizer) -> list[dict]:
    out, index = [], 0
    for group in optimizer.param_groups:
        g = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
        g["params"] = list(range(index, index + len(group["params"])))
        index += len(group["params"])
        out.append(g)
    return out


def gather(clients: Sequence[ShardClient], pool: ThreadPoolExecutor, request: pb.StateRequest, plan: PartitionPlan,
           optimizer: torch.optim.Optimizer, params: dict[str, torch.Tensor]) -> dict:
    """Read every shard's optimizer state and assemble ``optimizer``'s ``state_dict``.

    Raises:
        ShardRpcError: a shard refused or failed.
        RuntimeError: a shard answered outside the protocol.
    """
    def read(client: ShardClient) -> list:
        try:
            return [decode_frame(raw) for raw in client.get_state(request)]
        except grpc.RpcError as exc:
            raise client.error("get_state", exc) from None
        except FrameError as exc:
            raise RuntimeError(f"shard {client.index} sent a malformed state frame: {exc}") from None

    numel = {k.key: k.numel for k in plan.keys}
    per_key: dict[str, dict[str, torch.Tensor]] = {}
    for frames in pool.map(read, clients):
        for frame in frames:
            h = frame.header
            if h is None or h.key not in numel or not h.state:
                raise RuntimeError(f"a shard sent a state frame outside the protocol: {frame}")
            entries = per_key.setdefault(h.key, {})
            value = entries.setdefault(h.state, torch.zeros(1 if h.state in SCALAR_STATE else numel[h.key]))
            copy_payload(h, frame.payload, value[h.offset : h.offset + h.numel])
    key_of = {id(p): k for k, p in params.items()}
    state = {}
    for index, key in enumerate(_indices(optimizer, key_of)):
        if key in per_key:
            shape = params[key].shape
            state[index] = {name: v.reshape(()) if name in SCALAR_STATE else v.reshape(shape)
                            for name, v in per_key[key].items()}
    return {"state": state, "param_groups": _groups_without_params(optimizer)}


def load(clients: Sequence[ShardClient], pool: ThreadPoolExecutor, header: pb.RoundHeader, plan: PartitionPlan,
         optimizer: torch.optim.Optimizer, params: dict[str, torch.Tensor], state_dict: dict) -> None:
    """Send ``state_dict`` (torch.optim's format) to the shards and take its hyperparameters.

    Two passes: every shard checks the state, then every shard loads it, so
    a state that one shard refuses (an entry its optimizer does not keep, a
    round in progress) changes no shard.

    Raises:
        ValueError: ``state_dict`` does not fit ``optimizer`` (groups, parameters, shapes).
        ShardRpcError: a shard refused it (a round in progress, entries the optimizer does not keep).
    """
    groups = state_dict.get("param_groups")
    if not isinstance(groups, list) or len(groups) != len(optimizer.param_groups):
        raise ValueError(f"the state_dict has {len(groups) if isinstance(groups, list) else 'no'} param groups; "
                         f"the optimizer has {len(optimizer.param_groups)}")
    for g, (saved, live) in enumerate(zip(groups, optimizer.param_groups)):
        if len(saved.get("params", ())) != len(live["params"]):
            raise ValueError(f"param group {g} of the state_dict has {len(saved.get('params', ()))} parameters; "
                             f"the optimizer's has {len(live['params'])}")
    key_of = {id(p): k for k, p in params.items()}
    keys = _indices(optimizer, key_of)
    saved_index = [i for saved in groups for i in saved["params"]]
    by_key: dict[str, dict] = {}
    for position, index in enumerate(saved_index):
        entries = state_dict.get("state", {}).get(index)
        if entries:
            key = keys[position]
            shape = params[key].shape
            for name, value in entries.items():
                if not isinstance(value, torch.Tensor):
                    raise ValueError(f"state {name!r} of parameter {key!r} is not a tensor")
                if value.numel() != 1 and value.shape != shape:
                    raise ValueError(f"state {name!r} of parameter {key!r} has shape {tuple(value.shape)}, "
                                     f"the parameter {tuple(shape)}")
            by_key[key] = entries

    def frames_for(shard: int, check_only: bool):
        checked = pb.RoundHeader()
        checked.CopyFrom(header)
        checked.check_only = check_only
        yield encode_round(checked)
        held = {c.key for c in plan.shard_chunks(shard)}
        for key, entries in by_key.items():
            if key not in held:
                continue
            for name, value in entries.items():
                value = value.detach().to("cpu", torch.float32).reshape(-1)
                if name in SCALAR_STATE:
                    yield encode_chunk(key, 0, value[:1], 0, state=name)
                    continue
                for c in plan.shard_chunks(shard):
                    if c.key == key:
                        yield encode_chunk(key, c.offset, value[c.offset : c.offset + c.numel], 0, state=name)

    # every shard checks first, so that a state one shard refuses is loaded by none
    for check_only in (True, False):
        list(pool.map(lambda c: c.set_state(frames_for(c.index, check_only)), clients))
    for saved, live in zip(groups, optimizer.param_groups):  # torch.optim semantics: hyperparameters come too
        live.update({k: v for k, v in saved.items() if k != "params"})

"""What a sparse optimizer declares: each sharded table's spec and hyperparameters, checked against what the shards run.

``DistributedOptimizer(..., sparse_optimizer=opt)``: ``opt``'s class is the
tables' optimizer (``torch.optim.SGD``, ``torch.optim.Adagrad``,
``torch.optim.Adam``/``AdamW`` as lazy Adam, ``torch.optim.SparseAdam`` or
:class:`RowWiseAdagrad`), each param group the hyperparameters of the
tables whose ``handle`` it holds (:func:`table_specs`);
``shardps.worker.embedding.tables.SparseTables`` declares and pushes them.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from shardps.common.rows import TableSpec, hyperparam_problems
from shardps.worker.embedding.modules import ShardedTable, is_table_handle, table_of

__all__ = ["RowWiseAdagrad", "check_sparse_options", "group_spec", "table_specs"]


class RowWiseAdagrad(torch.optim.Optimizer):
    """Row-wise Adagrad for sharded tables: one accumulator per row, the mean of its squared gradient
    (FBGEMM's ``EXACT_ROWWISE_ADAGRAD``). Only a description for the shards: ``step()`` raises.

    Args: ``params`` (table handles), ``lr``, ``eps`` (1e-10), ``initial_accumulator_value`` (0),
    ``weight_decay`` (0: added to the touched rows' gradient, ``grad + weight_decay * row``).
    """

    def __init__(self, params, lr: float = 0.01, eps: float = 1e-10, initial_accumulator_value: float = 0.0,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "eps": eps, "initial_accumulator_value": initial_accumulator_value,
                                  "weight_decay": weight_decay})

    def step(self, closure=None):
        raise RuntimeError("RowWiseAdagrad runs on the shards: call DistributedOptimizer.step()")


def group_spec(opt: torch.optim.Optimizer, group: dict) -> tuple[str, dict[str, float]]:
    """The row optimizer and hyperparameters of one param group, checked as the shards check them.

    ``torch.optim.Adam`` and ``AdamW`` run as lazy Adam: their own update applied to the rows a step touches
    only (as ``torch.optim.SparseAdam``, only those rows and their moments move); ``weight_decay`` (SGD, Adagrad, Adam, AdamW,
    RowWiseAdagrad) decays the touched rows only (``shardps.server.sparse.optimizers``). The hyperparameters
    must be in torch's own ranges (``0 <= beta < 1``; ``lr_decay``, ``initial_accumulator_value``,
    ``weight_decay`` >= 0), with ``eps > 0`` and every value within float32's range
    (``shardps.common.rows.hyperparam_problems``): a param group edited after its optimizer was built is
    refused here, before any table is declared, as the shards would refuse it.

    Raises:
        ValueError: what the shards cannot run, naming the setting and what to use instead.
    """
    name = type(opt).__name__
    if group.get("maximize"):
        raise ValueError(f"sparse tables take {name} without maximize=True: negate the loss instead")
    decay = {"weight_decay": float(group.get("weight_decay") or 0.0)}
    torch_names = {"beta1": "betas[0]", "beta2": "betas[1]"}
    if isinstance(opt, torch.optim.SGD):
        if group.get("momentum") or group.get("nesterov") or group.get("dampening"):
            raise ValueError("sparse tables take torch.optim.SGD without momentum, dampening or nesterov (a row "
                             "untouched for many steps would still move): use Adagrad, Adam or RowWiseAdagrad "
                             "for the tables")
        kind, hyper = "sgd", decay
    elif isinstance(opt, torch.optim.Adagrad):
        kind, hyper = "adagrad", {**{k: float(group[k]) for k in ("lr_decay", "initial_accumulator_value", "eps")},
                                  **decay}
    elif isinstance(opt, torch.optim.SparseAdam):
        kind, hyper = "sparse_adam", {"beta1": float(group["betas"][0]), "beta2": float(group["betas"][1]),
                                      "eps": float(group["eps"])}
    elif isinstance(opt, torch.optim.Adam):  # AdamW too (a subclass with decoupled_weight_decay=True)
        if group.get("amsgrad"):
            raise ValueError(f"sparse tables take {name} without amsgrad=True (lazy row-wise Adam keeps no max of "
                             "the second moments): drop amsgrad for the tables' optimizer")
        kind, hyper = "adam", {"beta1": float(group["betas"][0]), "beta2": float(group["betas"][1]),
                               "eps": float(group["eps"]), **decay,
                               "decoupled_weight_decay": float(bool(group.get("decoupled_weight_decay")))}
    elif isinstance(opt, RowWiseAdagrad):
        kind, hyper = "rowwise_adagrad", {**{k: float(group[k]) for k in ("initial_accumulator_value", "eps")},
                                          **decay}
    else:
        raise ValueError(f"sparse_optimizer must be torch.optim.SGD (no momentum), Adagrad, Adam, AdamW, SparseAdam "
                         f"or shardps.RowWiseAdagrad, got {name}")
    problems = hyperparam_problems(kind, hyper)
    if problems:
        named = [f"{torch_names.get(p.split(':')[0], p.split(':')[0])}:{p.split(':', 1)[1]}" for p in problems]
        raise ValueError(f"sparse tables cannot run {name} with {'; '.join(named)}: the shards would refuse to "
                         "step the tables with it")
    return kind, hyper


def check_sparse_options(optimizer: torch.optim.Optimizer, sparse_optimizer: torch.optim.Optimizer | None,
                         model: torch.nn.Module | None, mode: str, options) -> None:
    """Refuse a DistributedOptimizer whose tables would not train as asked.

    Raises:
        ValueError: a table handle in the dense optimizer; sharded tables in ``model`` without a
            ``sparse_optimizer``; tables with async/ssp, ``max_grad_norm`` or ``grad_scaler``.
    """
    if any(is_table_handle(p) for g in optimizer.param_groups for p in g["params"]):
        raise ValueError("the optimizer holds the handle of a sharded table: give the table handles to "
                         "sparse_optimizer= (torch.optim.SGD, Adagrad, Adam, AdamW, SparseAdam or RowWiseAdagrad; "
                         "shardps.sharded_parameters(model) splits a model's parameters into the two) and the "
                         "dense parameters to the optimizer")
    if sparse_optimizer is None:
        if model is not None and any(isinstance(m, ShardedTable) for m in model.modules()):
            raise ValueError("model has sharded embedding tables: pass sparse_optimizer= over their handles")
        return
    if mode != "sync":
        raise ValueError(f"sparse tables train with sync dense rounds only (got mode={mode!r}): use "
                         "ConsistencyOptions(mode='sync') (tables sync too, exact), or ConsistencyOptions(mode='sync', "
                         "tables='async') (hybrid: dense sync, each worker's rows applied as they arrive)")
    if options.max_grad_norm is not None or options.grad_scaler is not None:
        raise ValueError("max_grad_norm and grad_scaler cover the dense parameters only and are not supported with "
                         "sparse tables yet: clip or scale without them, or train the tables dense")


def table_specs(opt: torch.optim.Optimizer,
                model: torch.nn.Module | None) -> dict[str, tuple[ShardedTable, TableSpec, dict]]:
    """``{name: (module, spec, param group)}`` of every table whose handle is in ``opt``.

    A module without ``name`` takes its name in ``model``.

    Raises:
        ValueError: ``opt`` holds something else than table handles, a table has no name (no ``model``),
            two tables share a name, or a group's settings cannot run on the shards.
    """
    names = {id(m): n for n, m in model.named_modules()} if model is not None else {}
    out: dict[str, tuple[ShardedTable, TableSpec, dict]] = {}
    for group in opt.param_groups:
        kind, hyper = group_spec(opt, group)
        for p in group["params"]:
            if not is_table_handle(p):
                raise ValueError("sparse_optimizer may hold only the handles of ShardedEmbedding/ShardedEmbeddingBag "
                                 "modules (module.handle); dense parameters go to the first optimizer")
            module = table_of(p)
            name = module.name or names.get(id(module))
            if not name:
                raise ValueError("a sharded table has no name: pass name= to it, or model= to DistributedOptimizer")
            if name in out:
                raise ValueError(f"two sharded tables are named {name!r}: give each its own name=")
            module.name = name
            spec = replace(module.spec(), optimizer=kind, hyperparams=hyper)
            out[name] = (module, spec, group)
    return out

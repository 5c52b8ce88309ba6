"""``Serving.Predict``: the job's own model, made local from each replica state, scoring feature records.

``shardps serve --model MODULE:CALLABLE`` names a zero-argument callable that returns the model the job trains
(the same ``nn.Module`` class, with its ``ShardedEmbedding``/``ShardedEmbeddingBag`` tables; not attached to any
shards). For each state a replica swaps in, :class:`Predictor` turns that model into a plain local one with
``shardps.local_model`` (every table's rows and the dense parameters of that state; an id the state does not
hold reads as its initial row, as in training), once per state number, and answers
``model(**{feature.name: tensor})`` under ``torch.no_grad()`` in eval mode: the output, or its first element
when ``forward`` returns a tuple or a list, as float32. The local model equals the live one bit for bit, so a
Predict answers exactly what ``local_model`` built from an export of the same state answers.

Errors are :class:`PredictError` carrying the gRPC status the Serving call ends with: a malformed feature
or an argument ``forward`` does not take is INVALID_ARGUMENT naming the feature; a state without the dense
parameters (not read yet) UNAVAILABLE; a model that does not fit the served tables FAILED_PRECONDITION.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import math
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future

import grpc
import torch
from torch import nn

from shardps.worker.embedding.local import local_model
from shardps.worker.embedding.modules import ShardedTable, table_keys
from shardps.worker.embedding.porting import replace_modules

__all__ = ["PredictError", "Predictor", "Refused", "decode_features", "load_factory"]

#: TableSpec fields that decide a table's rows where the state holds none (its initial rows) and their shape:
#: the model's table must agree with the served one on each, or its local model would not equal the job's.
ROW_FIELDS = ("embedding_dim", "num_embeddings", "padding_idx", "seed", "init_scale", "init", "init_args")


class Refused(Exception):
    """A Serving query refused: ``code`` (a ``grpc.StatusCode``) and the message the caller gets (its call ends
    with them; on a ``Query`` stream its answer carries them and the stream goes on)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class PredictError(Refused):
    """A Predict refused (its features, the served model or the state)."""


def load_factory(text: str, flag: str = "--model") -> Callable[[], nn.Module]:
    """The callable ``MODULE:CALLABLE`` names (``shardps.apps.movielens:serving_model``), imported.

    Raises:
        ValueError: not ``MODULE:CALLABLE``, the module does not import, or it holds no such callable (the
            message names ``flag``).
    """
    module_name, _, attr = text.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{flag} {text!r}: expected MODULE:CALLABLE, e.g. shardps.apps.movielens:serving_model")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the flag's
        raise ValueError(f"{flag} {text!r}: cannot import {module_name!r} ({type(exc).__name__}: {exc})") from None
    target = module
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ValueError(f"{flag} {text!r}: module {module_name!r} has no {attr!r}")
    if not callable(target):
        raise ValueError(f"{flag} {text!r}: {attr!r} is a {type(target).__name__}, not a callable")
    return target


def build_model(factory: Callable[[], nn.Module], flag: str = "--model") -> nn.Module:
    """``factory()``, checked to be an ``nn.Module``.

    Raises:
        ValueError: the factory raised, or returned something else (the message names ``flag``).
    """
    try:
        model = factory()
    except Exception as exc:  # noqa: BLE001 - said with the flag
        raise ValueError(f"{flag}: calling {getattr(factory, '__qualname__', factory)!r}() raised "
                         f"{type(exc).__name__}: {exc}") from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"{flag}: the callable returned a {type(model).__name__}, not the job's nn.Module")
    return model


def decode_features(features: Iterable, max_elements: int) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of ``pb.Feature`` messages: int64 (``int64_values``) or float32 (``float32_values``),
    little-endian, of each feature's ``shape`` (empty: a scalar).

    Raises:
        PredictError: INVALID_ARGUMENT naming the feature: no name, a name given twice, both or neither value
            fields, bytes that are not whole values, a shape whose product is not the element count, or more
            than ``max_elements`` elements.
    """
    out: dict[str, torch.Tensor] = {}
    for f in features:
        what = f"feature {f.name[:200]!r}"
        if not f.name:
            raise PredictError(grpc.StatusCode.INVALID_ARGUMENT, "a feature has no name (the forward() keyword)")
        if f.name in out:
            raise PredictError(grpc.StatusCode.INVALID_ARGUMENT, f"{what} is given twice")
        ints, floats = bool(f.int64_values), bool(f.float32_values)
        if ints == floats:
            raise PredictError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"{what}: give its elements in exactly one of int64_values and float32_values "
                               f"({'both' if ints else 'neither'} given; a feature of no elements cannot say its "
                               "dtype)")
        data, dtype = (f.int64_values, torch.int64) if ints else (f.float32_values, torch.float32)
        size = dtype.itemsize
        if len(data) % size:
            raise PredictError(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: {len(data)} bytes are not whole "
                               f"{str(dtype).removeprefix('torch.')} values ({size} bytes each)")
        count, shape = len(data) // size, [int(d) for d in f.shape]
        if count > max_elements:
            raise PredictError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"{what}: {count} elements, more than the {max_elements} a call may send")
        if math.prod(shape) != count:
            raise PredictError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"{what}: shape {shape[:16]} holds {math.prod(shape)} elements, {count} given")
        out[f.name] = torch.frombuffer(bytearray(data), dtype=dtype).view(shape)
    return out


def _dense_keys(model: nn.Module) -> list[str]:
    """The ``state_dict`` keys of ``model``'s parameters and persistent buffers outside its sharded tables (of a
    copy whose tables are empty modules: an unattached table has no ``state_dict``)."""
    if isinstance(model, ShardedTable):
        return []
    skeleton = copy.deepcopy(model)
    replace_modules(skeleton, {id(m): nn.Module() for m in skeleton.modules() if isinstance(m, ShardedTable)})
    return list(skeleton.state_dict().keys())


class Predictor:
    """The job's model (``factory()``'s), made local from each state of one replica and run on feature records
    (its local models are cached by state number: one predictor serves one replica).

    Args:
        model: the job's model, with its sharded tables (not attached; it is never changed).

    Attributes:
        tables: ``{module path: table name on the shards}`` of the model's sharded tables (a table two paths share
            under each).
        dense_keys: the ``state_dict`` keys of its other parameters and persistent buffers (what a state's
            dense parameters must hold).
        builds: local models built so far (one per state number asked for).
    """

    #: Local models kept (the newest state numbers): a call that took the previous state still finds its model.
    KEEP = 2

    def __init__(self, model: nn.Module) -> None:
        self.template = model
        first = {id(m): p for p, m in model.named_modules() if isinstance(m, ShardedTable)}  # a shared table's name
        self._first = {p: first[id(m)] for p, m in model.named_modules(remove_duplicate=False) if id(m) in first}
        self.tables = {p: model.get_submodule(f).name or f for p, f in self._first.items()}
        self.dense_keys = _dense_keys(model)
        params = list(inspect.signature(model.forward).parameters.values())
        self._any_keyword = any(p.kind == p.VAR_KEYWORD for p in params)
        named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        self.keywords = [p.name for p in named]
        self.required = [p.name for p in named if p.default is p.empty]
        self.builds = 0
        self._lock = threading.Lock()
        self._built: dict[int, Future] = {}

    def check_tables(self, served: Iterable[str], flag: str = "--tables") -> None:
        """Refuse, before serving, a model whose tables the replica does not serve.

        Raises:
            ValueError: a table of the model is not among ``served`` (the message names ``flag``).
        """
        missing = sorted(set(self.tables.values()) - set(served))
        if missing:
            raise ValueError(f"--model: the model's tables {missing} are not among {flag} {sorted(served)}: "
                             f"serve every table of the model")

    def _state_dict(self, state) -> dict[str, torch.Tensor]:
        """The local model's ``state_dict`` from ``state``: each table's rows under its module path, the dense
        parameters under their keys.

        Raises:
            PredictError: UNAVAILABLE: the state holds no dense parameters yet; FAILED_PRECONDITION: a table is
                not served, or its spec decides other rows than the model's table.
        """
        entries: dict[str, torch.Tensor] = {}
        for path, name in self.tables.items():
            if name not in state.tables:
                raise PredictError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"the model's table {name!r} is not served (tables {sorted(state.tables)})")
            export, module = state.tables[name], self.template.get_submodule(path)
            mine = module.spec(self._first[path])
            differ = [f for f in ROW_FIELDS if getattr(mine, f) != getattr(export.spec, f)]
            if differ:
                how = ", ".join(f"{f} {getattr(mine, f)!r} (the job's: {getattr(export.spec, f)!r})" for f in differ)
                raise PredictError(grpc.StatusCode.FAILED_PRECONDITION, f"--model's table {name!r} differs from the "
                                   f"job's in {how}: --model must build the model the job trains")
            keys = table_keys(path + ".", module.num_embeddings)
            values = [export.weight()] if module.num_embeddings else [export.ids, export.weights]
            entries.update(zip(keys, values))
        if self.dense_keys and not state.versions:
            raise PredictError(grpc.StatusCode.UNAVAILABLE,
                               f"state {state.number} holds no dense parameters yet ({self.dense_keys[0]!r}, ...): "
                               "the replica reads them every --dense-every seconds; try again")
        missing = [k for k in self.dense_keys if k not in state.dense]
        if missing:
            raise PredictError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"the job's dense parameters hold no {missing[:8]}: --model must build the model "
                               "the job trains")
        entries.update({k: state.dense[k] for k in self.dense_keys})
        return entries

    def _build(self, state) -> nn.Module:
        try:
            model = local_model(self.template, self._state_dict(state))
        except (RuntimeError, ValueError) as exc:  # load_state_dict's shapes, a table's rows
            raise PredictError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"--model's model does not take state {state.number}: {exc}") from None
        with self._lock:
            self.builds += 1
        return model.eval()

    def model_for(self, state) -> nn.Module:
        """The local model of ``state`` (a ``ReplicaState``), in eval mode: built at the first call for its number,
        then the same one (callers that ask at once wait for one build; a state never changes, so neither does its
        model, nor a refusal).

        Raises:
            PredictError: see :meth:`_state_dict`; FAILED_PRECONDITION: the state does not load into the model.
        """
        with self._lock:
            future = self._built.get(state.number)
            mine = future is None
            if mine:
                future = self._built[state.number] = Future()
                for old in sorted(self._built)[:-self.KEEP]:
                    del self._built[old]
        if mine:
            try:
                future.set_result(self._build(state))
            except BaseException as exc:  # noqa: BLE001 - the waiters get it too
                future.set_exception(exc)
        return future.result()

    def predict(self, state, features: dict[str, torch.Tensor]) -> torch.Tensor:
        """``model(**features)`` with ``state``'s local model under ``torch.no_grad()``: float32 on the CPU, of the
        output's shape (the first element of a tuple or list output).

        Raises:
            PredictError: INVALID_ARGUMENT: a feature ``forward`` takes no keyword for, one it needs is missing,
                or the model refused the values (its error quoted); FAILED_PRECONDITION: the output is not a
                tensor; and see :meth:`model_for`.
        """
        if not self._any_keyword:
            unknown = [n for n in features if n not in self.keywords]
            if unknown:
                raise PredictError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"feature {unknown[0][:200]!r}: the model's forward() takes no such keyword "
                                   f"(it takes {self.keywords})")
        missing = [n for n in self.required if n not in features]
        if missing:
            raise PredictError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"features {missing} missing: the model's forward() needs {self.required}")
        model = self.model_for(state)
        try:
            with torch.no_grad():
                out = model(**features)
        except (TypeError, ValueError, IndexError, RuntimeError) as exc:
            raise PredictError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"the model refused features {sorted(features)}: {type(exc).__name__}: "
                               f"{str(exc)[:1000]}") from None
        if isinstance(out, (tuple, list)) and out:
            out = out[0]
        if not isinstance(out, torch.Tensor):
            raise PredictError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"the model's forward() returned a {type(out).__name__}, not a tensor (or a tuple "
                               "or list whose first element is one)")
        return out.detach().to("cpu", torch.float32).contiguous()

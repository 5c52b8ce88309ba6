"""What worker and shard share about sparse tables: the spec, row placement and row initialisation.

A row's shard and its initial value are pure functions of ``(table, id,
seed)``, computed with the SplitMix64 mixer (Steele et al., "Fast
splittable pseudorandom number generators", OOPSLA 2014) in int64
tensor arithmetic, so they are the same on every machine, for every shard
count, and need no table of ids (a collisionless, hashed table as
Monolith's, Liu et al. 2022).

- placement: ``shard_of(name, ids, S) = mix(ids ^ salt(name)) mod S``;
- initialisation: element ``j`` of row ``id`` draws ``z = mix(mix(id ^ salt(name, seed)) + j)``
  and ``u = (z >> 40) / 2**24`` (uniform in ``[0, 1)`` on a grid of 2**-24); by the spec's ``init``:

  - ``""`` (the default): ``init_scale * (2 * u - 1)``, uniform in ``[-init_scale, init_scale)``;
  - ``"uniform"`` ``(a, b)``: ``a + (b - a) * u``;
  - ``"normal"`` ``(mean, std)``: ``mean + std * sqrt(-2 ln(1 - u)) * cos(2 pi v)`` with
    ``v = ((z >> 16) mod 2**24) / 2**24`` (Box and Muller, 1958);
  - ``"zeros"``: 0; ``"constant"`` ``(c)``: ``c``.

  The padding id (``padding_idx``) reads as zeros.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass, field

import torch

from shardps.proto import shardps_pb2 as pb

__all__ = ["TableSpec", "OPTIMIZERS", "INITS", "parse_init", "shard_of", "shard_of_salted", "placement_salt", "initial_rows", "initial_rows_salted", "salt", "check_ids", "ids_bytes", "ids_from",
           "rows_bytes", "rows_from", "state_widths", "FLOAT32_MAX", "lr_problem", "check_lr",
           "hyperparam_problems", "check_hyperparams"]

#: Row-wise optimizers the shards run, with their hyperparameters (lr travels with every push) and defaults.
#: ``weight_decay`` is applied to the rows a step touches only (an untouched row is not decayed);
#: ``adam`` is torch.optim.Adam's update on the touched rows (lazy Adam), ``decoupled_weight_decay`` 1.0
#: its AdamW decay (Loshchilov and Hutter, ICLR 2019); ``sparse_adam`` is torch.optim.SparseAdam's.
OPTIMIZERS: dict[str, dict[str, float]] = {
    "sgd": {"weight_decay": 0.0},
    "adagrad": {"lr_decay": 0.0, "initial_accumulator_value": 0.0, "eps": 1e-10, "weight_decay": 0.0},
    "rowwise_adagrad": {"initial_accumulator_value": 0.0, "eps": 1e-10, "weight_decay": 0.0},
    "sparse_adam": {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8},
    "adam": {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "decoupled_weight_decay": 0.0},
}

#: Row initialisers (``TableSpec.init``) and the number of arguments each takes (module docstring).
INITS: dict[str, int] = {"": 0, "uniform": 2, "normal": 2, "zeros": 0, "constant": 1}
#: A table's row weights as stored on the shards and sent (``TableSpec.dtype``). float16 halves the bytes of
#: weights (TorchRec's ``DataType.FP16`` tables); its optimizer state stays float32.
ROW_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16}
#: The largest finite float16.
FLOAT16_MAX = 65504.0


def _largest_initial(init: str, args: tuple[float, ...], init_scale: float) -> float:
    """The largest magnitude an initialiser can draw: ``normal`` draws at most 5.8 std from its mean (the radius
    of 24 random bits, ``sqrt(-2 ln 2^-24)`` = 5.77)."""
    if init == "normal":
        return abs(args[0]) + 5.8 * args[1]
    return max((abs(a) for a in args), default=0.0) if init else init_scale

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 ``x`` by ``k`` bits (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _shr_into(x: torch.Tensor, k: int, out: torch.Tensor) -> torch.Tensor:
    """:func:`_shr` of ``x`` written into ``out`` (a tensor of ``x``'s shape): no new tensor."""
    torch.bitwise_right_shift(x, k, out=out)
    return out.bitwise_and_((1 << (64 - k)) - 1)


def _mix_(z: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """:func:`mix` of int64 ``z`` in place (``scratch``: a tensor of its shape to write shifts into)."""
    z.add_(_GOLDEN)
    z.bitwise_xor_(_shr_into(z, 30, scratch)).mul_(_M1)
    z.bitwise_xor_(_shr_into(z, 27, scratch)).mul_(_M2)
    return z.bitwise_xor_(_shr_into(z, 31, scratch))


def mix(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser of int64 ``x`` (wrapping arithmetic), elementwise; int64 out. Computed in place in
    one new tensor and one scratch (a fresh tensor per operation took 2.5x as long for a round's initial rows)."""
    z = x.clone(memory_format=torch.contiguous_format)
    return _mix_(z, torch.empty_like(z))


def _counter_mix(base: torch.Tensor, dim: int) -> torch.Tensor:
    """``mix(base + arange(dim))`` for int64 ``base`` ``[n, 1]``: int64 ``[n, dim]``, and the scratch it used."""
    z = torch.arange(dim, dtype=torch.int64, device=base.device).expand(base.shape[0], dim).add(base)
    scratch = torch.empty_like(z)
    return _mix_(z, scratch), scratch


def salt(name: str, seed: int = 0) -> int:
    """A signed 64-bit salt of a table name and seed (BLAKE2b): tables with equal ids get unrelated rows."""
    digest = hashlib.blake2b(f"{name}\0{seed}".encode(), digest_size=8).digest()
    return _signed(int.from_bytes(digest, "little"))


def placement_salt(name: str) -> int:
    """The salt :func:`shard_of` mixes into table ``name``'s ids."""
    return salt(name, -1)


def shard_of(name: str, ids: torch.Tensor, num_shards: int) -> torch.Tensor:
    """The shard index of each id (int64 tensor ``[n]`` in, int64 ``[n]`` in ``[0, num_shards)`` out)."""
    return shard_of_salted(ids, placement_salt(name), num_shards)


def shard_of_salted(ids: torch.Tensor, salts, num_shards: int) -> torch.Tensor:
    """:func:`shard_of` with each table's :func:`placement_salt` given: an int, or int64 ``[n]`` (one per id,
    so the ids of several tables are placed in one pass)."""
    return _shr(mix(ids ^ salts), 1) % num_shards


def initial_rows(name: str, ids: torch.Tensor, dim: int, seed: int, init_scale: float,
                 padding_idx: int = -1, init: str = "", init_args: tuple[float, ...] = ()) -> torch.Tensor:
    """The rows ids start from: float32 ``[n, dim]`` for int64 ``ids`` ``[n]`` (see the module docstring;
    ``init``, ``init_args`` as :class:`TableSpec`'s)."""
    rows = initial_rows_salted(ids, salt(name, seed), dim, init_scale) if not init else \
        initial_rows_by(ids, salt(name, seed), dim, init, init_args)
    if padding_idx >= 0:
        rows[ids.reshape(-1) == padding_idx] = 0.0
    return rows


def initial_rows_by(ids: torch.Tensor, salt_: int, dim: int, init: str, init_args: tuple[float, ...]) -> torch.Tensor:
    """Initial rows of one table with initialiser ``init`` (not ``""``): float32 ``[n, dim]`` for int64 ``ids``
    ``[n]``, padding rows not zeroed (module docstring)."""
    ids = ids.reshape(-1, 1)
    if init == "zeros":
        return torch.zeros(ids.shape[0], dim, device=ids.device)
    if init == "constant":
        return torch.full((ids.shape[0], dim), float(init_args[0]), device=ids.device)
    z, scratch = _counter_mix(mix(ids ^ salt_), dim)
    u = _shr_into(z, 40, scratch).to(torch.float32).mul_(1.0 / (1 << 24))
    if init == "uniform":
        a, b = float(init_args[0]), float(init_args[1])
        return u * (b - a) + a
    if init == "normal":
        v = (_shr(z, 16) & ((1 << 24) - 1)).to(torch.float32) * (1.0 / (1 << 24))
        radius = torch.log1p(-u).mul_(-2.0).sqrt_()
        return radius.mul_(torch.cos(v * (2.0 * math.pi))).mul_(float(init_args[1])).add_(float(init_args[0]))
    raise ValueError(f"unknown row initialiser {init!r} (one of {sorted(k for k in INITS if k)})")


def initial_rows_salted(ids: torch.Tensor, salts, dim: int, scales) -> torch.Tensor:
    """:func:`initial_rows` of several tables' ids at once, bit for bit (padding rows not zeroed): ``salts``
    each id's ``salt(name, seed)`` (an int, or int64 ``[n]``), ``scales`` its ``init_scale`` (a float, or
    float32 ``[n]``). Returns float32 ``[n, dim]``."""
    ids = ids.reshape(-1, 1)
    z, scratch = _counter_mix(mix(ids ^ (salts if isinstance(salts, int) else salts.reshape(-1, 1))), dim)
    u = _shr_into(z, 40, scratch).to(torch.float32).mul_(1.0 / (1 << 24))
    return u.mul_(2.0).sub_(1.0).mul_(float(scales) if not isinstance(scales, torch.Tensor) else scales.reshape(-1, 1))


def parse_init(init) -> tuple[str, tuple[float, ...]]:
    """A row initialiser as a module takes it, as ``(TableSpec.init, TableSpec.init_args)``: None (uniform in
    ``[-init_scale, init_scale)``), ``"zeros"``, ``("uniform", a, b)``, ``("normal", mean, std)``,
    ``("constant", c)``.

    Raises:
        ValueError: an unknown initialiser or the wrong arguments (the message lists the forms).
    """
    forms = "None, 'zeros', ('uniform', a, b), ('normal', mean, std) or ('constant', c)"
    if init is None:
        return "", ()
    kind, *args = (init,) if isinstance(init, str) else tuple(init) if isinstance(init, (tuple, list)) else (None,)
    if kind not in INITS or not kind or len(args) != INITS[kind]:
        raise ValueError(f"init must be {forms}, got {init!r}")
    try:
        values = tuple(float(a) for a in args)
    except (TypeError, ValueError):
        raise ValueError(f"init must be {forms} with numbers, got {init!r}") from None
    if not all(math.isfinite(v) for v in values) or (kind == "uniform" and not values[0] < values[1]) or \
            (kind == "normal" and not values[1] >= 0):
        raise ValueError(f"init {init!r}: arguments must be finite, with a < b for uniform and std >= 0 for normal")
    return kind, values


def check_ids(ids: torch.Tensor, what: str, num_embeddings: int = 0) -> None:
    """Refuse ids a table cannot take.

    Raises:
        TypeError: ``ids`` is not an int32 or int64 tensor (TorchRec's ``KeyedJaggedTensor`` ids are int32 as
            often as int64; the worker widens int32 ids to int64 before it sends them).
        ValueError: a bounded table (``num_embeddings > 0``) got an id outside ``[0, num_embeddings)``
            (the message names the first one).
    """
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
        got = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise TypeError(f"{what} takes int32 or int64 ids, got {got}: convert with .long()")
    if num_embeddings > 0 and ids.numel():
        bad = (ids < 0) | (ids >= num_embeddings)
        if bool(bad.any()):
            first = int(ids.reshape(-1)[bad.reshape(-1)][0])
            raise ValueError(f"{what}: id {first} is outside [0, {num_embeddings}) (num_embeddings={num_embeddings}); "
                             "pass num_embeddings=None for a hashed table that takes any int64 id")


def ids_bytes(ids: torch.Tensor) -> bytes:
    """int64 ids ``[n]`` as little-endian bytes (8n)."""
    return ids.to(torch.int64).contiguous().numpy().tobytes()


def ids_from(data: bytes) -> torch.Tensor:
    """int64 ``[n]`` from :func:`ids_bytes`' bytes. Raises ValueError: not a multiple of 8 bytes."""
    if len(data) % 8:
        raise ValueError(f"ids take 8 bytes each, got {len(data)} bytes")
    return torch.frombuffer(bytearray(data), dtype=torch.int64) if data else torch.empty(0, dtype=torch.int64)


def rows_bytes(rows: torch.Tensor) -> bytes:
    """float32 rows ``[n, dim]`` as little-endian bytes (4 n dim)."""
    return rows.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()


def rows_from(data: bytes, n: int, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float32 ``[n, dim]`` from :func:`rows_bytes`' bytes of ``dtype`` values (float16 ones widened, exactly).
    Raises ValueError: the size is not ``n dim`` values of ``dtype``."""
    size = dtype.itemsize * n * dim
    if len(data) != size:
        raise ValueError(f"expected {n} rows of {dim} {str(dtype).removeprefix('torch.')} values ({size} bytes), "
                         f"got {len(data)} bytes")
    if not data:
        return torch.empty(n, dim, dtype=torch.float32)
    rows = torch.frombuffer(bytearray(data), dtype=dtype).view(n, dim)
    return rows if dtype == torch.float32 else rows.float()


def state_widths(optimizer: str, dim: int) -> dict[str, int]:
    """Optimizer state per row: ``{name: width}`` (float32 values per row)."""
    return {"sgd": {}, "adagrad": {"sum": dim}, "rowwise_adagrad": {"sum": 1},
            "sparse_adam": {"exp_avg": dim, "exp_avg_sq": dim}, "adam": {"exp_avg": dim, "exp_avg_sq": dim}}[optimizer]


#: The largest finite float32. A learning rate or hyperparameter above it cannot scale a float32 row (torch
#: raises "value cannot be converted to type float without overflow"), so tables refuse it.
FLOAT32_MAX = 3.4028234663852886e38


def _float32(value: float) -> float:
    """``value`` rounded to float32 (OverflowError: past :data:`FLOAT32_MAX`)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def lr_problem(lr) -> str | None:
    """Why ``lr`` cannot be a table's learning rate (None: it can): it must be a finite number, ``>= 0``, and
    at most :data:`FLOAT32_MAX` (the update multiplies float32 rows by it)."""
    try:
        lr = float(lr)
    except (TypeError, ValueError):
        return f"{lr!r} is not a number"
    if not (math.isfinite(lr) and lr >= 0):
        return f"{lr} is not finite and >= 0"
    if lr > FLOAT32_MAX:
        return f"{lr} is past float32's range (at most {FLOAT32_MAX:.4g}: the update multiplies float32 rows by it)"
    return None


def check_lr(table: str, lr) -> float:
    """``lr`` as a float, checked (:func:`lr_problem`).

    Raises:
        ValueError: the message names ``table`` and the learning rate.
    """
    problem = lr_problem(lr)
    if problem is not None:
        raise ValueError(f"learning rate of table {table!r}: {problem}; it must be finite, >= 0 and at most "
                         f"{FLOAT32_MAX:.4g}")
    return float(lr)


def hyperparam_problems(optimizer: str, hyper: dict[str, float]) -> list[str]:
    """What is wrong with ``optimizer``'s hyperparameters ``hyper`` (:data:`OPTIMIZERS`' names, defaults filled
    in or not), one ``name: why`` per setting; empty when the table can run them.

    The ranges are torch's own checks (``torch.optim.Adagrad``: ``lr_decay``, ``initial_accumulator_value``,
    ``weight_decay`` >= 0; ``Adam``/``SparseAdam``: ``0 <= beta < 1``; ``weight_decay >= 0``), and stricter in
    two ways: ``eps`` must be > 0 as a float32 for every optimizer (torch's Adagrad and Adam take 0, and a
    zero gradient on a zero accumulator then divides 0 by 0), and every value must be finite and within
    float32's range (it scales float32 rows). ``decoupled_weight_decay`` is 0 or 1.
    """
    problems = []
    for name, value in hyper.items():
        try:
            value = float(value)
            scaled = _float32(value)
        except (TypeError, ValueError, OverflowError):
            problems.append(f"{name}: {value!r} is not a finite number within float32's range (|x| <= "
                            f"{FLOAT32_MAX:.4g})")
            continue
        if not math.isfinite(scaled):
            problems.append(f"{name}: {value!r} is not finite")
        elif name in ("beta1", "beta2") and not 0.0 <= value < 1.0:
            problems.append(f"{name}: {value!r} is not in [0, 1) (torch's Adam and SparseAdam require "
                            "0 <= beta < 1)")
        elif name == "eps" and not scaled > 0.0:
            problems.append(f"{name}: {value!r} is not > 0 as a float32 (eps 0 divides 0 by 0 where a row's "
                            "gradient and accumulator are zero)")
        elif name in ("lr_decay", "initial_accumulator_value", "weight_decay") and not value >= 0.0:
            problems.append(f"{name}: {value!r} is not >= 0 (torch's optimizers require {name} >= 0)")
        elif name == "decoupled_weight_decay" and value not in (0.0, 1.0):
            problems.append(f"{name}: {value!r} is neither 0 nor 1")
    return problems


def check_hyperparams(optimizer: str, hyper: dict[str, float], table: str) -> None:
    """Refuse hyperparameters a table's rows cannot be stepped with (:func:`hyperparam_problems`).

    Raises:
        ValueError: the message names ``table``, the optimizer and every setting at fault.
    """
    problems = hyperparam_problems(optimizer, hyper)
    if problems:
        raise ValueError(f"table {table!r}: {optimizer} cannot run with {'; '.join(problems)}")


@dataclass(frozen=True, kw_only=True)
class TableSpec:
    """One sparse table as every worker declares it (``pb.TableSpec`` on the wire).

    Attributes:
        name: the table's name (1 to 128 printable characters), unique in the job.
        embedding_dim: values per row (1 to 65536).
        num_embeddings: 0: hashed, any int64 id; N > 0: ids in ``[0, N)``.
        padding_idx: the id that reads as zeros and is never trained (-1: none).
        optimizer: ``sgd``, ``adagrad``, ``rowwise_adagrad``, ``sparse_adam`` or ``adam`` (see :data:`OPTIMIZERS`).
        hyperparams: the optimizer's hyperparameters other than lr (defaults filled in).
        seed, init_scale: row initialisation (module docstring); init_scale None: ``1/sqrt(embedding_dim)``.
        init, init_args: the row initialiser (:data:`INITS`; ``""``: uniform in ``[-init_scale, init_scale)``)
            and its arguments: ``uniform (a, b)``, ``normal (mean, std)``, ``zeros ()``, ``constant (c)``.
        min_count: sightings before an id becomes a trained row (0 or 1: at once).
        ttl_rounds: evict rows not pushed for this many rounds (0: never).
        ttl_seconds: evict rows unseen for this many seconds of event time (0: never; Monolith's expiry): the
            pushes carry their events' time, a row keeps the time of the last push carrying it.
        capacity: rows per shard, least recently pushed evicted beyond it (0: no limit).
        max_bytes: bytes of rows and state per shard before pushes are refused (0: the shard's default).

    Raises:
        ValueError: a field out of range (the message names it).
    """

    name: str
    embedding_dim: int
    num_embeddings: int = 0
    padding_idx: int = -1
    optimizer: str = "sgd"
    hyperparams: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    init_scale: float | None = None
    init: str = ""
    init_args: tuple[float, ...] = ()
    min_count: int = 0
    ttl_rounds: int = 0
    capacity: int = 0
    max_bytes: int = 0
    dtype: str = "float32"
    ttl_seconds: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.name, str) and 1 <= len(self.name) <= 128 and self.name.isprintable()):
            raise ValueError(f"table name must be 1 to 128 printable characters, got {self.name!r}")
        if not 1 <= self.embedding_dim <= 65536:
            raise ValueError(f"table {self.name!r}: embedding_dim must be in [1, 65536], got {self.embedding_dim}")
        if self.num_embeddings < 0:
            raise ValueError(f"table {self.name!r}: num_embeddings must be >= 0 (0: hashed), got {self.num_embeddings}")
        if self.padding_idx < -1 or (self.num_embeddings and self.padding_idx >= self.num_embeddings):
            raise ValueError(f"table {self.name!r}: padding_idx {self.padding_idx} is not an id of the table")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"table {self.name!r}: optimizer {self.optimizer!r} is not one of {sorted(OPTIMIZERS)}")
        unknown = set(self.hyperparams) - set(OPTIMIZERS[self.optimizer])
        if unknown:
            raise ValueError(f"table {self.name!r}: {self.optimizer} takes no hyperparameter {sorted(unknown)[0]!r} "
                             f"(it takes {sorted(OPTIMIZERS[self.optimizer]) or 'only lr'})")
        full = {**OPTIMIZERS[self.optimizer], **{k: float(v) for k, v in self.hyperparams.items()}}
        if not all(math.isfinite(v) for v in full.values()):
            raise ValueError(f"table {self.name!r}: hyperparameters must be finite, got {full}")
        check_hyperparams(self.optimizer, full, self.name)
        object.__setattr__(self, "hyperparams", full)
        if self.init_scale is None:
            object.__setattr__(self, "init_scale", 1.0 / math.sqrt(self.embedding_dim))
        if not (math.isfinite(self.init_scale) and self.init_scale >= 0):
            raise ValueError(f"table {self.name!r}: init_scale must be finite and >= 0, got {self.init_scale}")
        if self.init not in INITS:
            raise ValueError(f"table {self.name!r}: init {self.init!r} is not one of {sorted(k for k in INITS if k)}")
        args = tuple(float(a) for a in self.init_args)
        if len(args) != INITS[self.init] or not all(math.isfinite(a) for a in args):
            raise ValueError(f"table {self.name!r}: init {self.init or 'uniform(-init_scale, init_scale)'} takes "
                             f"{INITS[self.init]} finite argument(s), got {self.init_args!r}")
        if (self.init == "uniform" and not args[0] < args[1]) or (self.init == "normal" and not args[1] >= 0):
            raise ValueError(f"table {self.name!r}: init {self.init}{args} needs a < b (uniform) or std >= 0 (normal)")
        object.__setattr__(self, "init_args", args)
        if not (math.isfinite(self.ttl_seconds) and self.ttl_seconds >= 0):
            raise ValueError(f"table {self.name!r}: ttl_seconds must be finite and >= 0, got {self.ttl_seconds}")
        object.__setattr__(self, "ttl_seconds", float(self.ttl_seconds))
        if self.dtype not in ROW_DTYPES:
            raise ValueError(f"table {self.name!r}: dtype must be one of {sorted(ROW_DTYPES)}, got {self.dtype!r}")
        if self.dtype == "float16" and _largest_initial(self.init, args, self.init_scale) > FLOAT16_MAX:
            raise ValueError(f"table {self.name!r}: its initial rows reach past float16's range (+-{FLOAT16_MAX}): "
                             f"init {self.init or 'uniform'}{args or (self.init_scale,)}; use smaller values or "
                             "dtype float32")
        for name in ("seed", "min_count", "ttl_rounds", "capacity", "max_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"table {self.name!r}: {name} must be >= 0, got {getattr(self, name)}")

    @property
    def row_dtype(self) -> torch.dtype:
        """The weights' dtype on the shards and the wire (``dtype``): float32 or float16."""
        return ROW_DTYPES[self.dtype]

    def initial_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows int64 ``ids`` ``[n]`` start from (and read as while not trained): float32 ``[n, dim]``, the
        values of :attr:`row_dtype` (a float16 table's initial rows rounded to float16, as the shards hold them)."""
        rows = initial_rows(self.name, ids, self.embedding_dim, self.seed, self.init_scale, self.padding_idx,
                            self.init, self.init_args)
        return rows if self.dtype == "float32" else rows.to(self.row_dtype).float()

    def row_bytes(self) -> int:
        """Bytes of one row's weights (``dtype``) and optimizer state (float32)."""
        return self.row_dtype.itemsize * self.embedding_dim + \
            4 * sum(state_widths(self.optimizer, self.embedding_dim).values())

    def to_proto(self) -> pb.TableSpec:
        return pb.TableSpec(name=self.name, embedding_dim=self.embedding_dim, num_embeddings=self.num_embeddings,
                            padding_idx=self.padding_idx, optimizer=self.optimizer, hyperparams=self.hyperparams,
                            seed=self.seed, init_scale=self.init_scale, init=self.init, init_args=self.init_args,
                            min_count=self.min_count,
                            ttl_rounds=self.ttl_rounds, capacity=self.capacity, max_bytes=self.max_bytes,
                            dtype=self.dtype, ttl_seconds=self.ttl_seconds)

    @classmethod
    def from_proto(cls, m: pb.TableSpec) -> "TableSpec":
        """Raises ValueError: a field out of range."""
        return cls(name=m.name, embedding_dim=m.embedding_dim, num_embeddings=m.num_embeddings,
                   padding_idx=m.padding_idx, optimizer=m.optimizer, hyperparams=dict(m.hyperparams), seed=m.seed,
                   init_scale=m.init_scale, init=m.init, init_args=tuple(m.init_args), min_count=m.min_count,
                   ttl_rounds=m.ttl_rounds, capacity=m.capacity,
                   max_bytes=m.max_bytes, dtype=m.dtype or "float32", ttl_seconds=m.ttl_seconds)

    def differences(self, other: "TableSpec") -> list[str]:
        """The fields where ``other`` differs, as ``field: mine vs other``."""
        return [f"{f}: {getattr(self, f)!r} vs {getattr(other, f)!r}" for f in self.__dataclass_fields__
                if getattr(self, f) != getattr(other, f)]

"""Checks of every value a client sends, made before the shard does any work with it.

Each check raises :class:`~shardps.server.errors.InvalidArgument` (or
``FailedPrecondition`` where the request is well-formed but does not fit)
with a message that names the field and the fix. Sizes are checked
arithmetically, so a 60-byte Join that asks for 2^40 elements costs
microseconds, not a plan build. Join's memory estimate is admission's
(``membership/admission.py``).
"""

from __future__ import annotations

import math

from shardps.proto import shardps_pb2 as pb
from shardps.common.codec import FLOAT_DTYPES, DecodedFrame, FrameError, decode_frame
from shardps.common.optim import parse_hyperparams
from shardps.common.plan import BUFFER_ITEMSIZE, MASTER_ITEMSIZE, MIN_CHUNK_BYTES
from shardps.server.config import ShardConfig
from shardps.server.errors import FailedPrecondition, InvalidArgument

#: Longest session token (DistributedOptimizer sends 32 hex characters).
MAX_SESSION_CHARS = 64
#: Longest parameter key.
MAX_KEY_CHARS = 1024
#: How much of a client-chosen string goes into a message or a log line.
SHOWN_CHARS = 64


def decode(raw: bytes, what: str) -> DecodedFrame:
    """Decode one frame of a client's stream.

    Raises:
        InvalidArgument: the bytes are not a frame (``what`` names the call).
    """
    try:
        return decode_frame(raw)
    except FrameError as exc:
        raise InvalidArgument(f"{what}: {exc}") from None


def shown(text: str) -> str:
    """``repr(text)``, cut to ``SHOWN_CHARS`` characters: what messages and logs show of client strings."""
    if len(text) <= SHOWN_CHARS:
        return repr(text)
    return f"{text[:SHOWN_CHARS]!r}... ({len(text)} characters)"


def check_worker_id(worker_id: str, config: ShardConfig) -> None:
    """A worker id is 1 to ``config.max_id_chars`` printable characters."""
    if not worker_id:
        raise InvalidArgument("worker_id must be a non-empty string")
    if len(worker_id) > config.max_id_chars:
        raise InvalidArgument(
            f"worker_id {shown(worker_id)} is longer than the {config.max_id_chars} characters this shard accepts"
        )
    if not worker_id.isprintable():
        raise InvalidArgument(f"worker_id {shown(worker_id)} holds non-printable characters")


def check_session(session: str) -> None:
    """A session is 1 to ``MAX_SESSION_CHARS`` printable characters."""
    if not session or len(session) > MAX_SESSION_CHARS or not session.isprintable():
        raise InvalidArgument(
            f"session must be 1 to {MAX_SESSION_CHARS} printable characters (the worker library makes one per process)"
        )


def check_dtype(code: int, what: str) -> None:
    """``code`` is a wire dtype of parameters and gradients (0 means float32)."""
    if code and code not in FLOAT_DTYPES:
        raise InvalidArgument(f"{what} {code} is not a wire dtype; use FLOAT32, BFLOAT16 or FLOAT16")


def check_round_header(header: pb.RoundHeader, config: ShardConfig) -> None:
    """Every field of a round header, before any frame of the stream is read."""
    check_worker_id(header.worker_id, config)
    check_session(header.session)
    check_dtype(header.pull_dtype, "pull_dtype")


def check_trailer(trailer: pb.RoundTrailer, num_groups: int, hyperparam_names: list[set[str]]) -> list[dict] | None:
    """Every field of a round's trailer, before the push is accepted.

    Args:
        num_groups: param groups of the job's optimizer.
        hyperparam_names: each group's hyperparameter names (without ``lr``) the job fixed.

    Returns:
        Each group's hyperparameters without ``lr`` if the trailer carries them, else None.

    Raises:
        InvalidArgument: a learning rate, hyperparameter, scale, norm or norm order
            that is out of range or malformed (the message names it).
    """
    if len(trailer.lrs) != num_groups:
        raise InvalidArgument(f"the push carries {len(trailer.lrs)} learning rates for {num_groups} param group(s)")
    for g, lr in enumerate(trailer.lrs):
        if not (math.isfinite(lr) and lr >= 0):
            raise InvalidArgument(f"learning rate of param group {g} is {lr}; it must be a finite number >= 0")
    if not (math.isfinite(trailer.inv_scale) and trailer.inv_scale >= 0):
        raise InvalidArgument(f"inv_scale is {trailer.inv_scale}; it must be a finite number >= 0 (0: not scaled)")
    if not (math.isfinite(trailer.max_grad_norm) and trailer.max_grad_norm >= 0):
        raise InvalidArgument(f"max_grad_norm is {trailer.max_grad_norm}; it must be a finite number >= 0")
    if not (trailer.norm_type == math.inf or (math.isfinite(trailer.norm_type) and trailer.norm_type >= 0)):
        raise InvalidArgument(f"norm_type is {trailer.norm_type}; it must be > 0 (or inf; 0 means 2)")
    if not trailer.group_hyperparams_json:
        return None
    spec = pb.OptimizerSpec(class_name="", group_hyperparams_json=trailer.group_hyperparams_json)
    if len(spec.group_hyperparams_json) != num_groups:
        raise InvalidArgument(f"the push carries hyperparameters of {len(spec.group_hyperparams_json)} param "
                              f"group(s), not {num_groups}")
    try:
        groups = parse_hyperparams(spec)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    for g, hp in enumerate(groups):
        hp.pop("lr", None)
        if set(hp) != hyperparam_names[g]:
            raise InvalidArgument(
                f"hyperparameters of param group {g} are {sorted(hp)}; the job's optimizer has "
                f"{sorted(hyperparam_names[g])}"
            )
    return groups


def disagreement(workers: list[str], lrs: list[list[float]], hyperparams: list, current: dict[int, dict]) -> str | None:
    """Why the pushes of one dense round cannot be stepped together, or None: a member's param groups' learning
    rates (``lrs[k]``, each member's trailer) differ from the first member's, or the hyperparameters the members
    step with differ, compared on this shard's groups (``hyperparams[k]``: every group's, from the member's
    trailer, or None where its push changed none: then ``current``, the shard's ``{group: {name: value}}``, JSON
    values). Sparse rounds refuse the same (``server/sparse/rounds.py``); before, the first member's were used and
    the others' only logged."""
    for w, mine in zip(workers[1:], lrs[1:]):
        if mine != lrs[0]:
            return (f"workers {shown(workers[0])} and {shown(w)} pushed different learning rates ({lrs[0]} vs "
                    f"{mine}): every worker must step the same param groups on the same schedule")
    given = next((h for h in hyperparams if h is not None), None)
    if given is None:
        return None
    names = {g: set(given[g]) for g in current}
    seen = [{g: {k: (h[g][k] if h is not None else current[g].get(k)) for k in names[g]} for g in current}
            for h in hyperparams]
    for w, mine in zip(workers[1:], seen[1:]):
        if mine != seen[0]:
            return (f"workers {shown(workers[0])} and {shown(w)} step with different hyperparameters ({seen[0]} vs "
                    f"{mine}): every worker must change them alike")
    return None


def check_plan_spec(spec: pb.PlanSpec, num_groups: int, config: ShardConfig) -> int:
    """Check a first joiner's plan against this shard's limits before it is built.

    Args:
        spec: the plan as sent.
        num_groups: param groups of the optimizer spec.

    Returns:
        An upper bound on the fp32 elements this shard would hold.

    Raises:
        FailedPrecondition: ``num_shards`` is not this shard's.
        InvalidArgument: a limit or a rule of the plan is broken.
    """
    if spec.num_shards != config.num_shards:
        raise FailedPrecondition(
            f"the worker's plan has {spec.num_shards} shard(s) but this is shard {config.shard_index} "
            f"of {config.num_shards}: pass the addresses of all {config.num_shards} shards, in shard order"
        )
    if spec.chunk_bytes > config.max_chunk_bytes:
        raise InvalidArgument(
            f"chunk_bytes {spec.chunk_bytes} exceeds the {config.max_chunk_bytes} this shard accepts; "
            "use smaller chunks or start the shard with a larger --max-message-bytes"
        )
    if spec.chunk_bytes < MIN_CHUNK_BYTES or spec.chunk_bytes % MASTER_ITEMSIZE:
        raise InvalidArgument(
            f"chunk_bytes must be a multiple of {MASTER_ITEMSIZE} and >= {MIN_CHUNK_BYTES}, got {spec.chunk_bytes}"
        )
    if not 1 <= num_groups <= config.max_groups:
        raise InvalidArgument(f"the optimizer has {num_groups} param groups; this shard accepts 1 to {config.max_groups}")
    if not 1 <= len(spec.keys) <= config.max_keys:
        raise InvalidArgument(f"the plan has {len(spec.keys)} keys; this shard accepts 1 to {config.max_keys}")
    per_chunk = spec.chunk_bytes // MASTER_ITEMSIZE
    # an upper bound on the plan's chunks: each key cut at chunk_bytes, plus one per shard boundary (plan format 4)
    total, chunks = 0, config.num_shards - 1
    for k in spec.keys:
        if not k.key or len(k.key) > MAX_KEY_CHARS:
            raise InvalidArgument(f"key {shown(k.key)} must have 1 to {MAX_KEY_CHARS} characters")
        if len(k.shape) > config.max_dims:
            raise InvalidArgument(f"key {shown(k.key)} has {len(k.shape)} dimensions (at most {config.max_dims})")
        if k.group >= num_groups:
            raise InvalidArgument(
                f"key {shown(k.key)} is in param group {k.group} but the optimizer has {num_groups} group(s)"
            )
        numel = math.prod(k.shape)
        total += numel
        chunks += -(-numel // per_chunk)
        if chunks > config.max_chunks:
            raise InvalidArgument(
                f"the plan would cut the model into more than {config.max_chunks} chunks; "
                "use a larger chunk_bytes (or raise the shard's --max-chunks)"
            )
    if len(spec.keys) + len(spec.buffers) > config.max_keys:
        raise InvalidArgument(f"the plan has {len(spec.keys) + len(spec.buffers)} keys and buffers; this shard "
                              f"accepts at most {config.max_keys}")
    buffer_bytes = 0
    for b in spec.buffers:
        if not b.key or len(b.key) > MAX_KEY_CHARS:
            raise InvalidArgument(f"buffer {shown(b.key)} must have 1 to {MAX_KEY_CHARS} characters")
        if len(b.shape) > config.max_dims:
            raise InvalidArgument(f"buffer {shown(b.key)} has {len(b.shape)} dimensions (at most {config.max_dims})")
        itemsize = BUFFER_ITEMSIZE.get(b.dtype)
        if itemsize is None:
            raise InvalidArgument(f"buffer {shown(b.key)} has unsupported dtype {b.dtype}")
        numel = math.prod(b.shape)
        buffer_bytes += numel * itemsize
        chunks += -(-numel // max(1, spec.chunk_bytes // itemsize))
        if chunks > config.max_chunks:
            raise InvalidArgument(
                f"the plan would cut the model and its buffers into more than {config.max_chunks} chunks; "
                "use a larger chunk_bytes (or raise the shard's --max-chunks)"
            )
    # parameters, and buffers counted as fp32 elements of the same bytes
    return -(-(total + -(-buffer_bytes // MASTER_ITEMSIZE)) // config.num_shards) + per_chunk

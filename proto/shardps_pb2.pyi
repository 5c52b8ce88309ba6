from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    INT64: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT16: _ClassVar[DType]
    INT8: _ClassVar[DType]
    UINT8: _ClassVar[DType]
    BOOL: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
BFLOAT16: DType
FLOAT16: DType
FLOAT64: DType
INT64: DType
INT32: DType
INT16: DType
INT8: DType
UINT8: DType
BOOL: DType

class KeySpec(_message.Message):
    __slots__ = ("key", "shape", "group")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    key: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    group: int
    def __init__(self, key: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., group: _Optional[int] = ...) -> None: ...

class BufferSpec(_message.Message):
    __slots__ = ("key", "shape", "dtype")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    key: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    def __init__(self, key: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class PlanSpec(_message.Message):
    __slots__ = ("keys", "num_shards", "chunk_bytes", "buffers")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[KeySpec]
    num_shards: int
    chunk_bytes: int
    buffers: _containers.RepeatedCompositeFieldContainer[BufferSpec]
    def __init__(self, keys: _Optional[_Iterable[_Union[KeySpec, _Mapping]]] = ..., num_shards: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., buffers: _Optional[_Iterable[_Union[BufferSpec, _Mapping]]] = ...) -> None: ...

class OptimizerSpec(_message.Message):
    __slots__ = ("class_name", "group_hyperparams_json")
    CLASS_NAME_FIELD_NUMBER: _ClassVar[int]
    GROUP_HYPERPARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    class_name: str
    group_hyperparams_json: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, class_name: _Optional[str] = ..., group_hyperparams_json: _Optional[_Iterable[str]] = ...) -> None: ...

class JobView(_message.Message):
    __slots__ = ("job_id", "initialiser", "initialised", "version", "restored")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    INITIALISER_FIELD_NUMBER: _ClassVar[int]
    INITIALISED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    initialiser: str
    initialised: bool
    version: int
    restored: bool
    def __init__(self, job_id: _Optional[str] = ..., initialiser: _Optional[str] = ..., initialised: _Optional[bool] = ..., version: _Optional[int] = ..., restored: _Optional[bool] = ...) -> None: ...

class ModeSpec(_message.Message):
    __slots__ = ("mode", "staleness", "scale_lr_by_staleness")
    MODE_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    SCALE_LR_BY_STALENESS_FIELD_NUMBER: _ClassVar[int]
    mode: str
    staleness: int
    scale_lr_by_staleness: bool
    def __init__(self, mode: _Optional[str] = ..., staleness: _Optional[int] = ..., scale_lr_by_staleness: _Optional[bool] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("worker_id", "plan", "plan_fingerprint", "optimizer", "session", "job", "static_digest", "mode")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    PLAN_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    STATIC_DIGEST_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    plan: PlanSpec
    plan_fingerprint: str
    optimizer: OptimizerSpec
    session: str
    job: JobView
    static_digest: str
    mode: ModeSpec
    def __init__(self, worker_id: _Optional[str] = ..., plan: _Optional[_Union[PlanSpec, _Mapping]] = ..., plan_fingerprint: _Optional[str] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., session: _Optional[str] = ..., job: _Optional[_Union[JobView, _Mapping]] = ..., static_digest: _Optional[str] = ..., mode: _Optional[_Union[ModeSpec, _Mapping]] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("initialise", "version", "members", "shard_index", "job", "lease_seconds", "incarnation")
    INITIALISE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    initialise: bool
    version: int
    members: int
    shard_index: int
    job: JobView
    lease_seconds: float
    incarnation: str
    def __init__(self, initialise: _Optional[bool] = ..., version: _Optional[int] = ..., members: _Optional[int] = ..., shard_index: _Optional[int] = ..., job: _Optional[_Union[JobView, _Mapping]] = ..., lease_seconds: _Optional[float] = ..., incarnation: _Optional[str] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("worker_id", "session")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    session: str
    def __init__(self, worker_id: _Optional[str] = ..., session: _Optional[str] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ("members",)
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    members: int
    def __init__(self, members: _Optional[int] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ResetReply(_message.Message):
    __slots__ = ("job_id", "version")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    version: int
    def __init__(self, job_id: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "session")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    session: str
    def __init__(self, worker_id: _Optional[str] = ..., session: _Optional[str] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("members", "membership_epoch", "version", "lease_seconds")
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedScalarFieldContainer[str]
    membership_epoch: int
    version: int
    lease_seconds: float
    def __init__(self, members: _Optional[_Iterable[str]] = ..., membership_epoch: _Optional[int] = ..., version: _Optional[int] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("digest", "plan")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    digest: bool
    plan: bool
    def __init__(self, digest: _Optional[bool] = ..., plan: _Optional[bool] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("shard_index", "num_shards", "version", "members", "min_workers", "initialised", "plan_fingerprint", "optimizer", "num_chunks", "param_bytes", "optimizer_state_bytes", "push_bytes_total", "pull_bytes_total", "pushed", "job_id", "waiting", "max_workers", "digest", "rounds_skipped", "membership_epoch", "lease_expiries", "last_round_contributors", "checkpoint_version", "checkpoint_unix_seconds", "incarnation", "restored_version", "pushes_accepted", "contributions_applied", "pushes_dropped", "rejoining", "plan", "mode", "staleness_histogram", "clocks", "checkpoint_name", "checkpoint_sparse_round", "restored_checkpoint", "restored_sparse_round", "tables", "stream_positions")
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    MIN_WORKERS_FIELD_NUMBER: _ClassVar[int]
    INITIALISED_FIELD_NUMBER: _ClassVar[int]
    PLAN_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    PARAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PUSH_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PULL_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PUSHED_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    MAX_WORKERS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRIES_FIELD_NUMBER: _ClassVar[int]
    LAST_ROUND_CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RESTORED_VERSION_FIELD_NUMBER: _ClassVar[int]
    PUSHES_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTIONS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    REJOINING_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    STALENESS_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    CLOCKS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_NAME_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_SPARSE_ROUND_FIELD_NUMBER: _ClassVar[int]
    RESTORED_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    RESTORED_SPARSE_ROUND_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    STREAM_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    num_shards: int
    version: int
    members: _containers.RepeatedScalarFieldContainer[str]
    min_workers: int
    initialised: bool
    plan_fingerprint: str
    optimizer: str
    num_chunks: int
    param_bytes: int
    optimizer_state_bytes: int
    push_bytes_total: int
    pull_bytes_total: int
    pushed: _containers.RepeatedScalarFieldContainer[str]
    job_id: str
    waiting: int
    max_workers: int
    digest: str
    rounds_skipped: int
    membership_epoch: int
    lease_expiries: int
    last_round_contributors: int
    checkpoint_version: int
    checkpoint_unix_seconds: float
    incarnation: str
    restored_version: int
    pushes_accepted: int
    contributions_applied: int
    pushes_dropped: int
    rejoining: _containers.RepeatedScalarFieldContainer[str]
    plan: PlanSpec
    mode: ModeSpec
    staleness_histogram: _containers.RepeatedScalarFieldContainer[int]
    clocks: _containers.RepeatedScalarFieldContainer[int]
    checkpoint_name: str
    checkpoint_sparse_round: int
    restored_checkpoint: str
    restored_sparse_round: int
    tables: _containers.RepeatedCompositeFieldContainer[TableSpec]
    stream_positions: _containers.RepeatedCompositeFieldContainer[StreamPosition]
    def __init__(self, shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., version: _Optional[int] = ..., members: _Optional[_Iterable[str]] = ..., min_workers: _Optional[int] = ..., initialised: _Optional[bool] = ..., plan_fingerprint: _Optional[str] = ..., optimizer: _Optional[str] = ..., num_chunks: _Optional[int] = ..., param_bytes: _Optional[int] = ..., optimizer_state_bytes: _Optional[int] = ..., push_bytes_total: _Optional[int] = ..., pull_bytes_total: _Optional[int] = ..., pushed: _Optional[_Iterable[str]] = ..., job_id: _Optional[str] = ..., waiting: _Optional[int] = ..., max_workers: _Optional[int] = ..., digest: _Optional[str] = ..., rounds_skipped: _Optional[int] = ..., membership_epoch: _Optional[int] = ..., lease_expiries: _Optional[int] = ..., last_round_contributors: _Optional[int] = ..., checkpoint_version: _Optional[int] = ..., checkpoint_unix_seconds: _Optional[float] = ..., incarnation: _Optional[str] = ..., restored_version: _Optional[int] = ..., pushes_accepted: _Optional[int] = ..., contributions_applied: _Optional[int] = ..., pushes_dropped: _Optional[int] = ..., rejoining: _Optional[_Iterable[str]] = ..., plan: _Optional[_Union[PlanSpec, _Mapping]] = ..., mode: _Optional[_Union[ModeSpec, _Mapping]] = ..., staleness_histogram: _Optional[_Iterable[int]] = ..., clocks: _Optional[_Iterable[int]] = ..., checkpoint_name: _Optional[str] = ..., checkpoint_sparse_round: _Optional[int] = ..., restored_checkpoint: _Optional[str] = ..., restored_sparse_round: _Optional[int] = ..., tables: _Optional[_Iterable[_Union[TableSpec, _Mapping]]] = ..., stream_positions: _Optional[_Iterable[_Union[StreamPosition, _Mapping]]] = ...) -> None: ...

class ExportRequest(_message.Message):
    __slots__ = ("min_version",)
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    min_version: int
    def __init__(self, min_version: _Optional[int] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointReply(_message.Message):
    __slots__ = ("version", "path", "name", "sparse_round", "written", "no_job")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SPARSE_ROUND_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    NO_JOB_FIELD_NUMBER: _ClassVar[int]
    version: int
    path: str
    name: str
    sparse_round: int
    written: bool
    no_job: bool
    def __init__(self, version: _Optional[int] = ..., path: _Optional[str] = ..., name: _Optional[str] = ..., sparse_round: _Optional[int] = ..., written: _Optional[bool] = ..., no_job: _Optional[bool] = ...) -> None: ...

class ChunkHeader(_message.Message):
    __slots__ = ("key", "offset", "numel", "dtype", "version", "crc32", "state", "pad")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PAD_FIELD_NUMBER: _ClassVar[int]
    key: str
    offset: int
    numel: int
    dtype: DType
    version: int
    crc32: int
    state: str
    pad: bytes
    def __init__(self, key: _Optional[str] = ..., offset: _Optional[int] = ..., numel: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., version: _Optional[int] = ..., crc32: _Optional[int] = ..., state: _Optional[str] = ..., pad: _Optional[bytes] = ...) -> None: ...

class RoundHeader(_message.Message):
    __slots__ = ("worker_id", "round", "plan_fingerprint", "pull_dtype", "session", "scaled", "check_only", "streamed", "options")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PLAN_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PULL_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SCALED_FIELD_NUMBER: _ClassVar[int]
    CHECK_ONLY_FIELD_NUMBER: _ClassVar[int]
    STREAMED_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    round: int
    plan_fingerprint: str
    pull_dtype: DType
    session: str
    scaled: bool
    check_only: bool
    streamed: bool
    options: RoundTrailer
    def __init__(self, worker_id: _Optional[str] = ..., round: _Optional[int] = ..., plan_fingerprint: _Optional[str] = ..., pull_dtype: _Optional[_Union[DType, str]] = ..., session: _Optional[str] = ..., scaled: _Optional[bool] = ..., check_only: _Optional[bool] = ..., streamed: _Optional[bool] = ..., options: _Optional[_Union[RoundTrailer, _Mapping]] = ...) -> None: ...

class StreamSpan(_message.Message):
    __slots__ = ("partition", "after", "last")
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    partition: str
    after: int
    last: int
    def __init__(self, partition: _Optional[str] = ..., after: _Optional[int] = ..., last: _Optional[int] = ...) -> None: ...

class StreamPosition(_message.Message):
    __slots__ = ("partition", "dense", "rows")
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    partition: str
    dense: int
    rows: int
    def __init__(self, partition: _Optional[str] = ..., dense: _Optional[int] = ..., rows: _Optional[int] = ...) -> None: ...

class RoundTrailer(_message.Message):
    __slots__ = ("lrs", "group_hyperparams_json", "absent_keys", "inv_scale", "max_grad_norm", "norm_type", "span")
    LRS_FIELD_NUMBER: _ClassVar[int]
    GROUP_HYPERPARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    ABSENT_KEYS_FIELD_NUMBER: _ClassVar[int]
    INV_SCALE_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    NORM_TYPE_FIELD_NUMBER: _ClassVar[int]
    SPAN_FIELD_NUMBER: _ClassVar[int]
    lrs: _containers.RepeatedScalarFieldContainer[float]
    group_hyperparams_json: _containers.RepeatedScalarFieldContainer[str]
    absent_keys: _containers.RepeatedScalarFieldContainer[int]
    inv_scale: float
    max_grad_norm: float
    norm_type: float
    span: StreamSpan
    def __init__(self, lrs: _Optional[_Iterable[float]] = ..., group_hyperparams_json: _Optional[_Iterable[str]] = ..., absent_keys: _Optional[_Iterable[int]] = ..., inv_scale: _Optional[float] = ..., max_grad_norm: _Optional[float] = ..., norm_type: _Optional[float] = ..., span: _Optional[_Union[StreamSpan, _Mapping]] = ...) -> None: ...

class RoundReport(_message.Message):
    __slots__ = ("round", "norm_part", "found_inf")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NORM_PART_FIELD_NUMBER: _ClassVar[int]
    FOUND_INF_FIELD_NUMBER: _ClassVar[int]
    round: int
    norm_part: float
    found_inf: bool
    def __init__(self, round: _Optional[int] = ..., norm_part: _Optional[float] = ..., found_inf: _Optional[bool] = ...) -> None: ...

class RoundCommit(_message.Message):
    __slots__ = ("round", "skip", "clip_coef")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SKIP_FIELD_NUMBER: _ClassVar[int]
    CLIP_COEF_FIELD_NUMBER: _ClassVar[int]
    round: int
    skip: bool
    clip_coef: float
    def __init__(self, round: _Optional[int] = ..., skip: _Optional[bool] = ..., clip_coef: _Optional[float] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("header", "payload", "round", "trailer", "report", "commit")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    header: ChunkHeader
    payload: bytes
    round: RoundHeader
    trailer: RoundTrailer
    report: RoundReport
    commit: RoundCommit
    def __init__(self, header: _Optional[_Union[ChunkHeader, _Mapping]] = ..., payload: _Optional[bytes] = ..., round: _Optional[_Union[RoundHeader, _Mapping]] = ..., trailer: _Optional[_Union[RoundTrailer, _Mapping]] = ..., report: _Optional[_Union[RoundReport, _Mapping]] = ..., commit: _Optional[_Union[RoundCommit, _Mapping]] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("min_version", "plan_fingerprint", "dtype", "worker_id", "session")
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    PLAN_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    min_version: int
    plan_fingerprint: str
    dtype: DType
    worker_id: str
    session: str
    def __init__(self, min_version: _Optional[int] = ..., plan_fingerprint: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., worker_id: _Optional[str] = ..., session: _Optional[str] = ...) -> None: ...

class InitReply(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("worker_id", "session", "plan_fingerprint")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PLAN_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    session: str
    plan_fingerprint: str
    def __init__(self, worker_id: _Optional[str] = ..., session: _Optional[str] = ..., plan_fingerprint: _Optional[str] = ...) -> None: ...

class SetStateReply(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class TableSpec(_message.Message):
    __slots__ = ("name", "embedding_dim", "num_embeddings", "padding_idx", "optimizer", "hyperparams", "seed", "init_scale", "min_count", "ttl_rounds", "capacity", "max_bytes", "init", "init_args", "dtype", "ttl_seconds")
    class HyperparamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_DIM_FIELD_NUMBER: _ClassVar[int]
    NUM_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    PADDING_IDX_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    HYPERPARAMS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    INIT_SCALE_FIELD_NUMBER: _ClassVar[int]
    MIN_COUNT_FIELD_NUMBER: _ClassVar[int]
    TTL_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    INIT_FIELD_NUMBER: _ClassVar[int]
    INIT_ARGS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    embedding_dim: int
    num_embeddings: int
    padding_idx: int
    optimizer: str
    hyperparams: _containers.ScalarMap[str, float]
    seed: int
    init_scale: float
    min_count: int
    ttl_rounds: int
    capacity: int
    max_bytes: int
    init: str
    init_args: _containers.RepeatedScalarFieldContainer[float]
    dtype: str
    ttl_seconds: float
    def __init__(self, name: _Optional[str] = ..., embedding_dim: _Optional[int] = ..., num_embeddings: _Optional[int] = ..., padding_idx: _Optional[int] = ..., optimizer: _Optional[str] = ..., hyperparams: _Optional[_Mapping[str, float]] = ..., seed: _Optional[int] = ..., init_scale: _Optional[float] = ..., min_count: _Optional[int] = ..., ttl_rounds: _Optional[int] = ..., capacity: _Optional[int] = ..., max_bytes: _Optional[int] = ..., init: _Optional[str] = ..., init_args: _Optional[_Iterable[float]] = ..., dtype: _Optional[str] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class DeclareTablesRequest(_message.Message):
    __slots__ = ("worker_id", "session", "tables", "rows_mode")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    ROWS_MODE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    session: str
    tables: _containers.RepeatedCompositeFieldContainer[TableSpec]
    rows_mode: str
    def __init__(self, worker_id: _Optional[str] = ..., session: _Optional[str] = ..., tables: _Optional[_Iterable[_Union[TableSpec, _Mapping]]] = ..., rows_mode: _Optional[str] = ...) -> None: ...

class DeclareTablesReply(_message.Message):
    __slots__ = ("round",)
    ROUND_FIELD_NUMBER: _ClassVar[int]
    round: int
    def __init__(self, round: _Optional[int] = ...) -> None: ...

class TableIds(_message.Message):
    __slots__ = ("table", "ids")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ...) -> None: ...

class PullRowsRequest(_message.Message):
    __slots__ = ("worker_id", "session", "table", "ids", "after_push", "tables", "after_push_number")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    AFTER_PUSH_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    AFTER_PUSH_NUMBER_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    session: str
    table: str
    ids: bytes
    after_push: bool
    tables: _containers.RepeatedCompositeFieldContainer[TableIds]
    after_push_number: int
    def __init__(self, worker_id: _Optional[str] = ..., session: _Optional[str] = ..., table: _Optional[str] = ..., ids: _Optional[bytes] = ..., after_push: _Optional[bool] = ..., tables: _Optional[_Iterable[_Union[TableIds, _Mapping]]] = ..., after_push_number: _Optional[int] = ...) -> None: ...

class PullRowsReply(_message.Message):
    __slots__ = ("rows", "round", "parts")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    rows: bytes
    round: int
    parts: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, rows: _Optional[bytes] = ..., round: _Optional[int] = ..., parts: _Optional[_Iterable[bytes]] = ...) -> None: ...

class TableRows(_message.Message):
    __slots__ = ("table", "ids", "grads", "lr")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    grads: bytes
    lr: float
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ..., grads: _Optional[bytes] = ..., lr: _Optional[float] = ...) -> None: ...

class PushRowsRequest(_message.Message):
    __slots__ = ("worker_id", "session", "push", "tables", "part", "parts", "event_time", "span")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    EVENT_TIME_FIELD_NUMBER: _ClassVar[int]
    SPAN_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    session: str
    push: int
    tables: _containers.RepeatedCompositeFieldContainer[TableRows]
    part: int
    parts: int
    event_time: float
    span: StreamSpan
    def __init__(self, worker_id: _Optional[str] = ..., session: _Optional[str] = ..., push: _Optional[int] = ..., tables: _Optional[_Iterable[_Union[TableRows, _Mapping]]] = ..., part: _Optional[int] = ..., parts: _Optional[int] = ..., event_time: _Optional[float] = ..., span: _Optional[_Union[StreamSpan, _Mapping]] = ...) -> None: ...

class PushRowsReply(_message.Message):
    __slots__ = ("round",)
    ROUND_FIELD_NUMBER: _ClassVar[int]
    round: int
    def __init__(self, round: _Optional[int] = ...) -> None: ...

class ExportRowsRequest(_message.Message):
    __slots__ = ("table", "state", "offset", "max_rows", "since_round")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    SINCE_ROUND_FIELD_NUMBER: _ClassVar[int]
    table: str
    state: bool
    offset: int
    max_rows: int
    since_round: int
    def __init__(self, table: _Optional[str] = ..., state: _Optional[bool] = ..., offset: _Optional[int] = ..., max_rows: _Optional[int] = ..., since_round: _Optional[int] = ...) -> None: ...

class ExportRowsReply(_message.Message):
    __slots__ = ("spec", "ids", "weights", "state", "state_width", "round", "step", "total_rows", "evicted", "evictions_forgotten", "incarnation", "positions")
    class StateEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    class StateWidthEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SPEC_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ROWS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FORGOTTEN_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    spec: TableSpec
    ids: bytes
    weights: bytes
    state: _containers.ScalarMap[str, bytes]
    state_width: _containers.ScalarMap[str, int]
    round: int
    step: int
    total_rows: int
    evicted: bytes
    evictions_forgotten: bool
    incarnation: str
    positions: _containers.RepeatedCompositeFieldContainer[StreamPosition]
    def __init__(self, spec: _Optional[_Union[TableSpec, _Mapping]] = ..., ids: _Optional[bytes] = ..., weights: _Optional[bytes] = ..., state: _Optional[_Mapping[str, bytes]] = ..., state_width: _Optional[_Mapping[str, int]] = ..., round: _Optional[int] = ..., step: _Optional[int] = ..., total_rows: _Optional[int] = ..., evicted: _Optional[bytes] = ..., evictions_forgotten: _Optional[bool] = ..., incarnation: _Optional[str] = ..., positions: _Optional[_Iterable[_Union[StreamPosition, _Mapping]]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("table", "ids")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("rows", "dim", "state", "state_age_seconds", "rounds")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATE_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    rows: bytes
    dim: int
    state: int
    state_age_seconds: float
    rounds: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rows: _Optional[bytes] = ..., dim: _Optional[int] = ..., state: _Optional[int] = ..., state_age_seconds: _Optional[float] = ..., rounds: _Optional[_Iterable[int]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("user", "items")
    USER_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    user: int
    items: bytes
    def __init__(self, user: _Optional[int] = ..., items: _Optional[bytes] = ...) -> None: ...

class ScoreReply(_message.Message):
    __slots__ = ("scores", "state")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    scores: bytes
    state: int
    def __init__(self, scores: _Optional[bytes] = ..., state: _Optional[int] = ...) -> None: ...

class Feature(_message.Message):
    __slots__ = ("name", "shape", "int64_values", "float32_values")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    INT64_VALUES_FIELD_NUMBER: _ClassVar[int]
    FLOAT32_VALUES_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    int64_values: bytes
    float32_values: bytes
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., int64_values: _Optional[bytes] = ..., float32_values: _Optional[bytes] = ...) -> None: ...

class PredictRequest(_message.Message):
    __slots__ = ("features",)
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    features: _containers.RepeatedCompositeFieldContainer[Feature]
    def __init__(self, features: _Optional[_Iterable[_Union[Feature, _Mapping]]] = ...) -> None: ...

class PredictReply(_message.Message):
    __slots__ = ("scores", "shape", "state")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    scores: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    state: int
    def __init__(self, scores: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ..., state: _Optional[int] = ...) -> None: ...

class StatesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VisibleState(_message.Message):
    __slots__ = ("state", "made_at_unix_seconds", "positions", "versions", "dense_read_unix_seconds")
    STATE_FIELD_NUMBER: _ClassVar[int]
    MADE_AT_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    DENSE_READ_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    state: int
    made_at_unix_seconds: float
    positions: _containers.RepeatedCompositeFieldContainer[StreamPosition]
    versions: _containers.RepeatedScalarFieldContainer[int]
    dense_read_unix_seconds: float
    def __init__(self, state: _Optional[int] = ..., made_at_unix_seconds: _Optional[float] = ..., positions: _Optional[_Iterable[_Union[StreamPosition, _Mapping]]] = ..., versions: _Optional[_Iterable[int]] = ..., dense_read_unix_seconds: _Optional[float] = ...) -> None: ...

class StatesReply(_message.Message):
    __slots__ = ("states", "delta_wire_bytes", "delta_payload_bytes")
    STATES_FIELD_NUMBER: _ClassVar[int]
    DELTA_WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DELTA_PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedCompositeFieldContainer[VisibleState]
    delta_wire_bytes: int
    delta_payload_bytes: int
    def __init__(self, states: _Optional[_Iterable[_Union[VisibleState, _Mapping]]] = ..., delta_wire_bytes: _Optional[int] = ..., delta_payload_bytes: _Optional[int] = ...) -> None: ...

class ServingQuery(_message.Message):
    __slots__ = ("tag", "lookup", "score", "predict")
    TAG_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    PREDICT_FIELD_NUMBER: _ClassVar[int]
    tag: int
    lookup: LookupRequest
    score: ScoreRequest
    predict: PredictRequest
    def __init__(self, tag: _Optional[int] = ..., lookup: _Optional[_Union[LookupRequest, _Mapping]] = ..., score: _Optional[_Union[ScoreRequest, _Mapping]] = ..., predict: _Optional[_Union[PredictRequest, _Mapping]] = ...) -> None: ...

class ServingAnswer(_message.Message):
    __slots__ = ("tag", "lookup", "score", "predict", "code", "error")
    TAG_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    PREDICT_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    tag: int
    lookup: LookupReply
    score: ScoreReply
    predict: PredictReply
    code: int
    error: str
    def __init__(self, tag: _Optional[int] = ..., lookup: _Optional[_Union[LookupReply, _Mapping]] = ..., score: _Optional[_Union[ScoreReply, _Mapping]] = ..., predict: _Optional[_Union[PredictReply, _Mapping]] = ..., code: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

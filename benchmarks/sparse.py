"""Sparse embedding tables benchmark: a DLRM-style model on a synthetic Criteo-shaped click log.

    python benchmarks/sparse.py [--json PATH] [--quick] [--ids 10000000] [--bounded] [--batch-size 2048]
                                [--steps 20] [--warmup 3] [--grid 1x1,2x1,...] [--dense-ids N]

Data (deterministic, generated with torch per step, no files): every sample
has 13 dense features (standard normal), 26 categorical features with one id
each, and a 0/1 click label (a fixed logistic function of the dense
features and of one hash bit of each id, so the label can be learnt). Each
categorical feature draws Zipf ranks over ``--ids`` ids (10**7 by default;
inverse CDF of a continuous power law with exponent ``--zipf`` 1.1 over
``[1, ids]``, floored) and maps rank ``r`` to id ``(a_f * r + b_f) mod ids``
with ``a_f`` prime to ``ids``, a different permutation per feature. Global
step ``t`` is one generator seed; with W workers each takes its own
``--batch-size`` samples of the global batch of ``W * batch-size``.

Model (DLRM, Naumov et al. 2019, smaller): bottom MLP 13 -> 64 -> 16 (ReLU);
26 embedding bags of dim 16 (``mode="sum"``, one id per bag); the dot
products of the 27 vectors (351) next to the bottom output -> top MLP 367
-> 128 -> 64 -> 1; ``BCEWithLogitsLoss``. Optimizers: Adam (lr 1e-3) for
the MLPs, Adagrad (lr 0.05) for the tables. Shards run with ``--threads 1``
and each worker process with ``(cores - shards) // workers`` torch threads,
at least 1 (2 cores are shared by up to 8 processes; more threads than
free cores make torch's OpenMP threads spin on cores the shards need:
1 x 1 with 2 worker threads here ran at 102 ms/step, with 1 at 94).

Systems:
- ``shardps`` (the grid, ``--grid`` ``SxW``: S shards, W workers, default 1,
  2, 4 of each): the 26 tables are hashed ``ShardedEmbeddingBag`` s in one
  ``ShardedEmbeddingBagCollection`` (one pull per shard and step for all of
  them; ``num_embeddings=None``: any int64 id, rows made when first trained; ``--bounded``: tables of
  ``--ids`` rows, looked up through a direct array on the shard where they hold at most 2^22 ids), their
  rows and Adagrad state on the shards; the MLPs are dense parameters of the
  same ``DistributedOptimizer`` (sync). Every worker is its own spawned process.
  Each step, after its forward, the worker makes the next batch and calls
  ``model.tables.prefetch`` on its ids (the shards look them up while the
  step computes and answer once its push is applied: the next forward
  only waits for the rows); the figures record ``prefetch``.
- ``no_prefetch`` (``--systems noprefetch``): shardps 1 shard x 1 worker
  without the prefetch, for comparison.
- ``oracle``: the same model in one process, no shardps: ``nn.EmbeddingBag(N,
  16, mode="sum", sparse=True)`` tables, ``torch.optim.Adagrad`` on their
  sparse gradients, Adam on the MLPs, every core of the machine (torch's
  default threads). Its tables are dense tensors of N rows, so N is the
  largest power of ten <= ``--ids`` whose weights plus Adagrad state
  (26 * N * 16 * 4 * 2 bytes) fit in half this machine's memory (10**6 on
  24 GiB); it reads the same batches with ids folded to ``id mod N``
  (almost no extra collisions, so the same rows per step). Its batch is one
  worker's.
- ``dense_tables``: the same model with plain ``nn.EmbeddingBag`` tables (dense
  gradients) as dense parameters of a ``DistributedOptimizer`` (1 shard, 1
  worker, Adagrad lr 0.05 for every parameter): every step pushes every
  table's whole gradient and pulls every row. Measured at ``--dense-ids`` ids
  per feature (default: the largest power of ten <= ``--ids`` for which six
  copies of the tables (worker weights and gradients, shard weights,
  Adagrad state, the round's gradient and its frames) fit in half this
  machine's memory), next to ``shardps`` 1x1 on the same data at that size.
  It runs ``--dense-steps`` timed steps after 1 warm-up step (a step moves
  the whole tables both ways); ``init_seconds`` is how long building its
  ``DistributedOptimizer`` (joining, the first push of the tables) took.

The machine's load average at the start is recorded (``load_average_at_start``):
other processes on these cores slow every figure.

Figures per run (timed steps: all after the ``--warmup`` ones):
- ``samples_per_s``: samples of every worker over the timed steps / the
  slowest worker's wall seconds for them;
- ``rows_per_s``: embedding rows a step needs (unique ids per feature per
  worker, summed over features and workers, counted after the timing from
  the same batches, not inside the timed loop) per second: the rows pulled
  from the shards (and pushed back) for shardps, the rows looked up and
  updated for the oracle;
- ``unique_rows_per_step``: those rows per worker step (mean);
- ``wire_bytes_per_step`` (shardps, per worker): bytes of the sparse tables'
  protobuf messages per step (PullRows requests and replies, PushRows
  requests and replies, counted on the worker's client calls; gRPC and TCP
  framing not included), next to ``ideal_bytes_per_step`` = unique rows x
  (row bytes down + gradient bytes up, 2 x 16 x 4 B) + unique rows x 2 x 8 B
  (each id named once each way); ``wire_ratio`` is their quotient. The
  library's own counters (``SparseTables.pushed_bytes`` + ``pulled_bytes``: push
  requests + pulled row payload) are ``counted_bytes_per_step``; the dense MLP
  parameters' frames (``shardps_worker_pushed/pulled_bytes``) are
  ``dense_bytes_per_step``, outside both;
- ``shard_bytes_per_row``: after the run, ``shardps_shard_table_bytes`` summed
  over tables and shards / ``shardps_shard_table_rows`` summed the same way
  (read from the shards' Prometheus endpoints), next to ``row_bytes`` =
  weights + Adagrad state = 2 x 16 x 4 = 128 B (``--row-dtype float16``:
  float16 weights, 16 x 2 + 16 x 4 = 96 B; the ideal wire bytes then count
  rows pulled at 2 B a value, gradients pushed at 4);
- ``peak_rss_bytes``: the largest worker's (or the oracle's) peak resident memory.

Targets (verdicts computed, printed and written):
1. wire bytes per step <= 1.1 x ideal, every shardps configuration at ``--ids``;
2. shardps 1 shard x 1 worker >= 0.5 x the oracle's samples/s: the median
   of the ratios of the grid's 1x1 to the oracle run and of ``--pairs``
   interleaved (1x1, oracle) runs (this machine's speed drifts by tens of
   per cent over minutes: a ratio compares runs made one after the other);
3. shardps sparse >= 10 x dense_tables samples/s, both 1x1 at ``--dense-ids``;
4. shard bytes per row <= 1.5 x row_bytes, the largest over the configurations at ``--ids``.

Progress (one line per run) goes to stderr. ``--quick``: 10**5 ids, batch
512, 2 timed steps after 2 warm-up ones, grid 1x1 and 2x2, dense tables at 10**4
ids: a smoke run (under a minute), not figures to quote.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from common import cpu_seconds, emit, parser, peak_rss_bytes, table  # noqa: E402
from torch import nn  # noqa: E402

FEATURES, DENSE_FEATURES, DIM = 26, 13, 16
BOTTOM, TOP = (64,), (128, 64)
LR_DENSE, LR_SPARSE = 1e-3, 0.05
#: Bytes of one row: weights [DIM] (float32, or float16 with --row-dtype float16) + Adagrad's state sum [DIM]
#: (float32); main() sets it from --row-dtype.
ROW_BYTES = 4 * (DIM + DIM)
ROW_DTYPES = {"float32": torch.float32, "float16": torch.float16}
#: Targets (see the module docstring).
WIRE_GOAL, ORACLE_GOAL, DENSE_GOAL, MEMORY_GOAL = 1.1, 0.5, 10.0, 1.5


# ---------------------------------------------------------------------------------------------------- data
def _multipliers(num_ids: int) -> list[tuple[int, int]]:
    """Per feature ``(a, b)`` of the rank -> id permutation ``(a * r + b) mod num_ids`` (``a`` prime to it)."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(FEATURES):
        a = int(torch.randint(num_ids // 3 + 1, max(num_ids // 3 + 2, num_ids), (1,), generator=g))
        while math.gcd(a, num_ids) != 1:
            a += 1
        out.append((a, int(torch.randint(0, num_ids, (1,), generator=g))))
    return out


def batch(step: int, rank: int, workers: int, per_worker: int, num_ids: int, zipf: float,
          perm: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Worker ``rank``'s part of global batch ``step``: dense float32 ``[B, 13]``, ids int64 ``[26, B]``,
    labels float32 ``[B]`` (see the module docstring)."""
    g = torch.Generator().manual_seed(1_000_003 * step + 17)
    rows = workers * per_worker
    dense = torch.randn(rows, DENSE_FEATURES, generator=g)
    u = torch.rand(FEATURES, rows, generator=g, dtype=torch.float64)
    e = 1.0 - zipf
    ranks = ((1.0 + u * (float(num_ids) ** e - 1.0)) ** (1.0 / e)).floor().to(torch.int64).clamp_(1, num_ids) - 1
    a = torch.tensor([p[0] for p in perm], dtype=torch.int64).view(-1, 1)
    b = torch.tensor([p[1] for p in perm], dtype=torch.int64).view(-1, 1)
    ids = (ranks * a + b) % num_ids
    w = torch.linspace(-1.0, 1.0, DENSE_FEATURES)
    bits = ((ids * 0x9E3779B1) >> 17) & 1
    logit = dense @ w + 0.3 * (bits.sum(0).float() - FEATURES / 2)
    labels = (torch.rand(rows, generator=g) < torch.sigmoid(logit)).float()
    mine = slice(rank * per_worker, (rank + 1) * per_worker)
    return dense[mine], ids[:, mine].contiguous(), labels[mine]


# ---------------------------------------------------------------------------------------------------- model
def _mlp(sizes: list[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or last_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """Bottom MLP, 26 embedding bags (given), pairwise dot products, top MLP: ``(dense, ids) -> logits [B]``."""

    def __init__(self, tables: list[nn.Module]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bottom = _mlp([DENSE_FEATURES, *BOTTOM, DIM], last_relu=True)
        if isinstance(tables, nn.Module):  # a ShardedEmbeddingBagCollection: one pull per shard for all tables
            self.tables, self.collection = tables, True
        else:
            self.tables, self.collection = nn.ModuleList(tables), False
        n = FEATURES + 1
        iu = torch.triu_indices(n, n, offset=1)
        self.register_buffer("iu", iu, persistent=False)
        self.top = _mlp([DIM + iu.shape[1], *TOP, 1], last_relu=False)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        if self.collection:
            out = self.tables(features(ids))
            looked_up = [out[str(f)] for f in range(ids.shape[0])]
        else:
            looked_up = [t(ids[f].view(-1, 1)) for f, t in enumerate(self.tables)]
        z = torch.stack([x, *looked_up], dim=1)  # [B, 27, DIM]
        inter = torch.bmm(z, z.transpose(1, 2))[:, self.iu[0], self.iu[1]]
        return self.top(torch.cat([x, inter], dim=1)).squeeze(1)


def features(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The collection's input for ids ``[26, B]``: ``{"f": ids [B, 1]}``, one id per bag and sample."""
    return {str(f): ids[f].view(-1, 1) for f in range(ids.shape[0])}


def make_model(kind: str, num_ids: int, row_dtype: str = "float32", bounded: bool = False) -> DLRM:
    """``kind``: ``sharded`` (ShardedEmbeddingBag, rows of ``row_dtype`` on the shards: hashed, or with ``bounded``
    tables of ``num_ids`` rows as TorchRec's and torch's), ``oracle`` (sparse nn.EmbeddingBag of ``num_ids`` rows),
    ``dense`` (nn.EmbeddingBag of ``num_ids`` rows, dense gradients). The initial rows are the same either way."""
    if kind == "sharded":
        from shardps.worker import ShardedEmbeddingBag, ShardedEmbeddingBagCollection

        rows = num_ids if bounded else None
        tables = ShardedEmbeddingBagCollection({str(f): ShardedEmbeddingBag(rows, DIM, mode="sum",
                                                                            dtype=ROW_DTYPES[row_dtype])
                                                for f in range(FEATURES)})
    else:
        tables = [nn.EmbeddingBag(num_ids, DIM, mode="sum", sparse=kind == "oracle") for _ in range(FEATURES)]
    return DLRM(tables)


def unique_rows(ids: torch.Tensor) -> int:
    """Rows a step needs: unique ids per feature, summed over features."""
    return sum(int(torch.unique(ids[f]).numel()) for f in range(ids.shape[0]))


# ---------------------------------------------------------------------------------------------------- runs
class _Counted:
    """A prefetched PullRows call whose request and reply bytes are counted when its reply is read (in the step
    whose forward uses it)."""

    def __init__(self, request, future, counts: dict) -> None:
        self._request, self._future, self._counts, self._seen = request, future, counts, False

    def result(self, timeout=None):
        reply = self._future.result(timeout)
        if not self._seen:
            self._counts["bytes"] += self._request.ByteSize() + reply.ByteSize()
            self._seen = True
        return reply

    def cancel(self) -> bool:
        return self._future.cancel()


def _count_calls(client, counts: dict) -> None:
    """Count the protobuf bytes of ``client``'s PullRows (blocking and prefetched) and PushRows calls (requests
    and replies) in ``counts``."""
    for method in ("pull_rows", "push_rows"):
        inner = getattr(client, method)

        def wrapped(request, _inner=inner):
            reply = _inner(request)
            counts["bytes"] += request.ByteSize() + reply.ByteSize()
            return reply

        setattr(client, method, wrapped)
    started = client.pull_rows_future

    def ahead(request):
        return _Counted(request, started(request), counts)

    client.pull_rows_future = ahead


def _cpu(pids: list[int]) -> float:
    """User + system CPU seconds of processes ``pids`` so far (NaN without Linux's /proc)."""
    readings = [cpu_seconds(pid) for pid in pids]
    return math.nan if None in readings else sum(readings)


def _dense_bytes(dist) -> float:
    r = dist.metrics.registry
    return sum(r.get_sample_value(f"shardps_worker_{d}_bytes_total") or 0.0 for d in ("pushed", "pulled"))


def _worker(rank: int, cfg: dict, servers: str, out_dir: str) -> None:
    """One shardps worker: ``cfg['warmup'] + cfg['steps']`` steps; its figures to ``out_dir/<rank>.json``."""
    torch.set_num_threads(cfg["threads"])
    from shardps.worker import DistributedOptimizer

    kind, workers, n, per = cfg["kind"], cfg["workers"], cfg["ids"], cfg["batch"]
    perm = _multipliers(n)
    began = time.perf_counter()
    model = make_model(kind, n, cfg.get("row_dtype", "float32"), cfg.get("bounded", False))
    if kind == "sharded":
        tables = [m.handle for m in model.tables.bags.values()]
        dense = torch.optim.Adam([p for name, p in model.named_parameters() if not name.startswith("tables.")],
                                 lr=LR_DENSE)
        sparse = torch.optim.Adagrad(tables, lr=LR_SPARSE)
    else:  # dense tables: one Adagrad for everything
        dense, sparse = torch.optim.Adagrad(model.parameters(), lr=LR_SPARSE), None
    dist = DistributedOptimizer(dense, model.named_parameters(), servers=servers, model=model,
                                sparse_optimizer=sparse, worker_id=f"w{rank}")
    init_seconds = time.perf_counter() - began
    counts = {"bytes": 0}
    for c in dist.clients:
        _count_calls(c, counts)
    loss_fn = nn.BCEWithLogitsLoss()
    start = wire = counted = dense_bytes = cpu = shards_cpu = 0.0
    losses = []
    total = cfg["warmup"] + cfg["steps"]
    following = batch(0, rank, workers, per, n, cfg["zipf"], perm)
    for step in range(total):
        if step == cfg["warmup"]:
            dist.synchronize()
            start, wire, dense_bytes = time.perf_counter(), counts["bytes"], _dense_bytes(dist)
            cpu, shards_cpu = time.process_time(), _cpu(cfg["shard_pids"]) if rank == 0 else 0.0
            counted = dist.tables.pushed_bytes + dist.tables.pulled_bytes if dist.tables else 0
        x, ids, y = following
        dist.zero_grad()
        loss = loss_fn(model(x, ids), y)
        if step + 1 < total:
            following = batch(step + 1, rank, workers, per, n, cfg["zipf"], perm)
            if cfg.get("prefetch"):  # the next step's rows, looked up by the shards while this step computes
                model.tables.prefetch(features(following[1]))
        loss.backward()
        dist.step()
        losses.append(loss.item())
    dist.synchronize()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    rows = _counted_rows(cfg, rank, workers, n, perm)
    out = {"seconds": seconds, "cpu_seconds": cpu, "unique_rows": rows, "wire_bytes": counts["bytes"] - wire,
           "dense_bytes": _dense_bytes(dist) - dense_bytes, "peak_rss_bytes": peak_rss_bytes(),
           "first_loss": losses[0], "last_loss": sum(losses[-3:]) / len(losses[-3:])}
    out["init_seconds"] = init_seconds
    if rank == 0:
        out["shards_cpu_seconds"] = _cpu(cfg["shard_pids"]) - shards_cpu
    if dist.tables is not None:
        out["counted_bytes"] = dist.tables.pushed_bytes + dist.tables.pulled_bytes - counted
    began = time.perf_counter()
    dist.close()
    out["close_seconds"] = time.perf_counter() - began
    Path(out_dir, f"{rank}.json").write_text(json.dumps(out))


def _counted_rows(cfg: dict, rank: int, workers: int, num_ids: int, perm, fold_to: int = 0) -> int:
    """Unique rows of this worker's timed steps (``unique_rows`` of each batch), counted after the timing: the
    batches are made again (they are a pure function of the step), so the count costs the timed loop nothing."""
    rows = 0
    for step in range(cfg["warmup"], cfg["warmup"] + cfg["steps"]):
        ids = batch(step, rank, workers, cfg["batch"], num_ids, cfg["zipf"], perm)[1]
        rows += unique_rows(ids % fold_to if fold_to else ids)
    return rows


def _oracle(rank: int, cfg: dict, out_dir: str) -> None:
    """The single-process oracle (torch only); figures to ``out_dir/0.json``."""
    n, per, fold = cfg["oracle_ids"], cfg["batch"], cfg["ids"]
    perm = _multipliers(fold)
    model = make_model("oracle", n)
    dense = torch.optim.Adam([p for name, p in model.named_parameters() if not name.startswith("tables.")],
                             lr=LR_DENSE)
    sparse = torch.optim.Adagrad([t.weight for t in model.tables], lr=LR_SPARSE)
    loss_fn = nn.BCEWithLogitsLoss()
    start, losses = 0.0, []
    for step in range(cfg["warmup"] + cfg["steps"]):
        if step == cfg["warmup"]:
            start, cpu = time.perf_counter(), time.process_time()
        x, ids, y = batch(step, 0, 1, per, fold, cfg["zipf"], perm)
        ids = ids % n
        dense.zero_grad()
        sparse.zero_grad()
        loss = loss_fn(model(x, ids), y)
        loss.backward()
        dense.step()
        sparse.step()
        losses.append(loss.item())
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    rows = _counted_rows(cfg, 0, 1, fold, perm, fold_to=n)
    Path(out_dir, "0.json").write_text(json.dumps({
        "seconds": seconds, "cpu_seconds": cpu, "unique_rows": rows, "peak_rss_bytes": peak_rss_bytes(), "first_loss": losses[0],
        "last_loss": sum(losses[-3:]) / len(losses[-3:])}))


def _scrape(address: str) -> dict[str, float]:
    """``{"rows": .., "bytes": ..}`` summed over the tables of one shard's Prometheus endpoint."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=30).read().decode()
    out = {"rows": 0.0, "bytes": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for key in out:
                if sample.name == f"shardps_shard_table_{key}":
                    out[key] += sample.value
    return out


def _summary(cfg: dict, rows: list[dict]) -> dict:
    steps, workers = cfg["steps"], len(rows)
    seconds = max(r["seconds"] for r in rows)
    unique = sum(r["unique_rows"] for r in rows)
    res = {"samples_per_s": workers * cfg["batch"] * steps / seconds, "rows_per_s": unique / seconds,
           "unique_rows_per_step": unique / (steps * workers), "step_ms": 1e3 * seconds / steps,
           "peak_rss_bytes": max(r["peak_rss_bytes"] for r in rows),
           "loss_first_step": rows[0]["first_loss"], "loss_last_steps": rows[0]["last_loss"],
           "worker_cpu_ms_per_step": 1e3 * sum(r["cpu_seconds"] for r in rows) / steps}
    for key in ("init_seconds", "close_seconds"):
        if key in rows[0]:
            res[key] = max(r[key] for r in rows)
    if "shards_cpu_seconds" in rows[0]:
        res["shard_cpu_ms_per_step"] = 1e3 * rows[0]["shards_cpu_seconds"] / steps
    if "wire_bytes" in rows[0]:
        res["wire_bytes_per_step"] = sum(r["wire_bytes"] for r in rows) / (steps * workers)
        res["dense_bytes_per_step"] = sum(r["dense_bytes"] for r in rows) / (steps * workers)
    if "counted_bytes" in rows[0]:
        res["counted_bytes_per_step"] = sum(r["counted_bytes"] for r in rows) / (steps * workers)
        down = ROW_DTYPES[cfg.get("row_dtype", "float32")].itemsize * DIM  # rows pulled; gradients go up as float32
        res["ideal_bytes_per_step"] = res["unique_rows_per_step"] * (down + 4 * DIM + 2 * 8)
        res["wire_ratio"] = res["wire_bytes_per_step"] / res["ideal_bytes_per_step"]
    return res


def run_shardps(kind: str, shards: int, workers: int, args, num_ids: int, prefetch: bool = True) -> dict:
    """Train with ``workers`` spawned worker processes over ``shards`` shard processes; the figures.
    ``prefetch``: sparse tables prefetch the next step's rows (``ShardedEmbeddingBagCollection.prefetch``)."""
    from shardps.worker import LocalCluster

    cfg = {"kind": kind, "workers": workers, "ids": num_ids, "batch": args.batch_size, "zipf": args.zipf,
           "prefetch": kind == "sharded" and prefetch, "row_dtype": args.row_dtype,
           "bounded": getattr(args, "bounded", False),
           "warmup": args.warmup if kind == "sharded" else 1, "steps": args.steps,
           "threads": max(1, ((os.cpu_count() or 1) - shards) // workers)}
    with tempfile.TemporaryDirectory() as out, \
            LocalCluster(shards, min_workers=workers, extra_args=("--metrics-port", "0", "--threads", "1")) as cluster:
        cfg["shard_pids"] = [proc.pid for proc in cluster.processes]
        try:
            mp.start_processes(_worker, args=(cfg, cluster.servers, out), nprocs=workers, start_method="spawn")
        except Exception as exc:
            codes = [proc.poll() for proc in cluster.processes]
            logs = "\n".join(f"--- shard {i} (exit code {codes[i]}):\n{cluster.log_tail(i)}" for i in range(shards))
            raise RuntimeError(f"{exc}\n{logs}") from exc
        rows = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(workers)]
        held = [_scrape(e["metrics"]) for e in cluster.endpoints] if kind == "sharded" else []
    res = {"shards": shards, "workers": workers, "ids_per_feature": num_ids, "worker_threads": cfg["threads"],
           "prefetch": cfg["prefetch"],
           **_summary(cfg, rows)}
    if held:
        res["shard_rows"] = int(sum(h["rows"] for h in held))
        res["shard_bytes"] = int(sum(h["bytes"] for h in held))
        res["shard_bytes_per_row"] = res["shard_bytes"] / max(1, res["shard_rows"])
    return res


def run_oracle(args, oracle_ids: int) -> dict:
    cfg = {"ids": args.ids, "oracle_ids": oracle_ids, "batch": args.batch_size, "zipf": args.zipf,
           "warmup": args.warmup, "steps": args.steps}
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_oracle, args=(cfg, out), nprocs=1, start_method="spawn")
        rows = [json.loads(Path(out, "0.json").read_text())]
    return {"ids_per_feature": oracle_ids, "ids_folded_from": args.ids, **_summary(cfg, rows)}


def largest_fitting(limit: int, copies: int) -> int:
    """The largest power of ten <= ``limit`` whose 26 tables of dim 16, ``copies`` times, fit in half the memory."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    n = 10 ** int(math.log10(limit))
    while n > 10 and FEATURES * n * DIM * 4 * copies > memory / 2:
        n //= 10
    return n


def _attempt(label: str, fn, *args) -> dict:
    """``fn(*args)``'s figures, or ``{"error": ...}`` (logged) when the run failed: the other runs still go on."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - recorded in the figures and printed
        _log(f"{label}: FAILED: {exc}")
        return {"error": str(exc)}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _describe(name: str, r: dict) -> str:
    extra = ""
    if "wire_ratio" in r:
        extra = (f", wire {r['wire_bytes_per_step'] / 1e6:.2f} MB/step ({r['wire_ratio']:.3f}x ideal), "
                 f"shard {r['shard_bytes_per_row']:.0f} B/row")
    return (f"{name}: {r['samples_per_s']:.0f} samples/s, {r['rows_per_s']:.0f} rows/s, "
            f"{r['step_ms']:.0f} ms/step{extra}")


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a short smoke run (see the module docstring)")
    p.add_argument("--row-dtype", choices=sorted(ROW_DTYPES), default="float32",
                   help="the shardps tables' row weights on the shards and the wire (default float32)")
    p.add_argument("--ids", type=int, default=10 ** 7, help="ids per categorical feature (default 10**7)")
    p.add_argument("--bounded", action="store_true", help="shardps' tables bounded at --ids rows (default: hashed)")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the ids (default 1.1)")
    p.add_argument("--batch-size", type=int, default=2048, help="samples per worker per step (default 2048)")
    p.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--grid", default="1x1,2x1,4x1,1x2,2x2,4x2,1x4,2x4,4x4",
                   help="shardps configurations SHARDSxWORKERS (default all of 1, 2, 4 x 1, 2, 4)")
    p.add_argument("--dense-ids", type=int, help="ids per feature of the dense-tables comparison "
                   "(default: the largest power of ten that fits, see the module docstring)")
    p.add_argument("--dense-steps", type=int, default=3, help="timed steps of the dense-tables run (default 3)")
    p.add_argument("--systems", default="grid,noprefetch,oracle,pairs,dense", help="which parts to run (default all)")
    p.add_argument("--pairs", type=int, default=3, help="interleaved (shardps 1x1, oracle) runs the vs_oracle "
                   "verdict takes the median ratio of (default 3)")
    args = p.parse_args()
    global ROW_BYTES
    ROW_BYTES = ROW_DTYPES[args.row_dtype].itemsize * DIM + 4 * DIM
    if args.quick:
        args.ids, args.batch_size, args.steps, args.warmup, args.pairs = 10 ** 5, 512, 2, 2, 1
        args.grid, args.dense_ids, args.dense_steps = "1x1,2x2", 10 ** 4, 2
    grid = [tuple(int(v) for v in g.split("x")) for g in args.grid.split(",")]
    systems = set(args.systems.split(","))
    oracle_ids = largest_fitting(args.ids, copies=2)
    dense_ids = args.dense_ids or largest_fitting(args.ids, copies=6)
    _log(f"DLRM-style: {FEATURES} tables x dim {DIM}, {args.ids} ids per feature (Zipf {args.zipf}), "
         f"batch {args.batch_size} per worker, {args.warmup} + {args.steps} steps; oracle at {oracle_ids} ids, "
         f"dense tables at {dense_ids} ids")
    load = os.getloadavg()
    _log(f"load average at start: {load[0]:.2f} (other processes share these cores: compare with care)")
    results: dict = {"grid": {}}
    if "grid" in systems:
        for shards, workers in grid:
            label = f"shardps {shards} shards x {workers} workers"
            r = _attempt(label, run_shardps, "sharded", shards, workers, args, args.ids)
            results["grid"][f"{shards}x{workers}"] = r
            if "error" not in r:
                _log(_describe(label, r))
    if "noprefetch" in systems:
        label = "shardps 1 shard x 1 worker without prefetch"
        results["no_prefetch"] = _attempt(label, run_shardps, "sharded", 1, 1, args, args.ids, False)
        if "error" not in results["no_prefetch"]:
            _log(_describe(label, results["no_prefetch"]))
    if "oracle" in systems:
        results["oracle"] = _attempt("oracle", run_oracle, args, oracle_ids)
        if "error" not in results["oracle"]:
            _log(_describe("oracle (one process, torch sparse)", results["oracle"]))
    if "pairs" in systems:  # this machine's speed drifts: each ratio compares runs made one after the other
        results["oracle_pairs"] = []
        for i in range(args.pairs):
            shardps = _attempt("shardps 1x1 (pair)", run_shardps, "sharded", 1, 1, args, args.ids)
            oracle = _attempt("oracle (pair)", run_oracle, args, oracle_ids)
            pair = {"shardps_samples_per_s": shardps.get("samples_per_s", math.nan),
                    "oracle_samples_per_s": oracle.get("samples_per_s", math.nan)}
            pair["ratio"] = pair["shardps_samples_per_s"] / pair["oracle_samples_per_s"]
            results["oracle_pairs"].append(pair)
            _log(f"pair {i + 1}/{args.pairs}: shardps 1x1 {pair['shardps_samples_per_s']:.0f} samples/s, oracle "
                 f"{pair['oracle_samples_per_s']:.0f}: {pair['ratio']:.3f}")
    if "dense" in systems:
        steps = args.steps
        args.steps = args.dense_steps
        label = f"shardps with dense tables at {dense_ids} ids"
        results["dense_tables"] = _attempt(label, run_shardps, "dense", 1, 1, args, dense_ids)
        if "error" not in results["dense_tables"]:
            _log(_describe(label, results["dense_tables"])
                 + f" (DistributedOptimizer built and joined in {results['dense_tables']['init_seconds']:.0f} s)")
        args.steps = steps
        label = f"shardps sparse at {dense_ids} ids"
        results["sparse_at_dense_ids"] = _attempt(label, run_shardps, "sharded", 1, 1, args, dense_ids)
        if "error" not in results["sparse_at_dense_ids"]:
            _log(_describe(label, results["sparse_at_dense_ids"]))

    # ------------------------------------------------------------ table and targets
    mb = lambda r, k: f"{r[k] / 1e6:.3f}" if k in r else "-"  # noqa: E731
    rows = []
    runs = [(f"shardps {k.replace('x', ' shards x ')} workers", r) for k, r in results["grid"].items()]
    runs += [(label, results[key]) for key, label in (
        ("no_prefetch", "shardps 1x1, no prefetch"), ("oracle", "oracle (1 process, torch sparse)"),
        ("dense_tables", "shardps, dense tables, 1x1"),
        ("sparse_at_dense_ids", "shardps, sparse tables, 1x1")) if key in results]
    for label, r in runs:
        if "error" in r:
            rows.append([label, "FAILED", *["-"] * 10])
            continue
        rows.append([label, r["ids_per_feature"], f"{r['samples_per_s']:.0f}", f"{r['rows_per_s']:.0f}",
                     f"{r['unique_rows_per_step']:.0f}", mb(r, "wire_bytes_per_step"), mb(r, "ideal_bytes_per_step"),
                     f"{r['wire_ratio']:.3f}" if "wire_ratio" in r else "-", mb(r, "dense_bytes_per_step"),
                     f"{r['shard_bytes_per_row']:.0f}" if "shard_bytes_per_row" in r else "-",
                     f"{r['worker_cpu_ms_per_step']:.0f}",
                     f"{r['shard_cpu_ms_per_step']:.0f}" if "shard_cpu_ms_per_step" in r else "-"])
    print(table(rows, ["system", "ids/feature", "samples/s", "rows/s", "rows/worker step", "table MB/step",
                       "ideal MB/step", "table/ideal", "MLP MB/step", "shard B/row", "worker CPU ms/step",
                       "shard CPU ms/step"]))
    print(f"(per worker step; row bytes {ROW_BYTES}: {args.row_dtype} weights + Adagrad state; MLP MB/step: the dense "
          "parameters' frames, for dense tables the whole tables)")

    targets = {}
    grid_ok = {k: r for k, r in results["grid"].items() if "error" not in r}
    failed = sorted(set(results["grid"]) - set(grid_ok))
    if results["grid"]:
        worst = max(grid_ok.items(), key=lambda kv: kv[1]["wire_ratio"]) if grid_ok else ("-", {"wire_ratio": math.inf})
        targets["wire_bytes"] = {"goal": f"wire bytes per step <= {WIRE_GOAL}x ideal at {args.ids} ids, every "
                                 "configuration", "value": worst[1]["wire_ratio"], "worst_config": worst[0],
                                 "failed_configs": failed, "met": worst[1]["wire_ratio"] <= WIRE_GOAL and not failed}
        big = max(grid_ok.items(), key=lambda kv: kv[1]["shard_bytes_per_row"]) if grid_ok else \
            ("-", {"shard_bytes_per_row": math.inf})
        ratio = big[1]["shard_bytes_per_row"] / ROW_BYTES
        targets["shard_memory"] = {"goal": f"shard bytes per row <= {MEMORY_GOAL}x row bytes ({ROW_BYTES} B: "
                                   "weights + Adagrad state), every configuration",
                                   "bytes_per_row": big[1]["shard_bytes_per_row"], "row_bytes": ROW_BYTES,
                                   "value": ratio, "worst_config": big[0], "failed_configs": failed,
                                   "met": ratio <= MEMORY_GOAL and not failed}
    samples = lambda key: results.get(key, {}).get("samples_per_s", math.nan)  # noqa: E731
    ratios = [p["ratio"] for p in results.get("oracle_pairs", [])]
    if "1x1" in results["grid"] and "oracle" in results:
        ratios.append(results["grid"]["1x1"].get("samples_per_s", math.nan) / samples("oracle"))
    if ratios:
        ratio = statistics.median(ratios)
        targets["vs_oracle"] = {"goal": f"1 shard x 1 worker >= {ORACLE_GOAL}x the oracle's samples/s "
                                f"(oracle at {oracle_ids} ids; median over {len(ratios)} comparisons: the grid's "
                                "1x1 against the oracle run, and each interleaved pair)", "value": ratio,
                                "ratios": ratios, "met": ratio >= ORACLE_GOAL}
    if "dense_tables" in results:
        ratio = samples("sparse_at_dense_ids") / samples("dense_tables")
        targets["vs_dense_tables"] = {"goal": f"sparse >= {DENSE_GOAL}x dense tables samples/s, 1x1 at "
                                      f"{dense_ids} ids per feature", "ids_per_feature": dense_ids, "value": ratio,
                                      "met": ratio >= DENSE_GOAL}
    for name, t in targets.items():
        print(f"target {name}: {t['goal']}: {'met' if t['met'] else 'NOT met'} ({t['value']:.3f})")
    emit({"load_average_at_start": load, "ids_per_feature": args.ids, "zipf": args.zipf, "batch_per_worker": args.batch_size,
          "steps": args.steps, "warmup": args.warmup, "dense_steps": args.dense_steps, "quick": args.quick,
          "features": FEATURES, "dense_features": DENSE_FEATURES, "embedding_dim": DIM, "row_dtype": args.row_dtype, "row_bytes": ROW_BYTES,
          "oracle_ids": oracle_ids, "dense_ids": dense_ids, **results, "targets": targets}, args.json)


if __name__ == "__main__":
    main()

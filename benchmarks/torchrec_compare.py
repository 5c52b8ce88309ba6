"""shardps against TorchRec and plain torch on the DLRM shape of ``benchmarks/sparse.py``, interleaved.

    python benchmarks/torchrec_compare.py [--json PATH] [--ids 1000000] [--batch-size 4096] [--steps 20]
                                          [--warmup 3] [--pairs 3] [--row-dtype float32] [--hashed] [--quick]

The model, the data and the optimizers are ``benchmarks/sparse.py``'s (26 tables of dim 16, one id per bag,
Zipf ids over ``--ids``, Adam on the MLPs, Adagrad lr 0.05 on the tables); every system trains the same
batches from the same initial values (the shardps tables' deterministic initial rows, copied into the
others' weights; the MLPs from one seed), so their losses are comparable. Systems, one after the other in
each of ``--pairs`` rounds (this machine's speed drifts over minutes: a ratio compares neighbouring runs):

- ``torchrec``: TorchRec's ``FusedEmbeddingBagCollection`` (FBGEMM's split-table batched embeddings on the
  CPU, ``fbgemm-gpu-cpu``: one fused pooled lookup for the 26 tables, and a backward that applies Adagrad
  (``EXACT_ADAGRAD``) to the touched rows) in one process, with 1 torch thread and with every core; the
  faster of the two is the round's baseline;
- ``torch``: ``nn.EmbeddingBag(sparse=True)`` tables and ``torch.optim.Adagrad`` in one process (every core);
- ``shardps``: 1 shard x 1 worker (``sparse.run_shardps``: the collection, prefetching, sync), its 26 tables
  bounded at ``--ids`` rows as TorchRec's and torch's are (``--hashed``: hashed tables, any int64 id, as
  ``benchmarks/sparse.py`` declares them; the rows and the losses are the same either way).

Printed and written: samples/s, CPU ms per step (the process's, plus the shard's for shardps), the mean loss
of the last 3 steps, per system and round, and the medians of ``shardps / torchrec`` and ``shardps / torch``.
Goal (issue "Sparse steps at TorchRec's speed on CPU"): shardps 1 x 1 >= 0.8x TorchRec's samples/s, CPU per
step <= 1.5x TorchRec's, the same loss to 1e-4. Needs torchrec (``pip install -e ".[torchrec]"``, then
``pip install --no-deps torchrec==1.8.0``). ``--quick``: 10**4 ids, batch 512, 2 + 2 steps, one round: a
smoke run, not figures to quote.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

import sparse  # noqa: E402
from common import emit, parser, peak_rss_bytes, table  # noqa: E402


class TorchRecTables(nn.Module):
    """TorchRec's ``FusedEmbeddingBagCollection`` over ``sparse.DLRM``'s feature dict (``{"f": ids [B, 1]}``):
    the ids as one ``KeyedJaggedTensor`` (one id per bag), the pooled rows as ``{"f": [B, dim]}``."""

    def __init__(self, num_ids: int, initial: list[torch.Tensor]) -> None:
        super().__init__()
        from torchrec import EmbeddingBagConfig, PoolingType
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

        configs = [EmbeddingBagConfig(name=f"t{f}", embedding_dim=sparse.DIM, num_embeddings=num_ids,
                                      feature_names=[str(f)], pooling=PoolingType.SUM) for f in range(sparse.FEATURES)]
        self.ebc = FusedEmbeddingBagCollection(tables=configs, optimizer_type=torch.optim.Adagrad,
                                               optimizer_kwargs={"lr": sparse.LR_SPARSE, "eps": 1e-10},
                                               device=torch.device("cpu"))
        with torch.no_grad():  # FBGEMM keeps the 26 tables in one flat tensor, table after table
            for f, rows in enumerate(initial):
                self.ebc.state_dict()[f"embedding_bags.t{f}.weight"].copy_(rows)

    def forward(self, features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from torchrec import KeyedJaggedTensor

        keys = list(features)
        values = torch.cat([features[k].reshape(-1) for k in keys])
        lengths = torch.ones(values.numel(), dtype=torch.int32)
        return self.ebc(KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)).to_dict()


def initial_rows(num_ids: int, row_dtype: str) -> list[torch.Tensor]:
    """The shardps tables' initial rows of ids ``[0, num_ids)``: float32 ``[num_ids, 16]`` per table."""
    model = sparse.make_model("sharded", num_ids, row_dtype)
    ids = torch.arange(num_ids)
    return [model.tables.bags[str(f)].spec(f"tables.bags.{f}").initial_rows(ids) for f in range(sparse.FEATURES)]


def _single(rank: int, cfg: dict, out_dir: str) -> None:
    """One process trains ``cfg['system']`` (``torchrec`` or ``torch``) with ``cfg['threads']`` threads."""
    torch.set_num_threads(cfg["threads"])
    n, per = cfg["ids"], cfg["batch"]
    perm = sparse._multipliers(n)
    initial = initial_rows(n, cfg["row_dtype"])
    if cfg["system"] == "torchrec":
        model = sparse.DLRM(TorchRecTables(n, initial))
        tables = None  # the fused collection steps its rows in backward
    else:
        model = sparse.make_model("oracle", n)
        with torch.no_grad():
            for t, rows in zip(model.tables, initial):
                t.weight.copy_(rows)
        tables = torch.optim.Adagrad([t.weight for t in model.tables], lr=sparse.LR_SPARSE)
    del initial
    dense = torch.optim.Adam([p for name, p in model.named_parameters() if not name.startswith("tables.")],
                             lr=sparse.LR_DENSE)
    loss_fn = nn.BCEWithLogitsLoss()
    losses, start, cpu = [], 0.0, 0.0
    for step in range(cfg["warmup"] + cfg["steps"]):
        if step == cfg["warmup"]:
            start, cpu = time.perf_counter(), time.process_time()
        x, ids, y = sparse.batch(step, 0, 1, per, n, cfg["zipf"], perm)
        dense.zero_grad()
        if tables is not None:
            tables.zero_grad()
        loss = loss_fn(model(x, ids), y)
        loss.backward()
        dense.step()
        if tables is not None:
            tables.step()
        losses.append(loss.item())
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    Path(out_dir, "0.json").write_text(json.dumps({
        "seconds": seconds, "cpu_seconds": cpu, "unique_rows": sparse._counted_rows(cfg, 0, 1, n, perm),
        "peak_rss_bytes": peak_rss_bytes(), "first_loss": losses[0], "last_loss": sum(losses[-3:]) / 3}))


def run_single(system: str, threads: int, args) -> dict:
    cfg = {"system": system, "threads": threads, "ids": args.ids, "batch": args.batch_size, "zipf": args.zipf,
           "warmup": args.warmup, "steps": args.steps, "row_dtype": args.row_dtype}
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_single, args=(cfg, out), nprocs=1, start_method="spawn")
        row = json.loads(Path(out, "0.json").read_text())
    return {"system": system, "threads": threads, **sparse._summary(cfg, [row]),
            "cpu_ms_per_step": 1e3 * row["cpu_seconds"] / args.steps, "last_loss": row["last_loss"]}


def run_shardps(args) -> dict:
    r = sparse.run_shardps("sharded", 1, 1, args, args.ids)
    return {**r, "system": "shardps", "last_loss": r["loss_last_steps"],
            "cpu_ms_per_step": r["worker_cpu_ms_per_step"] + r["shard_cpu_ms_per_step"]}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--ids", type=int, default=10 ** 6, help="ids per table (default 10**6: no folding anywhere)")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the ids (default 1.1)")
    p.add_argument("--batch-size", type=int, default=4096, help="samples per step (default 4096)")
    p.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--pairs", type=int, default=3, help="rounds of the interleaved runs (default 3)")
    p.add_argument("--row-dtype", choices=sorted(sparse.ROW_DTYPES), default="float32",
                   help="the shardps tables' rows on the shards (default float32)")
    p.add_argument("--hashed", action="store_true",
                   help="shardps' tables hashed (any int64 id) instead of bounded at --ids rows as TorchRec's")
    p.add_argument("--quick", action="store_true", help="a smoke run (module docstring)")
    args = p.parse_args()
    args.bounded = not args.hashed
    if args.quick:
        args.ids, args.batch_size, args.steps, args.warmup, args.pairs = 10 ** 4, 512, 2, 2, 1
    cores = torch.get_num_threads()
    rounds = []
    for i in range(args.pairs):
        runs = {"torchrec_1": run_single("torchrec", 1, args), f"torchrec_{cores}": run_single("torchrec", cores, args),
                "torch": run_single("torch", cores, args), "shardps": run_shardps(args)}
        best = max((runs["torchrec_1"], runs[f"torchrec_{cores}"]), key=lambda r: r["samples_per_s"])
        runs["vs_torchrec"] = runs["shardps"]["samples_per_s"] / best["samples_per_s"]
        runs["cpu_vs_torchrec"] = runs["shardps"]["cpu_ms_per_step"] / best["cpu_ms_per_step"]
        runs["vs_torch"] = runs["shardps"]["samples_per_s"] / runs["torch"]["samples_per_s"]
        rounds.append(runs)
        print(f"round {i + 1}/{args.pairs}: " + ", ".join(
            f"{k} {v['samples_per_s']:.0f} samples/s" for k, v in runs.items() if isinstance(v, dict))
            + f"; shardps {runs['vs_torchrec']:.3f}x TorchRec, {runs['vs_torch']:.3f}x torch", file=sys.stderr,
            flush=True)
    median = {k: statistics.median(r[k] for r in rounds) for k in ("vs_torchrec", "cpu_vs_torchrec", "vs_torch")}
    systems = [k for k, v in rounds[-1].items() if isinstance(v, dict)]
    print(table([[k, *(f"{r[k]['samples_per_s']:.0f}" for r in rounds), f"{rounds[-1][k]['cpu_ms_per_step']:.1f}",
                  f"{rounds[-1][k]['last_loss']:.6f}"] for k in systems],
                ["system", *(f"samples/s round {i + 1}" for i in range(len(rounds))), "CPU ms/step (last)",
                 "loss (last)"]))
    print(f"shardps 1x1 / TorchRec (median): {median['vs_torchrec']:.3f} samples/s (goal >= 0.8), "
          f"{median['cpu_vs_torchrec']:.2f} CPU per step (goal <= 1.5); / torch {median['vs_torch']:.3f}")
    emit({"ids": args.ids, "batch": args.batch_size, "steps": args.steps, "warmup": args.warmup,
          "row_dtype": args.row_dtype, "bounded": args.bounded, "quick": args.quick, "rounds": rounds, "median": median,
          "goal": {"vs_torchrec": 0.8, "cpu_vs_torchrec": 1.5, "loss_atol": 1e-4}}, args.json)


if __name__ == "__main__":
    main()

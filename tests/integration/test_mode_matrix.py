"""The mode x recipe matrix of ``docs/mode-recipe-matrix.md``, cell by cell, against real shard processes.

The table is the specification: each cell says ``trains`` (a few steps to a
finite, falling loss, plus the recipe's own checks: ``tests.support.matrix_cells``)
or ``refused: <advice>`` (construction raises ``ValueError`` whose message holds
the advice). Worker columns run 2 ``DistributedOptimizer`` threads; node
columns one node of 2 Gloo ranks (forked processes) with ``NodeOptimizer``,
every recipe of a mode in one pair of processes. Shards are shared per
test module and reset before every cell (a fresh job, any mode). Each cell is
bounded in time, so a hang fails it.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from tests.support import matrix_cells
from tests.support.forked import ForkedCluster
from tests.support.matrix_cells import RECIPES, reset, run_cell
from tests.support.threads import run_workers

DOC = Path(__file__).resolve().parents[2] / "docs" / "mode-recipe-matrix.md"
COLUMNS = ("sync", "async", "ssp", "sync, node", "async, node", "ssp, node")
#: wall-clock bound of one cell (2 threads), and of one node column (10 cells in one pair of processes)
CELL_SECONDS, COLUMN_SECONDS = 40.0, 150.0


def read_table() -> dict[tuple[str, str], str]:
    """``{(recipe, column): code}`` from the doc's table (the backticks stripped)."""
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("|")]
    split = [[c.strip() for c in line.strip().strip("|").split("|")] for line in rows]
    header, body = split[0], [r for r in split[2:]]
    return {(r[0], col): r[i].strip("`") for r in body for i, col in enumerate(header) if i > 0}


TABLE = read_table()


def test_the_table_has_every_cell_and_no_other() -> None:
    assert set(TABLE) == {(r, c) for r in RECIPES for c in COLUMNS}, sorted(set(TABLE) ^ {
        (r, c) for r in RECIPES for c in COLUMNS})
    for (recipe, column), code in TABLE.items():
        assert code in ("trains", "trains: own gradient") or code.startswith("refused: "), (recipe, column, code)


@pytest.fixture(scope="module")
def clusters():
    """One 2-shard cluster for the worker columns and one for the node columns (reset before every cell)."""
    started = [ForkedCluster(2, min_workers=1).start(), ForkedCluster(2, min_workers=1).start()]
    yield {"workers": started[0], "node": started[1]}
    for cluster in started:
        cluster.stop()


def check(code: str, results: list[dict], where: str) -> None:
    """Each result (one per worker or local rank) behaves as the table's ``code`` says."""
    for i, r in enumerate(results):
        assert r["seconds"] < CELL_SECONDS, f"{where}, worker {i}: took {r['seconds']:.1f}s"
        if code.startswith("refused: "):
            advice = code[len("refused: "):]
            assert r["outcome"].startswith("refused: ValueError") and advice in r["outcome"], (where, i, r["outcome"])
            continue
        assert r["outcome"] == "trained", (where, i, r["outcome"], r.get("trace", ""))
        losses = r["losses"]
        assert len(losses) == matrix_cells.STEPS and all(map(math.isfinite, losses)), (where, i, losses)
        assert losses[-1] < losses[0], (where, i, losses)
        assert not r["problems"], (where, i, r["problems"])


@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_worker_cell(clusters, recipe: str, mode: str) -> None:
    servers = clusters["workers"].servers
    reset(servers)
    results = run_workers(2, lambda w: run_cell(recipe, mode, servers, w), timeout=CELL_SECONDS)
    check(TABLE[(recipe, mode)], results, f"{recipe} / {mode}")


_node_results: dict[str, dict[tuple[str, int], dict]] = {}


def run_node_column(servers: str, out: Path, mode: str) -> dict[tuple[str, int], dict]:
    """Every recipe of ``mode`` in one node of 2 forked Gloo ranks; ``{(recipe, rank): result}`` (missing: hung)."""
    out.mkdir(parents=True, exist_ok=True)
    context = mp.start_processes(matrix_cells.node_column, args=(servers, str(out), mode, list(RECIPES)), nprocs=2,
                                 join=False, start_method="forkserver")
    deadline = time.monotonic() + COLUMN_SECONDS
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in context.processes:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
            break
    results = {}
    for index, recipe in enumerate(RECIPES):
        for rank in (0, 1):
            path = out / f"{mode}-{index}-{rank}.json"
            if path.exists():
                results[(recipe, rank)] = json.loads(path.read_text())
    return results


@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_node_cell(clusters, tmp_path_factory, recipe: str, mode: str) -> None:
    if mode not in _node_results:
        _node_results[mode] = run_node_column(clusters["node"].servers, tmp_path_factory.mktemp(f"node-{mode}"), mode)
    results = [_node_results[mode].get((recipe, rank)) for rank in (0, 1)]
    assert all(r is not None for r in results), f"{recipe} / {mode}, node: no result within {COLUMN_SECONDS}s (hung)"
    check(TABLE[(recipe, f"{mode}, node")], results, f"{recipe} / {mode}, node")


@pytest.mark.parametrize("mode", ["async", "ssp"])
@pytest.mark.parametrize("recipe", ["max_grad_norm", "grad_scaler", "max_grad_norm + grad_scaler"])
def test_one_worker_clips_and_scales_in_async_and_ssp(clusters, recipe: str, mode: str) -> None:
    """The reported hang: one worker, async or ssp, with clipping and/or a GradScaler, trains (and skips the
    overflowing first step on its own)."""
    servers = clusters["workers"].servers
    reset(servers)
    results = run_workers(1, lambda w: run_cell(recipe, mode, servers, w, workers=1), timeout=CELL_SECONDS)
    check(TABLE[(recipe, mode)], results, f"{recipe} / {mode}, one worker")


def test_shards_refuse_an_async_push_that_asks_them_to_clip() -> None:
    """A worker that asks async/ssp shards for the report/commit exchange (an older worker) is refused at once,
    naming the fix, instead of hanging the shard (``Mode.check_commit``)."""
    from shardps.server.consistency.modes import Mode
    from shardps.server.errors import InvalidArgument

    Mode("sync").check_commit("push", True)
    for mode in (Mode("async"), Mode("ssp", 1)):
        mode.check_commit("push", False)
        with pytest.raises(InvalidArgument, match=re.escape("clips and unscales its own gradient")):
            mode.check_commit("push", True)

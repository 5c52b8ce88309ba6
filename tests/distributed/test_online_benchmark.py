"""benchmarks/online.py runs end to end (``--quick``): online MovieLens, 2 trainers, sync against hybrid.

No timing is asserted (speed is the benchmark's report). What is tested: both modes ran, every run's trainers
took the same steps and trained every streamed event between them, the RMSEs are finite and sane (the
warm-started model, frozen or learning from the stream, beats the constant guess of the warm ratings' mean;
learning does not make it worse than frozen by more than a generous margin), and hybrid's progressive RMSE
stays near sync's (same data, same model; only how the item rows' updates are combined differs). The data is
MovieLens-100K, read in place from ``shared/data/ml-100k`` beside this checkout or ``$SHARDPS_MOVIELENS_DIR``
(as the DeepFM tests).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from tests.support.procs import run_benchmark

REPO = Path(__file__).resolve().parents[2]
DATA = Path(os.environ.get("SHARDPS_MOVIELENS_DIR") or REPO.parent / "shared" / "data" / "ml-100k")
WARM, STREAMED = 4_000, 2_000  # the benchmark's --quick


def constant_rmse() -> float:
    """RMSE on the quick run's streamed ratings of the warm ratings' mean (ratings in event-time order)."""
    rows = sorted((line.split("\t") for line in (DATA / "u.data").read_text().splitlines() if line),
                  key=lambda row: int(row[3]))
    ratings = [float(row[2]) for row in rows[:WARM + STREAMED]]
    mean = sum(ratings[:WARM]) / WARM
    return math.sqrt(sum((r - mean) ** 2 for r in ratings[WARM:]) / STREAMED)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_online_benchmark_trains_every_event_in_both_modes(tmp_path: Path) -> None:
    assert (DATA / "u.data").is_file(), f"MovieLens-100K is not at {DATA}: set SHARDPS_MOVIELENS_DIR"
    out = tmp_path / "online.json"
    result, _ = run_benchmark("online", "--quick", "--data-dir", str(DATA), out=out, timeout=120)
    streamed = result["streamed"]
    assert streamed == STREAMED and result["warm"] == WARM
    guess = constant_rmse()
    assert sorted(r["mode"] for r in result["runs"]) == ["hybrid", "sync"]
    for run in result["runs"]:
        assert run["events"] == streamed, run
        assert sum(t["scored"] for t in run["trainers"]) == streamed, run
        assert all(t["events"] == t["scored"] > 0 for t in run["trainers"]), run  # each trained all it scored
        assert {t["stream_steps"] for t in run["trainers"]} == {result["stream_steps"]}, run
        assert run["samples_per_s"] > 0
        frozen, progressive = run["frozen_rmse"], run["progressive_rmse"]
        assert math.isfinite(frozen) and math.isfinite(progressive), run
        assert 0.5 < frozen < guess and 0.5 < progressive < min(guess, frozen + 0.02), (run, guess)
    modes = result["modes"]
    assert abs(modes["hybrid"]["progressive_rmse"] - modes["sync"]["progressive_rmse"]) <= 0.02, modes
    assert result["rmse_difference"] == pytest.approx(
        abs(modes["hybrid"]["progressive_rmse"] - modes["sync"]["progressive_rmse"]))
    assert result["goal"]["met"] == (result["rmse_difference"] <= 0.005)
    one = result["one_trainer"]  # part 1: the broker job and its one-process baseline on the same stream
    assert one["events"] == streamed and one["replays"] == 0 and one["events_per_s"] > 0, one
    base = one["baseline"]
    assert 0.5 < base["progressive_rmse"] < guess and 0.5 < one["progressive_rmse"] < guess, one
    assert one["gain_vs_baseline"] == pytest.approx(one["gain"] / base["gain"]) or base["gain"] <= 0

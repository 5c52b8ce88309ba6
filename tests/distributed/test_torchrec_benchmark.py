"""benchmarks/torchrec_compare.py runs end to end (``--quick``): TorchRec, plain torch and shardps train alike.

No timing is asserted (speed is the benchmark's report); what is tested: every system ran in the round,
all four start from the same values and train the same batches, so their mean losses of the last steps
agree to 1e-4 (the comparison is of equal work), and the ratios are computed.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.support.procs import run_benchmark


@pytest.mark.slow
def test_torchrec_comparison_trains_every_system_to_the_same_loss(tmp_path: Path) -> None:
    out = tmp_path / "compare.json"
    result, _ = run_benchmark("torchrec_compare", "--quick", out=out, timeout=600)
    (round_,) = result["rounds"]
    systems = {k: v for k, v in round_.items() if isinstance(v, dict)}
    assert {"torchrec_1", "torch", "shardps"} <= set(systems), sorted(systems)
    losses = [run["last_loss"] for run in systems.values()]
    assert all(math.isfinite(x) for x in losses) and max(losses) - min(losses) <= 1e-4, losses
    for name, run in systems.items():
        assert run["samples_per_s"] > 0 and run["cpu_ms_per_step"] > 0, name
    assert all(math.isfinite(result["median"][k]) and result["median"][k] > 0 for k in result["median"])

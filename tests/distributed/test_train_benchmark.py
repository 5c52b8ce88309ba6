"""benchmarks/train.py runs end to end and shardps sync computes exactly what DDP computes.

No timing is asserted: speed is reported by the benchmark, never tested.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_train_benchmark_matches_ddp_math(tmp_path: Path) -> None:
    out = tmp_path / "train.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "train.py"), "--model", "mlp", "--steps", "7",
         "--batch-size", "16", "--json", str(out)],
        capture_output=True, text=True, timeout=400, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["shardps"]["final_loss"] == result["ddp"]["final_loss"] == result["zero"]["final_loss"]
    assert result["final_loss_abs_diff"] < 1e-4
    # the worker holds no optimizer state: params + grads only, half of DDP's with AdamW
    assert result["ratio_model_state_bytes"] <= 0.6
    for system in ("shardps", "ddp", "zero"):
        assert result[system]["samples_per_s"] > 0 and result[system]["peak_rss_bytes"] > 0
    assert "samples/s" in proc.stdout

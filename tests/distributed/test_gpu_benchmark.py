"""benchmarks/gpu.py runs end to end (on the CPU when there is no CUDA) and its JSON holds every row and phase.

Tiny models, 3 steps: the transformer at two batch sizes and the MLP, each
against plain PyTorch and with 2 and 4 shards, gradients in fp32 and in bf16 on the wire. No timing is asserted
(speed is reported, never tested): only that every row is there with its
samples/s, the same final loss as plain PyTorch (sync, one worker, AdamW
on the shards), every phase and timeline mark, and that the marks are in
the order a round goes through.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.procs import run_benchmark

PHASES = {"forward", "forward_wait_for_pull", "backward", "step_call", "grad_copy_off_device", "push",
          "push_after_backward", "round_wait", "pull", "push_pull_overlap", "copy_onto_device", "pull_after_step"}
MARKS = {"forward_end", "backward_end", "step_returned", "push_start", "push_end", "first_chunk_pulled",
         "last_chunk_pulled", "next_step_start"}


@pytest.mark.timeout(120)
def test_gpu_benchmark_smoke_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    result, stdout = run_benchmark("gpu", "--device", "cpu", "--tiny", "--steps", "3", "--warmup", "1", "--workloads",
                                   "transformer:2,transformer:4,mlp:4", "--shards", "2,4", "--wire", "fp32,bf16",
                                   out=out, timeout=110)
    assert result["device"] == "cpu" and "CPU" in result["device_name"] and result["machine"]["cores"] >= 1
    assert result["timed_steps"] == 2
    rows = {(r["workload"], r["samples_per_step"], r["system"]): r for r in result["rows"]}
    workloads = [("transformer", 2), ("transformer", 4), ("mlp", 4)]
    systems = ("torch", "torch_cpu_adamw", "shardps_2", "shardps_2_bf16", "shardps_4", "shardps_4_bf16")
    assert set(rows) == {(*w, s) for w in workloads for s in systems}
    for w in workloads:
        base = rows[(*w, "torch")]
        assert base["samples_per_s"] > 0 and set(base["phases_ms"]) == {"forward", "backward", "optimizer_step"}
        assert base["ratio_samples_per_s_vs_torch"] == 1.0
        oracle = rows[(*w, "torch_cpu_adamw")]  # the same AdamW on host copies: on the CPU, plain PyTorch itself
        assert oracle["final_loss_abs_diff"] < 1e-6 and oracle["final_loss_abs_diff_vs_cpu_adamw"] == 0.0
        for shards in (2, 4):
            r = rows[(*w, f"shardps_{shards}")]
            assert r["shards"] == shards and r["samples_per_s"] > 0 and r["ratio_samples_per_s_vs_torch"] > 0
            # sync, one worker, the same fused AdamW on the shards: the same final loss
            assert r["final_loss_abs_diff"] < 1e-5, (w, shards, r["final_loss"], base["final_loss"])
            assert r["final_loss_abs_diff_vs_cpu_adamw"] < 1e-5, (w, shards, r["final_loss"], oracle["final_loss"])
            assert set(r["phases_ms"]) == PHASES and set(r["timeline_ms"]) == MARKS
            assert all(v >= 0 for v in r["phases_ms"].values()), r["phases_ms"]
            assert r["phases_ms"]["push"] > 0 and r["phases_ms"]["pull"] >= 0 and r["phases_ms"]["backward"] > 0
            t = r["timeline_ms"]
            # the round in order: forward, backward, step(); the push starts before it ends, the pull after
            assert 0 < t["forward_end"] <= t["backward_end"] <= t["step_returned"] <= t["next_step_start"], t
            assert t["push_start"] <= t["push_end"] and t["first_chunk_pulled"] <= t["last_chunk_pulled"], t
            assert t["first_chunk_pulled"] > t["push_start"], t
            assert set(r["metrics_ms"]) == {"push", "pull"} and r["metrics_ms"]["pull"] > 0
            # fp32 gradients: about 4 bytes per parameter per step (measured 3.7-4.0 under load; the counter
            # counts a round when its pull is finished, so a step's bytes can fall outside the window)
            assert r["pushed_bytes_per_step"] >= 0.75 * 4 * r["params"], (r["pushed_bytes_per_step"], r["params"])
            bf16 = rows[(*w, f"shardps_{shards}_bf16")]
            assert bf16["push_dtype"] == "bf16" and r["push_dtype"] == "fp32"
            assert set(bf16["phases_ms"]) == PHASES and bf16["samples_per_s"] > 0
            # bf16 gradients: half the bytes (parameters still come back in fp32, so the loss stays close)
            assert bf16["pushed_bytes_per_step"] < 0.6 * r["pushed_bytes_per_step"], (bf16, r)
            assert bf16["final_loss_abs_diff"] < 1e-2
    assert "samples/s" in stdout and "timeline" in stdout

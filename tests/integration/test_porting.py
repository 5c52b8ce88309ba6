"""The porting example of docs/porting-from-ddp.md under real ``torchrun --nproc-per-node 2``.

``examples/porting/ddp_train.py`` (DDP over Gloo) and its port
``examples/porting/shardps_train.py`` (2 workers, 2 shards started here)
are run as a user runs them, and must train alike:

- in fp32 (``--no-amp``) sync rounds are DDP to float32 rounding, so rank
  0's loss and the clipped gradient's norm agree at every step to ``FP32_ATOL``,
  and so do the model and the optimizer state in the two checkpoint files
  (the port's gathered from the shards by ``dist.state_dict()``);
- with AMP (bf16 autocast on CPU, a GradScaler), each run of N steps saves a
  checkpoint, and a second run resumes from it to 2N: it starts at step N
  (mid-epoch, and the second run crosses an epoch and the StepLR decay), and
  every step's loss and norm agree with DDP's to ``AMP_ATOL``.

The doc's diff equals the real diff of the two files (``test_the_docs_diff_is_the_real_diff``).

Each torchrun is bounded by a timeout and killed with its whole process
group; the shards are stopped by the ``start_cluster`` fixture.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import torch

from tests.support.procs import REPO

EXAMPLES = REPO / "examples" / "porting"
DDP_SCRIPT, PORT_SCRIPT = EXAMPLES / "ddp_train.py", EXAMPLES / "shardps_train.py"
DOC = REPO / "docs" / "porting-from-ddp.md"

#: 1024 samples / 2 ranks / 64 per batch: 8 steps an epoch. A resume at step 6 is mid-epoch; 12 crosses an epoch
#: and the StepLR decay at step 10.
BATCH, HALF, STEPS = "64", 6, 12
#: below the gradient norm of most steps (8 of the 12): clipping acts
MAX_NORM = "0.25"
#: fp32: both sides average the same per-rank gradients (Gloo's all-reduce, the shards' average) and step AdamW
#: (torch's for-loop kernel, the shards' fused one): equal to float32 rounding (~1e-7 relative), printed with 6
#: decimals (5e-7), over 12 steps of a loss near 2. Measured: identical to the last printed digit.
FP32_ATOL = 1e-5
#: AMP: the forward runs in bf16 (8 significant bits). A weight that differs by one float32 rounding can round to
#: the neighbouring bf16 value (a 2^-8 change of that one weight's product), which moves a mean of 64 x 10 logits'
#: cross-entropy by far less than 1e-3. Measured: identical to the last printed digit.
AMP_ATOL = 2e-3
TIMEOUT = 120
STEP_LINE = re.compile(r"^step (\d+) loss (\S+) grad_norm (\S+)$")


def torchrun(script: Path, *args: str) -> str:
    """``torchrun --standalone --nproc-per-node 2 script args``, bounded; its stdout (rank 0's lines)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script), "--batch-size", BATCH, "--max-grad-norm", MAX_NORM, *args]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group: a timeout kills the ranks too
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"{script.name} {args}: no end in {TIMEOUT} s\n{stdout[-2000:]}\n{stderr[-3000:]}")
    assert proc.returncode == 0, f"{script.name} {args}: exit {proc.returncode}\n{stdout[-2000:]}\n{stderr[-3000:]}"
    return stdout


def steps(stdout: str) -> dict[int, tuple[float, float]]:
    """``step -> (loss, grad_norm)`` of rank 0's step lines, checked: consecutive steps, a finite final loss."""
    found = {int(m.group(1)): (float(m.group(2)), float(m.group(3)))
             for line in stdout.splitlines() if (m := STEP_LINE.match(line.strip()))}
    assert found, f"no step lines in:\n{stdout}"
    assert sorted(found) == list(range(min(found), max(found) + 1)), sorted(found)
    final = re.search(r"^final loss (\S+) at step (\d+)$", stdout, re.MULTILINE)
    assert final is not None, stdout
    loss, step = float(final.group(1)), int(final.group(2))
    assert math.isfinite(loss) and step == max(found) and loss == found[step][0], stdout
    return found


def assert_alike(ddp: dict[int, tuple[float, float]], port: dict[int, tuple[float, float]], atol: float) -> None:
    assert sorted(port) == sorted(ddp)
    far = [(s, ddp[s], port[s]) for s in ddp if any(abs(a - b) > atol for a, b in zip(ddp[s], port[s]))]
    assert not far, f"steps where (loss, grad_norm) of DDP and the port differ by more than {atol}: {far}"


def test_the_port_trains_as_ddp_does_in_fp32(start_cluster, tmp_path) -> None:
    ddp_ckpt, port_ckpt = tmp_path / "ddp.pt", tmp_path / "port.pt"
    ddp = steps(torchrun(DDP_SCRIPT, "--no-amp", "--steps", str(STEPS), "--checkpoint", str(ddp_ckpt)))
    cluster = start_cluster(2, min_workers=2)
    port = steps(torchrun(PORT_SCRIPT, "--no-amp", "--steps", str(STEPS), "--checkpoint", str(port_ckpt),
                          "--servers", cluster.servers))
    assert sorted(ddp) == list(range(1, STEPS + 1))
    clipped = sum(g > float(MAX_NORM) for _, g in ddp.values())
    assert clipped >= STEPS // 2, f"the test should clip most steps (--max-grad-norm {MAX_NORM}): {ddp}"
    assert_alike(ddp, port, FP32_ATOL)

    a, b = torch.load(ddp_ckpt), torch.load(port_ckpt)
    assert a["step"] == b["step"] == STEPS
    assert a["scheduler"] == b["scheduler"] and a["scaler"] == b["scaler"]
    torch.testing.assert_close(b["model"], a["model"], rtol=0, atol=FP32_ATOL)
    assert b["optimizer"]["state"].keys() == a["optimizer"]["state"].keys()
    for index, state in a["optimizer"]["state"].items():
        for name, value in state.items():  # step, exp_avg, exp_avg_sq: torch.optim's format from the shards
            torch.testing.assert_close(b["optimizer"]["state"][index][name], value, rtol=1e-5, atol=1e-8,
                                       msg=f"optimizer state {index}.{name}")
    assert [g["lr"] for g in b["optimizer"]["param_groups"]] == [g["lr"] for g in a["optimizer"]["param_groups"]]


def test_both_resume_from_their_checkpoint_with_amp(start_cluster, tmp_path) -> None:
    runs = {}
    for name, script in (("ddp", DDP_SCRIPT), ("port", PORT_SCRIPT)):
        checkpoint = tmp_path / f"{name}.pt"
        halves = []
        for until in (HALF, STEPS):
            servers = ("--servers", start_cluster(2, min_workers=2).servers) if name == "port" else ()
            # the port's second run meets fresh shards: everything it resumes comes from the file
            stdout = torchrun(script, "--steps", str(until), "--checkpoint", str(checkpoint), *servers)
            halves.append((stdout, steps(stdout)))
        (first_out, first), (second_out, second) = halves
        assert "resumed" not in first_out and sorted(first) == list(range(1, HALF + 1)), f"{name}:\n{first_out}"
        assert f"resumed from {checkpoint} at step {HALF}" in second_out, f"{name}:\n{second_out}"
        assert sorted(second) == list(range(HALF + 1, STEPS + 1)), f"{name}: the second run starts at step {HALF}"
        assert torch.load(checkpoint)["step"] == STEPS
        runs[name] = {**first, **second}
    assert_alike(runs["ddp"], runs["port"], AMP_ATOL)


def diff_block(text: str) -> str:
    """The first ```diff block of the doc."""
    m = re.search(r"^```diff\n(.*?)^```$", text, re.MULTILINE | re.DOTALL)
    assert m is not None, f"{DOC.relative_to(REPO)} holds no ```diff block"
    return m.group(1)


def test_the_docs_diff_is_the_real_diff() -> None:
    """The doc shows ``diff -u ddp_train.py shardps_train.py`` (run in examples/porting), without the timestamps."""
    run = subprocess.run(["diff", "-u", DDP_SCRIPT.name, PORT_SCRIPT.name], cwd=EXAMPLES, capture_output=True,
                         text=True, timeout=30)
    assert run.returncode == 1, f"diff: exit {run.returncode} (0: the files are the same; 2: trouble)\n{run.stderr}"
    real = re.sub(r"^(---|\+\+\+) (\S+)\t.*$", r"\1 \2", run.stdout, flags=re.MULTILINE)
    text = DOC.read_text()
    shown = diff_block(text)
    assert shown == real, ("docs/porting-from-ddp.md's diff is not the scripts' diff: regenerate it with\n"
                           "  (cd examples/porting && diff -u ddp_train.py shardps_train.py | sed -E "
                           "'1,2s/\\t.*//')")
    body = [line for line in real.splitlines()[2:] if not line.startswith("@@")]
    counts = (sum(line.startswith("-") for line in body), sum(line.startswith("+") for line in body),
              real.count("\n@@ "))
    m = re.search(r"(\d+) lines removed and (\d+) added \(one of them blank\), in (\d+) hunks", text)
    assert m is not None and tuple(map(int, m.groups())) == counts, f"the doc's counts should be {counts}"

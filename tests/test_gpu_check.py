"""bench/gpu_check.py without a GPU: its size and MFU arithmetic, and its --smoke run of every part."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check as check  # noqa: E402


def test_flops_count_every_matmul_parameter_once() -> None:
    # Prepare: a gpt block has qkv (3d² + 3d), proj (d² + d), the MLP (8d² + 5d) and two norms (4d);
    # the tied embedding (V·d) counts once, the final norm (2d) too, the position embedding not at all
    size, seq = check.Size(24, 16, 1024), 2048
    d, layers = size.n_embd, size.n_layer
    n = layers * (12 * d * d + 13 * d) + check.VOCAB * d + 2 * d
    # Execute
    flops = check.flops_per_token(size, seq)
    # Assert
    assert check.matmul_params(size, seq) == n
    assert flops == 6 * n + 12 * layers * d * seq


def test_the_largest_size_whose_estimate_fits_is_chosen(capsys: pytest.CaptureFixture[str]) -> None:
    ladder, batch, seq = check.LADDER, 8, 2048
    needs = [check.estimate_bytes(s, batch, seq) for s in ladder]
    assert needs == sorted(needs)
    assert check.choose_size(ladder, batch, seq, needs[2]) == 2  # an estimate equal to the free memory fits
    assert check.choose_size(ladder, batch, seq, needs[3] - 1) == 2
    with pytest.raises(RuntimeError, match="no size fits"):
        check.choose_size(ladder, batch, seq, needs[0] - 1)
    assert "estimate GiB" in capsys.readouterr().out


SHORT = [
    "--steps",
    "20",
    "--warmup",
    "4",
    "--reps",
    "1",
    "--throughput-steps",
    "6",
    "--throughput-warmup",
    "2",
]


@pytest.mark.slow(36)
def test_smoke_runs_every_part_on_the_cpu() -> None:
    """~20 s: precision through the Trainer, the size step-down after a pretended out-of-memory, plain
    loop against the Trainer with MFU, FSDP on one gloo rank, the energy search on the estimate."""
    done = subprocess.run(
        # fewer steps than the script's smoke defaults: the parts run through, not to a figure
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--smoke", *SHORT],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((ROOT / "bench" / "results" / "gpu_check_smoke.json").read_text())
    assert all(result[part]["passed"] for part in check.PARTS)
    assert result["throughput"]["out_of_memory"], "the step-down path ran"
    assert result["throughput"]["size"] == {"n_layer": 1, "n_head": 2, "n_embd": 32}
    assert 0 < result["throughput"]["vatra"]["mfu"] < 1

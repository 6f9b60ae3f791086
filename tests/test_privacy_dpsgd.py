"""DP-SGD (privacy.mode = "sample"): every sample is clipped to C, not the batch; noise zC/B."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from vatra.federated.privacy.dpsgd import DPSGD

# opacus's full backward hooks warn when the input needs no gradient; harmless here
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook:UserWarning")

CLIP = 1.0
BATCH = 8


def _model(seed: int = 0, d_in: int = 6, hidden: int = 5) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, 3))


def _batch(huge: bool, d_in: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, d_in, generator=gen)
    y = torch.randint(0, 3, (BATCH,), generator=gen)
    x[0] = 1e3 * x[0] if huge else 0.0  # sample 0: a gradient ~10³ × the others', or a quiet one
    return x, y


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None
    return p.grad.reshape(-1)


def _dpsgd_grad(model: nn.Module, x: torch.Tensor, y: torch.Tensor, z: float) -> torch.Tensor:
    """The gradient DP-SGD hands the optimizer, flattened; on a copy (opacus hooks a model once)."""
    model = copy.deepcopy(model)
    plugin = DPSGD(model, CLIP, z)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    plugin.after_backward(SimpleNamespace(model=model))  # type: ignore[arg-type]
    return torch.cat([_grad(p) for p in model.parameters()])


def _per_sample_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Reference: one backward per sample on an unhooked copy, (B, P)."""
    ref = copy.deepcopy(model)
    rows = []
    for i in range(len(x)):
        ref.zero_grad()
        F.cross_entropy(ref(x[i : i + 1]), y[i : i + 1]).backward()
        rows.append(torch.cat([_grad(p) for p in ref.parameters()]))
    return torch.stack(rows)


def test_each_sample_is_clipped_to_c_not_the_batch_as_a_whole() -> None:
    # Prepare: a batch where sample 0's gradient dwarfs the rest
    model = _model()
    x, y = _batch(huge=True)
    per_sample = _per_sample_grads(model, x, y)  # (B, P)
    norms = per_sample.norm(dim=1)
    assert norms[0] > 10 * CLIP and norms[0] > 10 * norms[1:].max()  # the test is not vacuous
    # Execute
    grad = _dpsgd_grad(model, x, y, z=0.0)
    # Assert: Σ_i g_i·min(1, C/‖g_i‖) / B, the DP-SGD update; float32 sums, hence 1e-5
    clipped = per_sample * (CLIP / norms).clamp(max=1.0)[:, None]
    assert (clipped.norm(dim=1) <= CLIP * (1 + 1e-6)).all()
    torch.testing.assert_close(grad, clipped.sum(0) / BATCH, rtol=1e-5, atol=1e-6)
    # clipping the mean gradient instead would let sample 0 set the direction: not what we got
    mean = per_sample.mean(0)
    batch_clipped = mean * min(1.0, CLIP / float(mean.norm()))
    assert float((grad - batch_clipped).norm()) > 0.1 * CLIP


def test_one_sample_moves_the_update_by_at_most_2c_over_b() -> None:
    # Prepare: neighbouring batches, differing in sample 0 only
    model = _model()
    huge, quiet = _batch(huge=True), _batch(huge=False)
    plain = _per_sample_grads(model, *huge).mean(0) - _per_sample_grads(model, *quiet).mean(0)
    assert float(plain.norm()) > 10 * 2 * CLIP / BATCH  # without clipping the sample dominates
    # Execute
    diff = _dpsgd_grad(model, *huge, z=0.0) - _dpsgd_grad(model, *quiet, z=0.0)
    # Assert: the sensitivity DP-SGD's noise is calibrated to (one clipped sample in, another out)
    assert float(diff.norm()) <= 2 * CLIP / BATCH * (1 + 1e-5)


def test_dpsgd_noise_has_std_z_c_over_b() -> None:
    # Prepare: ~60k parameters, so the sample std pins σ down to well under 1 %
    z = 1.3
    model = _model(d_in=400, hidden=150)
    x, y = _batch(huge=False, d_in=400)
    # Execute: the same batch with and without noise; the difference is the noise alone
    noisy = _dpsgd_grad(model, x, y, z=z)
    clean = _dpsgd_grad(model, x, y, z=0.0)
    noise = (noisy - clean).double() * BATCH  # N(0, (zC)²) per coordinate
    # Assert: n·s²/σ² ~ χ²(n): s²/σ² within 6·√(2/n) of 1 (a 10 % error in σ is ≥ 40 such widths)
    n = noise.numel()
    ratio = float(noise.pow(2).mean()) / (z * CLIP) ** 2
    assert ratio == pytest.approx(1.0, abs=6 * (2 / n) ** 0.5)
    assert abs(float(noise.mean())) < 6 * z * CLIP / n**0.5

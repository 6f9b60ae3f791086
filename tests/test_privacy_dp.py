"""Differential privacy: accountant vs a closed form, DP-FedAvg's ε per round and budget stop, DP-SGD."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from tests.conftest import small_config

from vatra.federated.privacy import Accountant
from vatra.federated.simulation import simulate
from vatra.rundir import RunDir, read_jsonl


def _reference_epsilon(z: float, q: float, steps: int, delta: float) -> float:
    """Independent RDP of the sampled Gaussian at integer orders (Mironov et al. 2019, Sec. 3.3):
    A_α = Σ_k C(α,k) (1−q)^(α−k) q^k exp((k²−k)/(2z²)), RDP(α) = log(A_α)/(α−1) per step,
    converted to (ε, δ) with Balle et al. (2020)'s bound, minimised over α."""
    best = math.inf
    for a in range(2, 257):
        logs = [
            math.lgamma(a + 1)
            - math.lgamma(k + 1)
            - math.lgamma(a - k + 1)
            + (a - k) * math.log1p(-q)
            + k * math.log(q)
            + (k * k - k) / (2 * z * z)
            if q < 1
            else ((a * a - a) / (2 * z * z) if k == a else -math.inf)
            for k in range(a + 1)
        ]
        m = max(logs)
        rdp = steps * (m + math.log(sum(math.exp(v - m) for v in logs))) / (a - 1)
        eps = rdp + math.log((a - 1) / a) - (math.log(delta) + math.log(a)) / (a - 1)
        best = min(best, eps)
    return best


@pytest.mark.parametrize(
    ("z", "q", "steps"), [(1.1, 0.01, 1000), (2.0, 0.1, 100), (1.0, 1.0, 10), (0.8, 0.3, 20)]
)
def test_accountant_matches_closed_form(z: float, q: float, steps: int) -> None:
    acc = Accountant(1e-5)
    acc.step(z, q, steps)
    # opacus evaluates fractional orders too, so it may find a slightly smaller ε than integers only
    ref = _reference_epsilon(z, q, steps, 1e-5)
    assert acc.epsilon() <= ref * 1.0001
    assert acc.epsilon() >= ref * 0.95


def _dp_cfg(**privacy):
    return small_config(
        federated={
            "strategy": "fedavg",
            "clients": 6,
            "clients_per_round": 3,
            "selection": "random",
            "rounds": 4,
            "local_steps": 2,
            "workers": 1,
            "privacy": privacy,
            "secure_aggregation": privacy.pop("sa", {}),
        }
    )


def test_client_dp_reports_epsilon_each_round_and_stops_at_budget(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "dp")
    summary = simulate(
        _dp_cfg(mode="client", noise_multiplier=1.5, clip_norm=0.5, target_epsilon=3.2), run, progress=False
    )
    rows = read_jsonl(run.metrics)
    eps = [r["epsilon"] for r in rows]
    assert eps == sorted(eps) and eps[-1] <= 3.2
    ref = Accountant(1e-5)
    ref.step(1.5, 0.5, len(rows) + 1)
    assert len(rows) < 4 or ref.epsilon() > 3.2  # stopped only where the next round would overspend
    assert len(rows) == 2  # ε: 2.25, 3.05, then 3.66 > 3.2
    assert summary["privacy"] == {"mode": "client", "epsilon": eps[-1], "delta": 1e-5}


def test_client_dp_with_secure_aggregation_noise_at_clients(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "dpsa")
    cfg = _dp_cfg(
        mode="client",
        noise_multiplier=0.2,
        clip_norm=0.5,
        noise_at="clients",
        adaptive_clip=True,
        sa={"enabled": True},
    )
    summary = simulate(cfg, run, progress=False)
    rows = read_jsonl(run.metrics)
    assert all(r["secagg_survivors"] == 3 and np.isfinite(r["epsilon"]) for r in rows)
    assert rows[-1]["dp_clip_norm"] != 0.5  # adaptive clipping moved the norm
    assert summary["privacy"]["epsilon"] == rows[-1]["epsilon"]


def test_sample_level_dp_sgd_via_opacus(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "dpsgd")
    cfg = _dp_cfg(mode="sample", noise_multiplier=1.0, clip_norm=1.0)
    simulate(cfg, run, progress=False)
    rows = read_jsonl(run.metrics)
    assert all(np.isfinite(r["epsilon"]) and r["epsilon"] > 0 for r in rows)
    assert rows[-1]["epsilon"] > rows[0]["epsilon"]


def test_resumed_run_keeps_counting_epsilon(tmp_path: Path) -> None:
    # Prepare: 2 DP rounds, then the same run folder asked for 4 rounds (a restarted server).
    cfg = _dp_cfg(mode="client", noise_multiplier=2.0, clip_norm=0.5)
    run = RunDir(tmp_path / "resume")
    simulate(
        cfg.model_copy(update={"federated": cfg.federated.model_copy(update={"rounds": 2})}),
        run,
        progress=False,
    )
    # Execute
    summary = simulate(cfg, run, progress=False)
    # Assert: ε after 4 rounds counts all 4, as a fresh accountant does
    ref = Accountant(1e-5)
    ref.step(2.0, 0.5, 4)
    assert summary["rounds"] == 4
    assert summary["privacy"]["epsilon"] == pytest.approx(ref.epsilon(), rel=1e-9)


def _rounds(cfg, rounds: int):
    return cfg.model_copy(update={"federated": cfg.federated.model_copy(update={"rounds": rounds})})


@pytest.mark.slow(26)
def test_resume_restores_sample_level_accountants_and_the_adaptive_clip_norm(tmp_path: Path) -> None:
    # Prepare: DP-SGD (one accountant per client) and DP-FedAvg with adaptive clipping, each run
    # once straight through and once stopped after round 2 and resumed from its checkpoint
    sample = _dp_cfg(mode="sample", noise_multiplier=1.0, clip_norm=1.0)
    adaptive = _dp_cfg(
        mode="client", noise_multiplier=0.2, clip_norm=0.5, noise_at="clients", adaptive_clip=True
    )
    straight = simulate(sample, RunDir(tmp_path / "straight"), progress=False)
    for name, cfg in (("sample", sample), ("adaptive", adaptive)):
        simulate(_rounds(cfg, 2), RunDir(tmp_path / name), progress=False)
        # Execute
        simulate(cfg, RunDir(tmp_path / name), progress=False)
    # Assert: ε of the resumed DP-SGD run counts every client's earlier steps, as the straight run
    resumed = read_jsonl(RunDir(tmp_path / "sample").metrics)
    assert resumed[-1]["epsilon"] == pytest.approx(straight["privacy"]["epsilon"], rel=1e-12)
    # round 3 starts from the clip norm round 2 adapted to, not from the configured one
    rows = read_jsonl(RunDir(tmp_path / "adaptive").metrics)
    assert rows[2]["dp_clip_norm"] == rows[1]["dp_next_clip_norm"] != 0.5


def test_private_uploads_in_a_run_are_clipped_and_say_nothing_per_client(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: DP-FedAvg with secure aggregation, noise at the clients, adaptive clipping and the
    # adaptive selector (which reads loss_before when it is there); every upload is intercepted
    from vatra.federated.privacy import FIT_METRICS_WHITELIST
    from vatra.federated.private import PrivateUpload

    clip = 0.05  # small: most updates of the digits MLP are clipped
    seen: list[tuple[float, dict]] = []
    encode = PrivateUpload.encode

    def spy(self, res, ins):
        norm = float(np.linalg.norm(res.update.astype(np.float64)))
        out = encode(self, res, ins)
        seen.append((norm, dict(out.metrics)))
        return out

    monkeypatch.setattr(PrivateUpload, "encode", spy)
    cfg = _dp_cfg(
        mode="client",
        noise_multiplier=0.2,
        clip_norm=clip,
        noise_at="clients",
        adaptive_clip=True,
        sa={"enabled": True},
    )
    cfg = cfg.model_copy(update={"federated": cfg.federated.model_copy(update={"selection": "adaptive"})})
    run = RunDir(tmp_path / "private")
    # Execute
    simulate(cfg, run, progress=False)
    # Assert: uploads carried only the whitelist; the clip was active; the rows hold aggregates only
    assert len(seen) == 4 * 3 and all(set(m) == set(FIT_METRICS_WHITELIST) for _, m in seen)
    assert sum(norm > clip for norm, _ in seen) >= 6
    for row in read_jsonl(run.metrics):
        assert not {"update_norm", "dp_unclipped", "loss_before", "local_accuracy"} & set(row)

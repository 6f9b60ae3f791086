"""The adaptive batch: the noise-scale estimate, the batch and LR rules, memory caps, and the
out-of-memory back-off on real ranks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tests._dist import final_weights, train_ranks
from tests.conftest import small_config

from vatra.balance.adaptive import HEADROOM, NoiseScale, lr_multiplier, memory_cap, next_global_batch
from vatra.config import config_from_dict
from vatra.errors import ConfigError


def test_noise_scale_recovers_a_known_one_from_uneven_rank_batches() -> None:
    """Per-sample gradients G + N(0, σ²I) in d dimensions: tr(Σ) = dσ², B_simple = dσ²/|G|². Three
    ranks of 5, 11 and 16 samples give each step's |g_r|² and the averaged |G_B|², as training does."""
    rng = np.random.default_rng(0)
    d, sigma, sizes = 50, 0.3, [5, 11, 16]
    true_g = rng.standard_normal(d) * 0.1
    want = d * sigma**2 / float(true_g @ true_g)
    noise = NoiseScale(smoothing=0.995)
    for _ in range(3000):
        means = [true_g + sigma * rng.standard_normal((b, d)).mean(axis=0) for b in sizes]
        mixed = sum(b * m for b, m in zip(sizes, means, strict=True)) / sum(sizes)
        noise.update([float(m @ m) for m in means], sizes, 1, float(mixed @ mixed))
    assert noise.value == pytest.approx(want, rel=0.1)
    one = NoiseScale(0.9)
    one.update([1.0], [8], 1, 1.0)  # one rank: nothing to compare it with
    assert one.value is None


def test_the_global_batch_follows_the_noise_scale_within_its_bounds() -> None:
    # towards the noise scale, at most max_change per decision, never below the start or above the max
    assert next_global_batch(64, 1000.0, 64, 512, 0.5, 10_000) == 96
    assert next_global_batch(96, 80.0, 64, 512, 0.5, 10_000) == 80
    assert next_global_batch(64, 10.0, 64, 512, 0.5, 10_000) == 64
    assert next_global_batch(384, 1e6, 64, 512, 0.5, 10_000) == 512
    assert next_global_batch(64, None, 64, 512, 0.5, 10_000) == 64  # no estimate yet: stay
    assert next_global_batch(64, 1000.0, 64, 512, 0.5, 70) == 70  # the memory caps bind
    # the LR rule: linear for SGD, square root for Adam(W), as documented
    assert lr_multiplier("auto", "sgd", 256, 64) == 4.0
    assert lr_multiplier("auto", "adamw", 256, 64) == 2.0
    assert lr_multiplier("none", "sgd", 256, 64) == 1.0


def test_memory_caps_keep_a_growing_batch_within_the_budget() -> None:
    """A rank whose peak is base + optimizer state + 2 MB a sample, against a 1 GB budget: decision
    after decision the batch grows as fast as allowed up to the cap; no batch it is given exceeds
    the budget, and shrinking batches (another rank's share growing) never lower the cap."""
    base, fixed, per_sample, budget = 400e6, 500e6, 2e6, 1e9

    def peak(b: int) -> float:
        return fixed + per_sample * b

    seen: list[tuple[int, float]] = []
    batch, given = 8, []
    for _ in range(20):
        seen.append((batch, peak(batch)))
        cap = memory_cap(*zip(*seen, strict=True), budget, base, 1)
        batch = min(cap, int(batch * 1.5))
        given.append(batch)
    assert all(peak(b) <= HEADROOM * budget for b in given)
    assert given[-1] == max(given) and peak(given[-1]) > 0.8 * budget  # it used most of the memory
    seen.append((4, peak(4)))
    assert memory_cap(*zip(*seen, strict=True), budget, base, 1) == given[-1]
    # a peak over the headroom (something else grew) caps the batch below the one that had it
    assert memory_cap([100, 200], [peak(100), 2 * budget], budget, base, 1) < 200


def test_adaptive_refuses_what_it_cannot_serve() -> None:
    with pytest.raises(ConfigError, match=r"needs a balancer"):
        config_from_dict({"balance": {"adaptive": True}})
    with pytest.raises(ConfigError, match=r"without comm's hooks"):
        config_from_dict({"balance": {"method": "static", "adaptive": True}, "comm": {"method": "topk"}})
    with pytest.raises(ConfigError, match=r"max_global_batch = 16 is below"):
        config_from_dict(
            {"balance": {"method": "static", "adaptive": True, "global_batch": 32, "max_global_batch": 16}}
        )
    with pytest.raises(ConfigError, match=r"chaos\.oom_batch"):
        config_from_dict({"chaos": {"oom_batch": [-1]}})

    from vatra.engine import Trainer
    from vatra.resilience.chaos import TrainingFaults

    cfg = small_config(chaos={"gpu_memory_gb": [4]})
    with pytest.raises(ConfigError, match=r"gpu_memory_gb limits a GPU's memory.*chaos\.oom_batch"):
        TrainingFaults(cfg.chaos).on_fit_start(Trainer.from_config(cfg))


def _run(run: Path, *sets: str) -> None:
    common = ["train.steps=30", "checkpoint.every_steps=10", "balance.method=static", "balance.adaptive=true"]
    common += ["balance.every=5", "train.precision=bf16", "train.eval_every=0", "run.tensorboard=false"]
    train_ranks(run, *common, *sets)  # 2 ranks, the workers vatra train starts


@pytest.mark.slow(47)
def test_an_out_of_memory_rank_is_recovered_on_all_ranks_and_the_redone_step_is_exact(tmp_path: Path) -> None:
    """Two ranks under bf16 autocast; rank 1 has memory for 12 samples and starts with 16: its first
    forward pass runs out of memory, both ranks drop the step, rank 1 is capped at 8, and the step is
    redone on the same global batch split 24 / 8. The run ends bit-equal to one that ran 24 / 8 from
    the start (the global batch held at 32 by max_global_batch, so only the split differs)."""
    hit = ["balance.batches=[16, 16]", "balance.max_global_batch=32", "chaos.oom_batch=[0, 12]"]
    _run(tmp_path / "hit", *hit)
    _run(tmp_path / "ref", "balance.batches=[24, 8]", "balance.max_global_batch=32")
    events = [json.loads(line) for line in (tmp_path / "hit" / "events.jsonl").read_text().splitlines()]
    ooms = [e for e in events if e["event"] == "oom"]
    assert [(e["step"], e["ranks"]) for e in ooms] == [(0, [1])]
    backoff = [e for e in events if e["event"] == "balance" and e.get("reason") == "oom"]
    assert backoff[0]["sizes"] == [24, 8]
    rows = [json.loads(line) for line in (tmp_path / "hit" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["global_batch"] == 32 and np.isfinite(r["loss"]) for r in rows if "global_batch" in r)
    a, b = final_weights(tmp_path / "hit", tmp_path, 30), final_weights(tmp_path / "ref", tmp_path, 30)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

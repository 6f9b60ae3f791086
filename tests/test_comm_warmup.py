"""The warm-up that ends when training says so (``vatra.comm.warmup``): compression starts once the
loss curve has settled, not before while it still falls steeply, and the run records when and why."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
from tests._dist import rewind, train_ranks

from vatra.comm.warmup import LossSettled
from vatra.rundir import read_jsonl


def _feed(curve: list[float], min_steps: int = 20, max_steps: int = 1000) -> LossSettled:
    detector = LossSettled(min_steps=min_steps, max_steps=max_steps)
    for step, loss in enumerate(curve, start=1):
        if detector.update(step, loss) is not None:
            break
    return detector


def _noisy(values: list[float], seed: int = 0, noise: float = 0.03) -> list[float]:
    """A per-batch loss: the curve times ±3 % noise, as a mini-batch's loss scatters."""
    rng = random.Random(seed)
    return [v * (1.0 + rng.uniform(-noise, noise)) for v in values]


def test_compression_starts_once_the_loss_has_settled() -> None:
    # Prepare: a loss that falls from 2.3 with a time constant of 30 steps to a floor of 0.1
    curve = _noisy([0.1 + 2.2 * math.exp(-t / 30) for t in range(600)])
    # Execute
    detector = _feed(curve)
    # Assert: it starts in the tail, after the steep part (where the fall per step is still more
    # than a third of the first step's) and well before the limit
    assert detector.decided is not None and detector.reason is not None
    assert 30 * math.log(3) < detector.decided < 200, detector.decided
    assert detector.reason.startswith("loss settled")


def test_compression_does_not_start_while_the_loss_still_falls_steeply() -> None:
    # Prepare: 150 flat steps (the loss has not begun to fall), then a steep fall over 150 steps
    flat = [2.3] * 150
    fall = [2.3 - 2.0 * t / 150 for t in range(150)]
    settled = [0.3] * 300
    # Execute
    detector = _feed(_noisy(flat + fall + settled))
    # Assert: neither the flat start nor the steep fall counts as settled; the flat end does
    assert detector.decided is not None and detector.decided > 300, detector.decided
    # a loss that keeps falling steeply never settles: compression starts at the limit, and says so
    steep = _feed(_noisy([2.3 - 0.002 * t for t in range(1000)]), max_steps=500)
    assert steep.decided == 500
    assert steep.reason is not None and "did not settle" in steep.reason


def test_never_before_the_lr_warmup_and_non_finite_losses_are_skipped() -> None:
    curve = [0.1 + 2.2 * math.exp(-t / 10) for t in range(300)]  # settled by step ~60
    assert _feed(curve, min_steps=150).decided == 150
    with_nan = _feed([math.nan if t % 7 == 0 else v for t, v in enumerate(curve)], min_steps=0)
    assert with_nan.decided is not None and with_nan.decided < 150
    assert with_nan.ema is not None and math.isfinite(with_nan.ema)
    # a loss that never fell (flat from the start) has not shown it settled: the limit
    assert _feed(_noisy([0.5] * 400), max_steps=300).decided == 300


def test_the_detector_state_resumes_to_the_same_decision() -> None:
    curve = _noisy([0.1 + 2.2 * math.exp(-t / 30) for t in range(600)])
    whole = _feed(curve)
    assert whole.decided is not None
    first = LossSettled(min_steps=20, max_steps=1000)
    for step, loss in enumerate(curve[:50], start=1):
        first.update(step, loss)
    second = LossSettled(min_steps=20, max_steps=1000)
    second.load_state_dict(first.state_dict())
    for step, loss in enumerate(curve[50:], start=51):
        if second.update(step, loss) is not None:
            break
    assert (second.decided, second.reason) == (whole.decided, whole.reason)


SETS = [
    "train.steps=400",
    "train.batch_size=16",
    "train.eval_every=0",
    "model.hidden=[64]",
    "optim.name=sgd",
    "optim.lr=0.1",
    "optim.warmup_steps=10",
    "optim.momentum=0.9",
    "comm.method=topk",
    "checkpoint.every_steps=40",
    "checkpoint.keep_last=0",
    "monitor.enabled=false",
    "heal.enabled=false",
    "run.tensorboard=false",
    "run.progress=off",
]


@pytest.mark.slow(30)
def test_a_real_run_records_when_and_why_compression_started(tmp_path: Path) -> None:
    # Prepare / Execute: digits on 2 ranks under SGD, only comm.method set
    run, again = tmp_path / "run", tmp_path / "again"
    summary = train_ranks(run, *SETS)
    # Assert: one event per rank, at the same step, with the reason, and the summary says the step
    started = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "compression_started"]
    assert len(started) == 2 and len({e["step"] for e in started}) == 1, started
    step = started[0]["step"]
    assert 10 <= step < 100 and started[0]["reason"].startswith("loss settled"), started  # limit: 100
    assert summary["compression_started_step"] == step
    # after the decision the bytes fall: DGC's ramp from 25 % towards the 1 % default
    sent = {m["step"]: m["comm_bytes"] for m in read_jsonl(run / "metrics.jsonl") if "comm_bytes" in m}
    assert sent[step + 1] < sent[step] / 2 and sent[400] < sent[step + 1], sent
    # a run resumed from a checkpoint before the decision decides on the same step, once
    saved = max(s for s in (40, 80) if s < step)
    rewind(run, again, step=saved)
    resumed = train_ranks(again, *SETS)
    events = [e for e in read_jsonl(again / "events.jsonl") if e["event"] == "compression_started"]
    assert [e["step"] for e in events] == [step] * 4  # the first launch's two, the resumed launch's two
    assert resumed["compression_started_step"] == step

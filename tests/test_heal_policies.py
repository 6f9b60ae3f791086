"""Healing policies in one process: the monitor's verdicts drive skips and rollbacks, a rollback
skips the faulty window's data and leaves the LR on its schedule, the action cap, prefetch."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tests.conftest import small_config

from vatra.engine import Plugin, Trainer
from vatra.errors import VatraError
from vatra.monitor import JsonlWriter, Monitor, ProgressDisplay
from vatra.monitor.report import write_report
from vatra.monitor.signals import Verdict
from vatra.resilience.chaos import TrainingFaults
from vatra.resilience.heal import ActionCap, Healer, HealingFailed, Rollback, SkipSpike
from vatra.rundir import RunDir, read_jsonl


def _fit(
    tmp_path: Path, steps: int = 150, eval_every: int = 0, **sections: Any
) -> tuple[Trainer, RunDir, dict[str, Any]]:
    torch.set_num_threads(1)
    train = {"steps": steps, "batch_size": 32, "eval_every": eval_every}
    cfg = small_config(train=train, monitor={"warmup_steps": 30}, **sections)
    run_dir = RunDir(tmp_path / "run").create()
    shown = ProgressDisplay("plain", log_every=1000)  # the console's lines (rank 0's display)
    plugins = [TrainingFaults(cfg.chaos), Monitor(cfg), Healer(cfg), shown, JsonlWriter(run_dir)]
    trainer = Trainer.from_config(cfg, plugins=plugins, run_dir=run_dir)
    return trainer, run_dir, trainer.fit()


def _actions(run_dir: RunDir) -> list[tuple[int, str]]:
    """Actions that change the training (prefetch and straggler naming are left out)."""
    events = read_jsonl(run_dir.events)
    return [(e["step"], e["action"]) for e in events if e.get("action") in ("skip_update", "rollback")]


def test_gradient_spike_update_is_skipped(tmp_path: Path) -> None:
    _, run_dir, summary = _fit(tmp_path, chaos={"grad_spike_at": [100]})
    assert _actions(run_dir) == [(99, "skip_update")]  # logged during step 100 (99 steps done)
    rows = {r["step"]: r for r in read_jsonl(run_dir.metrics)}
    assert rows[100]["skipped"] and not rows[99]["skipped"] and not rows[101]["skipped"]
    assert summary["heal_actions"].get("skip_update") == 1 and "rollback" not in summary["heal_actions"]


def test_nan_rolls_back_and_training_stays_finite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trainer, run_dir, summary = _fit(tmp_path, chaos={"inject_nan_at": [90]}, eval_every=40)
    actions = _actions(run_dir)
    assert ("skip_update" in {a for _, a in actions}) and ("rollback" in {a for _, a in actions})
    rollback = next(e for e in read_jsonl(run_dir.events) if e.get("action") == "rollback")
    to_step = rollback["evidence"]["to_step"]
    assert to_step <= 88 and rollback["evidence"]["lr_scale"] == 1.0
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert summary["steps"] == 150 and summary["val_accuracy"] > 0.8
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.1)  # no LR cut: the data was bad
    # the console told each action once, as it happened
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if "skipped step" in line] == [
        "vatra: skipped step 90: non-finite gradient norm"
    ], out
    assert [line for line in out if "rollback" in line] == [
        f"vatra: rollback: non-finite gradient norm at step 90, back to step {to_step} (memory)"
    ], out
    # the final evaluation is the last step's record, once; the summary's figures are that record's
    rows = read_jsonl(run_dir.metrics)
    evals = [r for r in rows if "val_accuracy" in r]
    assert [r["step"] for r in evals][-2:] == [120, 150] and rows[-1]["step"] == 150
    assert evals[-1]["val_accuracy"] == summary["val_accuracy"]
    # the report counts optimizer steps (150), not the lines the rollback replayed
    replayed = len(rows) - 150
    assert replayed > 0
    page = write_report(run_dir.path, summary=summary).read_text()
    assert "steps<b>150</b>" in page and f"steps replayed<b>{replayed}</b>" in page


class DataOrder(Plugin):
    """Records the targets of every batch the trainer draws, in order (healing draws to skip data)."""

    def __init__(self) -> None:
        self.targets: list[torch.Tensor] = []

    def on_fit_start(self, trainer: Trainer) -> None:
        draw = trainer.next_batch

        def record() -> Any:
            batch = draw()
            self.targets.append(batch[1].clone())
            return batch

        trainer.next_batch = record  # type: ignore[method-assign]


def test_a_rollback_skips_the_faulty_windows_data_and_the_lr_returns_to_its_schedule(tmp_path: Path) -> None:
    # Prepare: bad batches at data steps 90 and 115 (NaN). The first rolls back to the in-memory
    # snapshot of step 60 and skips the data up to data step 109; the second bad batch then comes
    # at step 66, before the loss is back on its baseline: that rollback also halves the LR.
    torch.set_num_threads(1)
    cfg = small_config(
        train={"steps": 200, "batch_size": 32},
        monitor={"warmup_steps": 30},
        chaos={"inject_nan_at": [90, 115]},
    )
    run_dir = RunDir(tmp_path / "run").create()
    order, healer = DataOrder(), Healer(cfg)
    plugins = [TrainingFaults(cfg.chaos), order, Monitor(cfg), healer, JsonlWriter(run_dir)]
    trainer = Trainer.from_config(cfg, plugins=plugins, run_dir=run_dir)
    # Execute
    summary = trainer.fit()
    # Assert: two rollbacks, each skipping the data of the faulty window; the first keeps the LR
    heal = [e for e in read_jsonl(run_dir.events) if e["event"] == "heal"]
    rollbacks = [e["evidence"] for e in heal if e["action"] == "rollback"]
    assert [(r["from_step"], r["to_step"], r["lr_scale"]) for r in rollbacks] == [
        (90, 60, 1.0),
        (66, 60, 0.5),
    ]
    ahead = [r["skipped_steps_of_data"] - (r["from_step"] - r["to_step"]) for r in rollbacks]
    assert ahead == [19, 19]  # on to 2 windows past the bad batch: 20 steps of its data unseen
    # the data came in the sampler's order, nothing replayed: exactly the undisturbed run's batches
    reference = Trainer.from_config(cfg)
    assert len(order.targets) == healer.clock + sum(ahead)
    for got in order.targets:
        assert torch.equal(got, reference.next_batch()[1])
    # the LR came back to its schedule once the loss was back on its baseline
    restores = [e for e in heal if e["action"] == "lr_restore"]
    assert len(restores) == 1 and restores[0]["evidence"]["lr_scale"] == 1.0
    lrs = {r["step"]: r["lr"] for r in read_jsonl(run_dir.metrics)}
    assert lrs[restores[0]["step"] + 1] == pytest.approx(0.1) and lrs[200] == pytest.approx(0.1)
    assert summary["steps"] == 200 and summary["val_accuracy"] > 0.8


def test_a_clean_run_takes_no_action(tmp_path: Path) -> None:
    _, run_dir, summary = _fit(tmp_path, steps=300)
    assert _actions(run_dir) == [] and summary["anomalies"] == 0


def _verdict(steps: range, loss: list[float], streams: dict[str, list[int]]) -> Verdict:
    alarmed = sorted({s for hits in streams.values() for s in hits})
    return Verdict(
        step=steps[-1],
        steps=list(steps),
        loss=loss,
        alarms=len(alarmed),
        straggler_ratio=1.0,
        slowest_rank=0,
        data_share=0.0,
        alarm_steps=alarmed,
        stream_alarms=streams,
    )


def test_loss_stream_alarms_for_k_windows_roll_back_and_gradient_stream_alarms_do_not() -> None:
    # Prepare: the policy decides from verdicts alone (a checkpointer is never called to decide)
    from types import SimpleNamespace

    rollback = Rollback(small_config(heal={"divergence_windows": 2}))
    trainer: Any = SimpleNamespace(state=SimpleNamespace(checkpointer=object(), step=0))
    rng = np.random.default_rng(0)

    def clean() -> list[float]:  # a healthy loss may sit anywhere, here below zero
        return list(-0.05 + 0.03 * rng.standard_normal(10))

    def window(start: int, losses: list[float], **streams: list[int]) -> Any:
        return rollback.on_step_end(trainer, _verdict(range(start, start + 10), losses, streams))

    # Execute / Assert: clean windows set the baseline; alarms blamed on the gradient stream only
    # (its spikes were skipped on their steps) roll nothing back
    for start in range(1, 51, 10):
        assert window(start, clean()) is None
    assert window(51, clean(), grad_norm=[53]) is None
    assert window(61, clean(), grad_norm=[61, 62]) is None
    # a transient loss spike (one window alarms, the next is back on the baseline): no rollback
    assert window(71, [3.0, *clean()[1:]], loss=[71], loss_change=[71]) is None
    assert window(81, clean()) is None
    # a divergence: the loss streams alarm, and the next window is still far above the baseline
    assert window(91, [2.3] * 10, loss=[91, 92], loss_change=[91]) is None
    action = window(101, [2.4] * 10)  # no alarm any more (the robust z followed), still diverged
    assert action is not None and action.kind == "rollback" and action.reason == "loss diverged"
    assert action.evidence["onset"] == 91 and action.evidence["windows"] == 2


def test_skips_are_the_monitors_gradient_stream_alarms_on_the_same_step() -> None:
    # Prepare: a gradient norm that trends up (as it does early in a run with error feedback),
    # three spikes, a NaN and a lasting change of level at step 151, which alarms until the
    # baseline has followed it; the ensemble's z-score detector alone (vote 1) on the same steps
    from types import SimpleNamespace

    from vatra.config import MonitorConfig
    from vatra.monitor import Ensemble

    cfg = small_config()
    skip = SkipSpike(cfg)
    ensemble = Ensemble(MonitorConfig(detectors=["zscore"], vote=1))
    trainer: Any = SimpleNamespace(state=SimpleNamespace(step=0))
    rng = np.random.default_rng(0)
    norms = list(np.linspace(0.5, 3.0, 300) + 0.05 * rng.standard_normal(300))
    for at in (120, 200, 260):
        norms[at] *= 30.0
    norms[230] = float("nan")
    norms = norms[:150] + [n + 1.0 for n in norms[150:]]
    # Execute: the policy decides before each step's update; the ensemble judges the step afterwards
    skipped, alarmed = [], []
    for step, norm in enumerate(norms, start=1):
        if skip.after_backward(trainer, norm) is not None:
            skipped.append(step)
        alarm = ensemble.observe(step, 1.0, norm)
        if alarm is not None and "grad_norm" in alarm.streams:
            alarmed.append(step)
    ensemble.close()
    # Assert: skipped exactly where the monitor's gradient stream alarms, no more, no less: the
    # spikes, the NaN and the first steps of the new level (a limit that lagged the baseline by
    # a batch of 16 norms went on skipping after the monitor had taken the new level as normal)
    assert skipped == alarmed
    assert {121, 151, 201, 231, 261} <= set(skipped) and 149 not in skipped and skipped[-1] == 261


def test_action_cap_ends_the_run_with_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(HealingFailed, match="healing could not hold the run: 1 actions in the last 100"):
        _fit(tmp_path, chaos={"grad_spike_at": [60, 80]}, heal={"max_actions": 1})
    assert issubclass(HealingFailed, VatraError)  # the worker prints it as one error line
    cap = ActionCap(2, window_steps=10)
    cap.admit(0, "a")
    cap.admit(5, "b")
    cap.admit(10, "c")  # the action at clock 0 has left the window


def test_high_data_wait_raises_prefetch_and_keeps_the_batch_order(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    cfg = small_config(train={"steps": 60, "batch_size": 32}, monitor={"gather_every": 10})
    trainer = Trainer.from_config(cfg, plugins=[Monitor(cfg), Healer(cfg)])
    batch = trainer.train_data.get_batch

    def slow_batch(idx: Any) -> Any:
        time.sleep(0.004)  # an I/O-bound loader: sleeping releases the GIL like a read would
        return batch(idx)

    trainer.train_data.get_batch = slow_batch  # type: ignore[method-assign]
    trainer.fit()
    rows = trainer.state.extras["heal"]["actions"]
    assert rows.get("prefetch", 0) >= 1

    # Prefetched batches are exactly the sampler's, and the sampler's state stays exact.
    reference = Trainer.from_config(cfg)
    fetched = Trainer.from_config(cfg)
    fetched.batches.prefetch(3)
    for _ in range(10):
        x_ref, y_ref = reference.next_batch()
        x, y = fetched.next_batch()
        torch.testing.assert_close(x, x_ref, rtol=0, atol=0)
        assert torch.equal(y, y_ref)
    assert fetched.batches.state_dict() == reference.batches.state_dict()
    jump = {**reference.batches.state_dict(), "position": 0}  # a rollback repositions the data
    fetched.batches.load_state_dict(jump)
    reference.batches.load_state_dict(jump)
    assert np.array_equal(fetched.next_batch()[1].numpy(), reference.next_batch()[1].numpy())
    fetched.batches.close()


def test_snapshot_reusing_buffers_copies_exactly_and_does_not_alias(tmp_path: Path) -> None:
    from vatra.resilience.heal.rollback import Snapshot

    trainer, _, _ = _fit(tmp_path, steps=5)
    old = Snapshot.take(trainer)
    trainer.train_step()
    new = Snapshot.take(trainer, reuse=old)
    weights = trainer.model.state_dict()
    moments = trainer.optimizer.state_dict()["state"]
    for k, v in weights.items():
        assert torch.equal(new.model[k], v) and new.model[k].data_ptr() != v.data_ptr()
    assert new.model["trunk.0.weight"].data_ptr() == old.model["trunk.0.weight"].data_ptr()  # reused
    for i, st in moments.items():
        for k, v in st.items():
            assert torch.equal(new.optimizer["state"][i][k], v)
    frozen = {k: v.clone() for k, v in new.model.items()}
    trainer.train_step()  # training on must not change the snapshot
    assert all(torch.equal(new.model[k], frozen[k]) for k in frozen)
    new.restore(trainer)
    assert trainer.state.step == new.step and torch.equal(
        trainer.model.state_dict()["trunk.0.weight"], frozen["trunk.0.weight"]
    )


def test_prefetch_needs_two_data_bound_windows_in_a_row() -> None:
    from vatra.resilience.heal.prefetch import Prefetch

    policy = Prefetch(small_config())

    def verdict(share: float) -> Verdict:
        return Verdict(
            step=10, steps=[10], loss=[1.0], alarms=0, straggler_ratio=1.0, slowest_rank=0, data_share=share
        )

    trainer: Any = None  # the policy decides from the verdict alone
    assert policy.on_step_end(trainer, verdict(0.9)) is None  # one descheduled fetch: not yet
    assert policy.on_step_end(trainer, verdict(0.1)) is None
    assert policy.on_step_end(trainer, verdict(0.9)) is None
    action = policy.on_step_end(trainer, verdict(0.9))
    assert action is not None and action.kind == "prefetch" and action.evidence["depth"] == 1

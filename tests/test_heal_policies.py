"""Healing policies in one process: skip a spike, roll back on NaN, the action cap, prefetch."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tests.conftest import small_config

from vatra.engine import Trainer
from vatra.errors import VatraError
from vatra.monitor import JsonlWriter, Monitor, TrainingFaults
from vatra.resilience.heal import ActionCap, Healer, HealingFailed
from vatra.rundir import RunDir, read_jsonl


def _fit(tmp_path: Path, steps: int = 150, **sections: Any) -> tuple[Trainer, RunDir, dict[str, Any]]:
    torch.set_num_threads(1)
    cfg = small_config(train={"steps": steps, "batch_size": 32}, monitor={"warmup_steps": 30}, **sections)
    run_dir = RunDir(tmp_path / "run").create()
    plugins = [TrainingFaults(cfg.chaos), Monitor(cfg), Healer(cfg), JsonlWriter(run_dir)]
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


def test_nan_rolls_back_and_training_stays_finite(tmp_path: Path) -> None:
    trainer, run_dir, summary = _fit(tmp_path, chaos={"inject_nan_at": [90]})
    actions = _actions(run_dir)
    assert ("skip_update" in {a for _, a in actions}) and ("rollback" in {a for _, a in actions})
    rollback = next(e for e in read_jsonl(run_dir.events) if e.get("action") == "rollback")
    assert rollback["evidence"]["to_step"] <= 88 and rollback["evidence"]["lr_scale"] == 0.5
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert summary["steps"] == 150 and summary["val_accuracy"] > 0.8
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5)


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
    from vatra.monitor.plugin import Verdict
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


def test_rollback_judges_a_loss_below_zero_by_its_spread() -> None:
    # A multitask loss with learned weights sits below zero: factor × baseline means nothing there.
    from types import SimpleNamespace

    from vatra.resilience.heal.rollback import Rollback

    policy = Rollback(small_config())
    trainer = SimpleNamespace(state=SimpleNamespace(checkpointer=object(), step=0))
    rng = np.random.default_rng(0)
    noisy = list(-0.05 + 0.03 * rng.standard_normal(200))  # healthy, fluctuating around -0.05
    verdict = SimpleNamespace(steps=list(range(200)), loss=noisy, alarms=0)
    assert policy.on_step_end(trainer, verdict) is None  # type: ignore[arg-type]
    risen = SimpleNamespace(steps=list(range(200, 206)), loss=[1.5] * 6, alarms=0)
    action = policy.on_step_end(trainer, risen)  # type: ignore[arg-type]
    assert action is not None and action.reason == "loss diverged"

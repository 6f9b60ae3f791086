"""The checkpoint plugin in one process: exact resume, corrupt fallback, async, auto interval, protocol."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
from tests.conftest import small_config

from vatra.config import Config
from vatra.engine import Trainer
from vatra.errors import ConfigError
from vatra.monitor import JsonlWriter, ProgressDisplay
from vatra.resilience import LAST_GOOD, LATEST, CheckpointPlugin, corrupt_version, open_store
from vatra.rundir import RunDir, read_jsonl


@pytest.fixture(autouse=True)
def _one_thread():
    # The tests share 2 cores with other work; intra-op threads only add contention at this size.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _cfg(**checkpoint: object) -> Config:
    # dropout, AdamW and a cosine schedule: resume must restore RNG, optimizer moments and the LR.
    return small_config(
        model={"hidden": [32], "dropout": 0.1},
        train={"steps": 20, "batch_size": 16},
        optim={"name": "adamw", "lr": 0.01, "schedule": "cosine", "warmup_steps": 3},
        checkpoint={"every_steps": 5, **checkpoint},
    )


def _fit(cfg: Config, run: Path, *, console: bool = False) -> tuple[Trainer, CheckpointPlugin]:
    rd = RunDir(run).create()
    plugin = CheckpointPlugin(cfg, rd)
    shown = [ProgressDisplay("plain", log_every=1000)] if console else []
    trainer = Trainer.from_config(cfg, plugins=[plugin, *shown, JsonlWriter(rd)], run_dir=rd)
    trainer.fit()
    return trainer, plugin


def _weights(t: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in t.model.parameters()]


def _events(run: Path, kind: str) -> list[dict]:
    return [e for e in read_jsonl(run / "events.jsonl") if e["event"] == kind]


def test_resume_from_an_earlier_version_is_bitwise_exact(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: an uninterrupted run saves at 5, 10, 15, 20
    cfg = _cfg()
    ref, _ = _fit(cfg, tmp_path / "run")
    store = open_store(cfg.store, tmp_path / "run" / "checkpoints")
    assert [m["step"] for m in store.versions()] == [5, 10, 15, 20]
    # Execute: roll back to step 10 and train again in a fresh process state
    store.set_tag(LATEST, next(m["version"] for m in store.versions() if m["step"] == 10))
    torch.manual_seed(12345)  # disturb the global RNG: the resume must restore it
    capsys.readouterr()
    resumed, _ = _fit(cfg, tmp_path / "run", console=True)
    # Assert: same weights, bit for bit (CPU, one process: no tolerance needed)
    assert resumed.state.step == 20
    assert all(torch.equal(a, b) for a, b in zip(_weights(ref), _weights(resumed), strict=True))
    lines = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in lines] == list(range(1, 21)) + list(range(11, 21))
    assert {m["attempt"] for m in lines[:20]} == {0} and {m["attempt"] for m in lines[20:]} == {1}
    second = {m["step"]: m for m in lines[20:]}
    assert all(second[m["step"]]["loss"] == m["loss"] for m in lines[10:20])
    (resume,) = _events(tmp_path / "run", "resume")
    assert resume["resumed_step"] == 10
    # the console says it once, as it happens: before the first step line, from where it went on
    out = capsys.readouterr().out.splitlines()
    said = [line for line in out if "resumed" in line]
    assert said == [f"vatra: resumed from checkpoint version {resume['version']} at step 10"], out
    assert out.index(said[0]) < next(i for i, line in enumerate(out) if line.startswith("step "))


def test_corrupt_checkpoint_falls_back_to_parent(tmp_path: Path) -> None:
    # Prepare: chaos damages the version written at step 20 (the newest)
    cfg = _cfg()
    cfg.chaos.corrupt_checkpoint_at = [20]
    ref, _ = _fit(cfg, tmp_path / "run")
    assert _events(tmp_path / "run", "chaos_corrupt")[0]["step"] == 20
    # Execute: a re-launch in the same run folder
    resumed, _ = _fit(cfg, tmp_path / "run")
    # Assert: the damage is detected and logged, step 15 is used, training redoes 16..20 exactly
    bad = _events(tmp_path / "run", "checkpoint_corrupt")
    assert len(bad) == 1 and "checksum mismatch" in bad[0]["problem"]
    assert _events(tmp_path / "run", "resume")[0]["resumed_step"] == 15
    assert all(torch.equal(a, b) for a, b in zip(_weights(ref), _weights(resumed), strict=True))
    assert len(_events(tmp_path / "run", "chaos_corrupt")) == 1  # fires once per run folder


def test_async_save_matches_sync_and_blocks_less(tmp_path: Path) -> None:
    sync, p_sync = _fit(_cfg(), tmp_path / "sync")
    asyn, p_async = _fit(_cfg(**{"async": True}), tmp_path / "async")
    assert all(torch.equal(a, b) for a, b in zip(_weights(sync), _weights(asyn), strict=True))
    stores = [open_store(_cfg().store, tmp_path / r / "checkpoints") for r in ("sync", "async")]
    a, b = (s.manifest(LATEST) for s in stores)
    assert a["step"] == b["step"] == 20
    # DCP files carry the same tensors: the same bytes, so the same content addresses
    assert a["files"]["__0_0.distcp"]["sha256"] == b["files"]["__0_0.distcp"]["sha256"]
    assert len(p_async.costs) == len(p_sync.costs) == 4


def test_gc_in_a_run_meeting_an_unreadable_manifest_deletes_nothing_and_goes_on(
    tmp_path: Path,
) -> None:
    # Prepare: the store already holds a truncated manifest (its objects are unknown)
    cfg = _cfg(keep_last=1)
    store = open_store(cfg.store, tmp_path / "run" / "checkpoints")
    store.backend.put("versions/s0000001-old.json", b'{"version": "s0000001-old", "files": {')
    work = tmp_path / "run" / "checkpoints" / ".work"  # a killed save's staging files, two layouts
    for leftover in (work / "rank00000" / "s0000001-a0" / "__0_0.distcp", work / "s0000001-a0" / ".metadata"):
        leftover.parent.mkdir(parents=True)
        leftover.write_bytes(b"partial")
    # Execute: four saves, each followed by gc --keep 1
    trainer, _ = _fit(cfg, tmp_path / "run")
    # Assert: the run finished; every gc aborted with the reason logged and deleted nothing
    assert trainer.state.step == 20
    aborted = _events(tmp_path / "run", "gc_aborted")
    assert [e["step"] for e in aborted] == [5, 10, 15, 20]
    assert all("versions/s0000001-old.json" in e["reason"] for e in aborted)
    assert [m["step"] for m in store.versions()] == [5, 10, 15, 20]
    assert all(store.verify(m["version"]) == [] for m in store.versions())
    assert store.backend.keys("versions/").count("versions/s0000001-old.json") == 1
    assert not [p for p in work.rglob("*") if p.is_file()]  # removed at the start, none left by saves


def test_auto_interval_follows_young_daly(tmp_path: Path) -> None:
    # Prepare: a tiny MTBF so the interval is short enough to see several saves in 40 steps
    cfg = _cfg(every_steps="auto", mtbf_s=0.001)
    cfg.train.steps = 40
    # Execute
    rd = RunDir(tmp_path / "run").create()
    plugin = CheckpointPlugin(cfg, rd)
    trainer = Trainer.from_config(cfg, plugins=[plugin, JsonlWriter(rd)], run_dir=rd)
    summary = trainer.fit()
    # Assert: the first save measures C; each later one comes at the interval computed at the one before
    saves = [e["step"] for e in _events(tmp_path / "run", "checkpoint_saved") if e["reason"] == "periodic"]
    assert saves[0] == 10 and len(saves) >= 3
    computed = _events(tmp_path / "run", "checkpoint_interval")
    for a, b in itertools.pairwise(saves):
        latest = [e for e in computed if e["step"] <= a][-1]
        assert b - a == latest["interval_steps"]
        # the closed form on the run's own figures, and what it costs
        steps = max(1, round(math.sqrt(2 * latest["cost_s"] * latest["mtbf_s"]) / latest["step_s"]))
        assert latest["interval_steps"] == steps
        assert latest["overhead"] == pytest.approx(latest["cost_s"] / latest["interval_s"])
    # the summary: the latest interval in seconds, and the share of training time spent saving
    assert plugin.interval is not None
    assert summary["checkpoint_interval_s"] == plugin.interval["interval_s"] == computed[-1]["interval_s"]
    assert 0 < summary["checkpoint_overhead"] == pytest.approx(sum(plugin.costs) / trainer.state.train_time_s)


def test_checkpointer_protocol_for_other_plugins(tmp_path: Path) -> None:
    # Prepare
    cfg = _cfg(every_steps=0)
    rd = RunDir(tmp_path / "run").create()
    trainer = Trainer.from_config(cfg, plugins=[CheckpointPlugin(cfg, rd)], run_dir=rd)
    trainer.plugins.on_fit_start(trainer)
    ckpt = trainer.state.checkpointer
    assert ckpt is not None
    for _ in range(3):
        trainer.train_step()
    good = ckpt.save(trainer, tags=("manual",))
    before = _weights(trainer)
    trainer.state.healthy = False  # a detector is unhappy: this save must not become last-good
    for _ in range(2):
        trainer.train_step()
    sick = ckpt.save(trainer)
    # Execute
    manifest = ckpt.restore(trainer, LAST_GOOD)
    # Assert
    store = open_store(cfg.store, rd.checkpoints)
    assert manifest["version"] == good == store.resolve(LAST_GOOD) == store.resolve("manual")
    assert store.resolve(LATEST) == sick
    assert trainer.state.step == 3
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(trainer), strict=True))


def test_a_checkpoint_of_another_model_is_a_clear_error_not_a_fallback(tmp_path: Path) -> None:
    _fit(_cfg(), tmp_path / "run")
    other = _cfg()
    other.model.hidden = [16]  # the saved weights are 32 wide
    with pytest.raises(
        ConfigError, match=r"checkpoint s0000020-a0 does not fit this run: .*[Ss]ize mismatch"
    ):
        _fit(other, tmp_path / "run")
    assert not _events(tmp_path / "run", "checkpoint_corrupt")  # no version was blamed for it


def test_a_run_whose_only_version_is_damaged_starts_exactly_as_a_fresh_one(tmp_path: Path) -> None:
    """Trying a damaged version must leave no trace: planning its load initialises the optimizer
    (DCP's zero-gradient step makes Adam's step count 1), which would shift every later update."""
    # Prepare: a run's only version (step 5) has a damaged object; an undisturbed reference
    cfg = _cfg(every_steps=5)
    cfg.train.steps = 5
    _fit(cfg, tmp_path / "run")
    store = open_store(cfg.store, tmp_path / "run" / "checkpoints")
    corrupt_version(store, store.manifest(LATEST))
    cfg.train.steps = 12
    cfg.checkpoint.every_steps = 0
    ref, _ = _fit(cfg, tmp_path / "ref")
    # Execute: the same command again on the damaged run folder
    resumed, _ = _fit(cfg, tmp_path / "run")
    # Assert: the damaged version was passed over, and training started from scratch bit for bit
    assert _events(tmp_path / "run", "checkpoint_corrupt") and not _events(tmp_path / "run", "resume")
    assert all(torch.equal(a, b) for a, b in zip(_weights(ref), _weights(resumed), strict=True))

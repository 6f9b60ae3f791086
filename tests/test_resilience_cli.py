"""``vatra ckpt`` on a run erasure-coded over six folders: list, show, verify --repair, rollback, gc."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tests.conftest import small_config, vatra_in_process

from vatra.config import dump_toml, load_config
from vatra.engine import Trainer
from vatra.resilience import LATEST, CheckpointPlugin, open_store
from vatra.rundir import RunDir


@pytest.fixture
def run(tmp_path: Path) -> Path:
    torch.set_num_threads(1)
    nodes = [str(tmp_path / f"node{i}") for i in range(6)]
    cfg = small_config(
        train={"steps": 12},
        checkpoint={"every_steps": 4},
        store={"erasure": {"k": 4, "m": 6, "nodes": nodes}},
    )
    rd = RunDir(tmp_path / "run").create()
    rd.config.write_text(dump_toml(cfg))
    Trainer.from_config(cfg, plugins=[CheckpointPlugin(cfg, rd)], run_dir=rd).fit()
    return rd.path


def test_ckpt_commands(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # list and show
    code, out, _ = vatra_in_process(capsys, "ckpt", "list", str(run))
    assert code == 0 and all(f"s00000{s:02d}-a0" in out for s in (4, 8, 12))
    code, out, _ = vatra_in_process(capsys, "ckpt", "show", str(run), "latest")
    manifest = json.loads(out)
    assert manifest["step"] == 12 and "latest" in manifest["current_tags"]
    # m − k = 2 shards of one object lost: still readable, repaired shard by shard
    store = open_store(load_config(run / "config.toml").store, run / "checkpoints")
    key = store.object_key(manifest["files"]["__0_0.distcp"]["sha256"])
    for i in (1, 4):
        (tmp_path / f"node{i}" / key).unlink()
    code, out, _ = vatra_in_process(capsys, "ckpt", "verify", str(run), "--repair")
    assert code == 0 and out.count("repaired:") == 2 and "DAMAGED" not in out
    assert all((tmp_path / f"node{i}" / key).is_file() for i in (1, 4))
    # m − k + 1 lost: verify names the damaged version and exits 1
    for i in (0, 2, 5):
        (tmp_path / f"node{i}" / key).unlink()
    code, out, err = vatra_in_process(capsys, "ckpt", "verify", str(run))
    assert code == 1 and f"{manifest['version']}: DAMAGED" in out and "only 3 of 6 shards intact" in out
    assert err.startswith("error: 1 damaged version(s)")
    # rollback refuses the damaged version, accepts an intact one; gc keeps tagged + newest
    code, _, err = vatra_in_process(capsys, "ckpt", "rollback", str(run), manifest["version"])
    assert code == 1 and "is damaged, not rolling back" in err
    code, out, _ = vatra_in_process(capsys, "ckpt", "rollback", str(run), "s0000004")
    assert code == 0 and store.resolve(LATEST) == "s0000004-a0"
    code, out, _ = vatra_in_process(capsys, "ckpt", "gc", str(run), "--keep", "1")
    assert code == 0 and "deleted 1 version(s)" in out and "s0000008-a0" in out
    # one-line errors
    code, _, err = vatra_in_process(capsys, "ckpt", "show", str(run), "nope")
    assert code == 1 and err.startswith("error: no version or tag 'nope'")
    code, _, err = vatra_in_process(capsys, "ckpt", "list", str(tmp_path))
    assert code == 2 and "not a run folder" in err

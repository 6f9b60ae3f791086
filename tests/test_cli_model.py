"""``vatra model``: list, show, diff, promote, rollback and history on a registry folder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tests.conftest import small_config, vatra_in_process
from tests.test_serve_registry import model_folder

from vatra.serve.registry import Registry


def _two_versions(tmp_path: Path) -> tuple[Registry, str, str]:
    reg = Registry(tmp_path / "models", cache_dir=tmp_path / "cache")
    base = {
        "config": {"optim": {"lr": 0.1}, "train": {"steps": 5}},
        "data": {"table": "s3://t", "version": 3},
    }
    a = reg.register(
        model_folder(tmp_path, b"a" * 100, "a"), "churn", {**base, "metrics": {"val_accuracy": 0.8}}
    )
    b = reg.register(
        model_folder(tmp_path, b"b" * 100, "b"),
        "churn",
        {
            "config": {"optim": {"lr": 0.05}, "train": {"steps": 5}},
            "data": {"table": "s3://t", "version": 4},
            "metrics": {"val_accuracy": 0.85},
            "signature": {"inputs": ["x"]},
        },
    )
    return reg, a.id, b.id


def test_list_show_and_diff(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # Prepare
    _, a, b = _two_versions(tmp_path)
    where = ("--registry", str(tmp_path / "models"))
    # Execute
    code_models, models, _ = vatra_in_process(capsys, "model", "list", *where)
    code_list, versions, _ = vatra_in_process(capsys, "model", "list", "churn", *where)
    code_show, shown, _ = vatra_in_process(capsys, "model", "show", f"churn@{a[:6]}", *where)
    code_json, raw, _ = vatra_in_process(capsys, "model", "show", "churn", "--json", *where)
    code_diff, diff, _ = vatra_in_process(capsys, "model", "diff", f"churn@{a[:8]}", f"churn@{b[:8]}", *where)
    empty = vatra_in_process(capsys, "model", "list", "--registry", str(tmp_path / "none"))
    unknown = vatra_in_process(capsys, "model", "list", "other", *where)
    # Assert
    assert [code_models, code_list, code_show, code_json, code_diff] == [0] * 5
    assert "churn" in models and b[:12] in models
    assert (
        a[:12] in versions
        and b[:12] in versions
        and "s3://t@v3" in versions
        and "val_accuracy=0.8" in versions
    )
    assert f"id {a}" in shown and "parent:       -" in shown and "metric:       val_accuracy = 0.8" in shown
    assert json.loads(raw)["version"] == b and json.loads(raw)["parent"] == a
    assert empty[0] == 0 and empty[1].startswith("no models in")
    assert unknown[0] == 2 and "no model 'other'" in unknown[2] and "(models: churn)" in unknown[2]
    lines = {" ".join(line.replace("│", " ").split()) for line in diff.splitlines()}
    assert "config optim.lr 0.1 0.05" in lines
    assert "metrics val_accuracy 0.8 0.85" in lines
    assert "data version 3 4" in lines
    assert "signature inputs - ['x']" in lines
    assert not any("train.steps" in line for line in lines)  # equal keys are not listed


def test_promote_rollback_and_history(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # Prepare
    reg, a, b = _two_versions(tmp_path)
    where = ("--registry", str(tmp_path / "models"))
    # Execute
    first = vatra_in_process(
        capsys, "model", "promote", f"churn@{a[:8]}", "--alias", "champion", "--reason", "r1", *where
    )
    second = vatra_in_process(
        capsys,
        "model",
        "promote",
        f"churn@{b[:8]}",
        "--alias",
        "champion",
        "--reason",
        "won the A/B test",
        "--evidence",
        '{"p_value": 0.01}',
        *where,
    )
    back = vatra_in_process(
        capsys, "model", "rollback", "churn", "--alias", "champion", "--reason", "p95 up", *where
    )
    code, history, _ = vatra_in_process(capsys, "model", "history", "churn", *where)
    bad = vatra_in_process(
        capsys, "model", "promote", "churn@zzzz", "--alias", "champion", "--reason", "x", *where
    )
    bad_evidence = vatra_in_process(
        capsys,
        "model",
        "promote",
        f"churn@{a[:8]}",
        "--alias",
        "c",
        "--reason",
        "x",
        "--evidence",
        "[1",
        *where,
    )
    # Assert
    assert [first[0], second[0], back[0], code] == [0, 0, 0, 0]
    assert f"champion: {b[:12]} -> {a[:12]} (p95 up)" in back[1]
    assert reg.aliases("churn") == {"champion": a}
    assert history.count("champion") == 3 and "won the A/B test" in history and "p_value" in history
    for result in (bad, bad_evidence):
        assert result[0] == 2 and result[2].startswith("error: ") and result[2].count("\n") == 1


def test_register_a_run_twice_gives_one_version_with_its_lineage(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Prepare: a trained run
    import vatra

    run = vatra.fit(small_config(monitor={"enabled": False}), run_dir=tmp_path / "run").run_dir
    where = ("--registry", str(tmp_path / "models"))
    # Execute
    first = vatra_in_process(capsys, "model", "register", str(run), "--name", "digits", *where)
    again = vatra_in_process(capsys, "model", "register", str(run), "--name", "digits", *where)
    not_a_run = vatra_in_process(capsys, "model", "register", str(tmp_path), "--name", "digits", *where)
    # Assert: one version, whose lineage is the run's, and whose folder loads as a model
    reg = Registry(tmp_path / "models", cache_dir=tmp_path / "cache")
    (mv,) = reg.versions("digits")
    assert first[0] == again[0] == 0
    assert first[1].startswith(f"registered {mv.ref}") and again[1].startswith(f"already registered {mv.ref}")
    assert mv.meta["run"] == "run" and mv.meta["config"]["optim"]["lr"] == 0.1
    assert set(mv.meta["metrics"]) >= {"final_loss", "val_accuracy"} and mv.meta["signature"]
    assert {"vatra-model.json", "model.safetensors"} <= set(mv.files)
    rows = np.arange(3 * 64).reshape(3, 64) % 17
    assert vatra.load(reg.resolve("digits@latest")).predict(rows).equals(vatra.load(run).predict(rows))
    assert not_a_run[0] == 2 and "not a run folder" in not_a_run[2]


def test_signed_registry_from_the_command_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: a version registered signed, with the key named by the environment
    monkeypatch.setenv("VATRA_TEST_REGISTRY_KEY", "s3cret-key")
    reg = Registry(tmp_path / "models", hmac_key=b"s3cret-key", cache_dir=tmp_path / "cache")
    mv = reg.register(model_folder(tmp_path, b"w" * 64), "m", {"metrics": {"val_accuracy": 0.5}})
    where = ("--registry", str(tmp_path / "models"), "--hmac-key-env", "VATRA_TEST_REGISTRY_KEY")
    record = tmp_path / f"models/models/m/versions/{mv.id}.json"
    # Execute
    ok = vatra_in_process(capsys, "model", "show", "m", *where)
    record.write_text(record.read_text().replace("0.5", "0.9"))
    tampered = vatra_in_process(capsys, "model", "show", "m", *where)
    monkeypatch.delenv("VATRA_TEST_REGISTRY_KEY")
    no_key = vatra_in_process(capsys, "model", "list", *where)
    # Assert
    assert ok[0] == 0 and mv.id in ok[1]
    assert tampered[0] == 1 and "signature does not match" in tampered[2] and tampered[2].count("\n") == 1
    assert no_key[0] == 2 and "VATRA_TEST_REGISTRY_KEY is not set" in no_key[2]
    assert "s3cret" not in ok[1] + tampered[2] + no_key[2]

"""``vatra model``: list, show, diff, promote, rollback and history on a registry folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.conftest import vatra_in_process
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

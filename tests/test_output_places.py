"""Files go where the user expects: drift pages beside their table, federated keys never into git."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from tests._dist import ROOT
from tests.conftest import vatra_in_process


def _git(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30)


def test_drift_page_goes_beside_the_table_not_into_the_current_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: a table in data/, the user's shell in another folder
    pytest.importorskip("deltalake")
    pytest.importorskip("pandera")
    data, elsewhere = tmp_path / "data", tmp_path / "elsewhere"
    data.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    jan, mar = data / "jan.csv", data / "mar.csv"
    jan.write_text("temp,load\n" + "".join(f"{20 + i % 7},{i % 11}\n" for i in range(60)))
    mar.write_text("temp,load\n" + "".join(f"{(20 + i % 7) * 9 / 5 + 32},{i % 11}\n" for i in range(60)))
    table = data / "lake"
    assert vatra_in_process(capsys, "data", "ingest", str(jan), "--table", str(table))[0] == 0
    # Execute
    code, out, err = vatra_in_process(
        capsys, "data", "drift", str(table), "--against", "0", "--file", str(mar)
    )
    # Assert: the °F column drifted (exit 1); the page lies in data/, beside lake/; none in the current folder
    assert code == 1, err
    assert (data / "drift-v0-mar.html").is_file()
    assert f"report: {data / 'drift-v0-mar.html'}" in out
    assert list(elsewhere.iterdir()) == []


def test_certs_warn_that_ca_key_is_a_secret_and_git_ignores_the_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: the user's own git repository
    pytest.importorskip("cryptography")
    assert _git(tmp_path, "init", "-q").returncode == 0
    (tmp_path / "train.toml").write_text("")
    # Execute
    code, _, err = vatra_in_process(capsys, "fl", "certs", str(tmp_path / "certs"), "--clients", "2")
    # Assert: one warning naming ca.key as a secret; git sees the user's file, nothing of certs/
    assert code == 0, err
    (warning,) = [line for line in err.splitlines() if "warning" in line]
    assert str(tmp_path / "certs" / "ca.key") in warning and "secret" in warning and "git" in warning
    untracked = _git(tmp_path, "status", "--porcelain", "--untracked-files=all").stdout.split()
    assert untracked == ["??", "train.toml"]


def test_the_projects_gitignore_keeps_key_folders_out_of_git() -> None:
    # Prepare
    if _git(ROOT, "rev-parse", "--git-dir").returncode != 0:
        pytest.skip("not a git checkout")
    paths = ["certs/ca.key", "certs/clients/0.token", "deploy/fl/server.key", "site3/clients/3.token"]
    # Execute
    ignored = _git(ROOT, "check-ignore", "--no-index", *paths).stdout.split()
    # Assert
    assert ignored == paths


def test_readme_drift_example_names_the_unit_change_the_data_makes() -> None:
    # examples/delta/make_data.py turns acme's March temperatures from °C into °F
    made = (ROOT / "examples" / "delta" / "make_data.py").read_text(encoding="utf-8")
    assert "temp * 9 / 5 + 32" in made
    (line,) = [x for x in (ROOT / "README.md").read_text(encoding="utf-8").splitlines() if "data drift" in x]
    assert "°C→°F" in line, line

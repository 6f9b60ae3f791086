"""Storage passwords: ``redact`` hides them in every URL form, ``split_password`` takes them out of the
URL as SQLAlchemy would read them, and a study passes them to its workers only in the environment.
(test_tune_postgres plays the attacker against a real server.)"""

from __future__ import annotations

import random
import string
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from tests._tune_helpers import write_config

from vatra.cli import main
from vatra.config import dump_toml, load_config
from vatra.errors import ConfigError
from vatra.tune._secret import redact, split_password

pytest.importorskip("optuna")
from sqlalchemy.engine import make_url  # optuna depends on it

HOST = "db.example:5432"
SCHEMES = ["postgresql", "postgres", "postgresql+psycopg", "postgresql+psycopg2", "mysql+pymysql"]
# what a password may hold written raw in user:password@ (an "@" included: the last one ends it)
RAW_SAFE = string.ascii_letters + string.digits + "@:/?!$'()*+,;=-._~[]"


def passwords(n: int, alphabet: str) -> list[str]:
    """``n`` passwords around a token no URL otherwise holds (any leak shows the token)."""
    rng = random.Random(n + len(alphabet))
    return [
        "".join(rng.choices(alphabet, k=rng.randint(0, 6)))
        + f"TOK{i:03d}X"
        + "".join(rng.choices(alphabet, k=3))
        for i in range(n)
    ]


def forms(scheme: str, password: str) -> list[str]:
    """Every place a URL (or a libpq key/value string, or a message quoting one) holds a password."""
    enc = quote(password, safe="")
    return [
        f"{scheme}://vatra:{password}@{HOST}/tune",
        f"{scheme}://vatra:{enc}@{HOST}/tune",
        f"{scheme}://:{enc}@{HOST}/tune",
        f"{scheme}://vatra@{HOST}/tune?password={enc}",
        f"{scheme}://vatra@{HOST}/tune?sslmode=require&password={enc}&application_name=a",
        f"{scheme}://vatra@{HOST}/tune?PASSWORD={enc}",
        f"{scheme}://vatra@{HOST}/tune?pass%77ord={enc}",
        f"{scheme}://vatra@{HOST}/tune?sslpassword={enc}",
        f"cannot open {scheme}://vatra:{enc}@{HOST}/tune: FATAL for user x@y",
        f"host=db.example password={enc} dbname=tune",
        f"host=db.example password = '{password}' dbname=tune",
    ]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_redact_hides_the_password_in_every_form(scheme: str) -> None:
    for password in passwords(40, RAW_SAFE) + passwords(40, string.printable.strip()):
        token = password[password.index("TOK") :][:7]
        for text in forms(scheme, password):
            if "'" in password and "'" in text:
                continue  # a quoted key/value string cannot hold an unescaped quote
            shown = redact(text)
            assert token not in shown, (text, shown)
            assert "***" in shown
            if text.startswith(scheme):  # what a log needs stays: where the study is
                assert "db.example" in shown and "/tune" in shown, shown


def test_redact_leaves_a_url_without_a_password_as_it_is() -> None:
    for text in [
        "postgresql://vatra@db.example:5432/tune",
        "postgresql://db.example:5432/tune?application_name=a",
        "/home/me/runs/st/journal.log",
        "sqlite:///runs/st.db",
    ]:
        assert redact(text) == text


@pytest.mark.parametrize("scheme", ["postgresql", "postgres", "postgresql+psycopg2"])
def test_split_password_reads_the_password_as_sqlalchemy_does(scheme: str) -> None:
    for password in passwords(30, string.printable.strip()):
        enc = quote(password, safe="")
        for url in [
            f"{scheme}://vatra:{enc}@{HOST}/tune?sslmode=require",
            f"{scheme}://vatra@{HOST}/tune?sslmode=require&password={enc}",
            f"{scheme}://vatra@{HOST}/tune?pass%77ord={enc}&sslmode=require",
        ]:
            bare, got = split_password(url)
            assert got == password, url
            assert "TOK" not in bare and "password" not in bare
            before, after = make_url(url), make_url(bare)
            assert (after.username, after.host, after.port, after.database) == (
                before.username,
                before.host,
                before.port,
                before.database,
            )
            assert dict(after.query) == {"sslmode": "require"}


@pytest.mark.parametrize(
    ("url", "expect"),
    [
        ("mysql+pymysql://vatra:TOK000X@db/tune", "a secret in this URL"),
        ("postgresql+pg8000://vatra:TOK000X@db/tune", "a secret in this URL"),
        ("postgresql://vatra@db/tune?sslpassword=TOK000X", "a secret in this URL"),
        ("postgresql://vatra:p@TOK000X@db/tune", "write it %40"),
    ],
)
def test_a_password_that_cannot_be_taken_out_is_refused_without_showing_it(url: str, expect: str) -> None:
    with pytest.raises(ConfigError) as err:
        split_password(url)
    assert expect in str(err.value) and "TOK000X" not in str(err.value)


def test_a_study_writes_and_passes_its_storage_without_the_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vatra.tune import study as study_module

    # Prepare: the password in the config file's URL; a worker start is recorded, not run
    password = "s3cr/t@TOK001X"
    url = f"postgresql://vatra:{quote(password, safe='')}@{HOST}/tune"
    cfg = load_config(write_config(tmp_path, {"storage": url}))
    started: list[dict[str, Any]] = []
    monkeypatch.setattr(study_module.subprocess, "Popen", lambda args, env: started.append(locals()))

    # Execute
    run = study_module.Study(cfg, 1)
    run._spawn(0, ["run.progress=off"], 0.0)

    # Assert: the study's config (written to its folder, and so every trial's) and the worker's
    # command line hold the URL without it; the worker's environment holds it, as libpq reads it
    assert run.password == password
    assert "TOK001X" not in dump_toml(run.cfg) and run.cfg.tune.storage == f"postgresql://vatra@{HOST}/tune"
    assert not any("TOK001X" in arg for arg in started[0]["args"])
    assert started[0]["env"]["PGPASSWORD"] == password


def test_a_password_the_storage_cannot_take_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_config(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["tune", str(path), "--storage", "mysql+pymysql://vatra:TOK002X@db/tune"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert "TOK002X" not in err and "PGPASSWORD" in err
    assert not (tmp_path / "runs").exists()

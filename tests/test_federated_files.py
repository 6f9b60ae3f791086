"""Files a federated run leaves on disk: a metrics file cut mid-append, and the modes and overwrite rule of
``vatra fl certs``."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509

from vatra._io import TEMP_MARK
from vatra.cli.app import main
from vatra.errors import ConfigError, VatraError
from vatra.federated.certs import generate
from vatra.rundir import append_jsonl, read_jsonl

PRIVATE = ("ca.key", "server.key", "tokens.json", "clients/0.token", "clients/1.token")


# ------------------------------------------------------------------ metrics.jsonl
def test_a_half_written_last_line_is_skipped_with_a_warning(tmp_path: Path) -> None:
    # Prepare: two rounds, then a crash in the middle of the third append
    path = tmp_path / "metrics.jsonl"
    for rnd in (1, 2):
        append_jsonl(path, {"round": rnd, "global_accuracy": 0.5})
    line = json.dumps({"round": 3, "global_accuracy": 0.7})
    with path.open("a") as f:
        f.write(line[: len(line) // 2])
    # Execute
    with pytest.warns(UserWarning, match="half-written last line"):
        rows = read_jsonl(path)
    # Assert
    assert [r["round"] for r in rows] == [1, 2]


def test_a_complete_last_line_without_newline_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"round": 1}\n{"round": 2}')
    assert [r["round"] for r in read_jsonl(path)] == [1, 2]


@pytest.mark.parametrize("tail", ["\n", '\n{"round": 3}\n'], ids=["last-with-newline", "middle"])
def test_a_damaged_line_that_is_not_a_cut_append_is_an_error(tmp_path: Path, tail: str) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"round": 1}\n{"round": 2, "glo' + tail)
    with pytest.raises(VatraError, match=r"metrics.jsonl, line 2: not valid JSON"):
        read_jsonl(path)


# ------------------------------------------------------------------ certs
@pytest.fixture(params=[0o022, 0o000, 0o277], ids=["umask-022", "umask-000", "umask-277"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_keys_and_tokens_are_0600_in_0700_folders_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    # Prepare: the folder's parent is ours; a permissive umask must not widen, a strict one not narrow
    folder = tmp_path / "certs"
    # Execute
    generate(folder, 2)
    # Assert
    assert _mode(folder) == 0o700 and _mode(folder / "clients") == 0o700
    for name in PRIVATE:
        assert _mode(folder / name) == 0o600, name
    assert not list(folder.rglob(f"*{TEMP_MARK}*"))


def test_private_files_are_created_0600_not_chmodded_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: record the mode every file is opened with and its mode before the first byte lands
    opened: dict[str, int] = {}
    real_open = os.open

    def spy(path: str | os.PathLike[str], flags: int, mode: int = 0o777, **kw: object) -> int:
        fd = real_open(path, flags, mode)
        if flags & os.O_CREAT:
            assert flags & os.O_EXCL, f"{path}: opened without O_EXCL"
            opened[Path(path).name] = stat.S_IMODE(os.fstat(fd).st_mode)
        return fd

    monkeypatch.setattr(os, "open", spy)
    old = os.umask(0)  # the most permissive: the create mode alone decides
    try:
        generate(tmp_path / "certs", 2)
    finally:
        os.umask(old)
    # Assert: every private file existed only as 0600 (its temporary file, renamed over the final name)
    private = {
        n: m for n, m in opened.items() if n.split(TEMP_MARK)[0] in {p.split("/")[-1] for p in PRIVATE}
    }
    assert len(private) == len(PRIVATE)
    assert all(mode == 0o600 for mode in private.values())


def test_certs_refuses_to_overwrite_a_ca_without_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare
    folder = tmp_path / "certs"
    main(["fl", "certs", str(folder), "--clients", "3"])
    ca_before = (folder / "ca.pem").read_bytes()
    capsys.readouterr()
    # Execute
    with pytest.raises(SystemExit) as exit_info:
        main(["fl", "certs", str(folder), "--clients", "3"])
    # Assert: one line, exit code 2, nothing replaced
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--force" in err and err.count("\n") == 1
    assert (folder / "ca.pem").read_bytes() == ca_before
    with pytest.raises(ConfigError, match="already holds a CA"):
        generate(folder, 3)


def test_certs_force_replaces_the_ca_and_drops_old_tokens(tmp_path: Path) -> None:
    # Prepare: a folder with 3 tokens
    folder = tmp_path / "certs"
    generate(folder, 3)
    ca_before, token_before = (folder / "ca.pem").read_bytes(), (folder / "clients" / "0.token").read_text()
    # Execute
    main(["fl", "certs", str(folder), "--clients", "2", "--force", "--host", "fl.example.org"])
    # Assert: a new CA, new tokens, client 2's old token gone, the server name in the certificate
    assert (folder / "ca.pem").read_bytes() != ca_before
    assert (folder / "clients" / "0.token").read_text() != token_before
    assert sorted(p.name for p in (folder / "clients").iterdir()) == ["0.token", "1.token"]
    assert set(json.loads((folder / "tokens.json").read_text())) == {"0", "1"}
    cert = x509.load_pem_x509_certificate((folder / "server.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "fl.example.org" in names.get_values_for_type(x509.DNSName)
    for name in ("ca.key", "server.key", "tokens.json", "clients/0.token"):
        assert _mode(folder / name) == 0o600


def test_an_append_after_a_torn_last_line_cuts_it_off_first(tmp_path: Path) -> None:
    from vatra.rundir import append_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"round": 1}\n{"round": 2, "glo')  # the crash cut round 2's line short
    append_jsonl(path, {"round": 2})  # the resumed run writes round 2 again
    append_jsonl(path, {"round": 3})
    assert [r["round"] for r in read_jsonl(path)] == [1, 2, 3]
    whole = tmp_path / "whole.jsonl"
    whole.write_text('{"round": 1}')  # complete, only its newline missing: kept
    append_jsonl(whole, {"round": 2})
    assert [r["round"] for r in read_jsonl(whole)] == [1, 2]


@pytest.mark.parametrize("damage", ["garbage", "truncated", "other model"])
def test_a_corrupt_server_checkpoint_is_one_clear_error(
    tmp_path: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.conftest import small_config

    from vatra.config import dump_toml
    from vatra.federated.checkpoint import CHECKPOINT, server_state
    from vatra.federated.simulation import simulate
    from vatra.resilience import LATEST, open_store
    from vatra.rundir import RunDir

    cfg = small_config(federated={"clients": 2, "rounds": 1, "local_steps": 1}, monitor={"report": False})
    simulate(cfg, RunDir(tmp_path / "run"), progress=False)
    store = open_store(cfg.store, tmp_path / "run" / "checkpoints")
    entry = store.manifest(LATEST)["files"][CHECKPOINT]
    ckpt = tmp_path / "run" / "checkpoints" / store.object_key(entry["sha256"])
    good = ckpt.read_bytes()
    if damage == "garbage":  # the only version's object: nothing intact to fall back to
        ckpt.write_bytes(b"\x00" * 64)
    elif damage == "truncated":
        ckpt.write_bytes(good[: len(good) // 2])
    else:  # an intact version holding a wider model's state: the config no longer matches it
        wide = cfg.model_copy(update={"model": cfg.model.model_copy(update={"hidden": [7]})})
        simulate(wide, RunDir(tmp_path / "other"), progress=False)
        other = server_state(RunDir(tmp_path / "other"))
        store.write_version({CHECKPOINT: other}, step=1, parent=store.resolve(LATEST), world_size=1)
    more = cfg.model_copy(update={"federated": cfg.federated.model_copy(update={"rounds": 2})})
    (tmp_path / "fl.toml").write_text(dump_toml(more))
    with pytest.raises(SystemExit) as exit_info:
        main(["federate", str(tmp_path / "fl.toml"), "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert exit_info.value.code != 0 and "Traceback" not in err
    assert err.strip().count("\n") == 0 and "server checkpoint" in err and "unreadable" in err

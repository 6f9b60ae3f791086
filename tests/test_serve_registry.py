"""The model registry: content ids, aliases with history, concurrent promotes, tampering, S3."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests._dist import ROOT

from vatra.resilience import StoreError
from vatra.serve.registry import Registry, RegistryError, RegistryUsageError
from vatra.serve.registry._records import canonical

META = {"metrics": {"val_accuracy": 0.9}, "data": {"table": "t", "version": 3}}


def model_folder(root: Path, weights: bytes, name: str = "m") -> Path:
    """A model folder: weights and a small manifest, in a subfolder (nested paths are kept)."""
    folder = root / name
    (folder / "weights").mkdir(parents=True, exist_ok=True)
    (folder / "weights" / "model.bin").write_bytes(weights)
    (folder / "vatra-model.json").write_text(json.dumps({"format": "test"}))
    return folder


def digests(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def registry(tmp_path: Path, **kw: object) -> Registry:
    return Registry(tmp_path / "models", cache_dir=tmp_path / "cache", **kw)  # type: ignore[arg-type]


def test_ids_are_content_hashes_and_registering_again_returns_the_same_version(tmp_path: Path) -> None:
    # Prepare
    reg = registry(tmp_path)
    folder = model_folder(tmp_path, b"\x01" * 100)
    # Execute
    first = reg.register(folder, "churn", META)
    again = reg.register(folder, "churn", META)
    other_meta = reg.register(folder, "churn", {**META, "metrics": {"val_accuracy": 0.8}})
    (folder / "weights" / "model.bin").write_bytes(b"\x01" * 99 + b"\x02")
    other_bytes = reg.register(folder, "churn", META)
    # Assert: the id is sha256 over the files' digests and the metadata, recomputed here
    files = {n: d for n, d in digests(model_folder(tmp_path / "x", b"\x01" * 100)).items()}
    assert first.id == hashlib.sha256(canonical({"files": files, "meta": META})).hexdigest()
    assert again == first
    assert len({first.id, other_meta.id, other_bytes.id}) == 3
    assert [v.id for v in reg.versions("churn")] == [first.id, other_meta.id, other_bytes.id]
    assert (first.parent, other_meta.parent, other_bytes.parent) == (None, first.id, other_meta.id)
    assert reg.get("churn").id == other_bytes.id == reg.get("churn@latest").id
    assert reg.get(f"churn@{first.id[:6]}").id == first.id


def test_promote_and_rollback_restore_the_exact_weights(tmp_path: Path) -> None:
    # Prepare: three versions with different weights
    reg = registry(tmp_path)
    versions = [reg.register(model_folder(tmp_path, bytes([i]) * 4096, f"v{i}"), "m", {}) for i in range(3)]
    expected = [digests(tmp_path / f"v{i}") for i in range(3)]
    # Execute / Assert: each promote and rollback serves that version's bytes
    for i, mv in enumerate(versions):
        reg.promote("m", mv.id[:8], "champion", f"round {i}")
        assert digests(reg.resolve("m@champion")) == expected[i]
    back = reg.rollback("m", "champion", "accuracy dropped")
    assert (back.source, back.target) == (versions[2].id, versions[1].id)
    assert digests(reg.resolve("m@champion")) == expected[1]
    reg.rollback("m", "champion", "again")
    assert digests(reg.resolve("m@champion")) == expected[0]
    with pytest.raises(RegistryUsageError, match="no earlier version"):
        reg.rollback("m", "champion", "once more")
    moves = reg.history("m")
    assert [(m.action, m.reason) for m in moves][-2:] == [
        ("rollback", "accuracy dropped"),
        ("rollback", "again"),
    ]
    assert [m.source for m in moves] == [None] + [m.target for m in moves[:-1]]
    assert reg.aliases("m") == {"champion": versions[0].id}


def test_registering_again_restores_a_lost_object(tmp_path: Path) -> None:
    reg = registry(tmp_path)
    folder = model_folder(tmp_path, b"w" * 1000)
    mv = reg.register(folder, "m", {})
    digest = mv.files["weights/model.bin"]["sha256"]
    (tmp_path / "models" / reg.store.object_key(digest)).unlink()
    with pytest.raises(RegistryError, match="missing"):
        reg.resolve("m")
    assert reg.register(folder, "m", {}) == mv
    assert digests(reg.resolve("m")) == digests(folder)


def test_a_damaged_cached_copy_is_fetched_again(tmp_path: Path) -> None:
    reg = registry(tmp_path)
    mv = reg.register(model_folder(tmp_path, b"w" * 1000), "m", {})
    folder = reg.resolve("m")
    (folder / "weights" / "model.bin").write_bytes(b"x" * 1000)
    assert digests(reg.resolve(f"m@{mv.short}")) == digests(tmp_path / "m")


_PROMOTER = """
import sys
from vatra.serve.registry import Registry
reg = Registry(sys.argv[1], cache_dir=sys.argv[2])
ids = sys.argv[4:]
for i in range(int(sys.argv[3])):
    reg.promote("m", ids[i % len(ids)], "champion", f"{sys.argv[2]} move {i}")
"""


@pytest.mark.slow(20)
def test_concurrent_promotes_from_two_processes_lose_no_move(tmp_path: Path) -> None:
    # Prepare
    reg = registry(tmp_path)
    ids = [reg.register(model_folder(tmp_path, bytes([i]) * 64, f"v{i}"), "m", {}).id for i in range(4)]
    n = 25
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    # Execute: two processes, each promoting n times (A: v0/v1, B: v2/v3)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _PROMOTER, str(tmp_path / "models"), str(tmp_path / who), str(n), *pair],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for who, pair in (("a", ids[:2]), ("b", ids[2:]))
    ]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    # Assert: every move is in the history, each names the version it replaced, the alias is the last
    assert [p.returncode for p in procs] == [0, 0], errors
    moves = registry(tmp_path).log.moves("m", "champion")
    assert len(moves) == 2 * n
    assert [m.seq for m in moves] == list(range(2 * n))
    assert [m.source for m in moves] == [None] + [m.target for m in moves[:-1]]
    for who in ("a", "b"):
        assert sorted(
            int(m.reason.split()[-1]) for m in moves if m.reason.startswith(str(tmp_path / who))
        ) == list(range(n))
    assert reg.aliases("m")["champion"] == moves[-1].target


def test_tampered_versions_and_alias_moves_are_refused_when_signing(tmp_path: Path) -> None:
    # Prepare
    reg = registry(tmp_path, hmac_key=b"k" * 32)
    mv = reg.register(model_folder(tmp_path, b"\x07" * 512), "m", META)
    reg.promote("m", mv.id, "champion", "first")
    root = tmp_path / "models"
    record = root / f"models/m/versions/{mv.id}.json"
    obj = (
        root
        / "objects"
        / mv.files["weights/model.bin"]["sha256"][:2]
        / mv.files["weights/model.bin"]["sha256"]
    )
    # Execute / Assert: one changed weights byte
    good = obj.read_bytes()
    obj.write_bytes(b"\x08" + good[1:])
    with pytest.raises(RegistryError, match="checksum mismatch") as err:
        reg.resolve("m@champion")
    assert "\n" not in str(err.value)
    obj.write_bytes(good)
    assert digests(reg.resolve("m@champion")) == digests(tmp_path / "m")
    # edited metadata (a better metric), with the id and signature left as they were
    original = record.read_text()
    record.write_text(original.replace('"val_accuracy": 0.9', '"val_accuracy": 0.99'))
    with pytest.raises(StoreError, match="signature does not match"):
        reg.get("m@champion")
    record.write_text(original)
    # an alias record pointed elsewhere; an unsigned record in a signed registry
    move = root / "models/m/aliases/champion/0000000000.json"
    body = json.loads(move.read_text())
    move.write_text(json.dumps({**body, "reason": "someone else"}))
    with pytest.raises(StoreError, match="signature does not match"):
        reg.history("m")
    body.pop("signature")
    move.write_text(json.dumps(body))
    with pytest.raises(StoreError, match="not signed"):
        reg.history("m")


def test_edited_metadata_is_refused_even_unsigned(tmp_path: Path) -> None:
    reg = registry(tmp_path)
    mv = reg.register(model_folder(tmp_path, b"\x07" * 512), "m", META)
    record = tmp_path / f"models/models/m/versions/{mv.id}.json"
    record.write_text(record.read_text().replace('"version": 3', '"version": 4'))
    with pytest.raises(RegistryError, match="no longer hash to its id"):
        reg.get("m")


def test_bad_names_and_refs_are_one_line_usage_errors(tmp_path: Path) -> None:
    reg = registry(tmp_path)
    folder = model_folder(tmp_path, b"1")
    reg.register(folder, "m", {})
    for call, match in (
        (lambda: reg.register(folder, "../x", {}), "model name"),
        (lambda: reg.register(tmp_path / "none", "m", {}), "not a folder"),
        (lambda: reg.get("m@zz"), "not an alias or a version id prefix"),
        (lambda: reg.get("other"), "no model 'other'"),
        (lambda: reg.promote("m", "m", "latest", "x"), "reserved"),
        (lambda: reg.rollback("m", "champion", "x"), "no such alias"),
    ):
        with pytest.raises(RegistryUsageError, match=match) as err:
            call()
        assert "\n" not in str(err.value)


def test_registry_on_s3(tmp_path: Path, s3_server: dict[str, str]) -> None:
    # Prepare
    reg = Registry("s3://ckpt-bucket/registry", options=s3_server, cache_dir=tmp_path / "cache")
    folder = model_folder(tmp_path, b"\x05" * 2048)
    # Execute
    mv = reg.register(folder, "m", META)
    reg.promote("m", mv.id, "champion", "first on s3")
    # Assert: the conditional PUT refuses a second writer of one history entry
    assert reg.backend.create("models/m/aliases/champion/0000000000.json", b"{}") is False
    assert reg.register(folder, "m", META).id == mv.id
    assert digests(reg.resolve("m@champion")) == digests(folder)
    assert [m.target for m in reg.history("m")] == [mv.id]

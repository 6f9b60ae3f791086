"""The store never deletes what it cannot read, never writes outside its destination, refuses
forged records when signing is on, and writes durably (no temporary file or partial object left)."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.conftest import small_config, small_disk, vatra_in_process

from vatra.config import config_from_dict, dump_toml
from vatra.errors import ConfigError
from vatra.resilience import (
    LAST_GOOD,
    LATEST,
    CheckpointStore,
    FsspecBackend,
    GcAborted,
    StoreError,
    corrupt_version,
    open_store,
    truncate_manifest,
)
from vatra.rundir import RunDir


def _store(root: Path, key: bytes | None = None) -> CheckpointStore:
    return CheckpointStore(FsspecBackend(str(root)), hmac_key=key)


def _versions(store: CheckpointStore, n: int) -> list[str]:
    out = []
    for step in range(1, n + 1):
        files = {"model.bin": os.urandom(256), "rank00000.pt": b"rank state %d" % step}
        out.append(
            store.write_version(files, step=step, parent=out[-1] if out else None, world_size=1)["version"]
        )
        time.sleep(0.01)
    return out


def _objects(root: Path) -> set[str]:
    return {p.name for p in (root / "objects").rglob("*") if p.is_file()}


# ------------------------------------------------------------ unreadable records
def test_gc_keeps_the_data_of_a_truncated_last_good_manifest(tmp_path: Path) -> None:
    # Prepare: last-good on the oldest version, latest on the newest; the last-good manifest cut short
    store = _store(tmp_path / "store")
    old, _, new = _versions(store, 3)
    store.set_tag(LAST_GOOD, old)
    before = _objects(tmp_path / "store")
    truncate_manifest(store, old)
    # Execute / Assert: gc deletes nothing and names the unreadable manifest
    with pytest.raises(GcAborted, match=rf"deleted nothing.*versions/{old}\.json"):
        store.gc(keep=1)
    assert _objects(tmp_path / "store") == before
    assert len(store.backend.keys("versions/")) == 3
    # listing still works around it, and a resume falls back past it
    assert [m["version"] for m in store.versions()] == [_, new]
    assert store.scan().unreadable.keys() == {f"versions/{old}.json"}
    truncate_manifest(store, new)
    skipped: list[str] = []
    got = store.load_verified(tmp_path / "restore", on_bad=lambda v, why: skipped.append(v))
    assert got is not None and got["version"] == _ and skipped == [new]


def test_gc_refuses_an_unreadable_tag_and_a_tag_naming_a_missing_version(tmp_path: Path) -> None:
    store = _store(tmp_path / "store")
    versions = _versions(store, 2)
    (tmp_path / "store" / "tags" / "keep-me").write_bytes(b"\xff\xfe")
    with pytest.raises(GcAborted, match="tags/keep-me"):
        store.gc(keep=1)
    store.set_tag("keep-me", "s0000099-gone")
    with pytest.raises(GcAborted, match="tags/keep-me: points at version s0000099-gone"):
        store.gc(keep=1)
    assert [m["version"] for m in store.versions()] == versions
    with pytest.raises(StoreError, match="tags/keep-me"):
        (tmp_path / "store" / "tags" / "keep-me").write_bytes(b"\xff")
        store.resolve("keep-me")  # an unreadable tag is an error, not "no such tag"


@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, CheckpointStore]:
    """A run folder with a config and three versions written straight to its store (no training)."""
    rd = RunDir(tmp_path / "run").create()
    cfg = small_config()
    rd.config.write_text(dump_toml(cfg))
    store = open_store(cfg.store, rd.checkpoints)
    _versions(store, 3)
    return rd.path, store


def test_verify_reports_unreadable_manifests_and_tags(
    run: tuple[Path, CheckpointStore], capsys: pytest.CaptureFixture[str]
) -> None:
    path, store = run
    first, second, _ = (m["version"] for m in store.versions())
    code, out, _ = vatra_in_process(capsys, "ckpt", "verify", str(path))
    assert code == 0 and "UNREADABLE" not in out
    # Execute: one manifest cut short, one tag naming a version that is gone
    truncate_manifest(store, first)
    store.set_tag("release", "s0000042-gone")
    code, out, err = vatra_in_process(capsys, "ckpt", "verify", str(path))
    # Assert: both named, exit 1, one error line
    assert code == 1
    assert f"UNREADABLE versions/{first}.json: not valid JSON" in out
    assert "UNREADABLE tags/release: points at version s0000042-gone" in out
    assert f"{second}: ok" in out
    assert err.startswith("error: 1 unreadable manifest(s) or tag(s), 1 tag(s) naming a missing version")
    assert err.count("\n") == 1
    code, out, err = vatra_in_process(capsys, "ckpt", "list", str(path))
    assert code == 0 and second in out and "warning: 2 manifest(s) or tag(s) cannot be read" in err
    # gc from the CLI refuses with one line and exit 1; --keep 0 is a usage error (exit 2)
    code, _, err = vatra_in_process(capsys, "ckpt", "gc", str(path), "--keep", "1")
    assert code == 1 and err.startswith("error: gc deleted nothing") and err.count("\n") == 1
    code, _, err = vatra_in_process(capsys, "ckpt", "gc", str(path), "--keep", "0")
    assert code == 2 and "must keep at least 1 version" in err


def test_ckpt_gc_removes_staging_leftovers(
    run: tuple[Path, CheckpointStore], capsys: pytest.CaptureFixture[str]
) -> None:
    path, store = run
    leftover = path / "checkpoints" / ".work" / "s0000009-a0" / "__0_0.distcp"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"half a save")
    stale = path / "checkpoints" / "objects" / "ab" / f"{'ab' * 32}.tmp-1234abcd"
    fresh = stale.with_name(f"{'cd' * 32}.tmp-5678abcd")
    stale.parent.mkdir(parents=True, exist_ok=True)  # a stored object may share the prefix
    stale.write_bytes(b"x")
    fresh.write_bytes(b"y")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    code, out, _ = vatra_in_process(capsys, "ckpt", "gc", str(path), "--keep", "1")
    assert code == 0 and "deleted 2 version(s)" in out and "removed the staging folder" in out
    assert not leftover.parent.parent.exists()
    assert not stale.exists() and fresh.exists()  # a temp file a live writer may still own stays
    assert store.verify(LATEST) == []


# ------------------------------------------------------------------ entry names
@pytest.mark.parametrize("name", ["../evil", "a/../../evil", "/tmp/evil", "a\\..\\evil", "a//b", "./a", ""])
def test_entry_names_outside_the_version_are_refused(tmp_path: Path, name: str) -> None:
    store = _store(tmp_path / "store")
    # on write: as a file and as an entry another rank stored
    with pytest.raises(StoreError, match="names must be relative paths"):
        store.write_version({name: b"x"}, step=1, parent=None, world_size=1)
    digest = store.put_object(b"payload")
    with pytest.raises(StoreError, match="names must be relative paths"):
        store.write_version(
            {}, step=1, parent=None, world_size=1, stored={name: {"sha256": digest, "size": 7}}
        )
    # on read: a manifest written behind the store's back
    good = store.write_version({"ok": b"payload"}, step=2, parent=None, world_size=1)
    forged = {**good, "files": {name: {"sha256": digest, "size": 7}}}
    (tmp_path / "store" / "versions" / f"{good['version']}.json").write_text(json.dumps(forged))
    dest = tmp_path / "deep" / "dest"
    with pytest.raises(StoreError, match=re.escape(f"file {name!r}")):
        store.materialize(LATEST, dest)
    assert not (tmp_path / "deep" / "evil").exists() and not (tmp_path / "evil").exists()
    assert store.scan().unreadable  # and gc would refuse it
    # fetch of a manifest held in memory is checked the same way
    with pytest.raises(StoreError, match="names must be relative paths"):
        store.fetch(forged, [name], dest)


def test_fetch_writes_only_the_named_files_and_stored_entries_join_the_manifest(tmp_path: Path) -> None:
    store = _store(tmp_path / "store")
    shard = tmp_path / "rank1.distcp"
    shard.write_bytes(b"rank 1 shard")
    digest, size = store.put_file(shard)  # "another rank" uploads its own file
    manifest = store.write_version(
        {"meta.bin": b"meta"},
        step=3,
        parent=None,
        world_size=2,
        stored={"r1/shard": {"sha256": digest, "size": size}},
    )
    assert set(manifest["files"]) == {"meta.bin", "r1/shard"}
    store.fetch(LATEST, ["r1/shard"], tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").rglob("*") if p.is_file()] == ["shard"]
    assert (tmp_path / "out" / "r1" / "shard").read_bytes() == b"rank 1 shard"
    with pytest.raises(StoreError, match="has no file 'nope'"):
        store.fetch(LATEST, ["nope"], tmp_path / "out")
    with pytest.raises(StoreError, match="is not in the store"):
        store.write_version(
            {}, step=4, parent=None, world_size=1, stored={"x": {"sha256": "0" * 64, "size": 1}}
        )


# ------------------------------------------------------------------ signatures
def test_signed_store_refuses_tampered_and_unsigned_records(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = _store(root, b"secret key")
    first, second = _versions(store, 2)
    assert store.manifest(LATEST)["version"] == second and store.verify(second) == []
    # a tampered manifest (one field changed, the signature kept) is refused on read
    path = root / "versions" / f"{second}.json"
    record = json.loads(path.read_text())
    record["step"] = 99
    path.write_text(json.dumps(record))
    with pytest.raises(StoreError, match=rf"versions/{second}\.json: signature does not match"):
        store.manifest(second)
    # ... so a resume falls back to the intact, signed parent, and gc deletes nothing
    got = store.load_verified(tmp_path / "restore")
    assert got is not None and got["version"] == first
    with pytest.raises(GcAborted, match="signature does not match"):
        store.gc(keep=1)
    # an unsigned manifest and an unsigned tag (written by a store without the key) are refused
    unsigned = _store(root).write_version({"m": b"forged"}, step=5, parent=None, world_size=1)
    with pytest.raises(StoreError, match="tags/latest: not signed"):
        store.resolve(LATEST)
    store.set_tag(LATEST, first)
    with pytest.raises(StoreError, match=rf"versions/{unsigned['version']}\.json: not signed"):
        store.manifest(unsigned["version"])
    # a tag copied from another tag's file does not verify: the signature binds the tag's name
    (root / "tags" / LAST_GOOD).write_bytes((root / "tags" / LATEST).read_bytes())
    with pytest.raises(StoreError, match="tags/last-good: signature does not match"):
        store.resolve(LAST_GOOD)
    # another key does not verify either
    with pytest.raises(StoreError, match="signature does not match"):
        _store(root, b"other key").manifest(first)


def test_hmac_key_env_opens_a_signing_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config_from_dict({"store": {"hmac_key_env": "VATRA_TEST_STORE_KEY"}}).store
    monkeypatch.delenv("VATRA_TEST_STORE_KEY", raising=False)
    with pytest.raises(
        ConfigError, match=r"store\.hmac_key_env: the environment variable VATRA_TEST_STORE_KEY"
    ):
        open_store(cfg, tmp_path)
    monkeypatch.setenv("VATRA_TEST_STORE_KEY", "k3y")
    store = open_store(cfg, tmp_path)
    store.write_version({"a": b"1"}, step=1, parent=None, world_size=1)
    assert _store(tmp_path, b"k3y").manifest(LATEST)["step"] == 1
    with pytest.raises(ConfigError, match="not an environment variable name"):
        config_from_dict({"store": {"hmac_key_env": "my secret"}})


# -------------------------------------------------------------- durable writes
def test_local_writes_fsync_the_file_and_its_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    backend = FsspecBackend(str(tmp_path / "store"))
    backend.put("tags/latest", b"v1")
    src = tmp_path / "shard.bin"
    src.write_bytes(b"shard")
    backend.put_file("objects/ab/abc", src)
    store = str(tmp_path / "store")
    assert any(p.startswith(f"{store}/tags/latest.tmp-") for p in synced)  # the bytes, before the rename
    assert f"{store}/tags" in synced and f"{store}/objects/ab" in synced  # the renames
    assert str(src) in synced and store in synced  # put_file's source; a new folder's entry


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: a real full disk for the backend alone (root only)."""
    with small_disk(tmp_path / "tiny", "1m") as path:
        yield path


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_a_full_disk_leaves_no_temporary_file_and_no_partial_object(tiny_fs: Path, tmp_path: Path) -> None:
    # Prepare: a store on the tiny filesystem, one version that fits
    store = _store(tiny_fs / "store")
    store.write_version({"small": b"s" * 1000}, step=1, parent=None, world_size=1)
    before = _files(tiny_fs)
    # Execute / Assert: bytes too large fail with one line naming the store; nothing is left behind
    with pytest.raises(StoreError, match=f"no space left on the device holding {tiny_fs}/store") as err:
        store.put_object(os.urandom(2 << 20))
    assert "\n" not in str(err.value)
    assert _files(tiny_fs) == before
    # a local file from another filesystem (disk → tmpfs: copied, not renamed) that does not fit
    big = tmp_path / "big.distcp"
    big.write_bytes(os.urandom(2 << 20))
    with pytest.raises(StoreError, match="no space left"):
        store.put_file(big)
    assert _files(tiny_fs) == before and big.is_file()  # the source is kept for a retry
    # one that fits crosses filesystems through a temporary name and is consumed
    ok = tmp_path / "ok.distcp"
    ok.write_bytes(b"fits")
    digest, _ = store.put_file(ok)
    assert store.get_object(digest) == b"fits" and not ok.exists()
    assert not [f for f in _files(tiny_fs) if ".tmp-" in f]
    assert store.manifest(LATEST)["step"] == 1 and store.verify(LATEST) == []


def test_a_damaged_version_takes_no_place_among_those_gc_keeps(tmp_path: Path) -> None:
    """A resume that fell back past a damaged version tells gc so: keeping the N newest must not
    count it, or an intact older version is deleted while fewer than N intact ones are left."""
    store = CheckpointStore(FsspecBackend(str(tmp_path / "store")))
    for step in (1, 2, 3, 4):
        store.write_version({"f": f"state {step}".encode()}, step=step, parent=None, world_size=1,
                            version=f"v{step}")  # fmt: skip
    deleted, _ = store.gc(2, damaged={"v4"})
    assert deleted == ["v1"]
    assert [m["version"] for m in store.versions()] == ["v2", "v3", "v4"]  # v4 kept as evidence


def test_saving_bytes_identical_to_a_damaged_object_rewrites_and_heals_it(tmp_path: Path) -> None:
    """A resumed run replays its steps and saves bit-identical state: the store must not skip the
    write because a (damaged) object with that address exists, or the new version is damaged too."""
    store = CheckpointStore(FsspecBackend(str(tmp_path / "store")))
    old = store.write_version({"model": b"weights at step 225"}, step=225, parent=None, world_size=1)
    corrupt_version(store, old)
    assert store.verify(old["version"])
    new = store.write_version({"model": b"weights at step 225"}, step=225, parent=None, world_size=1)
    assert store.verify(new["version"]) == [] and store.verify(old["version"]) == []

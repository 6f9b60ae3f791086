"""The model registry: immutable, content-addressed versions of model folders, on a store backend.

Layout under the registry's location (a local folder or ``s3://bucket/prefix``)::

    objects/<sha[:2]>/<sha256>                  file contents (the checkpoint store's objects)
    models/<name>/versions/<id>.json            a version: files, lineage, parent, who and when
    models/<name>/aliases/<alias>/<seq>.json    an alias's append-only history (aliases.py)

Objects are written before the version record that names them, so a register that dies half-way
leaves unreferenced objects, never half a version. Every read checks: objects by sha256, version
records by their content id (and signature with a key), alias records by signature.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from vatra.resilience._base import MissingKey, StoreError
from vatra.resilience.fsspec_backend import FsspecBackend
from vatra.resilience.manifest import check_name, decode_record, encode_record
from vatra.resilience.store import CheckpointStore, sha256
from vatra.serve.registry._records import (
    LATEST,
    MIN_PREFIX,
    VERSION_KIND,
    AliasMove,
    ModelVersion,
    RegistryError,
    RegistryUsageError,
    canonical,
    check_alias,
    check_model_name,
    content_id,
    parse_ref,
)
from vatra.serve.registry.aliases import AliasLog, current_user

REGISTRY_ENV = "VATRA_REGISTRY"
KEY_ENV = "VATRA_REGISTRY_HMAC_KEY_ENV"  # names the variable holding the key (never the key itself)
CACHE_ENV = "VATRA_CACHE_DIR"
STREAM_ABOVE = 64 << 20  # files larger than this are copied and streamed into the store, not read whole


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def default_uri() -> str:
    """``$VATRA_REGISTRY``, else ``./models``."""
    return os.environ.get(REGISTRY_ENV) or "models"


def key_from_env(var: str | None = None) -> bytes | None:
    """The signing key held by the variable ``var`` names (default: ``$VATRA_REGISTRY_HMAC_KEY_ENV``),
    like ``store.hmac_key_env``; None when no variable is named."""
    var = var if var is not None else os.environ.get(KEY_ENV, "")
    if not var:
        return None
    value = os.environ.get(var, "")
    if not value:
        raise RegistryUsageError(
            f"registry signing: the environment variable {var} is not set or empty; export the key, or "
            f"unset {KEY_ENV} to use the registry unsigned"
        )
    return value.encode()


class Registry:
    """Versions and aliases of named models at ``uri`` (a folder, or an fsspec URL such as ``s3://``).

    ``options``: the filesystem's options (``endpoint_url``, ...; S3 also reads the AWS_*
    environment). ``hmac_key``: every record is signed when written and refused unsigned or
    tampered when read. ``cache_dir``: where :meth:`resolve` materializes versions
    (default ``$VATRA_CACHE_DIR``, else ``~/.cache/vatra/models``). Safe to use from many
    processes at once: versions are content-addressed and alias moves never overwrite each other.
    """

    def __init__(
        self,
        uri: str | Path | None = None,
        *,
        options: dict[str, Any] | None = None,
        hmac_key: bytes | None = None,
        cache_dir: str | Path | None = None,
    ) -> None:
        location = str(uri if uri is not None else default_uri())
        if "://" not in location:
            location = str(Path(location).expanduser().resolve())
        self.uri = location
        self.backend = FsspecBackend(location, options)
        self.store = CheckpointStore(self.backend, hmac_key=hmac_key)
        self.key = hmac_key
        self.log = AliasLog(self.backend, hmac_key)
        cache = cache_dir or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "vatra" / "models"
        self.cache = Path(cache) / sha256(location.encode())[:12]

    # ----------------------------------------------------------------- versions
    @staticmethod
    def _version_key(name: str, version: str) -> str:
        return f"models/{name}/versions/{version}.json"

    def register(self, folder: str | Path, name: str, meta: dict[str, Any] | None = None) -> ModelVersion:
        """Store every file under ``folder`` as a version of ``name``; an identical folder with
        identical ``meta`` returns the version already stored (same id), untouched."""
        check_model_name(name)
        root = Path(folder)
        if not root.is_dir():
            raise RegistryUsageError(
                f"{folder}: not a folder; register a model folder (vatra export writes one)"
            )
        meta = dict(meta or {})
        try:
            canonical(meta)
        except (TypeError, ValueError) as err:
            raise RegistryUsageError(f"model metadata is not JSON: {err}") from None
        paths = sorted(p for p in root.rglob("*") if p.is_file())
        if not paths:
            raise RegistryUsageError(f"{folder}: no files to register")
        local = {check_name(p.relative_to(root).as_posix(), f"{folder}: file"): p for p in paths}
        files: dict[str, dict[str, Any]] = {
            rel: {"sha256": _file_sha256(p), "size": p.stat().st_size} for rel, p in local.items()
        }
        version = content_id(files, meta)
        existing = self._find(name, version)
        stored = existing is not None  # the same content: only objects missing from the store are uploaded
        for rel, path in local.items():
            if stored and self.backend.exists(self.store.object_key(files[rel]["sha256"])):
                continue
            if self._put(path) != files[rel]:
                raise RegistryUsageError(f"{folder}: {rel} changed while it was being registered; try again")
        if existing is not None:
            return existing
        newest = self.versions(name)
        mv = ModelVersion(
            name, version, files, meta, newest[-1].id if newest else None, current_user(), time.time()
        )
        self.backend.put(self._version_key(name, version), encode_record(mv.record(), VERSION_KIND, self.key))
        return mv

    def _put(self, path: Path) -> dict[str, Any]:
        size = path.stat().st_size
        if size <= STREAM_ABOVE:
            return {"sha256": self.store.put_object(path.read_bytes()), "size": size}
        with tempfile.TemporaryDirectory() as tmp:  # put_file may move its file: give it a copy
            copy = Path(tmp) / path.name
            shutil.copyfile(path, copy)
            digest, size = self.store.put_file(copy)
        return {"sha256": digest, "size": size}

    def _find(self, name: str, version: str) -> ModelVersion | None:
        key = self._version_key(name, version)
        try:
            raw = self.backend.get(key)
        except MissingKey:
            return None
        return ModelVersion.from_record(decode_record(raw, VERSION_KIND, key, self.key), name, version, key)

    def names(self) -> list[str]:
        return sorted({k.split("/")[1] for k in self.backend.keys("models/") if "/versions/" in k})

    def versions(self, name: str) -> list[ModelVersion]:
        """Every version of ``name``, oldest first; a damaged or tampered record raises, naming it."""
        prefix = f"models/{check_model_name(name)}/versions/"
        out = []
        for key in self.backend.keys(prefix):
            version = key.removeprefix(prefix).removesuffix(".json")
            raw = self.backend.get(key)
            out.append(
                ModelVersion.from_record(decode_record(raw, VERSION_KIND, key, self.key), name, version, key)
            )
        return sorted(out, key=lambda v: v.time)

    def get(self, ref: str) -> ModelVersion:
        """The version ``NAME@alias``, ``NAME@<id prefix>``, ``NAME@latest`` or ``NAME`` (newest) names."""
        name, what = parse_ref(ref)
        if what not in (None, LATEST) and what in self.log.aliases(name):
            target = self.log.current(name, what)
            found = self._find(name, target) if target else None
            if found is None:
                raise RegistryError(f"{ref}: the alias names version {target}, which is not in {self.uri}")
            return found
        versions = self.versions(name)
        if not versions:
            known = ", ".join(self.names()) or "none"
            raise RegistryUsageError(f"{ref}: no model {name!r} in {self.uri} (models: {known})")
        if what in (None, LATEST):
            return versions[-1]
        hits = [v for v in versions if v.id.startswith(what.lower())] if len(what) >= MIN_PREFIX else []
        if len(hits) != 1:
            why = "matches several versions" if hits else "is not an alias or a version id prefix"
            aliases = ", ".join(self.log.aliases(name)) or "none"
            raise RegistryUsageError(
                f"{ref}: {what!r} {why} of {name} (aliases: {aliases}; give at least {MIN_PREFIX} "
                "characters of an id from 'vatra model list')"
            )
        return hits[0]

    def resolve(self, ref: str) -> Path:
        """A local folder holding the version's files, checked against its sha256 entries; the
        cached copy is reused while every file still matches, else fetched again from the store."""
        mv = self.get(ref)
        dest = self.cache / mv.name / mv.id
        if dest.is_dir() and self._intact(dest, mv):
            return dest
        staging = dest.with_name(f"{mv.id}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            self.store.fetch({"version": mv.ref, "files": mv.files}, list(mv.files), staging)
        except StoreError as err:
            shutil.rmtree(staging, ignore_errors=True)
            raise RegistryError(f"{mv.ref}: {err}; this version is refused") from None
        if dest.is_dir():  # a damaged copy: moved aside first, so the rename below cannot merge into it
            old = dest.with_name(f"{mv.id}.tmp-{uuid.uuid4().hex[:8]}")
            os.replace(dest, old)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(staging, dest)
        except OSError:  # another process put its copy there first: use it, if intact
            shutil.rmtree(staging, ignore_errors=True)
            if not (dest.is_dir() and self._intact(dest, mv)):
                raise RegistryError(f"{mv.ref}: cannot place the version in the cache at {dest}") from None
        return dest

    @staticmethod
    def _intact(folder: Path, mv: ModelVersion) -> bool:
        present = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
        if present != set(mv.files):
            return False
        return all(_file_sha256(folder / n) == e["sha256"] for n, e in mv.files.items())

    # ------------------------------------------------------------------ aliases
    def aliases(self, name: str) -> dict[str, str]:
        """alias → the version id it names now."""
        out = {}
        for alias in self.log.aliases(check_model_name(name)):
            target = self.log.current(name, alias)
            if target is not None:
                out[alias] = target
        return out

    def promote(
        self, name: str, version: str, alias: str, reason: str, evidence: dict[str, Any] | None = None
    ) -> AliasMove:
        """Point ``alias`` at ``version`` (an id, prefix, alias or ``NAME@...`` ref), appending the move."""
        check_alias(alias)
        mv = self.get(version if "@" in version else f"{name}@{version}")
        if mv.name != name:
            raise RegistryUsageError(f"{version}: a version of {mv.name}, not of {name}")
        return self.log.promote(name, alias, mv.id, reason, evidence)

    def rollback(
        self, name: str, alias: str, reason: str, evidence: dict[str, Any] | None = None
    ) -> AliasMove:
        """Move ``alias`` one step back in its history (undoing the last promote not yet undone)."""
        check_model_name(name)
        if alias not in self.log.aliases(name):
            raise RegistryUsageError(
                f"{name}@{alias}: no such alias (aliases: {', '.join(self.aliases(name)) or 'none'})"
            )
        move = self.log.rollback(name, alias, reason, evidence)
        if self._find(name, move.target) is None:
            raise RegistryError(
                f"{name}@{alias}: rolled back to {move.target[:12]}, which is not in {self.uri}"
            )
        return move

    def history(self, name: str) -> list[AliasMove]:
        """Every alias move of ``name``, oldest first."""
        return self.log.history(check_model_name(name))

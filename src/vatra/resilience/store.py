"""The versioned checkpoint store: content-addressed objects, one manifest per version, movable tags.

Layout under the backend's root::

    objects/<sha[:2]>/<sha256>     file contents, addressed by their sha256 (identical files stored once)
    versions/<version>.json        manifest: version, parent, step, time, world_size, metrics, files
    tags/<name>                    the version a tag points at (``latest``, ``last-good``, ...)

A version becomes visible only when its manifest is written, after all its objects: a save that
dies half-way leaves unreferenced objects (removed by ``gc``), never a half version. Every read
checks sha256, so a damaged object is detected, never loaded.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vatra.registry import STORE_BACKENDS
from vatra.resilience._base import StoreBackend, StoreError

if TYPE_CHECKING:
    from vatra.config import StoreConfig

LATEST, LAST_GOOD = "latest", "last-good"
Manifest = dict[str, Any]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def new_version_id(step: int) -> str:
    """``s<step>-<random>``: readable, unique even when a rolled-back run saves the same step again."""
    return f"s{step:07d}-{uuid.uuid4().hex[:6]}"


class CheckpointStore:
    """Versions of a run's training state on one :class:`StoreBackend`."""

    def __init__(self, backend: StoreBackend) -> None:
        self.backend = backend

    # ---------------------------------------------------------------- objects
    @staticmethod
    def object_key(digest: str) -> str:
        return f"objects/{digest[:2]}/{digest}"

    def put_object(self, data: bytes) -> str:
        digest = sha256(data)
        key = self.object_key(digest)
        if not self.backend.exists(key):
            self.backend.put(key, data)
        return digest

    def put_file(self, path: Path) -> tuple[str, int]:
        """Store a local file as an object (moved into a local store, uploaded otherwise): (sha256, size)."""
        h = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
        digest, size = h.hexdigest(), path.stat().st_size
        key = self.object_key(digest)
        if not self.backend.exists(key):
            self.backend.put_file(key, path)
        return digest, size

    def get_object(self, digest: str) -> bytes:
        data = self.backend.get(self.object_key(digest))
        if sha256(data) != digest:
            raise StoreError(f"object {digest[:12]}: checksum mismatch (corrupt)")
        return data

    # -------------------------------------------------------------- versions
    def write_version(
        self,
        files: dict[str, bytes | Path],
        *,
        step: int,
        parent: str | None,
        world_size: int,
        metrics: dict[str, Any] | None = None,
        tags: tuple[str, ...] = (),
        version: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Manifest:
        """Store ``files`` (name → bytes or local path) as a version; move ``tags`` and ``latest`` to it."""
        entries: dict[str, dict[str, Any]] = {}
        for name, data in files.items():
            if isinstance(data, Path):
                digest, size = self.put_file(data)
            else:
                digest, size = self.put_object(data), len(data)
            entries[name] = {"sha256": digest, "size": size}
        manifest: Manifest = {
            "version": version or new_version_id(step),
            "parent": parent,
            "step": step,
            "time": time.time(),
            "world_size": world_size,
            "metrics": metrics or {},
            "tags": sorted({LATEST, *tags}),
            "files": entries,
            **(extra or {}),
        }
        self.backend.put(f"versions/{manifest['version']}.json", json.dumps(manifest, indent=1).encode())
        for tag in manifest["tags"]:
            self.set_tag(tag, manifest["version"])
        return manifest

    def versions(self) -> list[Manifest]:
        """Every readable manifest, oldest first (by save time)."""
        out = []
        for key in self.backend.keys("versions/"):
            if key.endswith(".json"):
                try:
                    out.append(json.loads(self.backend.get(key)))
                except (StoreError, ValueError):
                    continue  # an unreadable manifest is no version; verify reports it
        return sorted(out, key=lambda m: (m["time"], m["step"]))

    def tags(self) -> dict[str, str]:
        out = {}
        for key in self.backend.keys("tags/"):
            try:
                out[key.removeprefix("tags/")] = self.backend.get(key).decode().strip()
            except StoreError:
                continue
        return out

    def set_tag(self, tag: str, version: str) -> None:
        self.backend.put(f"tags/{tag}", version.encode())

    def resolve(self, ref: str) -> str:
        """A version id from an id, a tag or a unique id prefix."""
        tags = self.tags()
        if ref in tags:
            return tags[ref]
        ids = [m["version"] for m in self.versions()]
        if ref in ids:
            return ref
        hits = [v for v in ids if v.startswith(ref)]
        if len(hits) == 1:
            return hits[0]
        known = ", ".join([*sorted(tags), *ids[-5:]]) or "none (the store is empty)"
        raise StoreError(f"no version or tag {ref!r} in {self.backend.describe()}; known: {known}")

    def manifest(self, ref: str) -> Manifest:
        version = self.resolve(ref)
        try:
            return dict(json.loads(self.backend.get(f"versions/{version}.json")))
        except ValueError:
            raise StoreError(f"version {version}: manifest is not valid JSON (corrupt)") from None

    # ----------------------------------------------------------- integrity
    def verify(self, ref: str) -> list[str]:
        """Problems with a version (missing or corrupt objects); empty when every checksum matches."""
        try:
            manifest = self.manifest(ref)
        except StoreError as err:
            return [str(err)]
        problems = []
        for name, entry in manifest["files"].items():
            try:
                self.get_object(entry["sha256"])
            except StoreError as err:
                problems.append(f"{manifest['version']}/{name}: {err}")
        return problems

    def materialize(self, ref: str, dest: Path) -> Manifest:
        """Write a version's files under ``dest``, checking every checksum; raises on any damage."""
        manifest = self.manifest(ref)
        dest.mkdir(parents=True, exist_ok=True)
        for name, entry in manifest["files"].items():
            try:
                data = self.get_object(entry["sha256"])
            except StoreError as err:
                raise StoreError(f"version {manifest['version']} file {name}: {err}") from None
            path = dest / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        return manifest

    def load_verified(
        self, dest: Path, start: str = LATEST, on_bad: Callable[[str, str], None] | None = None
    ) -> Manifest | None:
        """Materialize ``start``, else its parent, and so on: the newest intact version of the chain.

        When the whole chain is damaged, older versions outside it are tried newest first.
        ``on_bad(version, problem)`` is called for each damaged version skipped. None when no
        version is intact (or the store is empty).
        """
        tried: set[str] = set()
        chain: list[str] = []
        try:
            ref: str | None = self.resolve(start)
        except StoreError:
            ref = None
        by_id = {m["version"]: m for m in self.versions()}
        while ref is not None and ref not in tried:
            chain.append(ref)
            tried.add(ref)
            ref = by_id.get(ref, {}).get("parent")
        chain += [v for v in reversed(list(by_id)) if v not in tried]
        for version in chain:
            try:
                return self.materialize(version, dest / version)
            except StoreError as err:
                if on_bad is not None:
                    on_bad(version, str(err))
        return None

    def repair(self) -> tuple[list[str], list[str]]:
        """Rewrite damaged redundant shards of every key; returns (repaired, unrepairable)."""
        repaired: list[str] = []
        failed: list[str] = []
        for prefix in ("objects/", "versions/", "tags/"):
            for key in self.backend.keys(prefix):
                try:
                    repaired += self.backend.repair(key)
                except StoreError as err:
                    failed.append(str(err))
        return repaired, failed

    # ------------------------------------------------------------------ gc
    def gc(self, keep: int) -> tuple[list[str], int]:
        """Keep the ``keep`` newest versions plus every tagged one; delete the rest and orphan objects.

        Returns (deleted version ids, number of deleted objects).
        """
        if keep < 1:
            raise StoreError(f"gc --keep {keep}: must keep at least 1 version")
        manifests = self.versions()
        tagged = set(self.tags().values())
        kept = {m["version"] for m in manifests[-keep:]} | tagged
        deleted = [m["version"] for m in manifests if m["version"] not in kept]
        for version in deleted:
            self.backend.delete(f"versions/{version}.json")
        live = {e["sha256"] for m in manifests if m["version"] in kept for e in m["files"].values()}
        removed = 0
        for key in self.backend.keys("objects/"):
            if key.rsplit("/", 1)[-1] not in live:
                self.backend.delete(key)
                removed += 1
        return deleted, removed


def open_store(cfg: StoreConfig, default_dir: Path) -> CheckpointStore:
    """The store a ``store`` config section describes (``default_dir`` when ``url`` is empty).

    ``store.backend = "auto"`` is the erasure backend when ``[store.erasure]`` is set, else fsspec;
    any backend, built-in or a user's import string, is built by its ``from_config``.
    """
    name = cfg.backend
    if name == "auto":
        name = "erasure" if cfg.erasure is not None else "fsspec"
    cls: type[StoreBackend] = STORE_BACKENDS.load_class(name, StoreBackend, "store.backend")
    return CheckpointStore(cls.from_config(cfg, cfg.url or str(default_dir.resolve())))

"""The versioned checkpoint store: content-addressed objects, one manifest per version, movable tags.

Layout under the backend's root::

    objects/<sha[:2]>/<sha256>     file contents, addressed by their sha256 (identical files stored once)
    versions/<version>.json        manifest: version, parent, step, time, world_size, metrics, files
    tags/<name>                    the version a tag points at (``latest``, ``last-good``, ...)

A version becomes visible only when its manifest is written, after all its objects (and its tags
after the manifest): a save that dies half-way leaves unreferenced objects (removed by ``gc``),
never a half version. Every read checks sha256, so a damaged object is detected, never loaded;
every manifest and tag is checked (and, with a key, its signature) when read. What cannot be read
is reported by :meth:`CheckpointStore.scan`, and ``gc`` deletes nothing while anything is.
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vatra.errors import ConfigError
from vatra.registry import STORE_BACKENDS
from vatra.resilience._base import GcAborted, StoreBackend, StoreError, StoreUsageError
from vatra.resilience.manifest import (
    SIGNATURE,
    Manifest,
    check_entry,
    check_name,
    decode_manifest,
    decode_tag,
    encode_manifest,
    encode_tag,
)

if TYPE_CHECKING:
    from vatra.config import StoreConfig

LATEST, LAST_GOOD = "latest", "last-good"
TEMP_AGE_S = 3600.0  # gc removes temporary files untouched this long (a live write touches its own)
_FIELDS = {"version", "parent", "step", "time", "world_size", "metrics", "tags", "files", SIGNATURE}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def new_version_id(step: int) -> str:
    """``s<step>-<random>``: readable, unique even when a rolled-back run saves the same step again."""
    return f"s{step:07d}-{uuid.uuid4().hex[:6]}"


def _check_id(name: str, what: str) -> str:
    """A version id or tag name: a safe name (tags may contain '/', version ids not)."""
    check_name(name, what)
    if what == "version" and ("/" in name or any(c.isspace() for c in name)):
        raise StoreError(f"version {name!r} contains '/' or a space; version ids are single words")
    return name


@dataclass(frozen=True)
class Scan:
    """Every record under ``versions/`` and ``tags/``: the readable ones and what is wrong with the rest.

    ``gc`` deletes only on a clean scan: an unreadable manifest may reference objects nobody else
    does, and a tag naming a version without a manifest may hide one the listing missed.
    """

    manifests: list[Manifest]  # readable manifests, oldest first (by save time)
    tags: dict[str, str]  # readable tag → version
    unreadable: dict[str, str]  # key → why it cannot be read (the error names the key)
    dangling: dict[str, str]  # tag → the version it names, which has no manifest

    @property
    def problems(self) -> list[str]:
        """One line per unreadable record or dangling tag."""
        return [*self.unreadable.values()] + [
            f"tags/{tag}: points at version {version}, which has no manifest in the store"
            for tag, version in self.dangling.items()
        ]


class CheckpointStore:
    """Versions of a run's training state on one :class:`StoreBackend`.

    With ``hmac_key`` every manifest and tag is signed when written and refused when unsigned or
    tampered on read (``store.hmac_key_env``); the manifests' sha256 entries cover the objects.
    """

    def __init__(self, backend: StoreBackend, *, hmac_key: bytes | None = None) -> None:
        self.backend = backend
        self.hmac_key = hmac_key

    # ---------------------------------------------------------------- objects
    @staticmethod
    def object_key(digest: str) -> str:
        return f"objects/{digest[:2]}/{digest}"

    def put_object(self, data: bytes) -> str:
        """Store bytes as an object (once: identical bytes share one); returns their sha256.

        Safe from any rank's process at the same time as others (content-addressed keys: two
        writers of one key write the same bytes).
        """
        digest = sha256(data)
        key = self.object_key(digest)
        if not self._stored_intact(key, digest):
            self.backend.put(key, data)
        return digest

    def put_file(self, path: Path) -> tuple[str, int]:
        """Store a local file as an object (moved into a local store, uploaded otherwise): (sha256, size).

        Like :meth:`put_object`, callable from any rank's process independently; the pair goes
        into :meth:`write_version`'s ``stored`` on the rank that writes the manifest.
        """
        h = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
        digest, size = h.hexdigest(), path.stat().st_size
        key = self.object_key(digest)
        if not self._stored_intact(key, digest):
            self.backend.put_file(key, path)
        return digest, size

    def _stored_intact(self, key: str, digest: str) -> bool:
        """Whether an intact copy of the object is stored already, so writing it can be skipped.

        A present copy is read back and checked: a resumed run that replays its steps saves
        bit-identical state, and skipping the write against a damaged copy would give the new
        version the old one's damage. Writing the good bytes over it heals every version that
        shares the object. Only repeated content pays the read (new training state is new bytes).
        """
        if not self.backend.exists(key):
            return False
        try:
            return sha256(self.backend.get(key)) == digest
        except StoreError:
            return False

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
        stored: dict[str, dict[str, Any]] | None = None,
    ) -> Manifest:
        """Store ``files`` (name → bytes or local path) as a version; move ``tags`` and ``latest`` to it.

        ``stored`` names files other processes already uploaded with :meth:`put_file` (name →
        ``{"sha256", "size"}``, e.g. each rank's own DCP shard); they are checked (safe names,
        objects present) and listed in the manifest beside ``files``. The manifest is written after
        every object, the tags after the manifest: a save that dies half-way leaves no half version.
        """
        version = _check_id(version or new_version_id(step), "version")
        where = f"version {version}"
        for tag in tags:
            _check_id(tag, "tag")
        clash = _FIELDS & set(extra or {})
        if clash:
            raise StoreError(f"{where}: extra fields {sorted(clash)} would replace the manifest's own")
        entries: dict[str, dict[str, Any]] = {}
        for name, data in files.items():
            check_name(name, f"{where}: file")
            if isinstance(data, Path):
                digest, size = self.put_file(data)
            else:
                digest, size = self.put_object(data), len(data)
            entries[name] = {"sha256": digest, "size": size}
        for name, entry in (stored or {}).items():
            if name in entries:
                raise StoreError(f"{where}: file {name!r} is given both as a file and as stored")
            check_entry(where, name, entry)
            self._check_stored(where, name, entry["sha256"])
            entries[name] = {"sha256": entry["sha256"], "size": entry["size"]}
        manifest: Manifest = {
            "version": version,
            "parent": parent,
            "step": step,
            "time": time.time(),
            "world_size": world_size,
            "metrics": metrics or {},
            "tags": sorted({LATEST, *tags}),
            "files": entries,
            **(extra or {}),
        }
        self.backend.put(f"versions/{version}.json", encode_manifest(manifest, self.hmac_key))
        for tag in manifest["tags"]:
            self.set_tag(tag, version)
        return manifest

    def _check_stored(self, where: str, name: str, digest: str) -> None:
        """An object another process uploaded is in the store (and readable, when in doubt).

        ``exists`` may say no to an object that is readable but short of a redundant copy (an
        erasure node that came back without its shard): then the object itself is read.
        """
        if self.backend.exists(self.object_key(digest)):
            return
        try:
            self.get_object(digest)
        except StoreError as err:
            raise StoreError(
                f"{where}: file {name!r}: object {digest[:12]} is not in the store ({err}); "
                "upload it with put_file before writing the version"
            ) from None

    def _read_manifest(self, version: str) -> Manifest:
        return decode_manifest(self.backend.get(f"versions/{version}.json"), version, self.hmac_key)

    def _read_tag(self, tag: str) -> str:
        return decode_tag(self.backend.get(f"tags/{tag}"), tag, self.hmac_key)

    def _scan_versions(self) -> tuple[list[Manifest], dict[str, str], set[str]]:
        """(readable manifests oldest first, unreadable key → why, every version id with a key)."""
        manifests: list[Manifest] = []
        unreadable: dict[str, str] = {}
        ids: set[str] = set()
        for key in self.backend.keys("versions/"):
            version = key.removeprefix("versions/").removesuffix(".json")
            try:
                if not key.endswith(".json"):
                    raise StoreError(f"{key}: not a manifest name (versions/<version>.json)")
                ids.add(_check_id(version, "version"))
                manifests.append(self._read_manifest(version))
            except StoreError as err:
                unreadable[key] = str(err)
        return sorted(manifests, key=lambda m: (m["time"], m["step"])), unreadable, ids

    def _scan_tags(self) -> tuple[dict[str, str], dict[str, str]]:
        """(readable tag → version, unreadable key → why)."""
        tags: dict[str, str] = {}
        unreadable: dict[str, str] = {}
        for key in self.backend.keys("tags/"):
            try:
                tags[key.removeprefix("tags/")] = self._read_tag(key.removeprefix("tags/"))
            except StoreError as err:
                unreadable[key] = str(err)
        return tags, unreadable

    def scan(self) -> Scan:
        """Read every manifest and tag; what cannot be read is reported, not skipped silently."""
        manifests, unreadable, ids = self._scan_versions()
        tags, bad_tags = self._scan_tags()
        dangling = {tag: version for tag, version in tags.items() if version not in ids}
        return Scan(manifests, tags, {**unreadable, **bad_tags}, dangling)

    def versions(self) -> list[Manifest]:
        """Every readable manifest, oldest first (by save time); :meth:`scan` reports the others."""
        return self._scan_versions()[0]

    def tags(self) -> dict[str, str]:
        """Every readable tag → its version; :meth:`scan` reports the others."""
        return self._scan_tags()[0]

    def set_tag(self, tag: str, version: str) -> None:
        self.backend.put(f"tags/{_check_id(tag, 'tag')}", encode_tag(tag, version, self.hmac_key))

    def resolve(self, ref: str) -> str:
        """A version id from an id, a tag or a unique id prefix; an unreadable tag raises, naming it."""
        tag_keys = self.backend.keys("tags/")
        if f"tags/{ref}" in tag_keys:
            return self._read_tag(ref)
        ids = [k.removeprefix("versions/").removesuffix(".json") for k in self.backend.keys("versions/")]
        if ref in ids:
            return ref
        hits = [v for v in ids if v.startswith(ref)]
        if len(hits) == 1:
            return hits[0]
        tags = [k.removeprefix("tags/") for k in tag_keys]
        known = ", ".join([*sorted(tags), *ids[-5:]]) or "none (the store is empty)"
        raise StoreError(f"no version or tag {ref!r} in {self.backend.describe()}; known: {known}")

    def manifest(self, ref: str) -> Manifest:
        return self._read_manifest(self.resolve(ref))

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
                if len(self.get_object(entry["sha256"])) != entry["size"]:
                    raise StoreError(f"object {entry['sha256'][:12]}: size differs from the manifest's")
            except StoreError as err:
                problems.append(f"{manifest['version']}/{name}: {err}")
        return problems

    def fetch(self, ref_or_manifest: str | Manifest, names: Iterable[str], dest: Path) -> Manifest:
        """Write only the named files of a version under ``dest``, checking every checksum.

        ``ref_or_manifest`` is a version id, tag or prefix, or a manifest already read (then no
        second read of it). Every name is checked before anything is written: one the manifest
        lacks, or one that would land outside ``dest`` (``..``, absolute, through a symlink),
        raises :class:`StoreError`, as does a missing or corrupt object. Returns the manifest.
        """
        manifest = ref_or_manifest if isinstance(ref_or_manifest, dict) else self.manifest(ref_or_manifest)
        where = f"version {manifest['version']}"
        root = dest.resolve()
        plan: list[tuple[str, dict[str, Any], Path]] = []
        for name in names:
            entry = manifest["files"].get(name)
            if entry is None:
                raise StoreError(f"{where} has no file {name!r}")
            check_entry(where, name, entry)
            path = dest / name
            if not path.resolve().is_relative_to(root):
                raise StoreError(f"{where}: file {name!r} would be written outside {dest}")
            plan.append((name, entry, path))
        dest.mkdir(parents=True, exist_ok=True)
        for name, entry, path in plan:
            try:
                data = self.get_object(entry["sha256"])
            except StoreError as err:
                raise StoreError(f"{where} file {name}: {err}") from None
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        return manifest

    def materialize(self, ref: str, dest: Path) -> Manifest:
        """Write all of a version's files under ``dest`` (:meth:`fetch` of every name)."""
        manifest = self.manifest(ref)
        return self.fetch(manifest, list(manifest["files"]), dest)

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
    def gc(
        self, keep: int, *, damaged: Collection[str] = (), temp_age_s: float = TEMP_AGE_S
    ) -> tuple[list[str], int]:
        """Keep the ``keep`` newest versions plus every tagged one; delete the rest and orphan objects.

        ``damaged``: versions the caller found damaged (a resume fell back past them). They are
        kept, as evidence for ``vatra ckpt verify``, but take none of the ``keep`` places: a
        damaged version must not push an intact one out.

        Deletes nothing (raises :class:`GcAborted`) when any manifest or tag cannot be read or a
        tag names a missing version: what such a record references is unknown, and treating its
        objects as orphans is how a damaged ``last-good`` would lose its data. Manifests go before
        objects, so a gc that dies half-way leaves orphans, never a version without its objects.
        Then the backend's leftovers older than ``temp_age_s`` are swept. Returns (deleted version
        ids, number of deleted objects).
        """
        if keep < 1:
            raise StoreUsageError(f"gc --keep {keep}: must keep at least 1 version; pass --keep 1 or more")
        scan = self.scan()
        if scan.unreadable or scan.dangling:
            keys = [*scan.unreadable, *(f"tags/{t}" for t in scan.dangling)]
            raise GcAborted(
                f"gc deleted nothing: {len(keys)} record(s) in {self.backend.describe()} cannot be read "
                f"({', '.join(keys)}): {scan.problems[0]}; run 'vatra ckpt verify' for the full report"
            )
        manifests = scan.manifests
        tagged = set(scan.tags.values())
        intact = [m["version"] for m in manifests if m["version"] not in damaged]
        kept = set(intact[-keep:]) | tagged | (set(damaged) & {m["version"] for m in manifests})
        deleted = [m["version"] for m in manifests if m["version"] not in kept]
        for version in deleted:
            self.backend.delete(f"versions/{version}.json")
        live = {e["sha256"] for m in manifests if m["version"] in kept for e in m["files"].values()}
        removed = 0
        for key in self.backend.keys("objects/"):
            if key.rsplit("/", 1)[-1] not in live:
                self.backend.delete(key)
                removed += 1
        self.backend.sweep(temp_age_s)
        return deleted, removed


def hmac_key(cfg: StoreConfig) -> bytes | None:
    """The signing key ``store.hmac_key_env`` names (None when that is empty)."""
    name = cfg.hmac_key_env
    if not name:
        return None
    value = os.environ.get(name, "")
    if not value:
        raise ConfigError(
            f"store.hmac_key_env: the environment variable {name} is not set or empty; export the key "
            "that signs this store's manifests and tags, or set store.hmac_key_env = '' to run unsigned"
        )
    return value.encode()


def open_store(cfg: StoreConfig, default_dir: Path, *, sub: str = "") -> CheckpointStore:
    """The store a ``store`` config section describes (``default_dir`` when ``url`` is empty).

    ``store.backend = "auto"`` is the erasure backend when ``[store.erasure]`` is set, else fsspec;
    any backend, built-in or a user's import string, is built by its ``from_config``. With
    ``store.hmac_key_env`` set, manifests and tags are signed and checked with that variable's key.
    ``sub`` (a relative path such as ``"async/server-0"``): a store of its own in that folder of
    every location (the url or default folder, each erasure node), for a process that must not
    share the run's ``latest`` tag and gc with another.
    """
    name = cfg.backend
    if name == "auto":
        name = "erasure" if cfg.erasure is not None else "fsspec"
    cls: type[StoreBackend] = STORE_BACKENDS.load_class(name, StoreBackend, "store.backend")
    key = hmac_key(cfg)
    url = cfg.url or str(default_dir.resolve())
    if sub:
        url = _below(url, sub)
        if cfg.erasure is not None:
            nodes = [_below(node, sub) for node in cfg.erasure.nodes]
            cfg = cfg.model_copy(update={"erasure": cfg.erasure.model_copy(update={"nodes": nodes})})
    return CheckpointStore(cls.from_config(cfg, url), hmac_key=key)


def _below(location: str, sub: str) -> str:
    """``sub``'s folder in a directory or fsspec URL."""
    if sub.startswith("/") or ".." in sub.split("/"):
        raise StoreUsageError(
            f"sub-store {sub!r}: give a relative path inside the store, such as 'async/server-0'"
        )
    return f"{location.rstrip('/')}/{sub.strip('/')}"

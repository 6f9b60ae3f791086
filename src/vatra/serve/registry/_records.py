"""What the registry stores: a model version (content id, files, lineage) and an alias move.

A version's id is the sha256 of its content: every file's sha256 under its relative path, and
its lineage metadata (run config, data table and version, metrics, signature, code version). The
same folder with the same lineage always gets the same id, so registering it twice is a no-op,
and a record whose content no longer hashes to its id (an edited metric, a swapped file) is
refused even in an unsigned registry.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from vatra.errors import ConfigError
from vatra.resilience._base import StoreError
from vatra.resilience.manifest import check_entry

VERSION_KIND = "vatra-model-version"
MOVE_KIND = "vatra-alias-move"
SHORT = 12  # characters of an id shown and accepted as the shortest prefix worth typing
MIN_PREFIX = 4
LATEST = "latest"  # NAME@latest: the newest version; never an alias name
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_ALIAS = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")
_ID = re.compile(r"[0-9a-f]{64}")


class RegistryError(StoreError):
    """A registry record is missing, damaged or tampered; or a version cannot be stored (exit 1)."""


class RegistryUsageError(RegistryError, ConfigError):
    """A name, alias or reference that does not parse or names nothing (exit 2)."""


def check_model_name(name: str) -> str:
    if not _NAME.fullmatch(name or ""):
        raise RegistryUsageError(
            f"model name {name!r}: use letters, digits, '.', '_' or '-' (up to 100, starting with a letter "
            "or digit), e.g. --name churn"
        )
    return name


def check_alias(alias: str) -> str:
    if not _ALIAS.fullmatch(alias or "") or alias == LATEST:
        raise RegistryUsageError(
            f"alias {alias!r}: use a word of letters, digits, '_' or '-' starting with a letter, such as "
            f"champion or challenger ({LATEST!r} is reserved for the newest version)"
        )
    return alias


def parse_ref(ref: str) -> tuple[str, str | None]:
    """``NAME@X`` → (NAME, X); ``NAME`` → (NAME, None)."""
    name, at, what = ref.partition("@")
    if at and not what:
        raise RegistryUsageError(f"{ref!r}: nothing after '@'; write NAME@champion or NAME@<id prefix>")
    return check_model_name(name), (what if at else None)


def canonical(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def content_id(files: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    """sha256 over every file's digest under its path and the lineage metadata."""
    digests = {name: entry["sha256"] for name, entry in files.items()}
    return hashlib.sha256(canonical({"files": digests, "meta": meta})).hexdigest()


@dataclass(frozen=True)
class ModelVersion:
    """One immutable version of a model folder.

    ``meta`` is the hashed lineage (keys the registry fills: ``config``, ``data``, ``metrics``,
    ``signature``, ``code_version``, ``run``; a caller may add its own); ``parent`` is the newest
    version of the name when this one was first registered; ``user`` / ``time`` say who and when.
    """

    name: str
    id: str
    files: dict[str, dict[str, Any]]
    meta: dict[str, Any]
    parent: str | None = None
    user: str = ""
    time: float = 0.0

    @property
    def short(self) -> str:
        return self.id[:SHORT]

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.short}"

    @property
    def size(self) -> int:
        return sum(int(e["size"]) for e in self.files.values())

    def record(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.id,
            "files": self.files,
            "meta": self.meta,
            "parent": self.parent,
            "user": self.user,
            "time": self.time,
        }

    @classmethod
    def from_record(cls, record: dict[str, Any], name: str, version: str, where: str) -> ModelVersion:
        """A stored version record, checked: the name and id it carries match its key, every file
        entry is well-formed, and the content hashes to the id."""
        files, meta = record.get("files"), record.get("meta")
        if record.get("name") != name or record.get("version") != version:
            raise RegistryError(f"{where}: names {record.get('name')}@{record.get('version')} (corrupt)")
        if not isinstance(files, dict) or not isinstance(meta, dict):
            raise RegistryError(f"{where}: 'files' or 'meta' is missing (corrupt)")
        for path, entry in files.items():
            check_entry(where, path, entry)
        if content_id(files, meta) != version:
            raise RegistryError(
                f"{where}: its files and metadata no longer hash to its id (tampered or corrupt); "
                "this version is refused"
            )
        parent = record.get("parent")
        return cls(
            name,
            version,
            files,
            meta,
            parent if isinstance(parent, str) else None,
            str(record.get("user", "")),
            float(record.get("time", 0.0)),
        )


@dataclass(frozen=True)
class AliasMove:
    """One entry of an alias's append-only history: ``alias`` went from ``source`` to ``target``."""

    name: str
    alias: str
    seq: int
    action: str  # "promote" | "rollback"
    source: str | None
    target: str
    user: str
    time: float
    reason: str
    evidence: dict[str, Any] | None = field(default=None)

    def record(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "alias": self.alias,
            "seq": self.seq,
            "action": self.action,
            "from": self.source,
            "to": self.target,
            "user": self.user,
            "time": self.time,
            "reason": self.reason,
            "evidence": self.evidence,
        }

    @classmethod
    def from_record(cls, record: dict[str, Any], name: str, alias: str, seq: int, where: str) -> AliasMove:
        if (record.get("name"), record.get("alias"), record.get("seq")) != (name, alias, seq):
            raise RegistryError(f"{where}: names another alias or position (corrupt or moved)")
        target, source = record.get("to"), record.get("from")
        if not isinstance(target, str) or not _ID.fullmatch(target):
            raise RegistryError(f"{where}: 'to' is not a version id (corrupt)")
        if source is not None and (not isinstance(source, str) or not _ID.fullmatch(source)):
            raise RegistryError(f"{where}: 'from' is not a version id (corrupt)")
        if record.get("action") not in ("promote", "rollback"):
            raise RegistryError(f"{where}: 'action' is not promote or rollback (corrupt)")
        evidence = record.get("evidence")
        return cls(
            name,
            alias,
            seq,
            str(record["action"]),
            source,
            target,
            str(record.get("user", "")),
            float(record.get("time", 0.0)),
            str(record.get("reason", "")),
            evidence if isinstance(evidence, dict) else None,
        )

"""Manifest and tag records: what a valid one is, and their optional HMAC-SHA256 signatures.

A manifest names a version's files and their sha256 digests; a tag names a version. Both are
checked on every read: a record that does not parse, names a file outside the version's folder
or (with a key) lacks a valid signature is refused with a :class:`StoreError` naming the key.
Objects need no signature of their own: the signed manifest fixes their sha256.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from typing import Any

from vatra.resilience._base import StoreError

Manifest = dict[str, Any]
SIGNATURE = "signature"
_SHA256 = re.compile(r"[0-9a-f]{64}")
_SCHEME = "hmac-sha256:"


def check_name(name: object, what: str) -> str:
    """``name`` when it is a relative ``/``-separated path that stays inside its folder.

    Refused: empty names or parts, ``.`` and ``..`` parts, absolute paths, backslashes and NUL
    (a manifest with ``../x`` would make ``materialize`` write outside its destination).
    """
    why = None
    if not isinstance(name, str) or not name:
        why = "is empty or not a string"
    elif name.startswith("/"):
        why = "is an absolute path"
    elif "\\" in name or "\0" in name:
        why = "contains a backslash or NUL"
    elif any(part in ("", ".", "..") for part in name.split("/")):
        why = "has an empty, '.' or '..' part"
    if why is not None:
        raise StoreError(f"{what} {name!r} {why}; names must be relative paths inside the version")
    return str(name)


def _mac(key: bytes, *parts: str) -> str:
    return _SCHEME + hmac.new(key, "\0".join(parts).encode(), hashlib.sha256).hexdigest()


def _canonical(manifest: Manifest) -> str:
    body = {k: v for k, v in manifest.items() if k != SIGNATURE}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _check_signature(where: str, signature: object, expected: str) -> None:
    if signature is None:
        raise StoreError(f"{where}: not signed, but store.hmac_key_env is set; refusing an unsigned record")
    # compare_digest raises TypeError on non-ASCII str: a tampered record may hold any text
    if (
        not isinstance(signature, str)
        or not signature.isascii()
        or not hmac.compare_digest(signature, expected)
    ):
        raise StoreError(f"{where}: signature does not match (tampered, or signed with another key)")


def encode_manifest(manifest: Manifest, key: bytes | None) -> bytes:
    """The bytes stored under ``versions/<version>.json`` (signed when ``key`` is given)."""
    record = dict(manifest)
    if key is not None:
        record[SIGNATURE] = _mac(key, "vatra-manifest", _canonical(manifest))
    return json.dumps(record, indent=1).encode()


def decode_manifest(raw: bytes, version: str, key: bytes | None) -> Manifest:
    """The manifest of ``version`` from its stored bytes; raises :class:`StoreError` on any flaw."""
    where = f"versions/{version}.json"
    try:
        record = json.loads(raw)
    except ValueError:
        raise StoreError(f"{where}: not valid JSON (truncated or corrupt)") from None
    if not isinstance(record, dict):
        raise StoreError(f"{where}: not a JSON object (corrupt)")
    if key is not None:
        _check_signature(where, record.get(SIGNATURE), _mac(key, "vatra-manifest", _canonical(record)))
    record.pop(SIGNATURE, None)
    if record.get("version") != version:
        raise StoreError(f"{where}: names version {record.get('version')!r}, not {version!r} (corrupt)")
    for field, kind in (("step", int), ("time", int | float), ("world_size", int), ("files", dict)):
        if not isinstance(record.get(field), kind) or isinstance(record.get(field), bool):
            raise StoreError(f"{where}: field {field!r} is missing or has the wrong type (corrupt)")
    if not isinstance(record.get("parent"), str | None):
        raise StoreError(f"{where}: field 'parent' has the wrong type (corrupt)")
    for name, entry in record["files"].items():
        check_entry(where, name, entry)
    record.setdefault("metrics", {})
    record.setdefault("tags", [])
    return record


def check_entry(where: str, name: object, entry: object) -> None:
    """A manifest file entry: a safe name, a sha256 hex digest and a size in bytes."""
    check_name(name, f"{where}: file")
    ok = (
        isinstance(entry, dict)
        and isinstance(entry.get("sha256"), str)
        and _SHA256.fullmatch(entry["sha256"]) is not None
        and isinstance(entry.get("size"), int)
        and not isinstance(entry["size"], bool)
        and entry["size"] >= 0
    )
    if not ok:
        raise StoreError(f"{where}: file {name!r} needs {{sha256: 64 hex digits, size: bytes ≥ 0}}")


def encode_tag(tag: str, version: str, key: bytes | None) -> bytes:
    """The bytes stored under ``tags/<tag>``: the version, then its signature when ``key`` is given."""
    return (version if key is None else f"{version} {_mac(key, 'vatra-tag', tag, version)}").encode()


def decode_tag(raw: bytes, tag: str, key: bytes | None) -> str:
    """The version a tag's stored bytes name; raises :class:`StoreError` on any flaw."""
    where = f"tags/{tag}"
    try:
        version, _, signature = raw.decode("ascii").strip().partition(" ")
    except UnicodeDecodeError:
        raise StoreError(f"{where}: not ASCII text (corrupt)") from None
    check_name(version, f"{where}: version")
    if "/" in version:
        raise StoreError(f"{where}: version {version!r} contains '/' (corrupt)")
    if key is not None:
        _check_signature(where, signature or None, _mac(key, "vatra-tag", tag, version))
    return version


def encode_record(record: dict[str, Any], kind: str, key: bytes | None) -> bytes:
    """Any other JSON record kept beside a store's versions (the model registry's version and alias
    records), signed like a manifest when ``key`` is given; ``kind`` is part of what is signed, so a
    record of one kind cannot pass for another."""
    out = dict(record)
    if key is not None:
        out[SIGNATURE] = _mac(key, kind, _canonical(record))
    return json.dumps(out, indent=1, sort_keys=True).encode()


def decode_record(raw: bytes, kind: str, where: str, key: bytes | None) -> dict[str, Any]:
    """A record :func:`encode_record` wrote; unparsable, unsigned or tampered (with a key) raises a
    :class:`StoreError` naming ``where``."""
    try:
        record = json.loads(raw)
    except ValueError:
        raise StoreError(f"{where}: not valid JSON (truncated or corrupt)") from None
    if not isinstance(record, dict):
        raise StoreError(f"{where}: not a JSON object (corrupt)")
    if key is not None:
        _check_signature(where, record.get(SIGNATURE), _mac(key, kind, _canonical(record)))
    record.pop(SIGNATURE, None)
    return record

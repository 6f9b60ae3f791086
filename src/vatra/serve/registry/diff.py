"""What differs between two versions: config keys, metrics, data, signature, code and files."""

from __future__ import annotations

from typing import Any

from vatra.serve.registry._records import ModelVersion

_MISSING = "-"


def flatten(value: object, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}``; lists and scalars are leaves."""
    if not isinstance(value, dict):
        return {prefix: value} if prefix else {}
    out: dict[str, Any] = {}
    for key, item in value.items():
        out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _rows(section: str, a: object, b: object) -> list[tuple[str, str, Any, Any]]:
    fa, fb = flatten(a), flatten(b)
    return [
        (section, key, fa.get(key, _MISSING), fb.get(key, _MISSING))
        for key in sorted(set(fa) | set(fb))
        if fa.get(key, _MISSING) != fb.get(key, _MISSING)
    ]


def diff_versions(a: ModelVersion, b: ModelVersion) -> list[tuple[str, str, Any, Any]]:
    """(section, key, value in a, value in b) for everything that differs; ``-`` where one lacks it.

    Sections: ``config`` (dotted keys of the run's config), ``metrics``, ``data`` (table and
    version), ``signature``, ``code`` (version, format, run), ``files`` (sha256 per file) and
    ``meta`` for any other lineage a caller added.
    """
    ma, mb = a.meta, b.meta
    rows = [
        *_rows("config", ma.get("config", {}), mb.get("config", {})),
        *_rows("metrics", ma.get("metrics", {}), mb.get("metrics", {})),
        *_rows("data", ma.get("data", {}), mb.get("data", {})),
        *_rows("signature", ma.get("signature", {}), mb.get("signature", {})),
    ]
    code = ("code_version", "format", "run")
    rows += _rows("code", {k: ma.get(k) for k in code}, {k: mb.get(k) for k in code})
    known = {"config", "metrics", "data", "signature", *code}
    rows += _rows(
        "meta",
        {k: v for k, v in ma.items() if k not in known},
        {k: v for k, v in mb.items() if k not in known},
    )
    rows += _rows(
        "files",
        {n: e["sha256"][:12] for n, e in a.files.items()},
        {n: e["sha256"][:12] for n, e in b.files.items()},
    )
    return rows

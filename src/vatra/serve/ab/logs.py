"""Read a serving log folder (``predictions.jsonl``, ``outcomes.jsonl``) and join each outcome to
the variant that made its prediction. The files are written by the server but reach it from
clients (ids, outcome values), so every line is checked and a bad one is counted and skipped,
never trusted and never fatal."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from vatra.errors import ConfigError

PREDICTIONS = "predictions.jsonl"
OUTCOMES = "outcomes.jsonl"
MAX_LINE = 64 * 1024  # a longer line is not one the server wrote
MAX_ID = 256


@dataclass
class Requests:
    """One entry per prediction request, sorted by time. The server writes one line per scored
    row, and the rows of one request share its time, variant, version, key, latency and error:
    consecutive lines equal in all of those are one request (``rows`` counts them), so a batch of
    64 failed rows is one failure, not 64 correlated ones, for the guardrails."""

    t: NDArray[np.float64]
    variant: NDArray[np.str_]
    version: NDArray[np.str_]
    latency_ms: NDArray[np.float64]
    error: NDArray[np.bool_]
    rows: NDArray[np.int64]


@dataclass
class Outcomes:
    """One row per outcome joined to its prediction (its variant, version and time ``pred_t``),
    sorted by the outcome's time."""

    t: NDArray[np.float64]
    value: NDArray[np.float64]
    variant: NDArray[np.str_]
    version: NDArray[np.str_]
    pred_t: NDArray[np.float64]


@dataclass
class ABLog:
    """Both files of one log folder: ``versions`` counts each variant's requests per model version,
    ``latest`` is the version of its last request; ``skipped`` counts the lines left out, by reason."""

    requests: Requests
    outcomes: Outcomes
    versions: dict[str, Counter[str]]
    latest: dict[str, str]
    skipped: Counter[str] = field(default_factory=Counter)


def _reject_constant(name: str) -> float:
    raise ValueError(f"non-finite number {name}")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)  # one decoder: json.loads makes one per call


def _rows(path: Path, skipped: Counter[str], label: str) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file; a line that is too long, not UTF-8, not JSON or not an
    object is counted under ``"<label>: <why>"``."""
    rows: list[dict[str, Any]] = []
    with path.open("rb") as f:
        for raw in f:
            if len(raw) > MAX_LINE:
                skipped[f"{label}: line over {MAX_LINE} bytes"] += 1
                continue
            if not raw.strip():
                continue
            try:
                row = _DECODER.decode(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError):
                skipped[f"{label}: not JSON"] += 1
                continue
            if not isinstance(row, dict):
                skipped[f"{label}: not an object"] += 1
                continue
            rows.append(row)
    return rows


def _number(v: Any) -> float | None:
    """A finite JSON number (not a bool), else None."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def _ident(v: Any) -> str | None:
    return v if isinstance(v, str) and 0 < len(v) <= MAX_ID else None


def read_log(log_dir: Path) -> ABLog:
    """Read ``log_dir``. A missing ``predictions.jsonl`` is an error naming the folder; a missing
    ``outcomes.jsonl`` is read as no outcomes yet (the guardrails still have every request)."""
    pred_path, out_path = log_dir / PREDICTIONS, log_dir / OUTCOMES
    if not pred_path.is_file():
        raise ConfigError(
            f"no {PREDICTIONS} in {log_dir}: pass the folder the server logs to "
            "(vatra model serve NAME --log-dir D) as --log-dir"
        )
    skipped: Counter[str] = Counter()
    seen: dict[str, tuple[str, str, float]] = {}  # prediction id -> (variant, version, t)
    t: list[float] = []
    variant: list[str] = []
    version: list[str] = []
    latency: list[float] = []
    error: list[bool] = []
    rows: list[int] = []
    last: tuple[object, ...] | None = None
    for row in _rows(pred_path, skipped, "predictions"):
        rid, var, ver = _ident(row.get("id")), _ident(row.get("variant")), _ident(row.get("version"))
        rt, lat, err = _number(row.get("t")), _number(row.get("latency_ms")), row.get("error")
        if rid is None or var is None or ver is None or rt is None:
            skipped["predictions: missing or bad id/variant/version/t"] += 1
            continue
        if lat is None or lat < 0 or not isinstance(err, bool):
            skipped["predictions: bad latency_ms/error"] += 1
            continue
        if rid in seen:
            skipped["predictions: repeated id"] += 1
            continue
        seen[rid] = (var, ver, rt)
        request = (rt, var, ver, row.get("key"), lat, err)
        if request == last:
            rows[-1] += 1
            continue
        last = request
        t.append(rt)
        variant.append(var)
        version.append(ver)
        latency.append(lat)
        error.append(err)
        rows.append(1)
    order = np.argsort(np.asarray(t, dtype=np.float64), kind="stable")
    requests = Requests(
        t=np.asarray(t, dtype=np.float64)[order],
        variant=np.asarray(variant, dtype=np.str_)[order],
        version=np.asarray(version, dtype=np.str_)[order],
        latency_ms=np.asarray(latency, dtype=np.float64)[order],
        error=np.asarray(error, dtype=bool)[order],
        rows=np.asarray(rows, dtype=np.int64)[order],
    )
    versions: dict[str, Counter[str]] = {}
    latest: dict[str, str] = {}
    for i in order:
        versions.setdefault(variant[i], Counter())[version[i]] += 1
        latest[variant[i]] = version[i]
    return ABLog(requests, _join_outcomes(out_path, seen, skipped), versions, latest, skipped)


def _join_outcomes(path: Path, seen: dict[str, tuple[str, str, float]], skipped: Counter[str]) -> Outcomes:
    """The outcomes whose id names a logged prediction, the first one per id."""
    ot: list[float] = []
    value: list[float] = []
    pred: list[tuple[str, str, float]] = []
    if path.is_file():
        done: set[str] = set()
        for row in _rows(path, skipped, "outcomes"):
            oid, rt, v = _ident(row.get("id")), _number(row.get("t")), _number(row.get("value"))
            if oid is None or rt is None or v is None:
                skipped["outcomes: missing or bad id/t/value"] += 1
                continue
            if oid not in seen:
                skipped["outcomes: id of no logged prediction"] += 1
                continue
            if oid in done:
                skipped["outcomes: repeated id"] += 1
                continue
            done.add(oid)
            ot.append(rt)
            value.append(v)
            pred.append(seen[oid])
    order = np.argsort(np.asarray(ot, dtype=np.float64), kind="stable")
    return Outcomes(
        t=np.asarray(ot, dtype=np.float64)[order],
        value=np.asarray(value, dtype=np.float64)[order],
        variant=np.asarray([p[0] for p in pred], dtype=np.str_)[order],
        version=np.asarray([p[1] for p in pred], dtype=np.str_)[order],
        pred_t=np.asarray([p[2] for p in pred], dtype=np.float64)[order],
    )

"""Time profiles of grid carbon intensity or electricity price, read from the files users have.

Shapes read:

- Electricity Maps' CSV export: ``Datetime (UTC)`` and ``Carbon Intensity gCO₂eq/kWh (direct)``
  (the life-cycle column when there is no direct one), one row an hour;
- the UK Carbon Intensity API's JSON (``api.carbonintensity.org.uk/intensity/...``):
  ``{"data": [{"from", "to", "intensity": {"forecast", "actual"}}]}``, half-hourly, ``actual``
  where known, else ``forecast`` (its regional endpoints nest the same list one level down);
- any CSV with a time column (``datetime``, ``time``, ``timestamp``, ``from``, ``start``, ``date``)
  and a value column (a carbon intensity, a ``price``, or the only other column).

A naive time is UTC. A slot lasts until the next row's time (the last one as long as the one before).
"""

from __future__ import annotations

import csv
import json
import math
from bisect import bisect_right
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from vatra.errors import ConfigError

_TIME_NAMES = ("datetime", "time", "timestamp", "from", "start", "date")
Point = tuple[float, float | None, float | None]  # start, end (None: the next start), value (None: a gap)


@dataclass(frozen=True)
class Profile:
    """Slots ``[starts[i], ends[i])`` (unix seconds, sorted, not overlapping) with a value each."""

    starts: tuple[float, ...]
    ends: tuple[float, ...]
    values: tuple[float, ...]
    unit: str  # the value column's name, as the file gave it
    path: str = ""

    def __post_init__(self) -> None:
        if not self.values:
            raise ConfigError(f"{self.path}: no rows with a time and a value")

    def covers(self, t: float) -> bool:
        return self.starts[0] <= t < self.ends[-1]

    def value_at(self, t: float) -> float:
        """The value of the slot holding ``t``; outside the profile (or in a gap) the mean of its
        slots that start in the same UTC hour of the day."""
        i = bisect_right(self.starts, t) - 1
        if i >= 0 and t < self.ends[i]:
            return self.values[i]
        return self.hour_means.get(_hour(t), self.mean)

    @cached_property
    def hour_means(self) -> dict[int, float]:
        """The mean of the slots that start in each UTC hour of the day (computed once)."""
        by_hour: dict[int, list[float]] = {}
        for start, value in zip(self.starts, self.values, strict=True):
            by_hour.setdefault(_hour(start), []).append(value)
        return {h: sum(v) / len(v) for h, v in by_hour.items()}

    @cached_property
    def mean(self) -> float:
        return sum(self.values) / len(self.values)


def _hour(t: float) -> int:
    return datetime.fromtimestamp(t, UTC).hour


def parse_time(text: str) -> float:
    """Unix seconds from ISO 8601 (``2024-01-01 00:00:00``, ``2018-01-20T12:00Z``; naive = UTC)
    or a unix timestamp."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    when = datetime.fromisoformat(text)
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()


def read_profile(path: str | Path) -> Profile:
    """A profile from ``path`` (CSV or JSON by its first character); a file that is not one of the
    shapes above is a :class:`ConfigError` naming what is wrong."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{p}: cannot read the profile ({err})") from None
    try:
        rows = _json_rows(text) if text.lstrip().startswith(("{", "[")) else _csv_rows(text)
    except KeyError as err:
        raise ConfigError(
            f"{p}: not the UK Carbon Intensity API's JSON (an item has no {err} key); its rows are "
            '{"from", "to", "intensity": {"forecast", "actual"}}'
        ) from None
    except (ValueError, TypeError, json.JSONDecodeError) as err:
        raise ConfigError(
            f"{p}: not a price or intensity profile ({err}); give an Electricity Maps CSV, the UK "
            "Carbon Intensity API's JSON, or a CSV with a time and a value column"
        ) from None
    unit, points = rows
    return _slots(points, unit, str(p))


def _csv_rows(text: str) -> tuple[str, list[Point]]:
    reader = csv.reader(line for line in text.splitlines() if line.strip())
    header = [h.strip() for h in next(reader, [])]
    low = [h.lower() for h in header]
    t_col = next((i for i, h in enumerate(low) if h.split(" (")[0] in _TIME_NAMES), None)
    if t_col is None:
        raise ValueError(f"no time column among {header} (one named like 'Datetime (UTC)' or 'time')")
    v_col = _value_column(low, t_col)
    points: list[Point] = []
    for n, row in enumerate(reader, start=2):
        if len(row) <= t_col:
            continue
        try:
            # a missing value: the slot is a gap (it ends the one before), filled by hour-of-day means
            value = _finite(row[v_col]) if len(row) > v_col and row[v_col].strip() else None
            points.append((parse_time(row[t_col]), None, value))
        except ValueError as err:
            raise ValueError(f"line {n}: {err}") from None
    return header[v_col], points


def _value_column(low: list[str], t_col: int) -> int:
    others = [i for i in range(len(low)) if i != t_col]
    for want in (("carbon intensity", "direct"), ("carbon intensity",), ("carbon_intensity",), ("price",)):
        hit = next((i for i in others if all(w in low[i] for w in want)), None)
        if hit is not None:
            return hit
    if len(others) == 1:
        return others[0]
    raise ValueError(f"no value column among {low} (a carbon intensity or a price)")


def _json_rows(text: str) -> tuple[str, list[Point]]:
    data: Any = json.loads(text)["data"]
    if isinstance(data, dict):  # regional endpoints: {"data": {"regionid": ..., "data": [...]}}
        data = data["data"]
    if data and isinstance(data[0], dict) and "data" in data[0]:  # [{"regionid": ..., "data": [...]}]
        data = data[0]["data"]
    points: list[Point] = []
    for item in data:
        intensity = item["intensity"]
        value = intensity.get("actual")
        if value is None:
            value = intensity["forecast"]
        points.append((parse_time(item["from"]), parse_time(item["to"]), _finite(value)))
    return "gCO2/kWh", points


def _finite(value: Any) -> float:
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"value {value!r} is not a finite number")
    return out


def _slots(points: list[Point], unit: str, path: str) -> Profile:
    points.sort(key=lambda p: p[0])
    starts = [p[0] for p in points]
    if len(set(starts)) != len(starts):
        raise ConfigError(f"{path}: two rows for the same time; one value per time slot")
    ends = []
    for i, (start, end, _) in enumerate(points):
        if i + 1 < len(points):  # a slot ends where the next begins, or earlier ("to" in the JSON)
            ends.append(starts[i + 1] if end is None else min(end, starts[i + 1]))
        else:  # the last one: as given, else as long as the one before (an hour if it is alone)
            ends.append(end if end is not None else start + (start - starts[i - 1] if i else 3600.0))
    kept = [(s, e, p[2]) for s, e, p in zip(starts, ends, points, strict=True) if p[2] is not None]
    return Profile(
        tuple(k[0] for k in kept), tuple(k[1] for k in kept), tuple(k[2] for k in kept), unit, path
    )

"""Price and interruption traces: AWS spot price history, Spot Advisor buckets, GCP and Azure
price CSVs, and interruption event lists, read into one shape.

Formats (the first line decides):

- AWS, ``aws ec2 describe-spot-price-history`` as JSON (``{"SpotPriceHistory": [{"AvailabilityZone",
  "InstanceType", "ProductDescription", "SpotPrice", "Timestamp"}]}``), as ``--output text``
  (tab-separated ``SPOTPRICEHISTORY`` lines, fields in that order), or as a CSV/TSV with those
  column names as its header.
- GCP, a CSV flattened from the Cloud Billing Catalog API's SKUs: ``effectiveTime``, ``region``
  (one of ``serviceRegions``), ``description`` (e.g. "Spot Preemptible A2 Instance Core"),
  ``usageUnit`` (``h``) and ``unitPrice`` (USD).
- Azure, a CSV of the Retail Prices API's items: ``effectiveStartDate``, ``armRegionName``,
  ``armSkuName``, ``skuName`` (rows whose skuName ends in "Spot"), ``unitOfMeasure``
  (``1 Hour``) and ``retailPrice``.
- Interruptions: Spot Advisor's frequency buckets (``instance_type,region,interruption`` with
  ``<5%``, ``5-10%``, ``10-15%``, ``15-20%``, ``>20%``) or observed events (``timestamp,zone``).

A bad file is one :class:`TraceError` line naming the file, the row and the field.
"""

from __future__ import annotations

import bisect
import csv
import io
import json
import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from vatra.errors import ConfigError

# Spot Advisor's buckets: the share of instances interrupted in a month; a bucket reads as its middle.
ADVISOR_BUCKETS = {"<5%": 0.025, "5-10%": 0.075, "10-15%": 0.125, "15-20%": 0.175, ">20%": 0.25}
_AWS_FIELDS = ("AvailabilityZone", "InstanceType", "ProductDescription", "SpotPrice", "Timestamp")


class TraceError(ConfigError):
    """A trace file that cannot be read: the message names the file, the row and the field."""


@dataclass
class PriceTrace:
    """Spot prices of one instance type per zone: a step function of time (unix seconds)."""

    instance_type: str
    times: dict[str, np.ndarray]  # zone -> sorted change times
    prices: dict[str, np.ndarray]  # zone -> USD per node-hour from that time on
    medians: dict[str, float] = field(init=False)
    _t: dict[str, list[float]] = field(init=False, repr=False)
    _p: dict[str, list[float]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.medians = {z: float(np.median(p)) for z, p in self.prices.items()}
        # plain lists: bisect on a list is several times faster than searchsorted for one scalar
        self._t = {z: t.tolist() for z, t in self.times.items()}
        self._p = {z: p.tolist() for z, p in self.prices.items()}

    @property
    def zones(self) -> list[str]:
        return sorted(self.times)

    @property
    def start(self) -> float:
        return min(float(t[0]) for t in self.times.values())

    @property
    def end(self) -> float:
        return max(float(t[-1]) for t in self.times.values())

    def price(self, zone: str, t: float) -> float:
        """The price in force at ``t`` (the first one before the trace starts)."""
        i = bisect.bisect_right(self._t[zone], t) - 1
        return self._p[zone][max(i, 0)]

    def next_change(self, zone: str, t: float) -> float:
        """The first price change strictly after ``t`` (inf after the last)."""
        ts = self._t[zone]
        i = bisect.bisect_right(ts, t)
        return ts[i] if i < len(ts) else math.inf


@dataclass
class Interruptions:
    """What the ``--interruptions`` file said: monthly frequencies per (instance type, region)
    from Spot Advisor, or observed events (time, zone) to replay."""

    monthly: dict[tuple[str, str], float] = field(default_factory=dict)
    events: list[tuple[float, str]] = field(default_factory=list)


def parse_time(text: str) -> float:
    """ISO 8601 (``2026-11-01T00:00:00Z``, ``+00:00`` or naive UTC) or unix seconds."""
    try:
        return float(text)
    except ValueError:
        pass
    dt = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    return (dt if dt.tzinfo else dt.replace(tzinfo=UTC)).timestamp()


class _Rows:
    """Rows of a delimited file with a header, each field read with a message naming file/row/field."""

    def __init__(self, path: Path, text: str) -> None:
        self.path = path
        first = text.splitlines()[0] if text.strip() else ""
        delim = "\t" if first.count("\t") > first.count(",") else ","
        reader = csv.reader(io.StringIO(text), delimiter=delim)
        self.header = [h.strip() for h in next(reader, [])]
        self.rows = [(n, r) for n, r in enumerate(reader, start=2) if any(c.strip() for c in r)]

    def get(self, row: tuple[int, list[str]], name: str) -> str:
        n, values = row
        try:
            return values[self.header.index(name)].strip()
        except IndexError:
            raise TraceError(f"{self.path}: row {n}: field {name}: missing (the row is short)") from None

    def number(self, row: tuple[int, list[str]], name: str) -> float:
        value = self.get(row, name)
        try:
            x = float(value)
        except ValueError:
            x = math.nan
        if not math.isfinite(x) or x < 0:
            raise TraceError(
                f"{self.path}: row {row[0]}: field {name}: {value!r} is not a price (a number >= 0)"
            )
        return x

    def time(self, row: tuple[int, list[str]], name: str) -> float:
        value = self.get(row, name)
        try:
            return parse_time(value)
        except ValueError:
            raise TraceError(
                f"{self.path}: row {row[0]}: field {name}: {value!r} is not a time (ISO 8601)"
            ) from None

    def need(self, *names: str) -> None:
        lost = [n for n in names if n not in self.header]
        if lost:
            raise TraceError(f"{self.path}: row 1: field {lost[0]}: missing from the header {self.header}")


Row = tuple[float, str, str, float]  # (time, zone, instance type, USD per hour)


def _aws_json(path: Path, text: str) -> list[Row]:
    try:
        items = json.loads(text)["SpotPriceHistory"]
    except (ValueError, KeyError, TypeError):
        raise TraceError(
            f"{path}: row 1: field SpotPriceHistory: not the JSON describe-spot-price-history writes"
        ) from None
    out: list[Row] = []
    for i, item in enumerate(items, start=1):
        where = f"{path}: row {i}"
        if not isinstance(item, dict):
            raise TraceError(f"{where}: field SpotPriceHistory: not an object")
        for name in _AWS_FIELDS[:2] + _AWS_FIELDS[3:]:
            if name not in item:
                raise TraceError(f"{where}: field {name}: missing")
        try:
            price = float(item["SpotPrice"])
        except (TypeError, ValueError):
            price = math.nan
        if not math.isfinite(price) or price < 0:
            raise TraceError(
                f"{where}: field SpotPrice: {item['SpotPrice']!r} is not a price (a number >= 0)"
            )
        try:
            t = parse_time(str(item["Timestamp"]))
        except ValueError:
            raise TraceError(
                f"{where}: field Timestamp: {item['Timestamp']!r} is not a time (ISO 8601)"
            ) from None
        out.append((t, str(item["AvailabilityZone"]), str(item["InstanceType"]), price))
    return out


def _delimited(path: Path, text: str) -> list[Row]:
    if text.startswith("SPOTPRICEHISTORY"):  # aws --output text: no header, fields in _AWS_FIELDS order
        text = "\t".join(("kind", *_AWS_FIELDS)) + "\n" + text
    rows = _Rows(path, text)
    if "SpotPrice" in rows.header:
        rows.need("AvailabilityZone", "InstanceType", "SpotPrice", "Timestamp")
        return [
            (rows.time(r, "Timestamp"), rows.get(r, "AvailabilityZone"), rows.get(r, "InstanceType"),
             rows.number(r, "SpotPrice"))
            for r in rows.rows
        ]  # fmt: skip
    if "unitPrice" in rows.header:  # GCP
        rows.need("effectiveTime", "region", "description", "usageUnit", "unitPrice")
        out = []
        for r in rows.rows:
            if rows.get(r, "usageUnit") != "h":
                raise TraceError(
                    f"{path}: row {r[0]}: field usageUnit: {rows.get(r, 'usageUnit')!r}, expected 'h'"
                )
            out.append((rows.time(r, "effectiveTime"), rows.get(r, "region"), rows.get(r, "description"),
                        rows.number(r, "unitPrice")))  # fmt: skip
        return out
    if "retailPrice" in rows.header:  # Azure
        rows.need(
            "effectiveStartDate", "armRegionName", "armSkuName", "skuName", "unitOfMeasure", "retailPrice"
        )
        out = []
        for r in rows.rows:
            if not rows.get(r, "skuName").endswith("Spot"):
                continue  # the same SKU's on-demand and low-priority rows
            if rows.get(r, "unitOfMeasure") != "1 Hour":
                raise TraceError(
                    f"{path}: row {r[0]}: field unitOfMeasure: "
                    f"{rows.get(r, 'unitOfMeasure')!r}, expected '1 Hour'"
                )
            region, sku = rows.get(r, "armRegionName"), rows.get(r, "armSkuName")
            out.append((rows.time(r, "effectiveStartDate"), region, sku, rows.number(r, "retailPrice")))
        return out
    raise TraceError(
        f"{path}: row 1: header {rows.header}: not a known price format "
        "(AWS SpotPrice, GCP unitPrice, Azure retailPrice)"
    )


def read_prices(path: Path, instance_type: str | None = None, zones: list[str] | None = None) -> PriceTrace:
    """Read a price trace and keep one instance type (and the given zones)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise TraceError(f"{path}: cannot read: {getattr(err, 'strerror', None) or err}") from None
    rows = _aws_json(path, text) if text.lstrip().startswith("{") else _delimited(path, text)
    types = sorted({r[2] for r in rows})
    if not rows:
        raise TraceError(f"{path}: row 2: no prices in the file")
    if instance_type is None and len(types) > 1:
        raise TraceError(f"{path}: field InstanceType: several types {types}: set fleet.instance_type to one")
    kind = instance_type or types[0]
    kept = [r for r in rows if r[2] == kind and (zones is None or r[1] in zones)]
    if not kept:
        raise TraceError(
            f"{path}: field InstanceType: no rows for {kind!r} in zones {zones or 'any'} (types: {types})"
        )
    times: dict[str, list[float]] = {}
    prices: dict[str, list[float]] = {}
    for t, zone, _, price in sorted(kept):
        times.setdefault(zone, []).append(t)
        prices.setdefault(zone, []).append(price)
    return PriceTrace(
        kind, {z: np.array(v) for z, v in times.items()}, {z: np.array(v) for z, v in prices.items()}
    )


def read_interruptions(path: Path) -> Interruptions:
    """Spot Advisor buckets (``interruption`` column) or an event list (``timestamp`` and ``zone``)."""
    try:
        rows = _Rows(path, path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise TraceError(f"{path}: cannot read: {getattr(err, 'strerror', None) or err}") from None
    out = Interruptions()
    if "interruption" in rows.header:
        rows.need("instance_type", "region", "interruption")
        for r in rows.rows:
            bucket = rows.get(r, "interruption").replace(" ", "")
            if bucket not in ADVISOR_BUCKETS:
                raise TraceError(
                    f"{path}: row {r[0]}: field interruption: {bucket!r} is not a Spot Advisor "
                    f"bucket {list(ADVISOR_BUCKETS)}"
                )
            out.monthly[(rows.get(r, "instance_type"), rows.get(r, "region"))] = ADVISOR_BUCKETS[bucket]
        return out
    if "timestamp" in rows.header:
        rows.need("timestamp", "zone")
        out.events = sorted((rows.time(r, "timestamp"), rows.get(r, "zone")) for r in rows.rows)
        return out
    raise TraceError(
        f"{path}: row 1: header {rows.header}: expected Spot Advisor buckets (interruption) "
        "or events (timestamp, zone)"
    )

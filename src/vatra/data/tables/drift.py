"""Drift between two tables, per column: PSI, KS and normalised Wasserstein for numbers, PSI, chi²
and Jensen–Shannon for categories, and the unit-change detector.

Every statistic is computed for every compared column; ``DriftConfig.numeric`` / ``categorical``
choose the one that decides (``auto``: a p-value test when the smaller side has at most
``small_sample`` rows, a distance above, where p-value tests reject for differences too small to
matter — Evidently's defaults). A column drifted when that statistic crosses its threshold or a unit
change was found. The p-value thresholds hold for the whole table: with m columns compared, each
is tested at ``level / m`` (Bonferroni), so an unchanged table raises a false alarm with
probability at most ``ks_pvalue`` / ``chi2_pvalue``.

- ``psi``: bins cut at the reference's ``bins``-quantiles (ties merged; the outer bins are open, so
  values beyond the reference's range land in them), each side's bin shares floored at 1e-4 before
  ``Σ (c − r) · ln(c / r)`` (Evidently's smoothing: an empty bin costs a bounded amount, not ∞).
  Over categories, one bin per category seen on either side.
- ``ks`` / ``ks_pvalue``: the two-sample Kolmogorov–Smirnov statistic, exact from the merged sorted
  samples, and scipy's asymptotic p-value (``kstwo`` at n·m/(n+m); ``kstwobign`` past 10,000),
  which is conservative with ties.
- ``wasserstein``: the 1-Wasserstein distance, exact from the same merge, divided by the
  reference's standard deviation (0 → its mean |value|, 0 again → 1): a shift in reference σ units.
- ``chi2_pvalue``: Pearson's chi² test of homogeneity on the 2 × categories table of counts
  (categories seen in either side, so a new one counts); ``jensen_shannon``: the Jensen–Shannon
  distance (base 2, in [0, 1]) of the category shares, less its sampling bias (see
  :func:`_unbiased_js`: with many categories and few rows each, the raw distance is large between
  two samples of one distribution).

Nulls, NaN and ±inf are dropped per column; their share is the ``null_share_reference`` /
``null_share_current`` statistic. Each numeric column is sorted once per side; everything else is
derived from the sorted arrays (1 M × 20 against 1 M × 20 takes seconds).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from vatra.data.tables import drift_units
from vatra.data.tables.drift_units import UnitChange
from vatra.errors import ConfigError

if TYPE_CHECKING:
    from vatra.config import DriftConfig

__all__ = ["ColumnDrift", "DriftReport", "UnitChange", "compare"]

PSI_FLOOR = 1e-4
UNIT_EVIDENCE = 1e-3  # a whole-column unit change must be a significant change: KS p below this, per table
MAX_NEW_NAMES = 20
MAX_LISTED = 3  # unit changes (sources) named per column in a reason
DECIDING_STAT = {  # method -> (statistic, drifted when above (True) or below (False) the threshold)
    "psi": ("psi", True),
    "ks": ("ks_pvalue", False),
    "wasserstein": ("wasserstein", True),
    "chi2": ("chi2_pvalue", False),
    "jensen_shannon": ("jensen_shannon", True),
}


@dataclass(frozen=True)
class ColumnDrift:
    """One compared column: every statistic, the one that decided, and any unit change."""

    column: str
    kind: Literal["numeric", "categorical"]
    stats: dict[str, float]
    method: str  # the statistic that decided: psi, ks, wasserstein, chi2, jensen_shannon
    drifted: bool  # the deciding statistic crossed its threshold, or a unit change was found
    unit: UnitChange | None  # the unit change covering the most rows
    rows: tuple[int, int]  # (reference, current) non-null rows
    units: tuple[UnitChange, ...] = ()  # every unit change found (one per source when per source)
    new_categories: tuple[str, ...] = ()  # current categories the reference lacks (most rows first, ≤ 20)
    threshold: float = math.nan  # the deciding statistic's threshold

    @property
    def crossed(self) -> bool:
        """Whether the deciding statistic alone crossed its threshold."""
        stat, above = DECIDING_STAT[self.method]
        value = self.stats[stat]
        return value > self.threshold if above else value < self.threshold

    @property
    def reason(self) -> str:
        """Why the column drifted, in words ('' when it did not)."""
        parts = [
            f"unit change {u.name} in {_percent(u.fraction)} of rows"
            + (f" (source {u.source!r})" if u.source is not None else "")
            for u in self.units[:MAX_LISTED]
        ]
        if len(self.units) > MAX_LISTED:
            parts.append(f"{len(self.units) - MAX_LISTED} more sources")
        if self.crossed:
            stat, above = DECIDING_STAT[self.method]
            label = {"ks": "ks p", "chi2": "chi² p"}.get(self.method, self.method)
            parts.append(f"{label} {self.stats[stat]:.3g} {'>' if above else '<'} {self.threshold:g}")
        if parts and self.new_categories:
            parts.append("new: " + ", ".join(repr(c) for c in self.new_categories[:3]))
        return "; ".join(parts)


@dataclass
class DriftReport:
    """Every compared column, and the columns left out with why."""

    columns: list[ColumnDrift]
    skipped: dict[str, str] = field(default_factory=dict)  # column -> why it was not compared
    source_column: str = ""

    @property
    def drifted(self) -> list[str]:
        """Columns that drifted or changed units."""
        return [c.column for c in self.columns if c.drifted]

    @property
    def unit_changes(self) -> list[UnitChange]:
        return [u for c in self.columns for u in c.units]

    def summary_line(self) -> str:
        drifted = [c for c in self.columns if c.drifted]
        skipped = f"; {len(self.skipped)} skipped" if self.skipped else ""
        if not drifted:
            return f"no drift in {len(self.columns)} columns{skipped}"
        named = ", ".join(f"{c.column} ({c.reason})" for c in drifted)
        return f"{len(drifted)} of {len(self.columns)} columns drifted: {named}{skipped}"

    def to_json(self) -> dict[str, Any]:
        return _plain(
            {
                "summary": self.summary_line(),
                "drifted": self.drifted,
                "columns": [{**asdict(c), "reason": c.reason} for c in self.columns],
                "skipped": self.skipped,
                "source_column": self.source_column or None,
            }
        )


def _plain(value: Any) -> Any:
    """JSON values only: tuples as lists, numpy scalars as Python, NaN/inf as null."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _percent(share: float) -> str:
    return f"{100 * share:.3g}%"


def _kind(t: pa.DataType) -> Literal["numeric", "categorical"] | None:
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t):
        return "numeric"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_boolean(t):
        return "categorical"
    if pa.types.is_dictionary(t):
        return _kind(t.value_type) and "categorical"
    return None


def numeric_values(column: pa.ChunkedArray) -> np.ndarray:
    """float64 values, NaN where null (and wherever the column held NaN or ±inf)."""
    values = pc.cast(column, pa.float64()).to_numpy()
    return np.where(np.isfinite(values), values, np.nan)


def category_values(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """The column as strings (booleans as "true"/"false"), nulls kept."""
    return pc.cast(column, pa.string())


def _columns(
    reference: pa.Table, current: pa.Table, cfg: DriftConfig, source_column: str
) -> tuple[list[str], dict[str, str]]:
    ref, cur = set(reference.column_names), set(current.column_names)
    if cfg.columns:
        unknown = [c for c in cfg.columns if c not in ref and c not in cur]
        if unknown:
            raise ConfigError(
                f"data.drift.columns: {', '.join(map(repr, unknown))} is in neither table; "
                f"columns: {', '.join(sorted(ref | cur))}"
            )
        wanted = list(cfg.columns)
    else:
        wanted = [*reference.column_names, *(c for c in current.column_names if c not in ref)]
    left_out = {*cfg.ignore, source_column}
    names, skipped = [], {}
    for name in wanted:
        if name in left_out:
            continue
        if name not in cur or name not in ref:
            skipped[name] = f"only in the {'reference' if name in ref else 'current rows'}"
            continue
        tr, tc = reference.schema.field(name).type, current.schema.field(name).type
        kr, kc = _kind(tr), _kind(tc)
        if kr is None or kc is None:
            skipped[name] = f"type {tr if kr is None else tc} is not compared (numbers and categories are)"
        elif kr != kc:
            skipped[name] = f"type clash: reference {tr}, current {tc}"
        elif reference[name].null_count == len(reference) or current[name].null_count == len(current):
            side = "reference" if reference[name].null_count == len(reference) else "current rows"
            skipped[name] = f"all null in the {side}"
        else:
            names.append(name)
    return names, skipped


def _groups(table: pa.Table, column: str) -> dict[str, np.ndarray]:
    """Row indices per source value (the value cast to a string; nulls as '(null)')."""
    encoded = pc.dictionary_encode(category_values(table[column]).combine_chunks(), null_encoding="encode")
    codes = encoded.indices.to_numpy(zero_copy_only=False)
    order = np.argsort(codes, kind="stable")
    bounds = np.flatnonzero(np.diff(codes[order])) + 1
    labels = ["(null)" if v is None else v for v in encoded.dictionary.to_pylist()]
    return {labels[codes[idx[0]]]: idx for idx in np.split(order, bounds) if len(idx)}


@dataclass(frozen=True)
class _Sources:
    column: str
    reference: dict[str, np.ndarray]
    current: dict[str, np.ndarray]
    rows: int  # current rows (all sources)


def _sources(reference: pa.Table, current: pa.Table, column: str) -> _Sources | None:
    if not column:
        return None
    if column not in current.column_names:
        raise ConfigError(
            f"data.source_column: {column!r} is not a column of the current rows; "
            f"columns: {', '.join(current.column_names)} (or set it to '')"
        )
    ref = _groups(reference, column) if column in reference.column_names else {}
    return _Sources(column, ref, _groups(current, column), len(current))


def _finite_sorted(values: np.ndarray) -> np.ndarray:
    return np.sort(values[~np.isnan(values)])


def _psi(r: np.ndarray, c: np.ndarray) -> float:
    """PSI of two share vectors, shares floored at ``PSI_FLOOR``."""
    r, c = np.maximum(r, PSI_FLOOR), np.maximum(c, PSI_FLOOR)
    return float(((c - r) * np.log(c / r)).sum())


def _ks_wasserstein(r: np.ndarray, c: np.ndarray) -> tuple[float, float]:
    """KS statistic and 1-Wasserstein distance of two sorted samples, exact, from one merge."""
    merged = np.concatenate([r, c])
    order = np.argsort(merged, kind="stable")  # two sorted runs: timsort merges them in O(n)
    values = merged[order]
    in_r = np.cumsum(order < len(r))  # reference rows ≤ each merged value (counting ties in order)
    in_c = np.arange(1, len(values) + 1) - in_r
    gap = np.abs(in_r * (1.0 / len(r)) - in_c * (1.0 / len(c)))
    last_of_tie = np.append(values[1:] != values[:-1], True)  # the CDFs are defined after a tie
    return float(gap[last_of_tie].max()), float(gap[:-1] @ np.diff(values))


def _ks_pvalue(ks: float, n: float) -> float:
    """scipy's asymptotic two-sample p-value (``kstwo`` at the effective size n·m/(n+m)); above
    10,000 its limit ``kstwobign`` (35 ms → µs per column at 1 M rows, same value to 3 digits)."""
    from scipy.stats import kstwo, kstwobign

    return float(kstwo.sf(ks, round(n)) if n <= 10_000 else kstwobign.sf(ks * math.sqrt(n)))


def numeric_stats(r: np.ndarray, c: np.ndarray, bins: int) -> dict[str, float]:
    """PSI, KS (statistic and p-value) and normalised Wasserstein of two sorted, non-empty samples."""
    edges = np.unique(drift_units.quantiles(r, np.linspace(0.0, 1.0, bins + 1)[1:-1]))
    shares = [
        np.diff(np.searchsorted(x, edges, side="right"), prepend=0, append=len(x)) / len(x) for x in (r, c)
    ]
    ks, w1 = _ks_wasserstein(r, c)
    std = float(r.std())
    scale = std if std > 0.0 else float(np.abs(r).mean()) or 1.0
    return {
        "psi": _psi(*shares),
        "ks": ks,
        "ks_pvalue": _ks_pvalue(ks, len(r) * len(c) / (len(r) + len(c))),
        "wasserstein": w1 / scale,
    }


def categorical_stats(r: dict[str, int], c: dict[str, int]) -> dict[str, float]:
    """PSI, chi² p-value and Jensen–Shannon distance of two category → count maps."""
    from scipy.spatial.distance import jensenshannon
    from scipy.stats import chi2_contingency

    cats = sorted(r.keys() | c.keys())
    counts = np.array([[r.get(k, 0) for k in cats], [c.get(k, 0) for k in cats]], dtype=np.float64)
    shares = counts / counts.sum(axis=1, keepdims=True)
    pvalue = 1.0 if len(cats) < 2 else float(chi2_contingency(counts, correction=False).pvalue)
    return {
        "psi": _psi(shares[0], shares[1]),
        "chi2_pvalue": pvalue,
        "jensen_shannon": _unbiased_js(
            float(jensenshannon(shares[0], shares[1], base=2.0)), len(cats), counts.sum(axis=1)
        ),
    }


def _unbiased_js(distance: float, categories: int, rows: np.ndarray) -> float:
    """The Jensen–Shannon distance less what sampling alone gives. Between two samples of one
    distribution the divergence (base 2) averages (k − 1)(1/n₁ + 1/n₂) / (8 ln 2) for k categories
    (it is a G-test statistic over 4·n·ln 2): 0.018, a distance of 0.13, for 1,000 categories
    of 20,000 rows a side, which would alarm on every unchanged table. That expectation is taken
    off the divergence (not below 0) before the square root."""
    bias = (categories - 1) * float((1.0 / rows).sum()) / (8.0 * math.log(2.0))
    return math.sqrt(max(distance * distance - bias, 0.0))


def _decide(
    kind: Literal["numeric", "categorical"], stats: dict[str, float], rows: tuple[int, int], cfg: DriftConfig
) -> tuple[str, float]:
    small = min(rows) <= cfg.small_sample
    method: str
    if kind == "numeric":
        method = cfg.numeric if cfg.numeric != "auto" else ("ks" if small else "wasserstein")
        thresholds = {"psi": cfg.psi, "ks": cfg.ks_pvalue, "wasserstein": cfg.wasserstein}
    else:
        method = cfg.categorical if cfg.categorical != "auto" else ("chi2" if small else "jensen_shannon")
        thresholds = {"psi": cfg.psi, "chi2": cfg.chi2_pvalue, "jensen_shannon": cfg.jensen_shannon}
    return method, thresholds[method]


def _changed(r: np.ndarray, c: np.ndarray, level: float) -> bool:
    """Whether ``c`` differs from ``r`` beyond doubt (KS p < ``level``): a quantile fit that matches a
    known factor on a hundred rows of a skewed column can be chance, and a table has many (column,
    source) pairs to be lucky in, so ``level`` is ``UNIT_EVIDENCE`` shared among them (Bonferroni)."""
    ks, _ = _ks_wasserstein(r, c)
    return _ks_pvalue(ks, len(r) * len(c) / (len(r) + len(c))) < level


def _units(
    name: str,
    r: np.ndarray,
    c: np.ndarray,
    r_all: np.ndarray,
    c_all: np.ndarray,
    cfg: DriftConfig,
    sources: _Sources | None,
    level: float,
) -> tuple[UnitChange, ...]:
    """Unit changes in one numeric column: per source first (naming it), else over all rows. The
    same change in every source is one change of the whole column (source None)."""

    def find(ref: np.ndarray, cur: np.ndarray) -> tuple[drift_units.UnitMap, float] | None:
        whole = drift_units.whole_column(ref, cur, cfg.unit_tolerance)
        if whole and _changed(ref, cur, level):
            return whole, 1.0
        part = drift_units.mixture(ref, cur, cfg.unit_tolerance, cfg.unit_min_fraction)
        # most rows changed is a whole-column claim: the same evidence (a few changed rows are
        # held to the mixture's own tail test, which a KS test could not see)
        return part if part is not None and (part[1] < 0.5 or _changed(ref, cur, level)) else None

    found: list[UnitChange] = []
    tested = 0
    if sources is not None:
        for label, rows in sources.current.items():
            cur = _finite_sorted(c_all[rows])
            own = sources.reference.get(label)
            ref = _finite_sorted(r_all[own]) if own is not None else r
            tested += len(cur) >= drift_units.MIN_ROWS
            if hit := find(ref if len(ref) >= drift_units.MIN_ROWS else r, cur):
                m, f = hit
                found.append(UnitChange(name, m.slope, m.name, f * len(cur) / len(c), label, m.offset))
        if tested > 1 and len(found) == tested and len({u.name for u in found}) == 1:
            found = [replace(found[0], fraction=sum(u.fraction for u in found), source=None)]
    if not found and (hit := find(r, c)):
        found.append(UnitChange(name, hit[0].slope, hit[0].name, hit[1], None, hit[0].offset))
    return tuple(sorted(found, key=lambda u: -u.fraction))


def _numeric_column(
    name: str,
    reference: pa.Table,
    current: pa.Table,
    cfg: DriftConfig,
    sources: _Sources | None,
    level: float = UNIT_EVIDENCE,
) -> ColumnDrift | None:
    r_all, c_all = numeric_values(reference[name]), numeric_values(current[name])
    r, c = _finite_sorted(r_all), _finite_sorted(c_all)
    if not len(r) or not len(c):
        return None
    stats = numeric_stats(r, c, cfg.bins)
    stats["null_share_reference"] = 1.0 - len(r) / len(r_all)
    stats["null_share_current"] = 1.0 - len(c) / len(c_all)
    units = _units(name, r, c, r_all, c_all, cfg, sources, level) if cfg.units else ()
    return _finish(name, "numeric", stats, (len(r), len(c)), cfg, units, ())


def category_counts(column: pa.ChunkedArray) -> dict[str, int]:
    """Rows per category (nulls left out)."""
    vc = pc.value_counts(pc.drop_null(category_values(column)))
    return dict(zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist(), strict=True))


def _categorical_column(name: str, reference: pa.Table, current: pa.Table, cfg: DriftConfig) -> ColumnDrift:
    r, c = category_counts(reference[name]), category_counts(current[name])
    stats = categorical_stats(r, c)
    nr, nc = sum(r.values()), sum(c.values())
    new = sorted((k for k in c if k not in r), key=lambda k: (-c[k], k))
    stats["new_categories"] = float(len(new))
    stats["new_share"] = sum(c[k] for k in new) / nc
    stats["null_share_reference"] = 1.0 - nr / len(reference)
    stats["null_share_current"] = 1.0 - nc / len(current)
    return _finish(name, "categorical", stats, (nr, nc), cfg, (), tuple(new[:MAX_NEW_NAMES]))


def _finish(
    name: str,
    kind: Literal["numeric", "categorical"],
    stats: dict[str, float],
    rows: tuple[int, int],
    cfg: DriftConfig,
    units: tuple[UnitChange, ...],
    new: tuple[str, ...],
) -> ColumnDrift:
    method, threshold = _decide(kind, stats, rows, cfg)
    stat, above = DECIDING_STAT[method]
    crossed = stats[stat] > threshold if above else stats[stat] < threshold
    unit = units[0] if units else None
    return ColumnDrift(name, kind, stats, method, crossed or bool(units), unit, rows, units, new, threshold)


def compare(
    reference: pa.Table, current: pa.Table, cfg: DriftConfig, *, source_column: str = ""
) -> DriftReport:
    """Compare ``current`` with ``reference`` column by column (see the module docstring).

    Columns: ``cfg.columns`` or every column both sides have, less ``cfg.ignore`` and
    ``source_column``; with ``source_column``, each source's current rows are also checked for a
    unit change against that source's reference rows (the whole reference for a new source).
    """
    names, skipped = _columns(reference, current, cfg, source_column)
    sources = _sources(reference, current, source_column)
    columns = []
    numeric = [n for n in names if _kind(reference.schema.field(n).type) == "numeric"]
    checks = len(numeric) * (1 + (len(sources.current) if sources is not None else 0))
    for name in names:
        if name in numeric:
            col = _numeric_column(name, reference, current, cfg, sources, UNIT_EVIDENCE / max(checks, 1))
            if col is None:
                skipped[name] = "only NaN or ±inf on one side"
                continue
            columns.append(col)
        else:
            columns.append(_categorical_column(name, reference, current, cfg))
    return DriftReport(_family_wise(columns), skipped, source_column)


def _family_wise(columns: list[ColumnDrift]) -> list[ColumnDrift]:
    """p-value tests held to their level for the table, not per column (Bonferroni): with m columns
    each is tested at ``level / m``, so an unchanged table raises a false alarm with probability at
    most ``level`` — not 1 − (1 − level)^m, about two in three for 20 columns at 0.05."""
    m = len(columns)
    out = []
    for col in columns:
        stat, above = DECIDING_STAT[col.method]
        if above or m == 1:
            out.append(col)
            continue
        threshold = col.threshold / m
        crossed = col.stats[stat] < threshold
        out.append(replace(col, threshold=threshold, drifted=crossed or bool(col.units)))
    return out

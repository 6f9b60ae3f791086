"""The unit-change detector: current values that are the reference's times a known unit factor.

A supplier that switches a sensor from °F to °C, or from metres to millimetres, leaves a column
whose values are still plausible numbers. Two tests look for that, on sorted arrays only (interval
counts and quantiles are binary searches, so a 1 M-row column costs microseconds after its sort):

- **whole column**: the current quantiles (5 … 95 %) against the reference's, fitted as
  ``current = k · reference`` (least squares through the origin) and as ``a · reference + b`` for
  the °F↔°C maps. The fit must land within ``unit_tolerance`` of a known map *and* explain the
  quantiles (median residual ≤ 5 % of the current 5–95 % spread, and ≥ 2× better than no change):
  a mean shift or a ×1.3 scale matches no known map, and a plain mean shift onto ×10 of the
  reference fails the shape check (a unit change scales the spread too). No per-quantile ratio
  is taken, so zero-centred and negative columns need no special case: quantiles near 0 carry
  little weight in the least-squares slope.
- **subset (mixture)**: a 2 % subset scaled ×100 barely moves the middle quantiles and falls in
  PSI's open top bin. A known map g is tested when the current rows that lie outside the
  reference's 0.1–99.9 % range while g⁻¹ of them falls in its 5–95 % central range are
  significantly more (two-proportion z ≥ 5) than the reference's own such share. Then
  ``(1 − f) · reference + f · k · reference`` is fitted (share f and factor k, k free within a
  factor 2 of g's) to the current shares of cells cut at the reference's quantiles and their images;
  the fit must pass a chi² test (α = 0.001, each cell's variance widened by 10 % of its share: real
  data drifts a little besides a unit change), and g is named only when k is within
  ``unit_tolerance`` of it or g itself fits about as well (Δchi² ≤ 3.84, for few changed rows).
  Cells weigh by their share, so tails count; with the free factor this keeps a subset ×1.5 from
  being read as mi→km (×1.609). A single affine map of every row that fits as well wins over the
  mixture (a zero-centred column ×1.6 is not half its rows in kg→lb). The test assumes the changed
  rows follow the reference's distribution; a change confined to one source is found per source
  (``data.source_column``) by the caller, whose rows are compared with that source's reference rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

_X = TypeVar("_X", float, np.ndarray)

MIN_ROWS = 50  # fewer rows on either side: quantiles too noisy to name a unit
FIT_RESIDUAL = 0.05  # whole column: median |current − fitted map| / current 5–95 % spread
IDENTITY_RATIO = 2.0  # ... and the identity must fit this many times worse
FIT_LEVELS = np.linspace(0.05, 0.95, 19)
RANGE = (0.001, 0.999)  # "outside the reference": beyond these quantiles
CENTRAL = (0.05, 0.95)  # where g⁻¹ of a changed value should land
CELL_LEVELS = np.array([0.001, 0.01, 0.05, *np.linspace(0.1, 0.9, 9), 0.95, 0.99, 0.999])
Z_MIN = 5.0  # excess beyond the range: a one-sided z this large is no resampling accident
MIX_ALPHA = 1e-3  # the mixture must fit the cells at this chi² level ...
MIX_SLACK = 0.1  # ... allowing each cell this relative error: real data drifts a little besides
FRACTIONS = np.linspace(0.0, 1.0, 501)  # the grid the changed share f is fitted on
SCALES = np.linspace(-2.0, 2.0, 21)  # × unit_tolerance: the grid a known map is refitted on
LOG_SCALES = np.arange(-6.5, 6.5, 0.02)  # log10 of the scales a subset's free factor is fitted on ...
FINE_STEPS = np.arange(-0.03, 0.0305, 0.001)  # ... then refined on
ONE = np.ones(1)
DELTA_CHI2 = 3.84  # chi² (1 dof) at α = 0.05: a factor outside the tolerance that fits this much better wins
DETECTABLE = 0.05  # share of changed rows that must land outside the reference for g to be testable


@dataclass(frozen=True)
class UnitChange:
    """A unit change found in a column: ``current ≈ factor · reference + offset`` for a share of rows."""

    column: str
    factor: float  # the map's slope: ×100, 2.54 (in→cm), 5/9 (°F→°C)
    name: str  # "×100", "in→cm (×2.54)", "°F→°C"
    fraction: float  # share of the current rows (all sources) that changed
    source: str | None = None  # the source value, when found per source
    offset: float = 0.0  # the affine maps' intercept (°F→°C: −160/9); 0 for a factor


@dataclass(frozen=True)
class UnitMap:
    """A known unit map ``x ↦ slope · x + offset`` (slope > 0)."""

    name: str
    slope: float
    offset: float = 0.0

    def __call__(self, x: _X) -> _X:
        return self.slope * x + self.offset

    def inverse(self, x: _X) -> _X:
        return (x - self.offset) / self.slope


def _known_maps() -> tuple[UnitMap, ...]:
    maps = []
    for n in range(1, 7):
        maps += [UnitMap(f"×{10**n:,}", 10.0**n), UnitMap(f"÷{10**n:,}", 10.0**-n)]
    named = [("in→cm (×2.54)", "cm→in (÷2.54)", 2.54), ("lb→kg (×0.4536)", "kg→lb (÷0.4536)", 0.45359237)]
    named.append(("mi→km (×1.609)", "km→mi (÷1.609)", 1.609344))
    for forward, back, k in named:
        maps += [UnitMap(forward, k), UnitMap(back, 1.0 / k)]
    return (*maps, UnitMap("°F→°C", 5.0 / 9.0, -160.0 / 9.0), UnitMap("°C→°F", 9.0 / 5.0, 32.0))


KNOWN_MAPS = _known_maps()


def quantiles(values: np.ndarray, levels: np.ndarray | tuple[float, ...]) -> np.ndarray:
    """Quantiles of a *sorted* array, linearly interpolated (numpy's default), without a partition."""
    pos = np.asarray(levels, dtype=np.float64) * (len(values) - 1)
    lo = np.floor(pos).astype(np.int64)
    hi = np.minimum(lo + 1, len(values) - 1)
    return values[lo] + (pos - lo) * (values[hi] - values[lo])


def _cdf(values: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Share of a sorted array ≤ each point."""
    return np.searchsorted(values, at, side="right") / len(values)


def whole_column(reference: np.ndarray, current: np.ndarray, tolerance: float) -> UnitMap | None:
    """The known map that turns the sorted reference into the sorted current column, if one does."""
    if min(len(reference), len(current)) < MIN_ROWS:
        return None
    qr, qc = quantiles(reference, FIT_LEVELS), quantiles(current, FIT_LEVELS)
    spread = max(qc[-1] - qc[0], 1e-12 * float(np.abs(qc).max()))
    if spread <= 0.0:
        return None  # the current column is all zeros: no scale to compare

    def residual(slope: float, offset: float) -> float:
        return float(np.median(np.abs(qc - (slope * qr + offset)))) / spread

    ss = float(qr @ qr)
    fits: dict[str, tuple[float, float] | None] = {
        "scale": (float(qr @ qc) / ss, 0.0) if ss > 0.0 else None,
        "affine": None,
    }
    if qr[-1] > qr[0]:
        a, b = np.polyfit(qr, qc, 1)
        fits["affine"] = (float(a), float(b))
    identity = residual(1.0, 0.0)
    residuals = {kind: residual(*fit) for kind, fit in fits.items() if fit is not None}
    best: tuple[float, UnitMap] | None = None
    for m in KNOWN_MAPS:
        kind = "affine" if m.offset else "scale"
        fit = fits[kind]
        known = np.abs(m(qr)).max()
        if fit is None or known == 0.0:
            continue
        distance = float(np.abs((fit[0] - m.slope) * qr + (fit[1] - m.offset)).max() / known)
        res = residuals[kind]
        fits_known = distance <= tolerance and res <= FIT_RESIDUAL and identity >= IDENTITY_RATIO * res
        if fits_known and (best is None or res < best[0]):
            best = (res, m)
    return best[1] if best else None


def _outside(m: UnitMap, lo_r: float, hi_r: float, lo_c: float, hi_c: float) -> list[tuple[float, float]]:
    """Intervals ``(u, v]`` of g(central range) that lie outside the reference's range."""
    g_lo, g_hi = m(lo_c), m(hi_c)
    parts = []
    if g_lo < lo_r:
        parts.append((np.nextafter(g_lo, -np.inf), np.nextafter(min(g_hi, lo_r), -np.inf)))
    if g_hi > hi_r:
        parts.append((max(g_lo, hi_r), g_hi))
    return [(float(u), float(v)) for u, v in parts if v > u]


def _share(values: np.ndarray, parts: list[tuple[float, float]]) -> float:
    edges = np.asarray(parts, dtype=np.float64).ravel()
    counts = np.searchsorted(values, edges, side="right")
    return float((counts[1::2] - counts[0::2]).sum()) / len(values)


def _excess(reference: np.ndarray, current: np.ndarray, m: UnitMap, bounds: tuple[float, ...]) -> bool:
    """Whether significantly more current rows than reference rows lie outside the reference's
    range where ``m`` of its central range lands (and enough changed rows would land there).
    ``bounds``: the reference's RANGE and CENTRAL quantiles."""
    nr, nc = len(reference), len(current)
    parts = _outside(m, *bounds)
    if not parts:
        return False  # m(central) lies inside the reference's range: changed rows would hide there
    s_r, s_c = _share(reference, parts), _share(current, parts)
    detectable = _share(reference, [(m.inverse(u), m.inverse(v)) for u, v in parts])
    pooled = (s_r * nr + s_c * nc) / (nr + nc)
    if pooled <= 0.0 or detectable - s_r < DETECTABLE:
        return False
    return (s_c - s_r) / math.sqrt(pooled * (1.0 - pooled) * (1.0 / nr + 1.0 / nc)) >= Z_MIN


def _scores(
    reference: np.ndarray,
    current: np.ndarray,
    slopes: np.ndarray,
    offsets: np.ndarray,
    cell_edges: np.ndarray,
    fractions: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """For each map ``x ↦ slope · x + offset``: how well ``(1 − f) · reference + f · map(reference)``
    fits the current rows' shares of cells cut at ``cell_edges`` and their images, for the best f of
    ``fractions``. Returns (chi², that f), one per map."""
    nr, nc = len(reference), len(current)
    images = slopes[:, None] * cell_edges[None, :] + offsets[:, None]  # (maps, L)
    edges = np.sort(np.concatenate([np.broadcast_to(cell_edges, images.shape), images], axis=1), axis=1)
    back = (edges - offsets[:, None]) / slopes[:, None]

    def shares(values: np.ndarray, at: np.ndarray) -> np.ndarray:  # (maps, 2L + 1)
        cdf = np.searchsorted(values, at.ravel(), side="right").reshape(at.shape) / len(values)
        return np.diff(cdf, prepend=0.0, append=1.0, axis=1)

    unchanged, changed, seen = shares(reference, edges), shares(reference, back), shares(current, edges)
    model = unchanged[:, None, :] + fractions[None, :, None] * (changed - unchanged)[:, None, :]
    floor = np.maximum(model, 1.0 / nc)  # (maps, fractions, cells)
    var = floor * (1.0 / nr + 1.0 / nc) + (MIX_SLACK * floor) ** 2
    score = ((seen[:, None, :] - model) ** 2 / var).sum(axis=2)
    best = score.argmin(axis=1)
    return score[np.arange(len(slopes)), best], fractions[best]


def _free_scale(
    reference: np.ndarray, current: np.ndarray, cell_edges: np.ndarray, near: list[float]
) -> tuple[float, float, float]:
    """The scale k within a factor 2 of any of ``near`` and share f of the best-fitting subset
    mixture: (chi², k, f). A coarse log grid, then a fine one around its three best local minima."""
    logs = np.log10(near)
    coarse = LOG_SCALES[(np.abs(LOG_SCALES[:, None] - logs[None, :]) <= 0.3).any(axis=1)]
    score, _ = _scores(reference, current, 10.0**coarse, np.zeros(len(coarse)), cell_edges, FRACTIONS[::5])
    minima = np.flatnonzero((score <= np.roll(score, 1)) & (score <= np.roll(score, -1)))
    best = (math.inf, 1.0, 0.0)
    for i in minima[np.argsort(score[minima])[:3]]:
        fine = coarse[i] + FINE_STEPS
        s, f = _scores(reference, current, 10.0**fine, np.zeros(len(fine)), cell_edges, FRACTIONS)
        j = int(s.argmin())
        best = min(best, (float(s[j]), float(10.0 ** fine[j]), float(f[j])))
    return best


def _name(
    best: tuple[float, float, float], exact: tuple[float, float], tolerance: float
) -> tuple[float, float] | None:
    """(chi², f) to report a known map with, from the best free fit (chi², its scale relative to
    the map, f) and the map's exact fit (chi², f): the free fit when its scale is within the
    tolerance, else the exact one when not significantly worse (Δchi² ≤ DELTA_CHI2: a few changed
    rows pin no scale), else None."""
    score, scale, f = best
    if abs(scale - 1.0) <= tolerance:
        return score, f
    return exact if exact[0] - score <= DELTA_CHI2 else None


def mixture(
    reference: np.ndarray, current: np.ndarray, tolerance: float, min_fraction: float
) -> tuple[UnitMap, float] | None:
    """The known map and the share of current rows it was applied to, if a subset of the sorted
    current rows is the sorted reference in other units (see the module docstring)."""
    if min(len(reference), len(current)) < MIN_ROWS:
        return None
    bounds = tuple(float(q) for q in quantiles(reference, (*RANGE, *CENTRAL)))
    candidates = [m for m in KNOWN_MAPS if _excess(reference, current, m, bounds)]
    if not candidates:
        return None
    from scipy.stats import chi2

    cell_edges = quantiles(reference, CELL_LEVELS)
    crit = float(chi2.ppf(1.0 - MIX_ALPHA, 2 * len(cell_edges) - 2))

    def fit(slopes: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return _scores(reference, current, slopes, offsets, cell_edges, FRACTIONS)

    def exact(m: UnitMap) -> tuple[float, float]:
        score, f = fit(np.array([m.slope]), np.array([m.offset]))
        return float(score[0]), float(f[0])

    options: list[tuple[float, UnitMap, float]] = []
    scales = [m for m in candidates if not m.offset]
    if scales:
        score, k, f = _free_scale(reference, current, cell_edges, [m.slope for m in scales])
        m = min(scales, key=lambda m: abs(math.log(k / m.slope)))
        if named := _name((score, k / m.slope, f), exact(m), tolerance):
            options.append((named[0], m, named[1]))
    for m in (m for m in candidates if m.offset):
        rescale = 1.0 + tolerance * SCALES
        score_s, f_s = fit(m.slope * rescale, m.offset * rescale)
        i = int(score_s.argmin())
        if named := _name((float(score_s[i]), float(rescale[i]), float(f_s[i])), exact(m), tolerance):
            options.append((named[0], m, named[1]))
    if not options:
        return None
    score, m, f = min(options, key=lambda o: o[0])
    if score > crit or f < min_fraction:
        return None
    qr, qc = quantiles(reference, FIT_LEVELS), quantiles(current, FIT_LEVELS)
    if qr[-1] > qr[0]:
        slope, offset = np.polyfit(qr, qc, 1)
        if slope > 0.0:
            single, _ = _scores(reference, current, np.array([slope]), np.array([offset]), cell_edges, ONE)
            if single[0] <= max(score, crit):
                return None
    return m, f

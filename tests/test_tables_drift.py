"""Drift statistics and the unit-change detector: vatra.data.tables.drift and its HTML page."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from vatra.config import DriftConfig
from vatra.data.tables.drift import ColumnDrift, compare
from vatra.data.tables.drift_html import write_html
from vatra.errors import ConfigError


def _normal(seed: int, n: int = 5000, loc: float = 50.0, scale: float = 10.0) -> np.ndarray:
    return np.random.default_rng(seed).normal(loc, scale, n)


def _one(reference: np.ndarray, current: np.ndarray, **cfg: Any) -> ColumnDrift:
    report = compare(pa.table({"x": reference}), pa.table({"x": current}), DriftConfig(**cfg))
    assert [c.column for c in report.columns] == ["x"]
    return report.columns[0]


@pytest.mark.parametrize("method", ["ks", "wasserstein", "psi"])
def test_mean_shift_is_flagged(method: str) -> None:
    # Prepare: the current rows' mean moved by half a reference σ
    reference, current = _normal(0), _normal(1) + 5.0

    # Execute
    col = _one(reference, current, numeric=method)

    # Assert: the deciding statistic crossed; Wasserstein / σ reads the shift in σ units (±0.05)
    assert col.drifted and col.crossed and col.method == method
    assert col.stats["ks_pvalue"] < 1e-6
    assert col.stats["wasserstein"] == pytest.approx(0.5, abs=0.05)
    assert col.unit is None  # a shift is no unit change


@pytest.mark.parametrize("factor", [1.3, 1.5])
def test_scale_change_is_flagged_but_is_no_unit_change(factor: float) -> None:
    reference = _normal(0)
    current = 50.0 + (_normal(1) - 50.0) * factor

    for method in ("ks", "wasserstein"):
        col = _one(reference, current, numeric=method)
        assert col.drifted, method
        assert col.unit is None


def test_identical_distribution_is_not_flagged() -> None:
    reference = _normal(0)

    same = _one(reference, reference.copy(), numeric="ks")
    resample = _one(reference, _normal(1), numeric="ks")

    assert same.stats["ks"] == 0.0 and same.stats["wasserstein"] == 0.0 and same.stats["psi"] == 0.0
    assert same.stats["ks_pvalue"] == 1.0
    assert not same.drifted and not resample.drifted
    assert same.unit is None and resample.unit is None


def _sourced(seed: int, n: int, changed: str | None = None) -> pa.Table:
    """Ten sources with their own level; "s9" holds 2 % of the rows; ``changed``'s rows ×100."""
    rng = np.random.default_rng(seed)
    share = np.array([0.98 / 9] * 9 + [0.02])
    source = rng.choice(10, n, p=share)
    x = rng.normal(40.0 + 2.0 * source, 5.0)
    if changed is not None:
        x[source == int(changed[1:])] *= 100.0
    return pa.table({"site": pa.array([f"s{i}" for i in source]), "x": x})


def test_unit_change_in_two_percent_of_rows_of_one_source() -> None:
    # Prepare: one supplier (2 % of the rows) switched to a unit 100× smaller
    reference, current = _sourced(0, 20_000), _sourced(1, 20_000, changed="s9")

    # Execute
    by_source = compare(reference, current, DriftConfig(), source_column="site")
    pooled = compare(reference, current, DriftConfig())

    # Assert: named with its factor and source; PSI alone misses it (the rows land in its top bin)
    col = by_source.columns[0]
    assert [c.column for c in by_source.columns] == ["x"]  # the source column itself is not compared
    assert col.drifted and col.unit is not None
    assert (col.unit.name, col.unit.factor, col.unit.source) == ("×100", 100.0, "s9")
    assert col.unit.fraction == pytest.approx(0.02, abs=0.004)
    assert col.stats["psi"] < DriftConfig().psi
    assert "x (unit change ×100 in 1.92% of rows (source 's9'); wasserstein" in by_source.summary_line()
    assert [u.source for u in by_source.unit_changes] == ["s9"]
    # pooled, the mixture test misses it: its changed rows are one source's, not a random subset
    assert pooled.columns[1].unit is None and not pooled.unit_changes


@pytest.mark.parametrize(("loc", "scale"), [(50.0, 10.0), (0.0, 1.0), (-50.0, 5.0)])
def test_unit_change_in_two_percent_of_rows_without_sources(loc: float, scale: float) -> None:
    # positive, zero-centred and negative columns alike: the detector takes no quantile ratios
    reference = _normal(0, 20_000, loc, scale)
    current = _normal(1, 20_000, loc, scale)
    current[:400] *= 100.0

    col = _one(reference, current)

    assert col.unit is not None and col.unit.name == "×100" and col.unit.source is None
    assert col.unit.fraction == pytest.approx(0.02, abs=0.004)


def test_fahrenheit_to_celsius_on_the_whole_column() -> None:
    reference = _normal(0, loc=70.0, scale=15.0)
    current = (_normal(1, loc=70.0, scale=15.0) - 32.0) * 5.0 / 9.0

    col = _one(reference, current)

    assert col.drifted and col.unit is not None
    assert col.unit.name == "°F→°C" and col.unit.fraction == 1.0
    assert (col.unit.factor, col.unit.offset) == pytest.approx((5.0 / 9.0, -160.0 / 9.0))


@pytest.mark.parametrize(
    ("factor", "name"),
    [
        (2.54, "in→cm (×2.54)"),
        (0.45359237, "lb→kg (×0.4536)"),
        (1.609344, "mi→km (×1.609)"),
        (1e-3, "÷1,000"),
    ],
)
@pytest.mark.parametrize("loc", [50.0, 0.0])
def test_known_factor_on_the_whole_column(factor: float, name: str, loc: float) -> None:
    col = _one(_normal(0, loc=loc), _normal(1, loc=loc) * factor)

    assert col.unit is not None and col.unit.name == name and col.unit.fraction == 1.0


@pytest.mark.parametrize("loc", [50.0, 0.0])
def test_no_unit_change_for_a_subset_shifted_or_rescaled(loc: float) -> None:
    # a 10 % subset ×1.5 must not be read as mi→km (×1.609), nor a shifted subset as anything
    reference, current = _normal(0, 20_000, loc), _normal(1, 20_000, loc)
    scaled, shifted = current.copy(), current.copy()
    scaled[:2000] *= 1.5
    shifted[:2000] += 30.0

    assert _one(reference, scaled).unit is None
    assert _one(reference, shifted).unit is None


def test_categorical_shift_and_new_category() -> None:
    rng = np.random.default_rng(0)
    reference = pa.table({"colour": rng.choice(["red", "green", "blue"], 5000, p=[0.5, 0.3, 0.2])})
    current = pa.table({"colour": rng.choice(["red", "green", "blue", "teal"], 5000, p=[0.3, 0.3, 0.3, 0.1])})

    for method in ("chi2", "jensen_shannon", "psi"):
        report = compare(reference, current, DriftConfig(categorical=method))
        col = report.columns[0]
        assert col.kind == "categorical" and col.drifted and col.method == method
        assert col.new_categories == ("teal",)
        assert col.stats["new_share"] == pytest.approx(0.1, abs=0.02)
        assert "new: 'teal'" in report.summary_line()
    assert col.stats["chi2_pvalue"] < 1e-6 and 0.1 < col.stats["jensen_shannon"] <= 1.0


def test_false_alarm_rate_over_100_identical_resamples() -> None:
    """Two samples of one distribution, 100 seeds × 3 number columns (+1 category): p-value tests
    at 0.05 flag about 5 % (bound: 8 %, 2.4 binomial σ above), the distances and the unit
    detector nothing. (At 5,000 rows: Wasserstein / σ's noise is ≈ 2 / √n, so at 2,000 rows a
    resample crosses 0.1 in about 1 % of columns.)"""
    n, seeds = 5000, 100

    def sample(seed: int) -> pa.Table:
        rng = np.random.default_rng(seed)
        return pa.table(
            {
                "normal": rng.normal(0.0, 1.0, n),
                "lognormal": rng.lognormal(3.0, 1.0, n),
                "count": rng.poisson(4.0, n),
                "category": rng.choice(["a", "b", "c", "d", "e"], n),
            }
        )

    methods = {
        "psi": ("psi", "psi"),
        "p-value": ("ks", "chi2"),
        "distance": ("wasserstein", "jensen_shannon"),
    }
    flagged = {name: [0, 0] for name in methods}  # [numeric, categorical]
    units = 0
    for seed in range(seeds):
        reference, current = sample(2 * seed), sample(2 * seed + 1)
        for name, (numeric, categorical) in methods.items():
            report = compare(reference, current, DriftConfig(numeric=numeric, categorical=categorical))
            for col in report.columns:
                flagged[name][col.kind == "categorical"] += col.crossed
            units += len(report.unit_changes)

    rates = {k: (v[0] / (3 * seeds), v[1] / seeds) for k, v in flagged.items()}
    assert units == 0, rates
    assert rates["psi"] == (0.0, 0.0) and rates["distance"] == (0.0, 0.0), rates
    assert rates["p-value"][0] <= 0.08 and rates["p-value"][1] <= 0.08, rates
    assert rates["p-value"][0] > 0.0  # the test can reject: not a statistic stuck at p = 1


def _mixed(seed: int, *, drift: bool) -> pa.Table:
    rng = np.random.default_rng(seed)
    temp = rng.normal(70.0, 15.0, 3000)
    return pa.table(
        {
            "temp": (temp - 32.0) * 5.0 / 9.0 if drift else temp,
            "load": rng.normal(0.0, 1.0, 3000) + (0.5 if drift else 0.0),
            "kind": rng.choice(["a", "b"], 3000),
            "id": np.arange(3000),
            "old": rng.normal(size=3000) if not drift else pa.nulls(3000, pa.float64()),
            **({"extra": rng.normal(size=3000)} if drift else {"when": pa.array(["x"] * 3000)}),
        }
    )


def test_tables_hold_their_false_alarm_level_not_each_column() -> None:
    """Unchanged tables: a 1,000-category column whose raw Jensen–Shannon distance between two
    samples is ~0.13 (sampling alone), p-value tests on 9 columns at once, and per-source unit
    checks on ~100-row groups of a skewed column — none of them may alarm."""
    rng = np.random.default_rng(7)

    def sample(n: int, numbers: int = 8) -> pa.Table:
        cols: dict[str, Any] = {f"x{i}": rng.lognormal(1.0, 0.8, n) for i in range(numbers)}
        cols["code"] = pa.array(rng.integers(0, 1000, n).astype(str))
        cols["site"] = pa.array(rng.integers(0, 10, n).astype(str))
        return pa.table(cols)

    big = compare(sample(20_000, 1), sample(20_000, 1), DriftConfig())
    code = next(c for c in big.columns if c.column == "code")
    assert code.method == "jensen_shannon" and code.stats["jensen_shannon"] < 0.05 and not big.drifted
    alarms = sum(
        bool(compare(sample(1000), sample(1000), DriftConfig(), source_column="site").drifted)
        for _ in range(20)
    )
    assert alarms <= 3  # Bonferroni over 19 KS/chi² columns: ≤ 5 % of tables in expectation


def test_summary_json_and_html_page(tmp_path: Path) -> None:
    reference, current = _mixed(0, drift=False), _mixed(1, drift=True)

    report = compare(reference, current, DriftConfig(ignore=["id"]))
    page = write_html(report, reference, current, tmp_path / "out" / "drift.html", title="drift of v3 vs v1")

    assert report.drifted == ["temp", "load"]
    assert report.skipped == {
        "old": "all null in the current rows",
        "when": "only in the reference",
        "extra": "only in the current rows",
    }
    line = report.summary_line()
    assert line.startswith("2 of 3 columns drifted: temp (unit change °F→°C in 100% of rows; wasserstein ")
    assert "load (wasserstein 0.4" in line and line.endswith("; 3 skipped")
    doc = report.to_json()
    assert json.loads(json.dumps(doc, allow_nan=False)) == doc  # plain JSON values only
    temp = doc["columns"][0]
    assert (
        temp["unit"]["name"] == "°F→°C"
        and temp["rows"] == [3000, 3000]
        and doc["drifted"] == ["temp", "load"]
    )
    text = page.read_text()
    assert page.is_file() and text.count("<img ") == 3  # one per compared column
    assert "drift of v3 vs v1" in text and "°F→°C" in text and "<b>temp</b>" in text


def test_null_shares_and_column_choice() -> None:
    x = pa.array([1.0, None, 3.0, float("nan")] * 50)
    y = pa.array([1.0, 2.0, 3.0, 4.0] * 50)
    table = pa.table({"x": x, "y": y, "flag": pa.array([True, False] * 100)})

    report = compare(table, table.set_column(0, "x", y), DriftConfig(columns=["x", "flag"]))

    x_col, flag = report.columns
    assert x_col.stats["null_share_reference"] == 0.5 and x_col.stats["null_share_current"] == 0.0
    assert x_col.rows == (100, 200) and flag.kind == "categorical"
    with pytest.raises(ConfigError, match="'nope' is in neither table"):
        compare(table, table, DriftConfig(columns=["nope"]))
    with pytest.raises(ConfigError, match=r"data\.source_column: 'site' is not a column"):
        compare(table, table, DriftConfig(), source_column="site")
    clash = compare(table, table.set_column(1, "y", pa.array(["a"] * 200)), DriftConfig())
    assert clash.skipped == {"y": "type clash: reference double, current string"}

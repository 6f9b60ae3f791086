"""The pinned table schema: inference, YAML round trip, lazy validation, explicit evolution."""

from __future__ import annotations

import pytest

pa = pytest.importorskip("pyarrow")
pd = pytest.importorskip("pandas")
pandera = pytest.importorskip("pandera.pandas")
pytest.importorskip("yaml")

from vatra.data.tables._column_rules import widened_bounds  # noqa: E402
from vatra.data.tables.schema import TableSchema, Violation, report_lines, summary_line  # noqa: E402
from vatra.errors import ConfigError  # noqa: E402

CITIES = ["Osijek", "Split", "Zagreb"]


def first_batch() -> pa.Table:
    """What a first CSV ingest gives: integer ages, float prices with a gap, city names, timestamps."""
    n = 200
    return pa.table(
        {
            "age": pa.array([18 + i % 73 for i in range(n)], pa.int64()),  # 18..90
            "price": pa.array([None if i == 7 else 10.0 + i * 2.5 for i in range(n)], pa.float64()),
            "city": pa.array([CITIES[i % 3] for i in range(n)]),
            "member": pa.array([i % 2 == 0 for i in range(n)]),
            "seen": pa.array(range(n), pa.timestamp("s")),
            "user": pa.array([f"u{i}" for i in range(n)]),  # ids: too many values for categories
        }
    )


def nullable_frame(table: pa.Table) -> pd.DataFrame:
    """``table`` as pandas with nullable integers and booleans, converted without vatra's code."""
    return table.to_pandas(types_mapper={pa.int64(): pd.Int64Dtype(), pa.bool_(): pd.BooleanDtype()}.get)


def test_infer_pins_types_nullability_ranges_and_categories() -> None:
    # Execute
    schema = TableSchema.infer(first_batch())
    cols = schema.pandera_schema.columns

    # Assert
    assert schema.columns == ["age", "price", "city", "member", "seen", "user"]
    assert [str(cols[c].dtype) for c in schema.columns] == [
        "Int64",
        "float64",
        "string[pyarrow]",
        "boolean",
        "datetime64[ns]",
        "string[pyarrow]",
    ]
    assert [cols[c].nullable for c in schema.columns] == [False, True, False, False, False, False]
    checks = {c: [str(k.error) for k in cols[c].checks] for c in schema.columns}
    # age: [18, 90] ± 25 % of 72, not below zero, rounded to 10s; price: [10, 507.5] ± 124.4 → [0, 640]
    assert checks["age"] == ["in_range(0, 110)"]
    assert checks["price"] == ["in_range(0.0, 640.0)"]
    assert checks["city"] == [f"isin({CITIES})"]
    assert checks["member"] == ["isin([False, True])"]
    assert checks["seen"] == [] and checks["user"] == []  # no range for time, no categories for ids
    assert schema.pandera_schema.strict is True and schema.pandera_schema.coerce is False
    assert schema.validate(first_batch()) == []


@pytest.mark.parametrize(
    ("lo", "hi", "integer", "expected"),
    [
        (18, 90, True, (0, 110)),  # all ≥ 0: the lower bound stops at zero
        (-4.5, 4.7, False, (-7.0, 7.0)),
        (-90, -18, True, (-110, 0)),  # all ≤ 0: the upper bound stops at zero
        (5.0, 5.0, False, (3.7, 6.3)),  # a constant widens by a margin of its value
        (0.00123, 0.00456, False, (0.0003, 0.0054)),
        (1000, 1003, True, (999, 1004)),
    ],
)
def test_bounds_widen_and_round_outward(lo: float, hi: float, integer: bool, expected: tuple) -> None:
    assert widened_bounds(lo, hi, 0.25, integer) == expected


def test_infer_leaves_out_ranges_and_categories_it_cannot_trust() -> None:
    # Prepare: a float column with inf, an all-NaN column, 4 categories with max_categories=3
    table = pa.table(
        {
            "ratio": [1.0, float("inf"), 2.0, 3.0],
            "empty": [float("nan")] * 4,
            "grade": ["a", "b", "c", "d"],
            "nothing": pa.nulls(4),
        }
    )

    # Execute
    cols = TableSchema.infer(table, max_categories=3).pandera_schema.columns

    # Assert
    assert all(cols[c].checks == [] for c in cols)
    assert cols["empty"].nullable and cols["nothing"].nullable and cols["nothing"].dtype is None


def test_yaml_round_trip_keeps_the_hash_and_is_a_pandera_schema() -> None:
    # Prepare
    schema = TableSchema.infer(first_batch())
    text = schema.to_yaml()

    # Execute
    again = TableSchema.from_yaml(text)
    # the same schema laid out differently: strict first, categories reordered, wider indentation
    swapped = text.replace("- Osijek\n    - Split", "- Split\n    - Osijek")
    shuffled = "strict: true\n" + swapped.replace("strict: true\n", "").replace("  ", "   ")
    plain = pandera.DataFrameSchema.from_yaml(text)

    # Assert
    assert again.hash == schema.hash
    assert swapped != text and TableSchema.from_yaml(shuffled).hash == schema.hash
    assert TableSchema.from_yaml(text.replace("max_value: 110", "max_value: 120")).hash != schema.hash
    assert plain == schema.pandera_schema  # pandera itself reads the pinned file
    plain.validate(nullable_frame(first_batch()), lazy=True)
    broken = first_batch().set_column(0, "age", pa.array([200] * 200))
    with pytest.raises(pandera.errors.SchemaErrors):
        plain.validate(nullable_frame(broken), lazy=True)


def broken_batch() -> pa.Table:
    """A second file where price became text, one age is out of range and one city is new."""
    table = first_batch().slice(0, 6)
    table = table.set_column(0, "age", pa.array([20, 30, 150, 40, 50, 60]))
    table = table.set_column(1, "price", pa.array(["1.5", "2.5", "n/a", "4", "5", "6"]))
    return table.set_column(2, "city", pa.array(["Split", "Rijeka", "Split", "Zagreb", "Split", "Osijek"]))


def test_a_broken_batch_reports_all_three_columns_in_one_line() -> None:
    # Prepare
    schema = TableSchema.infer(first_batch())

    # Execute
    violations = schema.validate(broken_batch())
    line = summary_line(violations, rows=6)

    # Assert
    assert violations == [
        Violation("age", "in_range(0, 110)", 1, ("150",)),
        Violation("price", "dtype('float64')", 1, ("str",)),
        Violation("city", f"isin({CITIES})", 1, ("Rijeka",)),
    ]
    assert line == (
        "3 columns break the pinned schema (age: 1 of 6 rows out of range [0, 110] (150); "
        "price: dtype float64 expected, got str; city: 1 of 6 rows not in the pinned categories (Rijeka))"
    )
    assert report_lines(violations) == [
        "age    in_range(0, 110)                     1 row, e.g. 150",
        "price  dtype('float64')                     got str",
        "city   isin(['Osijek', 'Split', 'Zagreb'])  1 row, e.g. Rijeka",
    ]


def test_null_and_float_into_int_columns_are_violations() -> None:
    # Prepare
    schema = TableSchema.infer(first_batch())
    batch = first_batch().slice(0, 4)
    batch = batch.set_column(0, "age", pa.array([20.5, 30.0, 40.0, 50.0]))
    batch = batch.set_column(2, "city", pa.array(["Split", None, None, "Osijek"]))

    # Execute
    violations = schema.validate(batch)

    # Assert
    assert violations == [
        Violation("age", "dtype('Int64')", 1, ("float64",)),
        Violation("city", "not_nullable", 2, ()),
    ]
    assert summary_line(violations, 4) == (
        "2 columns break the pinned schema (age: dtype Int64 expected, got float64; city: 2 of 4 rows null)"
    )


def test_a_valid_second_batch_passes_with_lossless_widenings() -> None:
    # Prepare: new values inside the widened ranges; integers where floats are pinned (a CSV of whole
    # prices), dictionary-encoded cities (Parquet), microsecond timestamps, a narrower int type
    schema = TableSchema.infer(first_batch())
    batch = pa.table(
        {
            "age": pa.array([0, 101, 110], pa.int32()),
            "price": pa.array([0, 600, 640], pa.int64()),
            "city": pa.array(["Zagreb", "Split", "Zagreb"]).dictionary_encode(),
            "member": [True, True, False],
            "seen": pa.array([1, 2, 3], pa.timestamp("us")),
            "user": pa.array(["new1", "new2", "new3"], pa.large_string()),
        }
    )

    # Execute
    violations = schema.validate(batch)
    conformed = schema.conform(batch)

    # Assert
    assert violations == []
    assert conformed.schema.field("price").type == pa.float64()
    assert conformed.schema.field("age").type == pa.int64()
    assert conformed.column("price").to_pylist() == [0.0, 600.0, 640.0]


def test_missing_and_extra_columns_are_violations() -> None:
    # Prepare
    schema = TableSchema.infer(first_batch())
    batch = first_batch().drop_columns(["member"]).append_column("discount", pa.array([0.1] * 200))

    # Execute
    violations = schema.validate(batch)

    # Assert
    assert violations == [
        Violation("member", "column_in_dataframe", 1, ()),
        Violation("discount", "column_in_schema", 1, ()),
    ]
    assert summary_line(violations, 200) == (
        "2 columns break the pinned schema (member: missing; discount: not in the pinned schema)"
    )


def test_updated_accepts_the_batch_and_lists_each_change() -> None:
    # Prepare: the broken batch with a float age, a null member and a new column besides
    schema = TableSchema.infer(first_batch())
    batch = broken_batch().set_column(1, "price", pa.array([1.5, 2.5, 900.0, None, 5.0, 6.0]))
    batch = batch.set_column(3, "member", pa.array([True, None, False, True, True, True]))
    batch = batch.append_column("discount", pa.array([0.1, 0.2, 0.1, 0.0, 0.3, 0.1]))
    before = schema.validate(batch)

    # Execute
    new, changes = schema.updated(batch)

    # Assert
    assert {v.column for v in before} == {"age", "price", "city", "member", "discount"}
    assert changes == [
        "column age: range widened to [0, 190]",
        "column price: range widened to [0.0, 1200.0]",
        "column city: new category 'Rijeka'",
        "column member: now nullable",
        "new column discount (float64)",
    ]
    assert new.validate(batch) == []
    # earlier data still pass, once they carry the new column (it is required from now on)
    assert new.validate(first_batch().append_column("discount", pa.array([0.0] * 200))) == []
    assert new.hash != schema.hash
    assert TableSchema.from_yaml(new.to_yaml()).hash == new.hash
    assert schema.validate(batch) == before  # the pinned schema itself is left as it was


def test_updated_widens_dtypes_drops_overfull_categories_and_keeps_the_rest() -> None:
    # Prepare
    schema = TableSchema.infer(first_batch(), max_categories=4)
    batch = first_batch().slice(0, 3).drop_columns(["seen"])
    batch = batch.set_column(0, "age", pa.array([20.5, 30.0, 40.0]))
    batch = batch.set_column(2, "city", pa.array(["Pula", "Rijeka", "Split"]))

    # Execute
    new, changes = schema.updated(batch, max_categories=4)
    kept, none = schema.updated(batch, add_columns=False, widen=False, categories=False)

    # Assert
    assert changes == [
        "column age: dtype widened from Int64 to float64",
        "column city: over 4 categories, category check dropped",
        "column seen: no longer required (absent from this batch)",
    ]
    assert new.validate(batch) == []
    assert none == [] and kept.hash == schema.hash


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            ("    nullable: true\n", "    nulable: true\n"),
            "unknown key 'nulable' in column 'price' (did you mean",
        ),
        (
            ("  age:\n    dtype: Int64\n    in_range:", "  age:\n    dtype: Int64\n    in_rnage:"),
            "'in_range'?",
        ),
        (("strict: true", "strcit: true"), "unknown key 'strcit' at the top level (did you mean 'strict'?)"),
        (("dtype: float64", "dtype: flaot64"), "column 'price': data type 'flaot64' not understood"),
        (("  age:\n    dtype: Int64", "  age:\n  dtype: Int64\n      x: 1"), "not valid YAML at line"),
        (("min_value: 0\n", "minimum: 0\n"), "column 'age': in_range() missing required argument"),
    ],
)
def test_a_hand_edit_with_a_typo_is_one_line_config_error(edit: tuple[str, str], message: str) -> None:
    # Prepare
    text = TableSchema.infer(first_batch()).to_yaml()
    assert edit[0] in text
    broken = text.replace(edit[0], edit[1], 1)

    # Execute
    with pytest.raises(ConfigError) as err:
        TableSchema.from_yaml(broken, source="/data/t/_vatra/schema.yaml")

    # Assert
    assert message in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).startswith("/data/t/_vatra/schema.yaml: ")
    assert err.value.exit_code == 2

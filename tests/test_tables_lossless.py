"""Delta tables never lose a value silently, and bad input to ``vatra data`` is one ``error:`` line.

Each test plays the user (or a hostile file) through the CLI in this process: the documented
evolution path (``schema update`` then ``ingest``) keeps every value, a value the table cannot hold
exactly is refused without ``--force``, and broken files, paths and versions give one line, exit 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.conftest import vatra_in_process

pa = pytest.importorskip("pyarrow")
pytest.importorskip("deltalake")
pytest.importorskip("pandera")
import pyarrow.parquet as pq  # noqa: E402
from deltalake import DeltaTable  # noqa: E402


def csv(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


def ingest(capsys: pytest.CaptureFixture[str], table: Path, *files: Path, force: bool = False) -> tuple:
    args = ["data", "ingest", *map(str, files), "--table", str(table)]
    return vatra_in_process(capsys, *args, *(["--force"] if force else []))


def read_arrow(table: Path, version: int | None = None) -> pa.Table:
    """The version's rows in vatra's order (files in the order they were added)."""
    from vatra.data.tables.delta import Table, read_version

    return read_version(Table.at(str(table)).open(version))


def rows(table: Path, version: int | None = None) -> dict[str, list]:
    return read_arrow(table, version).to_pydict()


def one_error_line(err: str) -> str:
    """The stderr of a refusal: exactly one line, the ``error:`` one, and no traceback."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, err
    return errors[0]


# ---------------------------------------------------------------- item 11: no silent nulls
def test_schema_update_then_ingest_widens_the_column_and_keeps_every_value(tmp_path: Path, capsys) -> None:
    # Prepare: a table of whole numbers, then a file with fractions in the same column
    table = tmp_path / "t"
    a = csv(tmp_path / "a.csv", "a,b\n1,2\n3,4\n")
    b = csv(tmp_path / "b.csv", "a,b\n1.5,2\n3.25,4\n")
    assert ingest(capsys, table, a)[0] == 0
    assert ingest(capsys, table, b)[0] == 2  # the pinned Int64 refuses fractions

    # Execute: the documented evolution path
    code, out, err = vatra_in_process(capsys, "data", "schema", "update", str(table), "--from", str(b))
    assert code == 0 and "dtype widened from Int64 to float64" in out, err
    code, out, err = ingest(capsys, table, b)

    # Assert: every value is stored, as the widened type; the old version still reads as it was
    assert code == 0, err
    assert "stored as null" not in out
    assert rows(table) == {"a": [1.0, 3.0, 1.5, 3.25], "b": [2, 4, 2, 4]}
    assert DeltaTable(str(table)).schema().to_arrow().field("a").type == pa.float64()
    assert rows(table, 0) == {"a": [1, 3], "b": [2, 4]}
    record = json.loads(DeltaTable(str(table)).history(1)[0]["vatra.ingest"])
    assert record["rows"] == 2 and record["nulled"] == {} and record["widened"] == {"a": "int64 → double"}
    code, out, _ = vatra_in_process(capsys, "data", "diff", str(table), "0", "1")
    assert code == 0 and "+2 added, -0 removed" in out  # the widened rows are the same rows
    code, out, _ = vatra_in_process(capsys, "data", "log", str(table))
    assert code == 0 and [line.split("│")[4].strip() for line in out.splitlines() if "b.csv" in line] == ["2"]


def test_old_rows_that_cannot_widen_exactly_refuse_the_ingest_even_forced(tmp_path: Path, capsys) -> None:
    table = tmp_path / "t"
    assert ingest(capsys, table, csv(tmp_path / "a.csv", f"a\n{2**53 + 1}\n1\n"))[0] == 0
    b = csv(tmp_path / "b.csv", "a\n1.5\n")
    assert vatra_in_process(capsys, "data", "schema", "update", str(table), "--from", str(b))[0] == 0
    for force in (False, True):
        code, _, err = ingest(capsys, table, b, force=force)
        assert code == 2 and str(2**53 + 1) in one_error_line(err) and "cannot be widened" in err
    assert DeltaTable(str(table)).version() == 0 and rows(table) == {"a": [2**53 + 1, 1]}


def test_header_only_first_ingest_is_refused_and_pins_nothing(tmp_path: Path, capsys) -> None:
    table = tmp_path / "t"
    header = csv(tmp_path / "h.csv", "a,b\n")
    code, _, err = ingest(capsys, table, header)
    assert code == 2
    line = one_error_line(err)
    assert "h.csv" in line and "no rows" in line and "schema.yaml" in line
    assert not table.exists()  # no table, no pinned schema of null columns
    assert ingest(capsys, table, csv(tmp_path / "r.csv", "a,b\n1,2\n"))[0] == 0
    assert rows(table) == {"a": [1], "b": [2]}


def test_an_all_null_column_takes_the_type_of_its_first_values(tmp_path: Path, capsys) -> None:
    table = tmp_path / "t"
    assert ingest(capsys, table, csv(tmp_path / "a.csv", "a,note\n1,\n2,\n"))[0] == 0
    code, out, err = ingest(capsys, table, csv(tmp_path / "b.csv", "a,note\n2,7.5\n1,\n"))
    assert code == 0 and "stored as null" not in out, err
    assert rows(table) == {"a": [1, 2, 2, 1], "note": [None, None, 7.5, None]}


def test_narrow_integers_first_then_wide_ones_are_kept(tmp_path: Path, capsys) -> None:
    table = tmp_path / "t"
    pq.write_table(pa.table({"n": pa.array([1, 2], pa.int32())}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"n": pa.array([5, 2**40], pa.int64())}), tmp_path / "b.parquet")
    assert ingest(capsys, table, tmp_path / "a.parquet")[0] == 0
    assert (
        vatra_in_process(
            capsys, "data", "schema", "update", str(table), "--from", str(tmp_path / "b.parquet")
        )[0]
        == 0
    )
    code, _, err = ingest(capsys, table, tmp_path / "b.parquet")
    assert code == 0, err
    assert rows(table) == {"n": [1, 2, 5, 2**40]}


def test_types_delta_stores_otherwise_keep_their_values_or_are_refused(tmp_path: Path, capsys) -> None:
    # unsigned integers (Delta has none) and timestamps (Delta holds microseconds)
    table = tmp_path / "t"
    whole_us = pa.array([1_000_000_000, 2_000_001_000], pa.timestamp("ns"))
    pq.write_table(pa.table({"u": pa.array([255, 7], pa.uint8()), "at": whole_us}), tmp_path / "a.parquet")
    code, _, err = ingest(capsys, table, tmp_path / "a.parquet")
    assert code == 0, err
    assert rows(table)["u"] == [255, 7]
    assert read_arrow(table).column("at").cast(pa.int64()).to_pylist() == [1_000_000, 2_000_001]

    sub_us = pa.array([1_000_000_000, 1_000_000_001], pa.timestamp("ns"))  # a nanosecond delta-rs would drop
    pq.write_table(pa.table({"u": pa.array([1, 2], pa.uint8()), "at": sub_us}), tmp_path / "b.parquet")
    code, _, err = ingest(capsys, table, tmp_path / "b.parquet")
    assert code == 2 and "column at, row 2" in one_error_line(err)
    pq.write_table(pa.table({"c": pa.array([2**63 + 5], pa.uint64())}), tmp_path / "big.parquet")
    code, _, err = ingest(capsys, tmp_path / "t2", tmp_path / "big.parquet")
    assert code == 2 and str(2**63 + 5) in one_error_line(err)
    pq.write_table(pa.table({"c": pa.array([1], pa.time64("us"))}), tmp_path / "time.parquet")
    code, _, err = ingest(capsys, tmp_path / "t3", tmp_path / "time.parquet")
    assert code == 2 and "column c is time64[us]" in one_error_line(err)
    assert not (tmp_path / "t2").exists() and not (tmp_path / "t3").exists()


def test_a_value_the_table_cannot_hold_is_refused_without_force(tmp_path: Path, capsys) -> None:
    # Prepare: a table of integers whose pinned schema a person edited to accept any type
    table = tmp_path / "t"
    assert ingest(capsys, table, csv(tmp_path / "a.csv", "a,b\n1,2\n3,4\n"))[0] == 0
    pinned = table / "_vatra" / "schema.yaml"
    text = pinned.read_text()
    assert "dtype: Int64" in text
    pinned.write_text(text.replace("dtype: Int64", "dtype: null", 1))
    bad = csv(tmp_path / "c.csv", "a,b\n2,3\n2.5,4\n")

    # Execute / Assert: refused, naming column, file, row and value; the table is unchanged
    code, _, err = ingest(capsys, table, bad)
    assert code == 2
    line = one_error_line(err)
    assert all(s in line for s in ("column a", "c.csv", "row 2", "2.5", "--force")), line
    assert DeltaTable(str(table)).version() == 0

    # --force stores it as null, counted and recorded (the documented forced semantics)
    code, out, err = ingest(capsys, table, bad, force=True)
    assert code == 0 and "1 value(s)" in out, err
    assert rows(table)["a"] == [1, 3, 2, None]
    assert json.loads(DeltaTable(str(table)).history(1)[0]["vatra.ingest"])["nulled"] == {"a": 1}


# ---------------------------------------------------------------- item 12: one error line, exit 2
def test_a_csv_whose_header_is_not_utf8_is_one_line(tmp_path: Path, capsys) -> None:
    bad = csv(tmp_path / "latin1.csv", "temp\xe9rature,b\n1,2\n".encode("latin-1"))
    table = tmp_path / "t"
    code, _, err = ingest(capsys, table, bad)
    assert code == 2
    line = one_error_line(err)
    assert "latin1.csv" in line and "UTF-8" in line
    assert not table.exists()
    assert ingest(capsys, table, csv(tmp_path / "ok.csv", "a,b\n1,2\n"))[0] == 0
    for command in (
        ["schema", "update", str(table), "--from", str(bad)],
        ["drift", str(table), "--against", "0", "--file", str(bad)],
    ):
        code, _, err = vatra_in_process(capsys, "data", *command)
        assert code == 2 and "UTF-8" in one_error_line(err)


def test_table_naming_a_regular_file_is_one_line(tmp_path: Path, capsys) -> None:
    regular = csv(tmp_path / "notes.txt", "hello\n")
    data = csv(tmp_path / "a.csv", "a,b\n1,2\n")
    for args in (
        ["ingest", str(data), "--table", str(regular)],
        ["ingest", str(data), "--table", str(regular / "sub")],
        ["log", str(regular)],
        ["show", str(regular)],
    ):
        code, _, err = vatra_in_process(capsys, "data", *args)
        assert code == 2, (args, err)
        line = one_error_line(err)
        assert str(regular) in line and "not a folder" in line
    assert regular.read_text() == "hello\n"


def test_a_negative_version_is_one_line(tmp_path: Path, capsys) -> None:
    table = tmp_path / "t"
    assert ingest(capsys, table, csv(tmp_path / "a.csv", "a,b\n1,2\n"))[0] == 0
    for args in (["show", str(table), "--version", "-1"], ["drift", str(table), "--against", "-1"]):
        code, _, err = vatra_in_process(capsys, "data", *args)
        assert code == 2, err
        assert "no version -1" in one_error_line(err)


def test_import_paths_holding_a_nul_is_one_line(tmp_path: Path, capsys) -> None:
    config = tmp_path / "bad.toml"
    config.write_text('[run]\nimport_paths = ["lib\\u0000evil"]\n')
    code, _, err = vatra_in_process(capsys, "data", "log", str(tmp_path / "t"), "--config", str(config))
    assert code == 2
    line = one_error_line(err)
    assert "run.import_paths" in line and "NUL" in line

    from vatra.config import config_from_dict
    from vatra.errors import ConfigError

    with pytest.raises(ConfigError, match="NUL"):
        config_from_dict({"run": {"import_paths": ["a\0b"]}})


def _truncated_parquet(path: Path) -> Path:
    pq.write_table(pa.table({"a": list(range(300))}), path)
    blob = path.read_bytes()
    path.write_bytes(blob[: len(blob) // 2])
    return path


@pytest.mark.parametrize(
    ("name", "make", "says"),
    [
        ("empty.csv", lambda p: csv(p, b""), "empty"),
        (
            "binary.csv",
            lambda p: csv(p, b"\x7fELF\x02\x01" + bytes(range(128, 256)) + b"\n\x00\x01"),
            "UTF-8",
        ),
        ("truncated.parquet", _truncated_parquet, "truncated.parquet"),
        ("dir.csv", lambda p: (p.mkdir(), p)[1], "is a folder"),
        ("twice.csv", lambda p: csv(p, "a,a\n1,2\n"), "more than once"),
    ],
)
def test_hostile_files_are_one_line(tmp_path: Path, capsys, name: str, make, says: str) -> None:
    bad = make(tmp_path / name)
    table = tmp_path / "t"
    code, _, err = ingest(capsys, table, bad)
    assert code == 2
    assert says in one_error_line(err)
    assert not table.exists()
    assert ingest(capsys, table, csv(tmp_path / "ok.csv", "a,b\n1,2\n"))[0] == 0
    code, _, err = vatra_in_process(capsys, "data", "schema", "update", str(table), "--from", str(bad))
    assert code == 2 and says in one_error_line(err)


def test_bad_ingest_options_and_an_unwritable_report_are_one_line(tmp_path: Path, capsys) -> None:
    data = csv(tmp_path / "a.csv", "a,b\n1,2\n3,4\n")
    table = tmp_path / "t"
    for option, value in (
        ("--range-margin", "nan"),
        ("--range-margin", "-5"),
        ("--range-margin", "inf"),
        ("--max-categories", "-1"),
    ):
        code, _, err = vatra_in_process(
            capsys, "data", "ingest", str(data), "--table", str(table), option, value
        )
        assert code == 2 and option in one_error_line(err)
    assert not table.exists()
    assert ingest(capsys, table, data)[0] == 0
    folder = tmp_path / "out"
    folder.mkdir()
    html = str(tmp_path / "page.html")
    code, _, err = vatra_in_process(
        capsys,
        "data",
        "drift",
        str(table),
        "--against",
        "0",
        "--file",
        str(data),
        "--html",
        html,
        "--json",
        str(folder),
    )
    assert code == 2 and "--json" in one_error_line(err)

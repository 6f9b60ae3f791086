"""One bad cell in a numeric column is named with its value and row, not mistaken for categories."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tests.conftest import vatra_in_process

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

from vatra.config import DataConfig  # noqa: E402
from vatra.data import DataContext  # noqa: E402
from vatra.data.tabular import build_table  # noqa: E402
from vatra.errors import ConfigError  # noqa: E402


def _csv(path: Path, bp: dict[int, str]) -> Path:
    """50 patients: age, blood pressure (``bp`` overrides cells by 0-based row), sex, a target."""
    lines = ["age,bp,sex,y"] + [
        f"{30 + i},{bp.get(i, f'{80 + i * 0.7:.1f}')},{'F' if i % 2 else 'M'},{i / 50:.3f}" for i in range(50)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _build(path: Path) -> None:
    cfg = DataConfig(name="table", path=str(path), target="y", categorical=["sex"])
    build_table(cfg, DataContext(seed=0, task="regression"))


def test_one_text_cell_among_numbers_is_named_with_its_row(tmp_path: Path) -> None:
    # Prepare: missing-value cells ('', NA) before it are not text; the typo 'high' is row 37
    data = _csv(tmp_path / "d.csv", {3: "", 10: "NA", 36: "high"})
    # Execute
    with pytest.raises(ConfigError) as err:
        _build(data)
    # Assert
    message = str(err.value)
    assert "column 'bp' holds text among its numbers: 'high' in row 37 of d.csv (line 38);" in message
    assert "more cell" not in message


def test_every_text_cell_is_counted_and_parquet_rows_are_named(tmp_path: Path) -> None:
    # Prepare
    data = _csv(tmp_path / "d.csv", {4: "n/a?", 20: "high", 21: '"1,5"'})
    table = pa.table({"x": ["1.5", "2", "-3e2", "oops", "nan", "7"], "y": [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]})
    pq.write_table(table, tmp_path / "t.parquet")
    # Execute
    with pytest.raises(ConfigError) as csv_err:
        _build(data)
    with pytest.raises(ConfigError) as parquet_err:
        build_table(
            DataConfig(name="table", path=str(tmp_path / "t.parquet"), target="y"), DataContext(seed=0)
        )
    # Assert
    assert "'n/a?' in row 5 of d.csv (line 6), and 2 more cell(s) that are no number" in str(csv_err.value)
    assert "column 'x' holds text among its numbers: 'oops' in row 4 of t.parquet;" in str(parquet_err.value)


def test_a_column_of_words_still_points_to_data_categorical(tmp_path: Path) -> None:
    # Prepare: sex is not declared categorical this time
    data = _csv(tmp_path / "d.csv", {})
    cfg = DataConfig(name="table", path=str(data), target="y")
    # Execute / Assert
    with pytest.raises(
        ConfigError, match=re.escape("column 'sex' is string, not numeric; add it to data.categorical")
    ):
        build_table(cfg, DataContext(seed=0, task="regression"))


def test_vatra_train_names_the_cell_in_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare
    data = _csv(tmp_path / "d.csv", {36: "high"})
    config = tmp_path / "c.toml"
    config.write_text(
        f'[data]\nname = "table"\npath = "{data}"\ntarget = "y"\ncategorical = ["sex"]\n'
        '[model]\nname = "mlp"\n[train]\nsteps = 2\ntask = "regression"\n'
    )
    # Execute
    code, _, err = vatra_in_process(capsys, "train", str(config), "--nproc", "1")
    # Assert
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("error: ") and "'high' in row 37 of d.csv" in err

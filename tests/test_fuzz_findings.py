"""Inputs the fuzz targets found, each now refused with its module's own error (one line, no traceback)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vatra.config import DataConfig
from vatra.config._load import load_config
from vatra.data._base import DataContext
from vatra.data.table import build_table
from vatra.errors import ConfigError


def _table(path: Path, body: bytes, target: str = "y") -> None:
    path.write_bytes(body)
    build_table(DataConfig(name="table", path=str(path), target=target), DataContext(seed=0))


def test_a_csv_header_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="column name is not UTF-8 text"):
        _table(tmp_path / "t.csv", b'"a","b"\xb1,"y"\n1,2,0\n3,4,1\n')


def test_a_csv_with_a_column_name_twice_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"columns \['a'\] appear more than once"):
        _table(tmp_path / "t.csv", b"a,a,y\n1,2,0\n3,4,1\n")


@pytest.mark.parametrize("where", ["file", "override"])
def test_a_nul_in_run_import_paths_is_a_config_error(tmp_path: Path, where: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[run]\nimport_paths = ["a\\u0000b"]\n' if where == "file" else "")
    sets = ['run.import_paths=["\\u0000"]'] if where == "override" else []
    with pytest.raises(ConfigError, match=r"run\.import_paths: a folder name holds a NUL character"):
        load_config(path, sets)

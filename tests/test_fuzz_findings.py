"""Inputs the fuzz targets found, each now refused with its module's own error (one line, no traceback)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vatra.config import DataConfig
from vatra.config._load import load_config
from vatra.data._base import DataContext
from vatra.data.tabular import build_table
from vatra.errors import ConfigError
from vatra.resilience._base import StoreError
from vatra.resilience.fsspec_backend import FsspecBackend
from vatra.resilience.manifest import decode_manifest
from vatra.resilience.store import CheckpointStore


def _table(path: Path, body: bytes, target: str = "y", **kw: Any) -> None:
    path.write_bytes(body)
    build_table(DataConfig(name="table", path=str(path), target=target, **kw), DataContext(seed=0))


def test_a_csv_header_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="column name is not UTF-8 text"):
        _table(tmp_path / "t.csv", b'"a","b"\xb1,"y"\n1,2,0\n3,4,1\n')


def test_a_csv_with_a_column_name_twice_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"columns \['a'\] appear more than once"):
        _table(tmp_path / "t.csv", b"a,a,y\n1,2,0\n3,4,1\n")


def test_a_split_column_that_is_not_utf8_text_is_a_config_error(tmp_path: Path) -> None:
    body = b"a,y,split\n1,0,train\n2,1,\xffval\n3,0,train\n4,1,val\n"  # pyarrow reads it as binary
    with pytest.raises(ConfigError, match=r"data\.split_column: values must be the text 'train' or 'val'"):
        _table(tmp_path / "t.csv", body, split_column="split")


def test_an_integer_feature_past_2_to_the_24_is_rounded_to_float32_not_a_traceback(tmp_path: Path) -> None:
    # float32 holds integers exactly only up to 2^24: ids or timestamps as features are rounded
    body = b"a,b,y\n44444444444443,1,0\n2,2,1\n3,1,0\n4,2,1\n5,1,0\n"
    (tmp_path / "t.csv").write_bytes(body)
    cfg = DataConfig(
        name="table", path=str(tmp_path / "t.csv"), target="y", standardize=False, val_fraction=0.2
    )
    train, val, _ = build_table(cfg, DataContext(seed=0))
    rows = [
        *train.get_batch(np.arange(len(train)))[0][:, 0].tolist(),
        *val.get_batch(np.arange(len(val)))[0][:, 0].tolist(),
    ]
    assert np.float32(44444444444443) in rows


def test_a_categorical_column_that_is_not_utf8_text_is_a_config_error(tmp_path: Path) -> None:
    body = b"a,c,y\n1,\xffred,0\n2,blue,1\n3,red,0\n4,blue,1\n5,red,0\n"  # pyarrow reads c as binary
    with pytest.raises(ConfigError, match="a text column holds values that are not UTF-8 text"):
        _table(tmp_path / "t.csv", body, categorical=["c"])


def test_a_parquet_footer_arrow_cannot_read_is_a_config_error(tmp_path: Path) -> None:
    # The input libFuzzer found: the table seed's footer mutated to name an integer of under 8 bits.
    kept = Path(__file__).parent / "fuzz" / "findings" / "table-parquet-int-under-8-bits"
    with pytest.raises(ConfigError, match=r"cannot read .*Integers with less than 8 bits"):
        _table(tmp_path / "t.parquet", kept.read_bytes()[:-1])  # the last byte picks the target's variant


@pytest.mark.parametrize("where", ["file", "override"])
def test_a_nul_in_run_import_paths_is_a_config_error(tmp_path: Path, where: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[run]\nimport_paths = ["a\\u0000b"]\n' if where == "file" else "")
    sets = ['run.import_paths=["\\u0000"]'] if where == "override" else []
    with pytest.raises(ConfigError, match=r"run\.import_paths: a folder name holds a NUL character"):
        load_config(path, sets)


def test_a_signed_manifest_with_a_non_ascii_signature_is_a_store_error(tmp_path: Path) -> None:
    # Prepare: a signed store holding one version, then its manifest's signature replaced by text.
    store = CheckpointStore(FsspecBackend(str(tmp_path)), hmac_key=b"k")
    version = store.write_version({"w.bin": b"weights"}, step=1, parent=None, world_size=1)["version"]
    path = tmp_path / "versions" / f"{version}.json"
    record = json.loads(path.read_text())
    path.write_text(json.dumps(record | {"signature": "hmac-sha256:é"}))
    # Execute + Assert: refused as tampered (it was a TypeError traceback), and listed by a scan.
    with pytest.raises(StoreError, match="signature does not match"):
        decode_manifest(path.read_bytes(), version, b"k")
    assert list(store.scan().unreadable) == [f"versions/{version}.json"]

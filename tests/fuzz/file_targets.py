"""Fuzz targets for what a user or a disk hands over: a config with overrides, checkpoint manifests and
tags, and CSV/Parquet tables.

Property: the config loader returns or raises :class:`~vatra.errors.ConfigError` (any
:class:`~vatra.errors.VatraError`: the CLI prints it as one ``error:`` line), and a config it accepts
dumps and reloads; the checkpoint store's readers raise only
:class:`~vatra.resilience._base.StoreError`; the table source returns datasets or raises
ConfigError.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import shutil
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
from tests.fuzz._harness import Target

from vatra.config import DataConfig
from vatra.config._load import config_from_dict, dump_toml, load_config
from vatra.data._base import DataContext
from vatra.data.tables.delta import read_file
from vatra.data.tabular import build_table
from vatra.errors import VatraError
from vatra.resilience._base import StoreError
from vatra.resilience.fsspec_backend import FsspecBackend
from vatra.resilience.manifest import decode_manifest, decode_tag, encode_manifest, encode_tag
from vatra.resilience.store import CheckpointStore

_SHM = Path("/dev/shm")  # memory-backed where there is one: each input rewrites a few files
_TMP = Path(tempfile.mkdtemp(prefix="vatra-fuzz-", dir=_SHM if _SHM.is_dir() else None))
atexit.register(shutil.rmtree, _TMP, True)
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# ---------------------------------------------------------------------------------------- config

CONFIG_TOKENS = [
    b"[run]", b"[data]", b"[train]", b"[federated]", b"[federated.secure_aggregation]", b"[monitor]",
    b"[heal]", b"[checkpoint]", b"[store]", b"[tune]", b"[tune.space.lr]", b"[parallel]", b"[balance]",
    b"[async]", b"[[", b"]]", b"steps", b"import_paths", b"path", b"name", b"\0train.steps=",
    b"\0data.path=", b"\0run.import_paths=", b"\0federated.rounds=", b'"""', b"'''", b"inf", b"nan",
    b"1979-05-27T07:32:00Z", b"0x", b"true", b"= {", b"= [",
]  # fmt: skip


def _config_seeds() -> list[bytes]:
    seeds = [p.read_bytes() for p in sorted(EXAMPLES.glob("*.toml"))]
    seeds += [b"[train]\nsteps = 5\n\0optim.lr=0.1\0run.name=x", b"\0train.steps=3\0monitor.enabled=false"]
    return seeds


def _config_findings() -> list[bytes]:
    """run.import_paths holding a NUL, in the file and in an override (a ValueError traceback before)."""
    return [b'[run]\nimport_paths = ["a\\u0000b"]\n', b'\0run.import_paths=["\\u0000"]']


def config_one_input(data: bytes) -> None:
    """A TOML file and ``--set`` overrides (NUL-separated) through :func:`load_config`, as ``vatra``
    reads them (no run kind, a training run, a federated run); an accepted config must reload."""
    text, *sets = data.split(b"\0")
    path = _TMP / "config.toml"
    path.write_bytes(text)
    run = (None, "train", "federated")[len(sets) % 3]
    saved = list(sys.path)  # run.import_paths go on sys.path: keep the fuzzer's own path unchanged
    try:
        cfg = load_config(path, [s.decode("utf-8", "replace") for s in sets], run=run)
    except VatraError:
        return
    finally:
        sys.path[:] = saved
    try:  # what a worker does with the run folder's config.toml
        config_from_dict(tomllib.loads(dump_toml(cfg)))
    finally:
        sys.path[:] = saved


# ------------------------------------------------------------------------------ manifests and tags

VERSION = "s0000010-abcdef"
KEY = b"fuzz-key"
MANIFEST_TOKENS = [
    b'"version"', b'"parent"', b'"step"', b'"time"', b'"world_size"', b'"files"', b'"sha256"', b'"size"',
    b'"signature"', b'"metrics"', b'"tags"', b"hmac-sha256:", b"../", b"/", b"\\", b"latest", b"last-good",
    b"null", b"true", b"1e999", b"-0",
]  # fmt: skip


def _manifest(parent: str | None = None) -> dict[str, Any]:
    files = {
        "rank0/model.pt": {"sha256": "ab" * 32, "size": 12},
        "meta.json": {"sha256": "0" * 64, "size": 0},
    }
    return {"version": VERSION, "parent": parent, "step": 10, "time": 1.5, "world_size": 2, "files": files}


def _manifest_seeds() -> list[bytes]:
    return [
        encode_manifest(_manifest(), None),
        encode_manifest(_manifest("s0000005-123456") | {"metrics": {"loss": 0.5}}, KEY),
        encode_tag("latest", VERSION, None),
        encode_tag("latest", VERSION, KEY),
    ]


def _store(key: bytes | None) -> CheckpointStore:
    root = _TMP / ("signed" if key else "plain")
    for sub in ("versions", "tags/runs"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "tags" / "runs" / "best").write_bytes(encode_tag("runs/best", VERSION, key))
    return CheckpointStore(FsspecBackend(str(root)), hmac_key=key)


_STORES = {key: _store(key) for key in (None, KEY)}


def _manifest_findings() -> list[bytes]:
    """A signed store's manifest whose signature is non-ASCII text (TypeError in compare_digest)."""
    return [json.dumps(_manifest() | {"signature": "hmac-sha256:é"}).encode()]


def manifest_one_input(data: bytes) -> None:
    """The manifest and tag decoders, and a store whose ``latest`` tag and one manifest hold ``data``
    (scanning, verifying it, resolving the input's first line as a ref), with and without a signing key."""
    for key, store in _STORES.items():
        with contextlib.suppress(StoreError):
            decode_manifest(data, VERSION, key)
        with contextlib.suppress(StoreError):
            decode_tag(data, "latest", key)
        root = Path(store.backend.url)
        (root / "versions" / f"{VERSION}.json").write_bytes(data)
        (root / "tags" / "latest").write_bytes(data)
        ref = data.split(b"\n", 1)[0].decode("utf-8", "replace")[:200]
        store.scan()  # every manifest and tag read; what cannot be is listed, not raised
        store.verify("latest")
        with contextlib.suppress(StoreError):
            store.resolve(ref)


# ------------------------------------------------------------------------------------------ tables

TABLE_TOKENS = [
    b"PAR1",
    b",",
    b"\n",
    b'"',
    b"y",
    b"split",
    b"train",
    b"val",
    b"q",
    b"c",
    b"nan",
    b"NaN",
    b"inf",
]
VARIANTS: list[dict[str, Any]] = [
    {"target": "y"},
    {"target": "y", "categorical": ["c"]},
    {"target": "y", "split_column": "split", "nan": "drop"},
    {"target": "y", "group": "q", "categorical_encoding": "embedding", "categorical": ["c"]},
    {"target": ["y", "a"], "nan": "mean"},
    {"target": "c", "features": ["a", "b"], "standardize": False},
]


def _frame(n: int = 12) -> dict[str, list[Any]]:
    rng = np.random.default_rng(0)
    return {
        "a": rng.normal(size=n).round(3).tolist(),
        "b": rng.integers(0, 5, n).tolist(),
        "c": rng.choice(["red", "green"], n).tolist(),
        "y": rng.integers(0, 2, n).tolist(),
        "split": ["train"] * (n - 3) + ["val"] * 3,
        "q": [i // 3 for i in range(n)],
    }


def _table_seeds() -> list[bytes]:
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    table = pa.table(_frame())
    csv, parquet = io.BytesIO(), io.BytesIO()
    pcsv.write_csv(table, csv)
    pq.write_table(table, parquet)
    return [csv.getvalue() + bytes([i]) for i in range(len(VARIANTS))] + [parquet.getvalue() + b"\x00"]


FINDINGS = Path(__file__).resolve().parent / "findings"  # inputs libFuzzer found, kept as they were


def _table_findings() -> list[bytes]:
    """A header that is not UTF-8, a column name twice, a split column or a category that is not
    UTF-8, an integer feature past 2^24, a Parquet footer naming a 4-bit integer (tracebacks from
    pyarrow before)."""
    kept = [p.read_bytes() for p in sorted(FINDINGS.glob("table-*"))]
    split = b"a,y,split\n1,0,train\n2,1,\xffval\n3,0,train\n4,1,val\n\x02"  # not UTF-8: read as binary
    big = b"a,b,y\n44444444444443,1,0\n2,2,1\n3,1,0\n4,2,1\n5,1,0\n\x00"  # past float32's exact integers
    category = b"a,c,y\n1,\xffred,0\n2,blue,1\n3,red,0\n4,blue,1\n5,red,0\n\x01"
    header = b'"a","b"\xb1,"y"\n1,2,0\n3,4,1\n\x00'
    return [header, b"a,a,y\n1,2,0\n3,4,1\n\x00", split, big, category, *kept]


def table_one_input(data: bytes) -> None:
    """CSV or Parquet bytes (Parquet by its ``PAR1`` magic) read as a Delta ingest reads a file, and as
    ``data.name = "table"``, the last byte picking the columns' roles. Accepted tables must give batches."""
    if not data:
        return
    body, variant = data[:-1], VARIANTS[data[-1] % len(VARIANTS)]
    path = _TMP / ("t.parquet" if body.startswith(b"PAR1") else "t.csv")
    path.write_bytes(body)
    with contextlib.suppress(VatraError):  # what a Delta ingest reads a file with
        read_file(str(path))
    try:
        train, val, _ = build_table(DataConfig(name="table", path=str(path), **variant), DataContext(seed=0))
    except VatraError:
        return
    for part in (train, val):
        if part is not None:
            part.get_batch(np.arange(min(len(part), 4)))


CONFIG = Target("config", config_one_input, _config_seeds, CONFIG_TOKENS, _config_findings)
MANIFEST = Target("manifest", manifest_one_input, _manifest_seeds, MANIFEST_TOKENS, _manifest_findings)
TABLE = Target("table", table_one_input, _table_seeds, TABLE_TOKENS, _table_findings)

"""Fuzz target for the serving logs ``vatra model ab-report`` reads: their ids and outcome values
come from clients.

Property: ``read_log`` never raises (a bad line is counted and skipped); the analysis returns or
raises :class:`~vatra.errors.ConfigError` (one ``error:`` line); the HTML page of an accepted log
holds no markup from the log.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path

from tests.fuzz._harness import Target

from vatra.errors import ConfigError
from vatra.serve.ab import ABConfig, analyse, read_log, render

_SHM = Path("/dev/shm")
_TMP = Path(tempfile.mkdtemp(prefix="vatra-fuzz-ab-", dir=_SHM if _SHM.is_dir() else None))
atexit.register(shutil.rmtree, _TMP, True)
SPLIT = b"\n--outcomes--\n"  # the input is predictions.jsonl, this separator, outcomes.jsonl

ABLOG_TOKENS = [
    b'"id"', b'"t"', b'"variant"', b'"version"', b'"key"', b'"latency_ms"', b'"error"', b'"value"',
    b'"champion"', b'"challenger"', b"true", b"false", b"null", b"NaN", b"Infinity", b"-1", b"1e308",
    b"<script>", b"\n", SPLIT,
]  # fmt: skip


def _ablog_seeds() -> list[bytes]:
    preds, outs = [], []
    for i in range(240):
        variant = "challenger" if i % 2 else "champion"
        row = {"id": f"r{i}", "t": float(i), "variant": variant, "version": variant[:2] + "01", "key": None}
        preds.append(json.dumps({**row, "latency_ms": 10.0 + i % 7, "error": i % 13 == 0}))
        outs.append(json.dumps({"id": f"r{i}", "t": i + 0.5, "value": float(i % 5 == 0)}))
    small = "\n".join(preds[:6]).encode() + SPLIT + "\n".join(outs[:6]).encode()
    return ["\n".join(preds).encode() + SPLIT + "\n".join(outs).encode(), small]


def ablog_one_input(data: bytes) -> None:
    """The two files of one log folder, read, analysed for both metrics and rendered."""
    preds, _, outs = data.partition(SPLIT)
    (_TMP / "predictions.jsonl").write_bytes(preds)
    (_TMP / "outcomes.jsonl").write_bytes(outs)
    log = read_log(_TMP)
    for metric in ("binary", "continuous"):
        try:
            result = analyse(log, ABConfig(metric=metric, min_n=2))  # type: ignore[arg-type]
        except ConfigError:
            continue
        page = render(result, "fuzz")
        assert "<script" not in page, "markup from the log reached the page"


ABLOG = Target("ablog", ablog_one_input, _ablog_seeds, ABLOG_TOKENS)

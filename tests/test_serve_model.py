"""``vatra model serve`` on a real registry: a digits model trained, exported and registered."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests._dist import ROOT
from tests.conftest import small_config, vatra_in_process

import vatra
from vatra.data.stratify import bundled_digits
from vatra.serve import export_run, load
from vatra.serve.app import ServeConfig, create_app, load_slots
from vatra.serve.registry import Registry
from vatra.serve.server import running
from vatra.serve.sources import RegistrySource
from vatra.serve.split import Split


@pytest.fixture(scope="module")
def digits_registry(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[str]]:
    """A registry holding two versions of "digits" (same weights, other metadata: another id);
    champion names the first. Returns the registry, the model folder and the two ids."""
    tmp = tmp_path_factory.mktemp("serve-model")
    run = vatra.fit(small_config(train={"steps": 20, "batch_size": 32, "eval_every": 0}), run_dir=tmp / "run")
    folder = export_run(run.run_dir, tmp / "model")
    registry = Registry(tmp / "registry", cache_dir=tmp / "cache")
    ids = [registry.register(folder, "digits", {"note": n}).id for n in ("first", "second")]
    registry.promote("digits", ids[0], "champion", "first served")
    return tmp / "registry", folder, ids


def digit_rows(n: int) -> list[dict[str, Any]]:
    pixels, _ = bundled_digits()
    return [{"x": pixels[i].tolist()} for i in range(n)]


@pytest.mark.slow(12)  # the module's fixture trains, exports and registers the model (~10 s)
def test_a_registered_model_answers_as_its_predictor_and_hot_swaps_on_promote(
    digits_registry: tuple[Path, Path, list[str]], tmp_path: Path
) -> None:
    where, folder, ids = digits_registry
    registry = Registry(where, cache_dir=tmp_path / "cache")
    source = RegistrySource(registry, "digits")
    cfg = ServeConfig(split=Split.single(source.default_ref()), log_dir=tmp_path / "log", poll_s=0.1)
    app = create_app(source, cfg, load_slots(source, cfg.split), log=lambda line: None)
    expected = load(folder).predict([r["x"] for r in digit_rows(16)])["prediction"].tolist()
    statuses: list[int] = []
    versions: list[str] = []
    stop = threading.Event()
    with running(app) as base, httpx.Client(base_url=base, timeout=30) as client:
        first = client.post("/predict", json={"rows": digit_rows(16), "key": "a"}).json()

        def fire() -> None:
            while not stop.is_set():
                r = client.post("/predict", json={"rows": digit_rows(4)})
                statuses.append(r.status_code)
                versions.append(r.json().get("version", "?"))

        thread = threading.Thread(target=fire)
        thread.start()
        time.sleep(0.3)
        registry.promote("digits", ids[1], "champion", "the second version")
        deadline = time.monotonic() + 20
        while ids[1] not in versions and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        thread.join()
    assert first["variant"] == "champion" and first["version"] == ids[0]
    assert [p["prediction"] for p in first["predictions"]] == expected
    assert set(first["predictions"][0]) == {"prediction", *(f"proba_{c}" for c in range(10))}
    assert set(statuses) == {200}, Counter(statuses)
    assert versions[0] == ids[0] and versions[-1] == ids[1]


@pytest.mark.slow(15)  # a real `vatra model serve` process: imports torch, fastapi, pyarrow (~8 s)
def test_vatra_model_serve_command(digits_registry: tuple[Path, Path, list[str]], tmp_path: Path) -> None:
    where, _, ids = digits_registry
    Registry(where).promote("digits", ids[0], "champion", "the command serves the first version")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "VATRA_CACHE_DIR": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "vatra", "model", "serve", "digits", "--registry", str(where), "--port", "0"]
    cmd += ["--ab", "champion=0.5,latest=0.5", "--log-dir", str(tmp_path / "log"), "--threads", "1"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line.startswith("vatra: serving digits on http://127.0.0.1:"), (line, proc.stderr)
        url = re.search(r"http://[0-9.]+:[0-9]+", line).group()  # type: ignore[union-attr]
        with httpx.Client(base_url=url, timeout=30) as client:
            answers = [
                client.post("/predict", json={"rows": digit_rows(1), "key": f"k{i}"}).json()
                for i in range(40)
            ]
            health = client.get("/healthz").json()
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert {a["variant"] for a in answers} == {"champion", "latest"}
    assert {a["variant"]: a["version"] for a in answers} == {"champion": ids[0], "latest": ids[1]}
    assert health["variants"]["latest"] == {"version": ids[1], "weight": 0.5}
    assert len((tmp_path / "log" / "predictions.jsonl").read_text().splitlines()) == 40


def test_bad_serve_options_are_one_line(
    digits_registry: tuple[Path, Path, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    where = str(digits_registry[0])
    for args, reason in [
        (["--ab", "champion=lots"], "alias=weight"),
        (["--ab", "champion=1,nosuch=1"], "nosuch"),
        (["--max-batch", "0"], "--max-batch"),
        (["--threads", "-1"], "--threads"),
    ]:
        code, _, err = vatra_in_process(capsys, "model", "serve", "digits", "--registry", where, *args)
        assert code == 2 and err.startswith("error: ") and reason in err and err.count("\n") == 1, err
    code, _, err = vatra_in_process(capsys, "model", "serve", "nosuch", "--registry", where)
    assert code == 2 and "no model 'nosuch'" in err, err

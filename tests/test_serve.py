"""Serving: the A/B split, micro-batching, hot swap, bad requests, logs and metrics on a real uvicorn."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from torch import nn

from vatra.errors import ConfigError
from vatra.serve.app import ServeConfig, create_app, load_slots
from vatra.serve.batcher import Answer, ModelError, RowsRefused, run_batch
from vatra.serve.server import running
from vatra.serve.source import Slot
from vatra.serve.split import Split


class TinyModel:
    """A 2-feature linear classifier; each version has its own weights; counts its model calls."""

    columns = ("x0", "x1")

    def __init__(self, version: str) -> None:
        torch.manual_seed(int(version.lstrip("v")))
        self.net = nn.Linear(2, 3)
        self.calls: list[int] = []  # rows per call
        self.call_s = 0.0  # a model call's time, beyond the arithmetic

    def predict(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        self.calls.append(len(rows))
        time.sleep(self.call_s)
        if any(r["x0"] == 999 for r in rows):
            raise RuntimeError("the model broke\nwith a second line")
        x = torch.tensor([[r["x0"], r["x1"]] for r in rows], dtype=torch.float32)  # (N, 2)
        with torch.no_grad():
            proba = self.net(x).softmax(dim=1)  # (N, 3)
        return [{"prediction": int(p.argmax()), "proba_0": float(p[0])} for p in proba]


class TinySource:
    """Aliases → version ids, as a registry would hold them; ``load`` may take a while."""

    def __init__(self, aliases: dict[str, str], load_s: float = 0.0) -> None:
        self.aliases = dict(aliases)
        self.load_s = load_s
        self.models: dict[str, TinyModel] = {}

    def version(self, ref: str) -> str:
        return self.aliases[ref]

    def load(self, ref: str, version: str) -> TinyModel:
        time.sleep(self.load_s)
        if version == "v0":
            raise OSError("weights file truncated")
        self.models[version] = TinyModel(version)
        return self.models[version]


@contextmanager
def serving(
    source: TinySource, tmp_path: Path, split: str = "champion=1", **kw: Any
) -> Iterator[httpx.Client]:
    cfg = ServeConfig(split=Split.parse(split), log_dir=tmp_path / "log", poll_s=0.05, **kw)
    app = create_app(source, cfg, load_slots(source, cfg.split), log=lambda line: None)
    with running(app) as base, httpx.Client(base_url=base, timeout=30) as client:
        yield client


def rows(n: int, start: int = 0) -> list[dict[str, float]]:
    return [{"x0": (start + i) / 7.0, "x1": -(start + i) / 3.0} for i in range(n)]


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# --- the split --------------------------------------------------------------------------------


def test_split_shares_within_one_percent_over_100k_keys() -> None:
    split = Split.parse("champion=0.9,challenger=0.1")
    keyed = Counter(split.choose(f"user-{i}") for i in range(100_000))
    random_ = Counter(split.choose(None) for _ in range(100_000))
    for counts in (keyed, random_):
        assert abs(counts["champion"] / 100_000 - 0.9) < 0.01
        assert abs(counts["challenger"] / 100_000 - 0.1) < 0.01


def test_split_is_sticky_per_key_and_normalises_weights() -> None:
    a, b = Split.parse("champion=9,challenger=1"), Split.parse("champion=0.9, challenger=0.1")
    assert a == b
    for i in range(1000):
        assert a.choose(f"k{i}") == b.choose(f"k{i}") == a.choose(f"k{i}")


@pytest.mark.parametrize("text", ["", "champion", "champion=0", "a=1,a=2", "a=-1,b=2", "a=x", "=1"])
def test_split_refuses_bad_text_with_one_line(text: str) -> None:
    with pytest.raises(ConfigError, match=r"^[^\n]*(alias|empty|twice)[^\n]*$"):
        Split.parse(text)


# --- over HTTP --------------------------------------------------------------------------------


def test_predict_routes_by_key_and_logs_each_row(tmp_path: Path) -> None:
    source = TinySource({"champion": "v1", "challenger": "v2"})
    with serving(source, tmp_path, "champion=0.7,challenger=0.3") as client:
        answers = [
            client.post("/predict", json={"rows": rows(2, i), "key": f"u{i % 100}"}) for i in range(300)
        ]
        again = client.post("/predict", json={"rows": rows(1), "key": "u7"}).json()
        metrics = client.get("/metrics").text
    assert all(r.status_code == 200 for r in answers)
    body = [r.json() for r in answers]
    by_key = {f"u{i % 100}": b["variant"] for i, b in enumerate(body)}
    assert again["variant"] == by_key["u7"]
    for i, b in enumerate(body):  # sticky: every request of a key went to the same variant
        assert b["variant"] == by_key[f"u{i % 100}"]
        assert b["version"] == {"champion": "v1", "challenger": "v2"}[b["variant"]]
        assert len(b["predictions"]) == len(b["ids"]) == 2
    share = Counter(by_key.values())["challenger"] / 100  # 100 keys: binomial sd 0.046
    assert 0.15 < share < 0.45
    for i in (0, 1, 2):  # the answer is the variant's own model's output for those rows
        model = source.models[body[i]["version"]]
        assert body[i]["predictions"] == model.predict(rows(2, i))
    log = jsonl(tmp_path / "log" / "predictions.jsonl")
    assert len(log) == 601 and {r["id"] for r in log} >= set(body[0]["ids"])
    assert set(log[0]) == {"id", "t", "variant", "version", "key", "latency_ms", "error"}
    assert not any(r["error"] for r in log)
    n = Counter(b["variant"] for b in body)
    for variant in ("champion", "challenger"):  # the answered requests, their rows, their latencies
        k = n[variant] + (variant == by_key["u7"])
        assert f'vatra_serve_requests_total{{variant="{variant}"}} {float(k)}' in metrics
        assert (
            f'vatra_serve_rows_total{{variant="{variant}"}} {float(2 * n[variant] + (k - n[variant]))}'
            in metrics
        )
        assert f'vatra_serve_latency_seconds_count{{variant="{variant}"}} {float(k)}' in metrics


def test_concurrent_requests_share_model_calls(tmp_path: Path) -> None:
    source = TinySource({"champion": "v1"})

    async def fire(base: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            return await asyncio.gather(
                *(client.post("/predict", json={"rows": rows(1, i)}) for i in range(48))
            )

    cfg = ServeConfig(split=Split.single("champion"), log_dir=tmp_path, max_batch=16, max_wait_ms=200)
    app = create_app(source, cfg, load_slots(source, cfg.split), log=lambda line: None)
    source.models["v1"].call_s = 0.02  # a slow model: requests pile up while it runs, however slow the client
    with running(app) as base:
        answers = asyncio.run(fire(base))
    calls = source.models["v1"].calls
    assert [r.status_code for r in answers] == [200] * 48
    assert sum(calls) == 48 and max(calls) <= 16
    assert len(calls) <= 12, calls  # 48 one-row requests in a few 16-row calls, not 48 calls
    reference = TinyModel("v1")  # same seed, same weights: each answer is its own row's output
    for i, r in enumerate(answers):  # to float32 rounding: a batched matmul sums in another order
        [got], [want] = r.json()["predictions"], reference.predict(rows(1, i))
        assert got == {"prediction": want["prediction"], "proba_0": pytest.approx(want["proba_0"], abs=1e-6)}


def test_a_lone_client_does_not_wait_for_the_latency_budget(tmp_path: Path) -> None:
    source = TinySource({"champion": "v1"})
    with serving(source, tmp_path, max_wait_ms=300) as client:
        started = time.perf_counter()
        for i in range(10):  # one after the other: nobody can share a model call with them
            assert client.post("/predict", json={"rows": rows(1, i)}).status_code == 200
        seconds = time.perf_counter() - started
    assert seconds < 1.5, seconds  # waiting out the budget would take 10 × 0.3 s


def test_hot_swap_under_load_answers_every_request(tmp_path: Path) -> None:
    source = TinySource({"champion": "v1"}, load_s=0.3)  # a slow load: requests keep coming meanwhile
    statuses: list[int] = []
    versions: list[str] = []
    stop = threading.Event()
    with serving(source, tmp_path) as client:

        def load() -> None:
            while not stop.is_set():
                r = client.post("/predict", json={"rows": rows(3)})
                statuses.append(r.status_code)
                versions.append(r.json().get("version", "?"))

        thread = threading.Thread(target=load)
        thread.start()
        time.sleep(0.3)
        source.aliases["champion"] = "v2"  # the alias moves
        deadline = time.monotonic() + 10
        while "v2" not in versions and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        stop.set()
        thread.join()
        metrics = client.get("/metrics").text
    assert set(statuses) == {200}, Counter(statuses)
    assert versions[0] == "v1" and versions[-1] == "v2"
    first_v2 = versions.index("v2")
    assert set(versions[first_v2:]) == {"v2"}  # no request went back to the old version
    assert first_v2 > 5  # the old version kept answering while the new one loaded
    assert 'vatra_serve_swaps_total{variant="champion"} 1.0' in metrics
    assert 'vatra_serve_version{variant="champion",version="v2"} 1.0' in metrics
    assert 'version="v1"' not in metrics


def test_a_version_that_fails_to_load_is_logged_once_and_the_old_one_serves(tmp_path: Path) -> None:
    source = TinySource({"champion": "v1"})
    lines: list[str] = []
    cfg = ServeConfig(split=Split.single("champion"), log_dir=tmp_path, poll_s=0.02)
    app = create_app(source, cfg, load_slots(source, cfg.split), log=lines.append)
    with running(app) as base, httpx.Client(base_url=base) as client:
        source.aliases["champion"] = "v0"  # a broken version
        time.sleep(0.3)  # ~15 polls
        during = client.post("/predict", json={"rows": rows(1)}).json()["version"]
        source.aliases["champion"] = "v2"  # the alias moves on
        deadline = time.monotonic() + 10
        while client.post("/predict", json={"rows": rows(1)}).json()["version"] != "v2":
            assert time.monotonic() < deadline
    assert during == "v1"
    assert lines == ["champion: keeps serving v1: weights file truncated", "champion: swapped v1 -> v2"]


def arrow_bomb() -> bytes:
    """A zstd-compressed Arrow stream of a few KiB that expands to 8 MB of zeros."""
    import pyarrow as pa

    table = pa.table({"x0": pa.array([0.0] * 1_000_000), "x1": pa.array([0.0] * 1_000_000)})
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with pa.ipc.new_stream(sink, table.schema, options=options) as writer:
        writer.write_table(table)
    body = sink.getvalue().to_pybytes()
    assert len(body) < 4096
    return bytes(body)


def test_bad_requests_get_4xx_with_one_line_reasons(tmp_path: Path) -> None:
    source = TinySource({"champion": "v1"})
    arrow_garbage = {"content-type": "application/vnd.apache.arrow.stream"}
    with serving(source, tmp_path, max_body_bytes=4096) as client:
        good = client.post("/predict", json={"rows": rows(1)}).json()["ids"][0]
        cases = {
            "not JSON": (client.post("/predict", content=b"{rows: 1"), 400, "not JSON"),
            "no rows": (client.post("/predict", json={"row": []}), 400, '"rows"'),
            "rows not a list": (client.post("/predict", json={"rows": {"x0": 1}}), 400, "list of objects"),
            "empty": (client.post("/predict", json={"rows": []}), 422, "empty"),
            "missing column": (client.post("/predict", json={"rows": [{"x0": 1}]}), 422, "lacks column 'x1'"),
            "unknown column": (
                client.post("/predict", json={"rows": [{"x0": 1, "x1": 2, "y": 3}]}),
                422,
                "unknown column 'y'",
            ),
            "object value": (client.post("/predict", json={"rows": [{"x0": {}, "x1": 2}]}), 422, "object"),
            "bad key": (client.post("/predict", json={"rows": rows(1), "key": [1]}), 400, "key"),
            "long key": (
                client.post("/predict", json={"rows": rows(1), "key": "k" * 300}),
                400,
                "at most 256",
            ),
            "too large": (client.post("/predict", json={"rows": rows(200)}), 413, "limit of 4096 bytes"),
            "bad arrow": (client.post("/predict", content=b"\xff" * 64, headers=arrow_garbage), 400, "Arrow"),
            "deep JSON": (client.post("/predict", content=b"[" * 4000), 400, "too deeply"),
            "arrow bomb": (
                client.post("/predict", content=arrow_bomb(), headers=arrow_garbage),
                413,
                "expands",
            ),
            "unknown id": (
                client.post("/outcome", json={"id": "nope", "value": 1}),
                404,
                "unknown prediction id",
            ),
            "bad value": (client.post("/outcome", json={"id": good, "value": "high"}), 422, "finite number"),
            "no id": (client.post("/outcome", json={"value": 1}), 400, '"id"'),
            "no route": (client.get("/predictions"), 404, "Not Found"),
            "wrong method": (client.get("/predict"), 405, "Method Not Allowed"),
        }
        assert client.post("/outcome", json={"id": good, "value": True}).status_code == 200
        again = client.post("/outcome", json={"id": good, "value": 0})
        metrics = client.get("/metrics").text
    cases["outcome twice"] = (again, 409, "already has an outcome")
    for what, (response, status, reason) in cases.items():
        error = response.json()["error"]
        assert (response.status_code, reason in error, "\n" in error) == (status, True, False), (what, error)
    assert 'vatra_serve_rejected_total{status="400"}' in metrics
    assert 'vatra_serve_errors_total{kind="input",variant="champion"} 3.0' in metrics
    assert jsonl(tmp_path / "log" / "outcomes.jsonl") == [
        {"id": good, "t": pytest.approx(time.time(), abs=60), "value": 1.0}
    ]


def test_a_request_the_model_refuses_or_fails_on_fails_alone(tmp_path: Path) -> None:
    source = TinySource({"champion": "v1"})

    async def fire(base: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            bad = {3: [{"x0": "high", "x1": 1}], 5: [{"x0": 999, "x1": 1}]}  # a TypeError, a RuntimeError
            requests = [client.post("/predict", json={"rows": bad.get(i, rows(1, i))}) for i in range(8)]
            return await asyncio.gather(*requests)

    cfg = ServeConfig(split=Split.single("champion"), log_dir=tmp_path, max_wait_ms=200)
    app = create_app(source, cfg, load_slots(source, cfg.split), log=lambda line: None)
    with running(app) as base:
        answers = asyncio.run(fire(base))
    assert [r.status_code for r in answers] == [200, 200, 200, 422, 200, 500, 200, 200]
    assert "\n" not in answers[3].json()["error"]
    assert answers[5].json() == {"error": "the model failed: RuntimeError: the model broke"}
    log = jsonl(tmp_path / "predictions.jsonl")
    assert [r["error"] for r in log].count(True) == 2


def test_a_failed_batch_is_scored_request_by_request() -> None:
    model = TinyModel("v1")
    requests = [rows(2), [{"x0": "high", "x1": 1}], rows(1, 5), [{"x0": 999, "x1": 0}]]
    answers = run_batch(Slot("v1", model), requests)
    assert model.calls == [5, 2, 1, 1, 1]  # the batch, then each request alone
    assert isinstance(answers[0], Answer) and isinstance(answers[2], Answer)
    assert answers[0].outputs == TinyModel("v1").predict(rows(2))
    assert isinstance(answers[1], RowsRefused) and isinstance(answers[3], ModelError)


def test_arrow_in_arrow_out_and_restart_keeps_outcome_ids(tmp_path: Path) -> None:
    import pyarrow as pa

    table = pa.Table.from_pylist(rows(5))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    source = TinySource({"champion": "v1"})
    with serving(source, tmp_path) as client:
        r = client.post(
            "/predict",
            content=sink.getvalue().to_pybytes(),
            headers={"content-type": "application/vnd.apache.arrow.stream", "x-request-key": "k"},
        )
        health = client.get("/healthz").json()
    out = pa.ipc.open_stream(r.content).read_all()
    assert r.headers["x-variant"] == "champion" and r.headers["x-model-version"] == "v1"
    assert out.column_names == ["id", "prediction", "proba_0"]
    assert out.drop_columns(["id"]).to_pylist() == source.models["v1"].predict(rows(5))
    assert health == {"status": "ok", "variants": {"champion": {"version": "v1", "weight": 1.0}}}
    with serving(source, tmp_path) as client:  # a restarted server accepts outcomes of earlier ids
        assert (
            client.post("/outcome", json={"id": out.column("id")[0].as_py(), "value": 2.5}).status_code == 200
        )

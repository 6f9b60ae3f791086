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
from vatra.serve.server import running
from vatra.serve.split import Split


class TinyModel:
    """A 2-feature linear classifier; each version has its own weights; counts its model calls."""

    columns = ("x0", "x1")

    def __init__(self, version: str) -> None:
        torch.manual_seed(int(version.lstrip("v")))
        self.net = nn.Linear(2, 3)
        self.calls: list[int] = []  # rows per call

    def predict(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        self.calls.append(len(rows))
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
        self.models[version] = TinyModel(version)
        return self.models[version]


@contextmanager
def serving(source: TinySource, tmp_path: Path, split: str = "champion=1", **kw: Any) -> Iterator[httpx.Client]:
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
    with pytest.raises(ConfigError, match="^[^\n]*(alias|empty|twice)[^\n]*$"):
        Split.parse(text)


# --- over HTTP --------------------------------------------------------------------------------


def test_predict_routes_by_key_and_logs_each_row(tmp_path: Path) -> None:
    source = TinySource({"champion": "v1", "challenger": "v2"})
    with serving(source, tmp_path, "champion=0.7,challenger=0.3") as client:
        answers = [client.post("/predict", json={"rows": rows(2, i), "key": f"u{i % 100}"}) for i in range(300)]
        again = client.post("/predict", json={"rows": rows(1), "key": "u7"}).json()
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

"""``vatra model ab-report`` on serving log folders: the join, the rules (win, guardrail, futility),
hostile log lines counted and skipped, and the HTML page rendered in headless Chromium."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from tests.conftest import vatra_in_process

from vatra.cli.model_ab import apply_decision
from vatra.errors import ConfigError
from vatra.serve.ab import ABConfig, analyse, read_log, render
from vatra.serve.registry import Registry


def write_log(
    folder: Path,
    n: int,
    *,
    rate: tuple[float, float] = (0.10, 0.10),
    errors: tuple[float, float] = (0.01, 0.01),
    latency: tuple[float, float] = (20.0, 20.0),
    share: float = 0.5,
    seed: int = 0,
    outcomes: bool = True,
    versions: tuple[str, str] = ("v1aaaa", "v2bbbb"),
    start: int = 0,
) -> Path:
    """A serving log of ``n`` requests split champion/challenger, as the server writes it: one
    prediction row per request and, for those that did not fail, one outcome row (binary at the
    arm's ``rate``) a little later. ``start``: append request ``start`` onwards to a log."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    is_b = rng.random(n) < share
    arm = is_b.astype(int)
    err = rng.random(n) < np.take(errors, arm)
    lat = rng.lognormal(np.log(np.take(latency, arm)), 0.3)
    conv = rng.random(n) < np.take(rate, arm)
    with (folder / "predictions.jsonl").open("a") as pf, (folder / "outcomes.jsonl").open("a") as of:
        for k in range(n):
            i = start + k
            variant, version = ("challenger", versions[1]) if is_b[k] else ("champion", versions[0])
            row = {"id": f"r{i}", "t": 1000.0 + i, "variant": variant, "version": version, "key": None}
            pf.write(json.dumps({**row, "latency_ms": float(lat[k]), "error": bool(err[k])}) + "\n")
            if outcomes and not err[k]:
                of.write(json.dumps({"id": f"r{i}", "t": 1000.5 + i, "value": float(conv[k])}) + "\n")
    return folder


def test_a_winning_challenger_is_promoted_with_its_evidence(tmp_path: Path) -> None:
    # Prepare: conversion 10 % -> 16 %, healthy guardrails
    log = read_log(write_log(tmp_path / "log", 6000, rate=(0.10, 0.16)))
    # Execute
    result = analyse(log, ABConfig(metric="binary", horizon=6000))
    # Assert: promote, fired before the end of the log, with the numbers that justified it
    d = result.decision
    assert (d.action, d.rule) == ("promote", "win")
    assert d.evidence is not None and result.primary is not None
    assert d.evidence.lo > 0 and d.evidence.p < 0.05
    assert (
        d.evidence.n_champion + d.evidence.n_challenger
        < result.primary.n_champion + result.primary.n_challenger
    )
    assert all(g.tripped is None for g in result.guardrails)
    ev = result.evidence_dict()
    assert ev["challenger"] == {"variant": "challenger", "version": "v2bbbb"}
    json.dumps(ev)  # the registry stores it as JSON


def test_a_failing_challenger_trips_the_error_guardrail_before_any_outcome_verdict(tmp_path: Path) -> None:
    # Prepare: the challenger fails 8 % of requests (champion 1 %); conversion the same
    log = read_log(write_log(tmp_path / "log", 3000, errors=(0.01, 0.08), seed=1))
    # Execute
    result = analyse(log, ABConfig())
    # Assert: rolled back by the guardrail, early (well before the whole log)
    d = result.decision
    assert (d.action, d.rule) == ("rollback", "guardrail:error_rate")
    assert d.evidence is not None and d.evidence.lo > 0
    assert d.evidence.n_champion + d.evidence.n_challenger < 1500


def test_a_slow_challenger_trips_the_latency_guardrail(tmp_path: Path) -> None:
    # Prepare: the challenger is 40 % slower; errors and conversion the same
    log = read_log(write_log(tmp_path / "log", 3000, latency=(20.0, 28.0), seed=2))
    # Execute
    result = analyse(log, ABConfig())
    # Assert
    assert (result.decision.action, result.decision.rule) == ("rollback", "guardrail:latency_p95")
    latency = next(g for g in result.guardrails if g.name == "latency_p95")
    assert latency.challenger > latency.champion


def test_futility_stops_when_the_interval_rules_out_the_minimum_effect(tmp_path: Path) -> None:
    # Prepare: no real difference, and only a lift of 5 points would matter
    log = read_log(write_log(tmp_path / "log", 8000, seed=3))
    # Execute
    result = analyse(log, ABConfig(mde=0.05, horizon=8000))
    none = analyse(log, ABConfig(horizon=8000))
    # Assert: stop for futility with the interval below the mde; without an mde, keep going
    d = result.decision
    assert (d.action, d.rule) == ("stop", "futility")
    assert d.evidence is not None and d.evidence.hi < 0.05
    assert none.decision.action == "continue"


def test_only_the_current_experiment_is_judged_after_an_alias_moved(tmp_path: Path) -> None:
    # Prepare: challenger v2 clearly won; then its alias moved to v3, which converts like v1
    folder = write_log(tmp_path / "log", 6000, rate=(0.10, 0.18), versions=("v1", "v2"))
    write_log(folder, 3000, versions=("v1", "v3"), start=6000, seed=11)
    # Execute
    result = analyse(read_log(folder), ABConfig(horizon=3000))
    # Assert: v2's win is not credited to v3; only the 3,000 requests since the move count
    assert result.latest["challenger"] == "v3" and result.decision.action == "continue"
    assert result.primary is not None and result.primary.n_champion + result.primary.n_challenger < 3000
    assert 3000 <= sum(result.traffic.values()) <= 3010  # from v2's last request on
    assert any("an alias moved" in n and "earlier requests left out" in n for n in result.notes)


def test_a_guardrail_trip_overrides_an_earlier_win(tmp_path: Path) -> None:
    # Prepare: the challenger converts better (a quick win) but fails more requests (a later trip)
    log = read_log(write_log(tmp_path / "log", 8000, rate=(0.10, 0.20), errors=(0.01, 0.025), seed=12))
    # Execute
    result = analyse(log, ABConfig(horizon=8000))
    # Assert: rollback, and the report says a win had fired
    win_t = analyse(log, ABConfig(horizon=8000, error_margin=0.5, latency_ms=1e9)).decision.evidence
    assert (result.decision.action, result.decision.rule) == ("rollback", "guardrail:error_rate")
    assert win_t is not None and result.decision.evidence is not None
    assert win_t.t < result.decision.evidence.t
    assert any("'win' fired too" in n for n in result.notes)


def test_lower_is_better_turns_a_drop_into_a_win(tmp_path: Path) -> None:
    # Prepare: a continuous metric (minutes to resolve a ticket) that the challenger lowers by 20 %
    folder = write_log(tmp_path / "log", 3000, seed=14, outcomes=False)
    rng = np.random.default_rng(14)
    rows = [json.loads(line) for line in (folder / "predictions.jsonl").read_text().splitlines()]
    with (folder / "outcomes.jsonl").open("w") as f:
        for row in rows:
            minutes = rng.lognormal(np.log(30.0 if row["variant"] == "champion" else 24.0), 0.5)
            f.write(json.dumps({"id": row["id"], "t": row["t"] + 0.5, "value": minutes}) + "\n")
    log = read_log(folder)
    # Execute
    lower = analyse(log, ABConfig(metric="continuous", higher_is_better=False, horizon=3000))
    higher = analyse(log, ABConfig(metric="continuous", horizon=3000, latency_ms=1e9, error_margin=0.5))
    # Assert: the same interval below 0 is a win one way and a loss the other
    assert (lower.decision.action, lower.decision.rule) == ("promote", "win")
    assert (higher.decision.action, higher.decision.rule) == ("rollback", "lose")
    assert lower.decision.evidence is not None and lower.decision.evidence.hi < 0


def test_hostile_and_malformed_lines_are_counted_not_trusted(tmp_path: Path) -> None:
    # Prepare: a good log, then lines a client or a broken writer could leave
    folder = write_log(tmp_path / "log", 400, seed=4)
    good = read_log(folder)
    bad_pred = [
        b"not json",
        b"\xff\xfe garbage",
        b"[1, 2]",
        b'{"id": "x1", "t": NaN, "variant": "champion", "version": "v", "latency_ms": 1, "error": false}',
        b'{"id": "x2", "t": 1, "variant": "champion", "version": "v", "latency_ms": -1, "error": false}',
        b'{"id": "x3", "t": 1, "variant": "champion", "version": "v", "latency_ms": 1, "error": "no"}',
        b'{"id": "r0", "t": 1, "variant": "challenger", "version": "v", "latency_ms": 1, "error": false}',
        b'{"id": "'
        + b"a" * 300
        + b'", "t": 1, "variant": "c", "version": "v", "latency_ms": 1, "error": false}',
        b'{"id": "x4", "t": true, "variant": "champion", "version": "v", "latency_ms": 1, "error": false}',
        b"[" * 100_000,
        b"{" + b'"a": 1, ' * 10_000 + b'"b": 2}',
    ]
    bad_out = [
        b'{"id": "r1", "t": 5, "value": "1"}',
        b'{"id": "nobody", "t": 5, "value": 1}',
        b'{"id": "r1", "t": 1e308, "value": Infinity}',
        b"{}",
        b'"just a string"',
    ]
    with (folder / "predictions.jsonl").open("ab") as f:
        f.write(b"\n".join(bad_pred) + b"\n")
    with (folder / "outcomes.jsonl").open("ab") as f:
        f.write(b"\n".join(bad_out) + b"\n")
    # Execute
    log = read_log(folder)
    # Assert: every bad line counted, the good rows untouched
    assert sum(log.skipped.values()) == len(bad_pred) + len(bad_out) + sum(good.skipped.values())
    assert log.skipped["predictions: repeated id"] == 1
    assert log.skipped["outcomes: id of no logged prediction"] == 1
    assert len(log.requests.t) == len(good.requests.t) and len(log.outcomes.t) == len(good.outcomes.t)


def test_random_bytes_never_crash_the_reader(tmp_path: Path) -> None:
    # Prepare: 200 files of random bytes and mutated good lines
    rng = np.random.default_rng(5)
    line = json.dumps(
        {"id": "a", "t": 1.0, "variant": "champion", "version": "v", "latency_ms": 2.0, "error": False}
    )
    for k in range(200):
        folder = tmp_path / f"f{k}"
        folder.mkdir()
        raw = bytearray((line + "\n") * 3, "utf-8")
        for i in rng.integers(0, len(raw), size=rng.integers(1, 8)):
            raw[i] = int(rng.integers(0, 256))
        (folder / "predictions.jsonl").write_bytes(bytes(raw) + rng.bytes(int(rng.integers(0, 64))))
        (folder / "outcomes.jsonl").write_bytes(rng.bytes(int(rng.integers(0, 256))))
        # Execute / Assert: reads, or is refused with a one-line error, never anything else
        log = read_log(folder)
        try:
            analyse(log, ABConfig())
        except ConfigError as err:
            assert "\n" not in str(err)


def test_cli_prints_the_decision_and_writes_a_self_contained_html(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare
    folder = write_log(tmp_path / "serve" / "digits", 5000, rate=(0.10, 0.16), seed=6)
    page = tmp_path / "ab.html"
    # Execute
    code, out, err = vatra_in_process(
        capsys,
        "model",
        "ab-report",
        "digits",
        "--log-dir",
        str(folder),
        "--horizon",
        "5000",
        "--html",
        str(page),
    )
    # Assert
    assert code == 0, err
    assert "decision: promote (win)" in out and "error_rate" in out and "traffic: challenger=" in out
    text = page.read_text()
    assert "<svg" in text and "http://" not in text and "https://" not in text and "<script" not in text


def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare: an empty folder, a binary metric fed with revenue, a third variant
    folder = write_log(tmp_path / "log", 300, seed=7)
    first, *rest = (folder / "outcomes.jsonl").read_text().splitlines()
    revenue = json.dumps({**json.loads(first), "value": 12.5})
    (folder / "outcomes.jsonl").write_text("\n".join([revenue, *rest]) + "\n")
    (tmp_path / "empty").mkdir()
    # Execute / Assert
    code, _, err = vatra_in_process(capsys, "model", "ab-report", "m", "--log-dir", str(tmp_path / "empty"))
    assert code == 2 and err.startswith("error: no predictions.jsonl") and err.count("\n") == 1
    code, _, err = vatra_in_process(capsys, "model", "ab-report", "m", "--log-dir", str(folder))
    assert code == 2 and "--metric continuous" in err and err.count("\n") == 1
    code, _, err = vatra_in_process(
        capsys, "model", "ab-report", "m", "--log-dir", str(folder), "--alpha", "2"
    )
    assert code == 2 and "alpha" in err
    code, out, err = vatra_in_process(
        capsys, "model", "ab-report", "m", "--log-dir", str(folder), "--metric", "continuous", "--json"
    )
    assert code == 0, err
    assert json.loads(out)["action"] in ("continue", "promote", "rollback", "stop")


def _registry_with_canary(tmp_path: Path) -> tuple[Registry, str, str]:
    """A real registry: v1 is champion; the challenger alias went v1 -> v2 (a canary)."""
    reg = Registry(tmp_path / "models")
    ids = []
    for k in (1, 2):
        folder = tmp_path / f"model{k}"
        folder.mkdir()
        (folder / "weights.bin").write_bytes(bytes([k]) * 64)
        ids.append(reg.register(folder, "digits", {"k": k}).id)
    reg.promote("digits", ids[0], "champion", "first model")
    reg.promote("digits", ids[0], "challenger", "canary starts equal")
    reg.promote("digits", ids[1], "challenger", "canary of v2")
    return reg, ids[0], ids[1]


def _ab(capsys: pytest.CaptureFixture[str], folder: Path, reg: Registry, *extra: str) -> tuple[int, str, str]:
    args = ["model", "ab-report", "digits", "--log-dir", str(folder), "--registry", reg.uri, *extra]
    return vatra_in_process(capsys, *args)


def test_apply_promotes_a_winner_in_the_alias_history_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare
    reg, v1, v2 = _registry_with_canary(tmp_path)
    folder = write_log(tmp_path / "log", 6000, rate=(0.10, 0.16), versions=(v1[:12], v2[:12]))
    # Execute: applied twice, as a scheduled job would
    code, out, err = _ab(capsys, folder, reg, "--horizon", "6000", "--apply")
    again, out2, _ = _ab(capsys, folder, reg, "--horizon", "6000", "--apply")
    # Assert: champion -> v2 once, with the evidence of the moment the test fired
    assert code == 0 and again == 0, err
    assert "applied: promoted" in out and "already applied" in out2
    assert reg.aliases("digits")["champion"] == v2
    moves = [m for m in reg.history("digits") if m.alias == "champion"]
    assert [m.target for m in moves] == [v1, v2]
    ev = moves[-1].evidence
    assert ev is not None and ev["rule"] == "win" and ev["at_decision"]["lo"] > 0
    assert ev["challenger"]["version"] == v2[:12]


def test_apply_rolls_the_challenger_back_when_a_guardrail_trips(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: v2 fails 8 % of requests
    reg, v1, v2 = _registry_with_canary(tmp_path)
    folder = write_log(tmp_path / "log", 3000, errors=(0.01, 0.08), seed=1, versions=(v1, v2))
    # Execute
    code, out, err = _ab(capsys, folder, reg, "--apply")
    again, out2, _ = _ab(capsys, folder, reg, "--apply")
    # Assert: the challenger alias is back on v1, the champion untouched, and only one move made
    assert code == 0 and again == 0, err
    assert "decision: rollback (guardrail:error_rate)" in out and "already applied" in out2
    assert reg.aliases("digits") == {"champion": v1, "challenger": v1}
    last = reg.history("digits")[-1]
    assert (last.alias, last.action) == ("challenger", "rollback")
    assert last.evidence is not None and last.evidence["rule"] == "guardrail:error_rate"
    assert len(reg.history("digits")) == 4


def test_apply_without_an_earlier_challenger_points_it_at_the_champion(tmp_path: Path) -> None:
    # Prepare: the challenger alias was set once, straight to v2
    reg = Registry(tmp_path / "models")
    ids = []
    for k in (1, 2):
        (tmp_path / f"m{k}").mkdir()
        (tmp_path / f"m{k}" / "w.bin").write_bytes(bytes([k]) * 8)
        ids.append(reg.register(tmp_path / f"m{k}", "digits").id)
    reg.promote("digits", ids[0], "champion", "first")
    reg.promote("digits", ids[1], "challenger", "canary")
    folder = write_log(tmp_path / "log", 3000, errors=(0.01, 0.08), seed=1, versions=(ids[0], ids[1]))
    result = analyse(read_log(folder), ABConfig())
    # Execute
    done = apply_decision(reg, "digits", result)
    # Assert
    assert done is not None and reg.aliases("digits")["challenger"] == ids[0]
    assert "no earlier challenger version" in reg.history("digits")[-1].reason


CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def test_html_report_renders_in_headless_chromium(tmp_path: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    # Prepare: a report whose variant name is hostile markup
    folder = write_log(tmp_path / "log", 5000, rate=(0.10, 0.16), seed=9)
    text = (
        (folder / "predictions.jsonl").read_text().replace('"challenger"', '"<img src=x onerror=alert(1)>"')
    )
    (folder / "predictions.jsonl").write_text(text)
    result = analyse(read_log(folder), ABConfig(horizon=5000, mde=0.02))
    page = tmp_path / "ab.html"
    page.write_text(render(result, "digits"))
    # Execute
    proc = subprocess.run(
        [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    dom = proc.stdout
    # Assert: the browser built the charts, the tables and the numbers; the markup stayed text
    assert proc.returncode == 0 and "<body" in dom, proc.stderr[-2000:]
    for element in (
        'id="effect-chart"',
        'class="ci-band"',
        'class="effect"',
        'id="p-chart"',
        'class="p-seq"',
    ):
        assert element in dom, element
    assert dom.count('class="split"') == 2 and dom.count('class="guardrail"') == 2
    assert 'id="card-decision"' in dom and ">promote<" in dom
    assert f"{result.decision.evidence.n_champion}" in dom  # type: ignore[union-attr]
    assert "<img" not in dom and "&lt;img src=x onerror=alert(1)&gt;" in dom


def test_a_log_without_outcomes_yet_runs_the_guardrails_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: requests logged, no outcomes file yet
    folder = write_log(tmp_path / "log", 600, seed=10, outcomes=False)
    (folder / "outcomes.jsonl").unlink()
    page = tmp_path / "ab.html"
    # Execute
    code, out, err = vatra_in_process(
        capsys, "model", "ab-report", "m", "--log-dir", str(folder), "--html", str(page)
    )
    # Assert: continue, said why; the page has the guardrails and no effect chart
    assert code == 0, err
    assert "decision: continue" in out and "only the guardrails ran" in out
    text = page.read_text()
    assert 'id="guardrails"' in text and 'id="effect-chart"' not in text


def test_the_rows_of_one_batched_request_count_as_one_request(tmp_path: Path) -> None:
    # Prepare: 50 requests of 20 rows each, as the server logs a batch (one line per row, same
    # t/variant/version/key/latency/error), every 5th request failed as a whole; an outcome per row
    folder = tmp_path / "log"
    folder.mkdir()
    preds, outs = [], []
    for r in range(50):
        variant = "challenger" if r % 2 else "champion"
        for k in range(20):
            rid = f"q{r}-{k}"
            row = {"id": rid, "t": 100.0 + r, "variant": variant, "version": variant[:3], "key": f"u{r}"}
            preds.append(json.dumps({**row, "latency_ms": 5.0 + r, "error": r % 5 == 0}))
            outs.append(json.dumps({"id": rid, "t": 100.5 + r, "value": 1.0}))
    (folder / "predictions.jsonl").write_text("\n".join(preds) + "\n")
    (folder / "outcomes.jsonl").write_text("\n".join(outs) + "\n")
    # Execute
    log = read_log(folder)
    # Assert: 50 requests (10 failed), 1,000 rows, every row's outcome joined
    assert len(log.requests.t) == 50 and int(log.requests.rows.sum()) == 1000
    assert int(log.requests.error.sum()) == 10
    assert len(log.outcomes.t) == 1000 and not log.skipped


def test_json_evidence_is_strict_json_before_the_test_may_decide(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: 120 requests: fewer outcomes per arm than the test needs, interval unbounded
    folder = write_log(tmp_path / "log", 120, seed=13)
    # Execute
    code, out, err = vatra_in_process(capsys, "model", "ab-report", "m", "--log-dir", str(folder), "--json")
    # Assert: null where a number is not finite (the registry's history and jq read it)
    assert code == 0, err
    ev = json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert ev["action"] == "continue" and ev["at_decision"]["lo"] is None and ev["at_decision"]["hi"] is None

"""``vatra energy schedule``: the cheapest window and the pause-resume plan of a small profile,
checked by hand and against a brute-force search."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
from tests.conftest import vatra_in_process

from vatra.errors import ConfigError
from vatra.monitor.energy.profile import Profile, parse_time, read_profile
from vatra.monitor.energy.schedule import (
    Pieces,
    cheapest_chunks,
    cheapest_window,
    parse_duration,
    plan_mean,
)

H = 3600.0
T0 = parse_time("2024-01-01T00:00Z")
PRICES = (50, 40, 10, 30, 5, 60)  # €/MWh, hours 00:00 .. 05:00


@pytest.fixture
def prices(tmp_path: Path) -> Path:
    path = tmp_path / "prices.csv"
    rows = "".join(f"2024-01-01 {h:02d}:00,{p}\n" for h, p in enumerate(PRICES))
    path.write_text("datetime,price_eur_mwh\n" + rows)
    return path


def test_the_cheapest_window_of_a_small_profile_matches_the_hand_computed_one(prices: Path) -> None:
    p = read_profile(prices)
    # 2 h windows on the hour: 45, 25, 20, 17.5, 32.5 → 03:00–05:00
    two = cheapest_window(p, 2 * H, T0)
    assert (two.start, two.end, two.mean) == (T0 + 3 * H, T0 + 5 * H, 17.5)
    # 1.5 h: the best starts on a half hour, 03:30–05:00: (0.5·30 + 5) / 1.5
    ninety = cheapest_window(p, 1.5 * H, T0)
    assert (ninety.start, ninety.mean) == (T0 + 3.5 * H, pytest.approx(20 / 1.5))
    # a deadline at 04:00 leaves 02:00–04:00 (20) as the best 2 h
    early = cheapest_window(p, 2 * H, T0, deadline=T0 + 4 * H)
    assert (early.start, early.mean) == (T0 + 2 * H, 20.0)


def test_the_pause_resume_plan_takes_the_cheapest_hours_and_covers_the_run_before_the_deadline(
    prices: Path,
) -> None:
    p = read_profile(prices)
    # 2 h: the 5 and the 10 hours
    plan = cheapest_chunks(p, 2 * H, T0)
    assert [(c.start, c.end) for c in plan] == [(T0 + 2 * H, T0 + 3 * H), (T0 + 4 * H, T0 + 5 * H)]
    assert plan_mean(plan) == 7.5
    # 2.5 h: then half of the 30 hour, which touches the 10 hour: merged into one chunk
    plan = cheapest_chunks(p, 2.5 * H, T0)
    assert [(c.start, c.end) for c in plan] == [(T0 + 2 * H, T0 + 3.5 * H), (T0 + 4 * H, T0 + 5 * H)]
    # before a 04:00 deadline the 5 hour is out of reach: the 10 and the 30 hours, one chunk
    plan = cheapest_chunks(p, 2 * H, T0, deadline=T0 + 4 * H)
    assert [(c.start, c.end, c.mean) for c in plan] == [(T0 + 2 * H, T0 + 4 * H, 20.0)]


def test_plans_on_random_profiles_against_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(20):
        # Prepare: 12 half-hour slots with random values, a random run length and deadline
        n = 12
        starts = tuple(T0 + i * 1800.0 for i in range(n))
        p = Profile(
            starts, tuple(s + 1800.0 for s in starts), tuple(rng.uniform(0, 100) for _ in range(n)), "v"
        )
        run_s = rng.choice([900.0, 1800.0, 3000.0, 7200.0])
        deadline = T0 + rng.uniform(run_s / 1800.0 + 1, n) * 1800.0
        # Execute
        best = cheapest_window(p, run_s, T0, deadline)
        plan = cheapest_chunks(p, run_s, T0, deadline)
        # Assert: no start on a 1-minute grid beats the window (tolerance: float sums)
        pieces = Pieces(p, T0, deadline)
        grid = [T0 + 60.0 * k for k in range(int((deadline - run_s - T0) // 60) + 1)]
        assert all(pieces.window(s, s + run_s).mean >= best.mean - 1e-9 for s in grid)
        assert best.start >= T0 and best.end <= deadline + 1e-6
        # the plan covers the run exactly, before the deadline, and never costs more than one window
        assert sum(c.end - c.start for c in plan) == pytest.approx(run_s)
        assert plan[0].start >= T0 and plan[-1].end <= deadline + 1e-6
        assert plan_mean(plan) <= best.mean + 1e-9


def test_durations_and_a_run_that_cannot_fit() -> None:
    assert [parse_duration(t) for t in ("90m", "2h", "1h30m", "1d", "5400")] == [
        5400,
        7200,
        5400,
        86400,
        5400,
    ]
    with pytest.raises(ConfigError, match="write it as 90m"):
        parse_duration("soon")
    p = Profile((T0,), (T0 + H,), (1.0,), "v")
    with pytest.raises(ConfigError, match=r"does not fit.*give a later --deadline"):
        cheapest_window(p, 2 * H, T0, deadline=T0 + H)


def test_cli_prints_the_window_and_plan(capsys: pytest.CaptureFixture[str], prices: Path) -> None:
    code, out, err = vatra_in_process(
        capsys, "energy", "schedule", "examples/digits.toml", "--profile", str(prices),
        "--duration", "2h", "--start", "2024-01-01T00:00Z", "--pause-resume",
    )  # fmt: skip
    assert code == 0, err
    assert (
        "cheapest window: 2024-01-01 03:00 UTC to 2024-01-01 05:00 UTC, mean 17.5 (-61 % against now)" in out
    )
    assert "2 chunks, mean 7.5 (-83 % against now)" in out
    assert "dry run: nothing started" in out


def test_cli_measures_the_duration_from_the_last_run(
    capsys: pytest.CaptureFixture[str], prices: Path, tmp_path: Path
) -> None:
    # Prepare: a finished run of the same name: 0.9 s a step; digits.toml asks for train.steps
    run = tmp_path / "runs" / "m-20240101-000000-1"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"steps": 100, "wall_s": 90.0}))
    sets = ["--set", f"run.out_dir={tmp_path / 'runs'}", "--set", "run.name=m", "--set", "train.steps=4000"]
    # Execute
    code, out, err = vatra_in_process(
        capsys, "energy", "schedule", "examples/digits.toml", "--profile", str(prices), *sets,
        "--start", "2024-01-01T00:00Z",
    )  # fmt: skip
    # Assert: 4000 steps × 0.9 s = 1 h: the 04:00 hour (5)
    assert code == 0, err
    assert "run: 1.00 h (measured:" in out and "to 2024-01-01 05:00 UTC, mean 5 " in out
    # no finished run: one line asking for --duration
    code, out, err = vatra_in_process(
        capsys, "energy", "schedule", "examples/digits.toml", "--profile", str(prices),
        "--set", f"run.out_dir={tmp_path / 'none'}",
    )  # fmt: skip
    assert code == 2 and err.startswith("error: no finished run named") and "give --duration" in err


@pytest.mark.slow(30)
def test_run_starts_vatra_train_in_the_window_now(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # Prepare: this hour and the next are the cheapest of the profile, so the window starts now and
    # nothing waits (with only this hour cheap, a run started in its last minute would straddle the
    # next, dearer one, and the cheapest 60 s would be this hour tomorrow: the profile repeats daily)
    hour = int(time.time() // H * H)
    rows = "".join(f"{hour + i * int(H)},{1 if i < 2 else 100}\n" for i in range(6))
    (profile := tmp_path / "p.csv").write_text("time,price\n" + rows)
    sets = [f"run.out_dir={tmp_path / 'runs'}", "train.steps=4", "dist.nproc=1", "checkpoint.enabled=false"]
    sets += ["monitor.report=false", "run.progress=off"]
    # Execute
    code, out, err = vatra_in_process(
        capsys, "energy", "schedule", "examples/digits.toml", "--profile", str(profile),
        "--duration", "60", "--run", *[a for s in sets for a in ("--set", s)],
    )  # fmt: skip
    # Assert: one run trained, with its energy
    assert code == 0, err
    (summary,) = (tmp_path / "runs").glob("digits-*/summary.json")
    assert json.loads(summary.read_text())["steps"] == 4 and "energy_kwh" in summary.read_text()
    assert "waiting" not in out

"""vatra.parallel in one process: impossible layouts as one-line errors, the stage split, the
layout planner and ``vatra plan``, and the monitor's per-stage view."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tests._dist import ROOT
from tests._parallel import (
    BATCH,
    SEQ,
    VOCAB,
    _config,
    _trainer,
    _user_model,
)
from tests.conftest import vatra_in_process

from vatra.config import config_from_dict
from vatra.errors import ConfigError
from vatra.parallel import (
    resolve_plan,
    split_stages,
)
from vatra.parallel.plan import Costs, choose, layouts, plan


# ------------------------------------------------------------------ single process
def test_split_balances_measured_costs() -> None:
    assert split_stages([1.0] * 4, 2) == [range(0, 2), range(2, 4)]
    assert split_stages([4.0, 1.0, 1.0, 1.0, 1.0], 2) == [range(0, 1), range(1, 5)]
    assert split_stages([1.0] * 4, 2, last_extra=2.0) == [range(0, 3), range(3, 4)]
    assert split_stages([1.0, 2.0, 3.0], 3) == [range(0, 1), range(1, 2), range(2, 3)]
    with pytest.raises(ValueError, match="cannot split 2 blocks into 3"):
        split_stages([1.0, 1.0], 3)


@pytest.mark.parametrize(
    ("parallel", "model", "expected"),
    [
        ({"tp": 3}, {}, "parallel.tp = 3 does not divide model.n_head = 4"),
        ({"pp": 8, "microbatches": 8}, {}, "parallel.pp = 8 with 1 stage(s) per rank needs 8 blocks, but"),
        (
            {"pp": 2, "schedule": "interleaved_1f1b", "virtual_stages": 4},
            {},
            "parallel.pp = 2 with 4 stage(s) per rank needs 8 blocks",
        ),
        ({"pp": 4, "microbatches": 2}, {}, "parallel.microbatches = 2 is fewer than parallel.pp = 4"),
        ({"pp": 2, "microbatches": 3}, {}, "parallel.microbatches = 3 does not divide train.batch_size = 8"),
        ({"auto": True}, {"name": "mlp"}, "parallel.auto: the planner measures the gpt model's blocks"),
        ({"schedule": "dualpipe"}, {}, "parallel.schedule: Input should be"),
        ({"sequence_parallel": True}, {}, "parallel.sequence_parallel splits the built-in gpt plan's norms"),
    ],
)
def test_impossible_layouts_are_one_line_errors(
    parallel: dict[str, Any], model: dict[str, Any], expected: str
) -> None:
    raw = {"model": {"name": "gpt", "n_layer": 4, "n_head": 4, **model}, "parallel": parallel}
    raw["train"] = {"batch_size": BATCH}
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw)
    assert str(err.value).startswith(expected) and "\n" not in str(err.value)


def test_trainer_refuses_a_layout_that_does_not_fill_the_world() -> None:
    with pytest.raises(ConfigError, match=r"dp × fsdp × tp × pp = 1 × 2 × 1 × 1 = 2, but the job has 1 rank"):
        _trainer(_config({"fsdp": 2}), None)


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        (["parallel.fsdp=4"], "error: parallel: dp × fsdp × tp × pp = 1 × 4 × 1 × 1 = 4, but the job has 2"),
        (["parallel.tp=3"], "error: parallel.tp = 3 does not divide model.n_head = 4"),
        (["parallel.fsdp=2", "comm.method=topk"], "error: parallel: fsdp, tp and pp reduce gradients"),
    ],
)
def test_cli_layout_errors_exit_2_with_one_line(
    sets: list[str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [a for s in [*sets, f"run.out_dir={tmp_path}"] for a in ("--set", s)]
    config = str(ROOT / "examples/gpt_text.toml")
    code, _, err = vatra_in_process(capsys, "train", config, "--nproc", "2", *args)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), err
    assert not list(tmp_path.iterdir())  # refused before any worker started


# ------------------------------------------------------------------ the planner
def _costs(layers: int = 4) -> Costs:
    """Synthetic measurements: equal blocks of 10 ms on 8 samples, a 4 ms head."""
    return Costs(
        block_s=[0.01] * layers,
        head_s=0.004,
        batch=8,
        block_params=12 * 32 * 32,
        embedding_params=(VOCAB + SEQ) * 32,
        head_params=VOCAB * 32,
        seq=SEQ,
        width=32,
        heads=4,
        vocab=VOCAB,
    )


def test_planner_lists_every_layout_and_the_bubble_formula() -> None:
    cfg = _config({"schedule": "gpipe"})
    ranked = plan(_costs(), cfg, 4, bandwidth=1e9)
    assert sorted((e.dp, e.fsdp, e.tp, e.pp) for e in ranked) == sorted(layouts(4))
    assert len(ranked) == 10  # the ordered factorisations of 4 = 2² into four factors
    pp4 = next(e for e in ranked if e.pp == 4)
    assert pp4.microbatches == 8 and pp4.bubble == pytest.approx(3 / (8 + 4 - 1))
    steps = [e.step_s for e in ranked if e.feasible]
    assert steps == sorted(steps)


def test_planner_charges_a_latency_per_message() -> None:
    cfg = _config({"schedule": "gpipe"})
    free = {(e.dp, e.fsdp, e.tp, e.pp): e.comm_s for e in plan(_costs(), cfg, 4, bandwidth=1e9)}
    slow = plan(_costs(), cfg, 4, bandwidth=1e9, latency=1e-3)
    extra = {(e.dp, e.fsdp, e.tp, e.pp): e.comm_s - free[(e.dp, e.fsdp, e.tp, e.pp)] for e in slow}
    assert extra[(4, 1, 1, 1)] == pytest.approx(1e-3)  # DDP: one bucket of gradients
    assert extra[(1, 4, 1, 1)] == pytest.approx(3 * (4 + 1) * 1e-3)  # 2 all-gathers, 1 reduce-scatter a unit
    assert extra[(1, 1, 4, 1)] == pytest.approx(4 * 4 * 1e-3)  # 4 blocks × 4 all-reduces
    assert extra[(1, 1, 1, 4)] == pytest.approx(2 * (4 - 1) * 1e-3)  # the fill's and the drain's hops
    assert extra[(2, 2, 1, 1)] == pytest.approx((3 + 1) * (4 + 1) * 1e-3)  # HSDP: + an all-reduce per unit


def test_planner_marks_a_layout_that_does_not_fit_in_memory_infeasible() -> None:
    # Prepare: the memory of each layout without a limit
    cfg = _config({})
    free = {(e.dp, e.fsdp, e.tp, e.pp): e for e in plan(_costs(), cfg, 4, bandwidth=1e9)}
    replicated, sharded = free[(4, 1, 1, 1)], free[(1, 4, 1, 1)]
    assert sharded.memory_gb < replicated.memory_gb  # fsdp divides parameters, gradients, optimizer state
    # Execute: a limit between the two
    limit = (sharded.memory_gb + replicated.memory_gb) / 2
    ranked = plan(_costs(), cfg, 4, bandwidth=1e9, memory_gb=limit)
    # Assert: dp = 4 is infeasible, named so, and ranked after every feasible layout
    by_layout = {(e.dp, e.fsdp, e.tp, e.pp): e for e in ranked}
    assert not by_layout[(4, 1, 1, 1)].feasible and by_layout[(1, 4, 1, 1)].feasible
    assert by_layout[(4, 1, 1, 1)].why.startswith("needs ") and "GB >" in by_layout[(4, 1, 1, 1)].why
    feasible = [e.feasible for e in ranked]
    assert feasible == sorted(feasible, reverse=True)
    assert "tp 8" not in " ".join(e.why for e in ranked)  # only divisors of the world are tried


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--latency-us", "-1"], "error: Invalid value for '--latency-us': Input should be greater than"),
        (
            ["--set", "parallel.auto_latency_us=-3"],
            "error: parallel.auto_latency_us: Input should be greater",
        ),
        (["--set", "train.compile=maybe"], "error: train.compile: Input should be a valid boolean"),
    ],
)
def test_plan_and_new_keys_refuse_bad_values_in_one_line(
    args: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = vatra_in_process(
        capsys, "plan", str(ROOT / "examples/gpt_text.toml"), "--world", "2", *args
    )
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(expected), err


def test_plan_command_prints_ranked_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--world", "4", "--memory-gb", "0.01", "--set", "train.batch_size=4"]
    code, out, err = vatra_in_process(capsys, "plan", str(ROOT / "examples/gpt_text.toml"), *args)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("vatra: 2 blocks") and len(lines) == 2 + 10
    assert "no: 4 stages > 2 blocks" in out and "no: needs" in out


def test_auto_names_why_no_layout_fits() -> None:
    cfg = _config({"auto": True, "auto_memory_gb": 1e-6})
    with pytest.raises(ConfigError, match=r"no layout of 2 ranks fits: dp .* needs"):
        choose(cfg, 2)


def test_a_tp_plan_names_real_modules() -> None:
    model = _user_model(_config({}))
    assert sorted(resolve_plan(model, {"[13]": "colwise"})) == ["1", "3"]  # fnmatch globs
    expected = r"parallel\.tp_plan: 'layers\.\*\.fc1' matches no module of Sequential; module paths"
    with pytest.raises(ConfigError, match=expected):
        resolve_plan(model, {"layers.*.fc1": "colwise"})


def test_parallel_layouts_refuse_what_steps_ranks_apart() -> None:
    with pytest.raises(ConfigError, match=r"but dist\.mode = 'diloco' lets ranks step apart"):
        _config({"fsdp": 2}, dist={"mode": "diloco"})
    with pytest.raises(ConfigError, match=r"parallel: uneven per-rank batches \(balance\.method\)"):
        _config({"tp": 2}, balance={"method": "static"})
    with pytest.raises(ConfigError, match=r"parallel: train\.precision = 'fp16' needs a gradient scaler"):
        _config({"pp": 2}, train={"precision": "fp16"})
    with pytest.raises(ConfigError, match=r"parallel: train\.compile compiles the whole model's forward"):
        _config({"fsdp": 2}, train={"compile": True})


def test_monitor_averages_each_stage_over_its_ranks() -> None:
    from vatra.monitor.plugin import BUBBLE, COLUMNS, COMPUTE, Monitor

    def row(busy: float, bubble: float) -> list[float]:
        r = [0.0] * len(COLUMNS)
        r[COMPUTE], r[BUBBLE] = busy, bubble
        return r

    # 4 ranks × 2 steps of dp 2 × pp 2: ranks 0, 1 hold stage 0 (pp outermost), ranks 2, 3 stage 1
    window = [
        [row(1.0, 0.2), row(3.0, 0.4)],
        [row(2.0, 0.2), row(2.0, 0.4)],
        [row(4.0, 0.1), row(4.0, 0.1)],
        [row(4.0, 0.3), row(4.0, 0.3)],
    ]
    metrics: dict[str, Any] = {}
    Monitor._stage_view(window, 2, metrics)
    assert metrics["pp_stage_busy_s"] == [2.0, 4.0]
    assert metrics["pp_stage_bubble"] == pytest.approx([0.3, 0.2])

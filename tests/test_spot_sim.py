"""The spot simulator: a hand-computed run, Young/Daly's interval, the hazard model, the trace
readers (good and bad files) and ``vatra spot simulate`` on the shipped example."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest
from tests.conftest import vatra_in_process

from vatra.cost.sim import (
    POLICIES,
    HazardModel,
    Interruptions,
    Job,
    PriceTrace,
    SimConfig,
    TraceError,
    World,
    load_sim_config,
    log_loss,
    read_interruptions,
    read_prices,
    simulate,
    young_daly,
)
from vatra.cost.sim.hazard import History, base_rate, observe
from vatra.cost.sim.simulate import Setup
from vatra.cost.sim.synth import synthetic_prices
from vatra.errors import ConfigError

T0 = 1_790_000_000.0 // 86400 * 86400  # a midnight, UTC
REPO = Path(__file__).resolve().parent.parent


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=UTC).isoformat().replace("+00:00", "Z")


def _aws_json(path: Path, rows: list[tuple[float, str, float]], kind: str = "p4d.24xlarge") -> Path:
    items = [
        {"AvailabilityZone": z, "InstanceType": kind, "ProductDescription": "Linux/UNIX",
         "SpotPrice": f"{p}", "Timestamp": _iso(t)}
        for t, z, p in rows
    ]  # fmt: skip
    path.write_text(json.dumps({"SpotPriceHistory": items}), encoding="utf-8")
    return path


def _tiny_config(**fleet: object) -> SimConfig:
    return SimConfig.model_validate({
        "job": {"total_steps": 100, "step_s": 36.0, "nodes": 1, "checkpoint_s": 36.0, "restore_s": 72.0},
        "fleet": {"on_demand_usd_per_h": 4.0, "min_nodes": 1, "max_nodes": 1, "replace_s": 300.0, **fleet},
        "world": {"history_days": 0},
        "policy": {"fixed_interval_s": 1800.0},
    })  # fmt: skip


def test_simulator_reproduces_a_hand_computed_run(tmp_path: Path) -> None:
    # Prepare: one zone at $1/h for 10 hours, one node; one observed interruption at 2736 s.
    trace = read_prices(_aws_json(tmp_path / "p.json", [(T0, "z-1a", 1.0), (T0 + 36000, "z-1a", 1.0)]))
    events = Interruptions(events=[(T0 + 2736.0, "z-1a")])
    cfg = _tiny_config()
    # Execute
    on_demand, spot = simulate(cfg, Setup.of(cfg, trace, events), ("on-demand", "spot fixed"))
    # Assert. The job is 100 steps x 36 s = 3600 s of work on one node.
    # On-demand: run 0-1800 s (50 steps), checkpoint 1800-1836, run 1836-3636 (50 steps): done at
    # 3636 s, paid 3636 s x $4/h = $4.04; one checkpoint (the one due at 3636 s loses to the end).
    assert on_demand.completion_h == pytest.approx(3636 / 3600)
    assert on_demand.cost_usd == pytest.approx(3636 / 3600 * 4.0)
    assert (on_demand.restarts, on_demand.checkpoints, on_demand.lost_work_h) == (0, 1, 0.0)
    # Spot: run 0-1800 (50 steps), checkpoint 1800-1836 (saved: 50), run 1836-2736 (+25 steps);
    # reclaimed at 2736: 25 steps = 900 s = 0.25 h lost, no node until the replacement at
    # 2736 + 300 = 3036, restore 3036-3108, run 50 steps 3108-4908: done at 4908 s.
    # Paid nodes: 0-2736 and 3036-4908 = 2736 + 1872 = 4608 node-seconds x $1/h = $1.28.
    assert spot.completion_h == pytest.approx(4908 / 3600)
    assert spot.cost_usd == pytest.approx(4608 / 3600 * 1.0)
    assert spot.lost_work_h == pytest.approx(0.25)
    assert (spot.restarts, spot.checkpoints, spot.node_hours) == (1, 1, pytest.approx(4608 / 3600))


def test_young_daly_interval_is_the_closed_form(tmp_path: Path) -> None:
    assert young_daly(60.0, 7200.0) == pytest.approx(math.sqrt(2 * 60.0 * 7200.0))  # = 929.5 s
    trace = read_prices(_aws_json(tmp_path / "p.json", [(T0, "z-1a", 1.0), (T0 + 36000, "z-1a", 1.0)]))
    cfg = _tiny_config(nodes=4, max_nodes=4)
    p = 0.02  # per node-hour: the job of 4 nodes fails at rate 4 * -ln(1 - p) per hour
    job = Job(cfg, "spot young-daly", trace, T0, "z-1a", np.random.default_rng(0), constant_p=p)
    mtbf = 3600.0 / (4 * -math.log(1 - p))
    assert job.interval() == pytest.approx(math.sqrt(2 * 36.0 * mtbf))


def test_hazard_model_beats_a_constant_hazard_on_a_daily_cycle() -> None:
    # Prepare: 40 days of one zone whose price (so whose hazard) follows a daily cycle.
    trace = read_prices_from(synthetic_prices({"z-1a": 10.0}, days=40, start=T0, seed=3))
    world = World(trace, base_rate(0.25), elasticity=3.0, scale=30.0)
    rng = np.random.default_rng(7)
    train = observe(trace, T0, T0 + 28 * 86400, 50, world, rng=rng)
    test = observe(trace, T0 + 28 * 86400, trace.end, 50, world, rng=rng)
    # Execute
    model = HazardModel().fit(train)
    # Assert: lower held-out log-loss than the training rate as a constant hazard.
    fitted = log_loss(model.predict(test.x), test)
    constant = log_loss(np.full(len(test.k), model.constant), test)
    assert fitted < constant * 0.97, (fitted, constant)


def test_a_history_without_interruptions_gives_a_constant_hazard() -> None:
    # 2 bins of 10 node-hours, no interruption: nothing to fit; the constant is (0 + 0.5) / (20 + 1).
    quiet = History(np.zeros((2, 4)), np.zeros(2), np.full(2, 10.0))
    model = HazardModel().fit(quiet)
    assert not model.fitted and model.predict(np.ones((3, 4))).tolist() == [0.5 / 21] * 3


def test_predictive_policy_moves_away_from_risk_and_costs_less(tmp_path: Path) -> None:
    # Prepare: two zones with strong daily cycles that peak two hours apart; dear hours are risky
    # (hazard ∝ price ** 4); the first 8 days fit the model, a 50-hour job on 4 nodes follows.
    trace = read_prices_from(
        synthetic_prices({"a": 10.0, "b": 10.0}, days=16, start=T0, amplitude=0.4, seed=1)
    )
    cfg = SimConfig.model_validate({
        "job": {"total_steps": 3000, "step_s": 60.0, "nodes": 4, "checkpoint_s": 60.0, "restore_s": 120.0},
        "fleet": {"on_demand_usd_per_h": 30.0, "min_nodes": 4, "max_nodes": 4},
        "world": {"history_days": 8, "interruptions_per_month": 0.25, "hazard_scale": 40,
                  "price_elasticity": 4, "seeds": 3},
        "policy": {"risk_threshold": 0.01, "migrate_s": 300.0},
    })  # fmt: skip
    # Execute
    fixed, young_daly_, predictive = simulate(cfg, Setup.of(cfg, trace, Interruptions()), POLICIES[1:])
    # Assert: it moves; it loses less work than the fixed interval and costs less than either
    # interval alone (its lost work against Young/Daly's varies with the seeds: not asserted).
    assert predictive.migrations > 0 and fixed.migrations == young_daly_.migrations == 0
    assert predictive.lost_work_h < fixed.lost_work_h
    assert predictive.cost_usd < min(fixed.cost_usd, young_daly_.cost_usd)


def read_prices_from(history: dict[str, list[dict[str, str]]]) -> PriceTrace:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "p.json"
        path.write_text(json.dumps(history), encoding="utf-8")
        return read_prices(path)


SAMPLES = {
    "aws.txt": "SPOTPRICEHISTORY\tus-east-1a\tp4d.24xlarge\tLinux/UNIX\t11.5\t2026-11-01T00:00:00+00:00\n"
    "SPOTPRICEHISTORY\tus-east-1a\tp4d.24xlarge\tLinux/UNIX\t12.5\t2026-11-01T01:00:00+00:00\n",
    "aws.csv": "AvailabilityZone,InstanceType,ProductDescription,SpotPrice,Timestamp\n"
    "us-east-1a,p4d.24xlarge,Linux/UNIX,11.5,2026-11-01T00:00:00Z\n"
    "us-east-1a,p4d.24xlarge,Linux/UNIX,12.5,2026-11-01T01:00:00Z\n",
    "aws.tsv": "Timestamp\tSpotPrice\tAvailabilityZone\tInstanceType\n"
    "2026-11-01T00:00:00Z\t11.5\tus-east-1a\tp4d.24xlarge\n"
    "2026-11-01T01:00:00Z\t12.5\tus-east-1a\tp4d.24xlarge\n",
    "gcp.csv": "effectiveTime,region,description,usageUnit,unitPrice\n"
    "2026-11-01T00:00:00Z,us-central1,Spot Preemptible A2 Instance,h,11.5\n"
    "2026-11-01T01:00:00Z,us-central1,Spot Preemptible A2 Instance,h,12.5\n",
    "azure.csv": "effectiveStartDate,armRegionName,armSkuName,skuName,unitOfMeasure,retailPrice\n"
    "2026-11-01T00:00:00Z,eastus,Standard_ND96asr_v4,ND96asr v4 Spot,1 Hour,11.5\n"
    "2026-11-01T00:30:00Z,eastus,Standard_ND96asr_v4,ND96asr v4,1 Hour,27.2\n"
    "2026-11-01T01:00:00Z,eastus,Standard_ND96asr_v4,ND96asr v4 Spot,1 Hour,12.5\n",
}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_price_formats_read_to_the_same_step_function(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_text(SAMPLES[name], encoding="utf-8")
    trace = read_prices(path)
    (zone,) = trace.zones
    t0 = datetime(2026, 11, 1, tzinfo=UTC).timestamp()
    assert [trace.price(zone, t0 + 1800), trace.price(zone, t0 + 3600)] == [11.5, 12.5]  # no on-demand row
    assert trace.next_change(zone, t0) == t0 + 3600


def test_aws_json_and_interruption_files(tmp_path: Path) -> None:
    trace = read_prices(
        _aws_json(tmp_path / "p.json", [(T0 + 3600, "a", 2.0), (T0, "a", 1.0), (T0, "b", 3.0)])
    )
    assert (
        trace.zones == ["a", "b"] and trace.price("a", T0 + 10) == 1.0 and trace.price("a", T0 + 3600) == 2.0
    )
    advisor = tmp_path / "advisor.csv"
    advisor.write_text(
        "instance_type,region,interruption\np4d.24xlarge,us-east-1,>20%\ng5.xlarge,us-east-1,<5%\n"
    )
    assert read_interruptions(advisor).monthly == {
        ("p4d.24xlarge", "us-east-1"): 0.25,
        ("g5.xlarge", "us-east-1"): 0.025,
    }
    events = tmp_path / "events.csv"
    events.write_text("timestamp,zone\n2026-11-01T02:00:00Z,a\n2026-11-01T01:00:00Z,b\n")
    assert [z for _, z in read_interruptions(events).events] == ["b", "a"]


AWS_HEADER = "AvailabilityZone,InstanceType,SpotPrice,Timestamp\n"
ROW = '{"SpotPriceHistory": [{"AvailabilityZone": "a", "InstanceType": "x", "SpotPrice": %s}]}'
GCP_HEADER = "effectiveTime,region,description,usageUnit,unitPrice\n"
BAD = [
    ("p.json", ROW % '"cheap", "Timestamp": "2026-11-01"', "row 1: field SpotPrice"),
    ("p.json", ROW % '"1"', "row 1: field Timestamp"),
    ("p.json", '{"prices": []}', "field SpotPriceHistory"),
    ("p.csv", AWS_HEADER + "a,x,1.0,2026-11-01\na,x,-3,2026-11-02\n", "row 3: field SpotPrice"),
    ("p.csv", AWS_HEADER + "a,x,1.0,yesterday\n", "row 2: field Timestamp"),
    ("p.csv", "AvailabilityZone,InstanceType,SpotPrice\na,x,1.0\n", "row 1: field Timestamp"),
    ("p.csv", AWS_HEADER + "a,x\n", "row 2: field Timestamp: missing"),
    ("g.csv", GCP_HEADER + "2026-11-01,r,d,GiBy.mo,1\n", "row 2: field usageUnit"),
    ("p.csv", "when,price\n1,2\n", "row 1: header"),
    ("i.csv", "instance_type,region,interruption\np4d,us-east-1,often\n", "row 2: field interruption"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "text", "where"), BAD)
def test_bad_files_fail_with_file_row_and_field(tmp_path: Path, name: str, text: str, where: str) -> None:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    with pytest.raises(TraceError) as err:
        (read_interruptions if name == "i.csv" else read_prices)(path)
    message = str(err.value)
    assert message.startswith(f"{path}: ") and where in message and "\n" not in message


def test_job_times_are_measured_from_a_run_folder(tmp_path: Path) -> None:
    run = tmp_path / "run-20261205"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"steps": 200, "wall_s": 50.0, "checkpoint_s": 3.0}))
    lines = [{"event": "checkpoint_saved"}] * 3 + [{"event": "resumed", "recovery_s": 4.0}]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    sim = tmp_path / "sim.toml"
    fleet = "[fleet]\non_demand_usd_per_h = 1\nmax_nodes = 2\n"
    sim.write_text('[job]\ntotal_steps = 10\nmeasure_from = "run-20261205"\n' + fleet)
    job = load_sim_config(sim).job
    assert (job.step_s, job.checkpoint_s, job.restore_s) == (0.25, 1.0, 4.0)
    # A training config stands for its newest finished run under <run.out_dir>/<run.name>-*.
    train = tmp_path / "train.toml"
    train.write_text(f'[run]\nname = "run"\nout_dir = "{tmp_path}"\n[data]\nname = "digits"\n')
    sim.write_text(sim.read_text().replace('"run-20261205"', f'"{train}"'))
    (tmp_path / "run-20261206").mkdir()  # an unfinished run: no summary.json
    assert load_sim_config(sim).job.step_s == 0.25
    sim.write_text("[job]\ntotal_steps = 10\nstep_s = 1\n" + fleet)
    with pytest.raises(ConfigError, match=r"job\.checkpoint_s is not set"):
        load_sim_config(sim)


def test_cli_runs_the_shipped_seed_example(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = vatra_in_process(
        capsys, "spot", "simulate", str(REPO / "examples/spot_seed.toml"), "--out", str(tmp_path)
    )
    assert code == 0, err
    result = json.loads((tmp_path / "results.json").read_text())
    by = {p["policy"]: p for p in result["policies"]}
    assert list(by) == ["on-demand", "spot fixed", "spot young-daly", "spot predictive"]
    assert all(p["finished"] for p in by.values()) and by["on-demand"]["restarts"] == 0
    assert all(by[p]["cost_usd"] < by["on-demand"]["cost_usd"] for p in list(by)[1:])
    assert "spot predictive" in out and result["gpus"] == [8, 64]


def test_cli_bad_trace_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "p.csv"
    bad.write_text("AvailabilityZone,InstanceType,SpotPrice,Timestamp\na,x,lots,2026-11-01\n")
    code, _, err = vatra_in_process(
        capsys, "spot", "simulate", str(REPO / "examples/spot_seed.toml"), "--trace", str(bad)
    )
    assert (
        code == 2
        and err.strip() == f"error: {bad}: row 2: field SpotPrice: 'lots' is not a price (a number >= 0)"
    )

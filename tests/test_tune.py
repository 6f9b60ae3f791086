"""``vatra tune``: the search space and its errors, a study end to end, resume after kill -9, two
workers on one journal, pruning, failed trials, and the mlp keys a search varies."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from tests._dist import run_vatra, start_vatra
from tests._tune_helpers import SPACE, study_of, write_config
from tests.conftest import vatra_in_process

from vatra.cli import main
from vatra.config import ModelConfig, config_from_dict, load_config

optuna = pytest.importorskip("optuna")

# ----------------------------------------------------------------------------- the space


@pytest.mark.parametrize(
    ("entry", "expect"),
    [
        ({"optim.lrr": {"type": "float", "low": 0.1, "high": 1.0}}, "unknown key 'lrr' in optim"),
        ({"optimm.lr": {"type": "float", "low": 0.1, "high": 1.0}}, "unknown key 'optimm' in the config"),
        ({"optim": {"type": "float", "low": 0.1, "high": 1.0}}, "optim is a section"),
        ({"optim.lr": {"type": "float", "low": 1.0, "high": 1.0}}, "empty range"),
        (
            {"optim.lr": {"type": "float", "low": 0.1, "high": 1.0, "lw": 3}},
            "allowed keys here: choices, high",
        ),
        ({"optim.lr": {"type": "float", "low": 0.0, "high": 1.0, "log": True}}, "log scale needs low > 0"),
        ({"optim.name": {"type": "categorical", "choices": []}}, "non-empty choices"),
        (
            {"optim.momentum": {"type": "float", "low": 0, "high": 0.5, "when": {"optim.nam": "sgd"}}},
            "'optim.nam' is not a parameter of the space",
        ),
        ({"optim.name": {"type": "categorical", "choices": ["sgd", "lion"]}}, "the value 'lion' is rejected"),
        ({"train.batch_size": {"type": "float", "low": 0.5, "high": 8}}, "the value 0.5 is rejected"),
    ],
)
def test_invalid_space_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], entry: dict[str, Any], expect: str
) -> None:
    path = write_config(tmp_path, {"space": entry})
    with pytest.raises(SystemExit) as exit_:
        main(["tune", str(path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert expect in err, err
    assert not (tmp_path / "runs").exists()  # refused before anything was written


def test_conditional_parameter_only_when_its_condition_holds() -> None:
    from vatra.config import TuneConfig
    from vatra.tune.space import order, suggest

    tune = TuneConfig.model_validate({"space": SPACE})
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    names = order(tune.space)
    seen = set()
    for _ in range(30):
        params = suggest(study.ask(), tune.space, names)
        seen.add(params["optim.name"])
        assert ("optim.momentum" in params) == (params["optim.name"] == "sgd"), params
    assert seen == {"sgd", "adam"}


def test_tune_section_is_refused_by_train_and_left_out_of_run_configs(tmp_path: Path) -> None:
    from vatra.config import dump_toml
    from vatra.errors import ConfigError

    path = write_config(tmp_path)
    with pytest.raises(ConfigError, match=r"tune\..*vatra tune CONFIG"):
        load_config(path, run="train")
    assert "[tune" not in dump_toml(config_from_dict({}))


def test_mlp_width_depth_activation_override_hidden() -> None:
    from torch import nn

    from vatra.data import DatasetSpec
    from vatra.models.mlp import build_mlp

    spec = DatasetSpec(kind="classification", input_shape=(64,), num_classes=10)
    mlp = build_mlp(ModelConfig(hidden=[32, 32], width=8, depth=3, activation="tanh"), spec)
    linears = [m for m in mlp.trunk if isinstance(m, nn.Linear)]
    assert [m.out_features for m in linears] == [8, 8, 8]
    assert sum(isinstance(m, nn.Tanh) for m in mlp.trunk) == 3
    plain = build_mlp(ModelConfig(hidden=[32, 32]), spec)
    assert [m.out_features for m in plain.trunk if isinstance(m, nn.Linear)] == [32, 32]
    assert all(not isinstance(m, nn.Tanh) for m in plain.trunk)


# ----------------------------------------------------------------------------- studies


@pytest.mark.slow(46)
def test_study_end_to_end_with_two_workers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: 3 trials on the embedded journal, 2 workers of one thread each (a tiny model)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = write_config(tmp_path)
    folder = tmp_path / "runs" / "st"

    # Execute
    out = run_vatra("tune", str(path), "--workers", "2", timeout=180)

    # Assert: every trial finished once, with its own number and run folder
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads((folder / "study.json").read_text())
    numbers = [t["number"] for t in data["trials"]]
    assert len(numbers) == len(set(numbers)) and len(numbers) >= 3
    assert sum(t["state"] == "COMPLETE" for t in data["trials"]) >= 3
    for t in data["trials"]:
        assert Path(t["run_dir"]) == folder / f"trial-{t['number']}"
        assert (Path(t["run_dir"]) / "summary.json").is_file()
        assert t["duration_s"] > 0
    assert data["best"]["value"] == max(t["value"] for t in data["trials"] if t["state"] == "COMPLETE")
    page = (folder / "report.html").read_text()
    assert page.count("<img") >= 2 and "Best trials" in page

    main(["tune", "show", str(folder)])
    shown = capsys.readouterr().out
    assert "optim.lr" in shown and f"{data['best']['value']:.4g}" in shown

    best = tmp_path / "best.toml"
    main(["tune", "best", str(folder), "--config-out", str(best)])
    head = best.read_text().splitlines()[:2]
    assert head[0].startswith(f"# trial {data['best']['number']} of study st: val_accuracy")
    assert "torch thread(s): OMP_NUM_THREADS=" in head[1]  # what repeats the trial exactly
    cfg = load_config(best, run="train")  # a plain run's config: no [tune]
    assert cfg.optim.lr == pytest.approx(data["best"]["params"]["optim.lr"])
    assert cfg.optim.name == data["best"]["params"]["optim.name"]
    # with the worker's thread count (1, as set above) the best config repeats the trial exactly
    rerun = run_vatra("train", str(best), "--run-dir", str(tmp_path / "rerun"), "--set", "run.progress=off")
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    summary = json.loads((tmp_path / "rerun" / "summary.json").read_text())
    assert summary["val_accuracy"] == data["best"]["value"]


@pytest.mark.slow(26)
def test_killed_study_resumes_without_duplicate_trials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # Prepare: the first attempt's trials are long (to be killed in the middle of one); the resumed
    # attempt's are short, to keep the test fast (the study and its trials are the same otherwise)
    path = write_config(
        tmp_path, {"trials": 2, "space": {"optim.lr": SPACE["optim.lr"]}}, monitor={"report": False}
    )
    folder = tmp_path / "runs" / "st"
    proc = start_vatra(
        "tune", str(path), "--set", "train.steps=100000", new_session=True, stdout=subprocess.DEVNULL
    )

    # Execute: kill -9 the whole tree (vatra tune and its worker) mid-trial, then the same command
    metrics = folder / "trial-0" / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) > 20):
        assert proc.poll() is None and time.time() < deadline, "the study ended before it could be killed"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(0.5)
    again = run_vatra("tune", str(path), timeout=180)

    # Assert: the killed trial failed as interrupted, was retried, and the study reached 2 trials
    assert again.returncode == 0, again.stderr[-2000:]
    data = json.loads((folder / "study.json").read_text())
    trials = {t["number"]: t for t in data["trials"]}
    assert len(trials) == len(data["trials"])  # no duplicated numbers
    assert trials[0]["state"] == "FAIL" and trials[0]["error"] is None
    assert any(t["retry_of"] == 0 for t in trials.values())
    assert sum(t["state"] in ("COMPLETE", "PRUNED") for t in trials.values()) == 2


def finished_in(folder: Path) -> int:
    """How many trials the study in ``folder``'s journal holds as COMPLETE or PRUNED (read only)."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    if not (folder / "journal.log").is_file():
        return 0
    storage = JournalStorage(JournalFileBackend(str(folder / "journal.log")))
    if not storage.get_all_studies():
        return 0
    trials = optuna.load_study(study_name="st", storage=storage).get_trials(deepcopy=False)
    return sum(t.state.name in ("COMPLETE", "PRUNED") for t in trials)


@pytest.mark.slow(69)
def test_ctrl_c_says_what_finished_and_the_same_command_resumes_counting_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = write_config(
        tmp_path, {"trials": 4, "space": {"optim.lr": SPACE["optim.lr"]}}, monitor={"report": False}
    )
    folder = tmp_path / "runs" / "st"
    proc = start_vatra("tune", str(path), "--set", "train.steps=100", new_session=True)

    # Execute: Ctrl-C (SIGINT to the terminal's process group) once the study holds a finished
    # trial (a trial's summary.json comes before its worker tells the study, so it is not enough)
    deadline = time.time() + 120
    while not finished_in(folder):
        assert proc.poll() is None and time.time() < deadline, "the study ended before its Ctrl-C"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)

    # Assert: one line says how many trials finished and that the same command resumes
    assert proc.returncode == 130, err[-2000:]
    data = json.loads((folder / "study.json").read_text())
    finished = sum(t["state"] in ("COMPLETE", "PRUNED") for t in data["trials"])
    assert 1 <= finished < 4
    assert f"vatra tune: stopped after {finished} of 4 trials; the same command resumes study st" in err
    assert "Traceback" not in err, err[-2000:]
    assert re.findall(r"\[(\d+)/4\]", out) == [str(n) for n in range(1, finished + 1)], out

    # ... and the same command goes on counting from there: no number twice
    again = run_vatra("tune", str(path), "--set", "train.steps=100", timeout=180)
    assert again.returncode == 0, again.stderr[-2000:]
    lines = again.stdout.splitlines()
    assert f"vatra tune: resuming: {finished} of 4 trials finished before" in lines
    counted = re.findall(r"\[(\d+)/4\]", again.stdout)
    assert counted == [str(n) for n in range(finished + 1, 5)], again.stdout


def test_pruner_stops_a_hopeless_trial_early(tmp_path: Path) -> None:
    from vatra.tune.workers import serve

    # Prepare: a good trial first, then one that cannot learn (lr 1e-6); median prunes after 1 trial
    space = {"optim.lr": {"type": "float", "low": 1e-6, "high": 0.1, "log": True}}
    tune = {"trials": 2, "space": space, "pruner": "median", "pruner_startup": 1}
    path = write_config(tmp_path, tune, train={"steps": 40, "eval_every": 5, "batch_size": 32})
    cfg, run, study = study_of(path)
    study.enqueue_trial({"optim.lr": 0.05})
    study.enqueue_trial({"optim.lr": 1e-6})

    # Execute
    serve(cfg, url=run.url, name=run.name)

    # Assert: trial 1 pruned at its first eval, its run stopped there
    good, bad = study.get_trials()
    assert good.state.name == "COMPLETE"
    assert bad.state.name == "PRUNED"
    lines = (run.folder / "trial-1" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 5 < cfg.train.steps
    assert json.loads((run.folder / "trial-1" / "summary.json").read_text())["pruned_at_step"] == 5


def test_a_failing_trial_is_recorded_and_the_study_goes_on(tmp_path: Path) -> None:
    from vatra.tune.workers import serve

    # Prepare: the user's model builder raises for one value of its argument
    (tmp_path / "failmod.py").write_text(
        "from torch import nn\n"
        "def build(width, spec):\n"
        "    if width > 100:\n"
        "        raise ValueError(f'width {width} is too wide for this test')\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10))\n"
    )
    space = {"model.kwargs.width": {"type": "categorical", "choices": [8, 1000]}}
    path = write_config(
        tmp_path,
        {"trials": 3, "space": space},
        model={"name": "failmod:build", "kwargs": {"width": 8}},
        run={"import_paths": [str(tmp_path)]},
    )
    cfg, run, study = study_of(path)
    for width in (8, 1000, 8):
        study.enqueue_trial({"model.kwargs.width": width})

    # Execute
    serve(cfg, url=run.url, name=run.name)

    # Assert
    states = [t.state.name for t in study.get_trials()]
    assert states == ["COMPLETE", "FAIL", "COMPLETE"]
    assert study.trials[1].user_attrs["error"] == "ValueError: width 1000 is too wide for this test"


@pytest.mark.slow(12)
def test_epochs_size_each_trial_by_its_batch_size_and_best_keeps_them(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # Prepare: 2 epochs per trial over two batch sizes (digits: 1437 training rows)
    space = {"train.batch_size": {"type": "categorical", "choices": [256, 512]}}
    path = write_config(
        tmp_path, {"trials": 2, "epochs": 2, "pruner": "median", "space": space}, monitor={"report": False}
    )
    folder = tmp_path / "runs" / "st"
    # Execute: the console entry in this process (the trials run in its worker process)
    code, _, err = vatra_in_process(capfd, "tune", str(path))
    best = tmp_path / "best.toml"
    main(["tune", "best", str(folder), "--config-out", str(best)])
    # Assert: steps = epochs × ceil(rows / batch), one evaluation per epoch, in each trial and in best
    assert code == 0, err[-2000:]
    data = json.loads((folder / "study.json").read_text())
    for t in data["trials"]:
        ran = load_config(Path(t["run_dir"]) / "config.toml")
        per_epoch = -(-1437 // t["params"]["train.batch_size"])
        assert (ran.train.steps, ran.train.eval_every) == (2 * per_epoch, per_epoch)
        assert [step for step, _ in t["intermediate"]] == [1, 2]  # reported by epoch, not by step
    chosen = load_config(best, run="train")
    per_epoch = -(-1437 // data["best"]["params"]["train.batch_size"])
    assert (chosen.train.steps, chosen.train.eval_every) == (2 * per_epoch, per_epoch)


def test_timeout_stops_asking_for_trials(tmp_path: Path) -> None:
    import sklearn.datasets  # noqa: F401  (a worker's first imports, not the 5 seconds under test)

    import vatra.api  # noqa: F401
    from vatra.tune.workers import serve

    # Prepare: far more trials than 5 seconds hold (`vatra tune` hands its workers this deadline,
    # tune.timeout_s after it starts them)
    path = write_config(tmp_path, {"trials": 10_000, "timeout_s": 5.0})
    cfg, run, study = study_of(path)
    # Execute
    serve(cfg, url=run.url, name=run.name, deadline=time.time() + cfg.tune.timeout_s)
    # Assert: it stopped after the trial that ran over, every trial it began finished
    states = [t.state.name for t in study.get_trials()]
    assert 1 <= len(states) < 10_000 and set(states) == {"COMPLETE"}


@pytest.mark.slow(23)
def test_a_trial_can_be_a_two_rank_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # Prepare: one trial of two ranks, pruned by the median pruner's rules on rank 0's reports
    path = write_config(tmp_path, {"trials": 1, "trial_nproc": 2}, monitor={"report": False})
    # Execute
    out = run_vatra("tune", str(path), timeout=240)
    # Assert: the trial completed as a 2-rank run, and rank 0 told optuna its value
    assert out.returncode == 0, out.stderr[-2000:]
    (trial,) = json.loads((tmp_path / "runs" / "st" / "study.json").read_text())["trials"]
    summary = json.loads((Path(trial["run_dir"]) / "summary.json").read_text())
    assert trial["state"] == "COMPLETE" and summary["world_size"] == 2
    assert trial["value"] == pytest.approx(summary["val_accuracy"])
    assert [step for step, _ in trial["intermediate"]] == [5, 10, 15, 20]


@pytest.mark.parametrize(
    ("args", "sets", "expect"),
    [
        (["--workers", "0"], [], "--workers 0: must be ≥ 1"),
        (["--join", "nosuch"], [], "--join nosuch: no such study"),
        ([], ["tune.storage=ftp://x"], "tune.storage 'ftp://x': expected ''"),
        ([], ["tune.pruner=median", "tune.epochs=1"], "tune.epochs = 1 ends them there"),
        ([], ["tune.pruner=median", "train.eval_every=0"], "set train.eval_every below train.steps"),
        ([], ["tune.pruner_warmup=1.5"], "tune.pruner_warmup"),
        ([], ["tune.sampler=cmaes"], "tune.sampler"),
    ],
)
def test_bad_study_options_are_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], sets: list[str], expect: str
) -> None:
    path = write_config(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["tune", str(path), *args, *(x for s in sets for x in ("--set", s))])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert expect in err, err


@pytest.mark.parametrize(
    ("argv", "expect"),
    [
        (["tune", "show"], "vatra tune show STUDY: name the study"),
        (["tune", "show", "nosuch"], "study 'nosuch': no study.json"),
        (["tune", "best", "nosuch"], "pass --config-out best.toml"),
    ],
)
def test_show_and_best_usage_errors_are_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], expect: str
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert expect in err, err

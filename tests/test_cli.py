"""The ``vatra`` command end to end: training on 2 processes, torchrun, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tests._dist import ROOT, run_vatra
from tests.conftest import vatra_in_process

from vatra.cli import main
from vatra.launch import free_port

METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "samples_per_s", "step_time_s", "data_time_s"}


def check_run_folder(run: Path, steps: int, world_size: int) -> list[dict]:
    assert (run / "config.toml").is_file()
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    assert all(m.keys() >= METRIC_KEYS for m in lines)
    summary = json.loads((run / "summary.json").read_text())
    for key in ("steps", "final_loss", "val_accuracy", "samples_per_s", "wall_s", "world_size"):
        assert key in summary
    assert summary["steps"] == steps
    assert summary["world_size"] == world_size
    return lines


@pytest.mark.slow(23)
def test_train_two_processes_end_to_end(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = run_vatra(
        "train", "examples/digits.toml", "--nproc", "2", "--set", "train.steps=60", "--run-dir", str(run)
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = check_run_folder(run, 60, 2)
    first = sum(m["loss"] for m in lines[:10]) / 10
    last = sum(m["loss"] for m in lines[-10:]) / 10
    assert last < 0.5 * first
    assert any("val_accuracy" in m for m in lines)  # eval steps carry validation metrics
    assert list((run / "tb").glob("events.out.tfevents.*"))
    assert "done: 60 steps" in proc.stdout


@pytest.mark.slow(18)
def test_worker_runs_under_plain_torchrun(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        "-m", "vatra.worker", "examples/digits.toml",
        "--set", "train.steps=12", "--set", "run.tensorboard=false", "--run-dir", str(run),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    check_run_folder(run, 12, 2)


@pytest.mark.slow(26)
def test_two_nodes_rendezvous_like_torchrun(tmp_path: Path) -> None:
    """Two elastic agents (one per "node", 1 process each) meet at a c10d rendezvous."""
    endpoint = f"127.0.0.1:{free_port()}"
    common = ["train", "examples/digits.toml", "--nproc", "1", "--nnodes", "2", "--rdzv-endpoint", endpoint]
    common += [
        "--set",
        "train.steps=20",
        "--set",
        f"run.out_dir={tmp_path}",
        "--set",
        "run.tensorboard=false",
    ]
    env_cmd = [sys.executable, "-m", "vatra", *common]
    node1 = subprocess.Popen(
        [*env_cmd, "--node-rank", "1"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    node0 = run_vatra(*common, "--node-rank", "0")
    _, err1 = node1.communicate(timeout=240)
    assert node0.returncode == 0, node0.stderr[-2000:]
    assert node1.returncode == 0, err1.decode()[-2000:]
    (run,) = tmp_path.iterdir()  # rank 0 chose the run folder and shared it with every rank
    check_run_folder(run, 20, 2)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["train", "missing.toml"], "error: config file not found: missing.toml"),
        (["train", "examples/digits.toml", "--set", "data.name=imagenet"], "error: data.name:"),
        (["train", "examples/digits.toml", "--set", "model.name=resnet"], "error: model.name:"),
        (["train", "examples/digits.toml", "--set", "data.sharding=zigzag"], "error: data.sharding:"),
        (["train", "examples/digits.toml", "--nproc", "0"], "error: --nproc 0: must be ≥ 1"),
        (["train", "examples/digits.toml", "--set", "train.steps=many"], "error: train.steps:"),
        (["train", "examples/digits.toml", "--nnodes", "2"], "error: --nnodes > 1 needs --rdzv-endpoint"),
        (["config", "show", "examples/digits.toml", "--set", "optim.lr=fast"], "error: optim.lr:"),
        (["train", "examples/digits.toml", "--set", "comm.momentum_correction=true"], "error: comm"),
        (["train", "examples/digits.toml", "--no-such-flag"], "error: No such option"),
    ],
)
def test_usage_errors_are_one_line(
    args: list[str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Execute: the console entry in this process (each error comes before anything starts)
    out_dir = ["--set", f"run.out_dir={tmp_path}"] if args[0] == "train" else []
    code, _, err = vatra_in_process(capsys, *args, *out_dir)
    # Assert
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(expected)
    assert "Traceback" not in err
    assert not list(tmp_path.iterdir())  # nothing written for a run that never started


def test_version_help_and_config_show(capsys: pytest.CaptureFixture[str]) -> None:
    code, version, _ = vatra_in_process(capsys, "--version")
    assert code == 0 and version.startswith("vatra ")
    _, help_text, _ = vatra_in_process(capsys, "--help")
    assert "train" in help_text and "config" in help_text
    code, shown, _ = vatra_in_process(
        capsys, "config", "show", "examples/digits.toml", "--set", "train.steps=7"
    )
    assert code == 0
    assert "steps = 7" in shown and "[optim]" in shown


TRAIN = ["train", "examples/digits.toml"]
FL_SERVER = ["fl", "server", "examples/fl_digits.toml", "--address", "127.0.0.1:1", "--certs", "nowhere"]
FL_CLIENT = ["fl", "client", "--server", "127.0.0.1:1", "--client-id", "0", "--certs", "nowhere"]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ([*TRAIN, "--set", "optim.lr=inf"], "error: optim.lr: must be a finite number"),
        ([*TRAIN, "--set", "run.name=../x"], "error: run.name: the name contains '/'"),
        (
            [*TRAIN, "--set", "monitor.enabled=false", "--set", "monitor.report=true"],
            "error: monitor.report = true: report.html is part of the monitor",
        ),
        (
            [*TRAIN, "--set", "monitor.enabled=false", "--set", "heal.enabled=true"],
            "error: heal.policies: rollback, straggler, prefetch act on the monitor's verdicts",
        ),
        (
            [*TRAIN, "--set", "comm.method=powersgd", "--set", "comm.min_numel=64"],
            "error: comm.min_numel: powersgd ignores it",
        ),
        ([*TRAIN, "--set", "comm.overlap=sometimes"], "error: comm.overlap:"),
        (
            ["federate", "examples/fl_digits.toml", "--set", "checkpoint.every_steps=5"],
            "error: checkpoint.every_steps: a federated run reads no [checkpoint] keys but keep_last",
        ),
        ([*FL_SERVER, "--set", "checkpoint.async=true"], "error: checkpoint.async: a federated run reads no"),
        (
            [*FL_CLIENT, "--config", "examples/fl_digits.toml", "--set", "checkpoint.enabled=false"],
            "error: checkpoint.enabled: a federated run reads no",
        ),
    ],
)
def test_config_checks_are_one_line_and_exit_code_2(
    args: list[str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Execute: the real command line, in this process (each check fails before anything starts)
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--set", f"run.out_dir={tmp_path}"])
    # Assert
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(expected) and err.count("\n") == 1, err
    assert not list(tmp_path.iterdir())  # nothing written


def test_a_config_file_that_is_not_utf8_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "cp1252.toml"
    config.write_bytes(b'[run]\nname = "\x93digits\x94"\n')
    with pytest.raises(SystemExit) as exit_:
        main(["train", str(config)])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"error: {config}: not UTF-8 text (byte 14, line 2: 0x93); " + (
        "TOML files are UTF-8: save it as UTF-8\n"
    )

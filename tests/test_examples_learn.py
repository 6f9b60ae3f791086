"""The shipped examples learn: each one, shortened, beats its trivial baseline by a margin.

Every test runs an example as a user would (``vatra train``, ``vatra federate``, the script) in
this process on one rank, with fewer steps or rounds than it ships with, and compares its main
metric with what a model that learned nothing scores on the same data: the majority class, the
positive rate, a random order, byte frequencies, the mean.
The figures the full examples reach are in README.md's example table.
"""

from __future__ import annotations

import json
import math
import runpy
import sys
from pathlib import Path

import numpy as np
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest
import torch
from tests._dist import ROOT

import vatra
from vatra.config import load_config
from vatra.losses import ndcg_at_k

EXAMPLES = ROOT / "examples"
QUIET = ["run.progress=off", "run.tensorboard=false", "monitor.enabled=false", "heal.enabled=false",
         "checkpoint.enabled=false"]  # fmt: skip


def train(tmp_path: Path, config: Path, steps: int, *sets: str) -> dict:
    """``vatra train CONFIG`` for ``steps`` steps on one rank in this process, evaluated once at
    the end (what ``vatra.fit`` runs in every worker): its summary."""
    overrides = [*QUIET, f"train.steps={steps}", f"train.eval_every={steps}", *sets]
    # tabular/ and multitask/ each have a model.py imported as "model": each run builds its own
    # (vatra.registry.add_import_paths forgets the other folder's), so nothing is reset here
    return vatra.fit(load_config(config, overrides), run_dir=tmp_path / "run").summary


def make_data(example: str) -> None:
    runpy.run_path(str(EXAMPLES / example / "make_data.py"), run_name="__main__")


def majority_macro_f1(labels: np.ndarray) -> float:
    """Macro-F1 of always predicting the most common of two classes: its F1 2m/(1+m), halved."""
    share = float(np.bincount(labels).max() / len(labels))
    return share / (1 + share)


@pytest.mark.parametrize("example", ["digits.toml", "tune_digits.toml"])
def test_digits_example_beats_chance(example: str, tmp_path: Path) -> None:
    from sklearn.datasets import load_digits

    # tune_digits.toml: its base run, the one each trial starts from (what `vatra train` runs)
    summary = train(tmp_path, EXAMPLES / example, 60)
    labels = load_digits().target
    majority = np.bincount(labels).max() / len(labels)  # 0.10: ten balanced classes
    assert summary["val_accuracy"] > majority + 0.6, summary


def test_synthetic_example_beats_chance(tmp_path: Path) -> None:
    summary = train(tmp_path, EXAMPLES / "synthetic.toml", 100, "data.samples=4000")
    assert summary["val_accuracy"] > 1 / 10 + 0.25, summary  # ten classes of equal size


def test_tabular_example_beats_the_majority_class(tmp_path: Path) -> None:
    make_data("tabular")
    summary = train(tmp_path, EXAMPLES / "tabular" / "tabular.toml", 60)
    diagnosis = pq.read_table(EXAMPLES / "tabular" / "cancer.parquet").column("diagnosis").to_pylist()
    _, labels = np.unique(diagnosis, return_inverse=True)
    assert summary["val_macro_f1"] > majority_macro_f1(labels) + 0.4, summary


def test_ranking_example_beats_a_random_order(tmp_path: Path) -> None:
    make_data("ranking")
    summary = train(tmp_path, EXAMPLES / "ranking" / "ranking.toml", 60)
    table = pq.read_table(EXAMPLES / "ranking" / "ranking.parquet", columns=["qid", "relevance"])
    qid, relevance = (table.column(c).to_numpy() for c in ("qid", "relevance"))
    lists = [torch.from_numpy(relevance[qid == q]).double() for q in np.unique(qid)]
    target = torch.nn.utils.rnn.pad_sequence(lists, batch_first=True, padding_value=-1.0)  # (Q, L)
    generator = torch.Generator().manual_seed(0)
    random_scores = torch.rand(target.shape, generator=generator, dtype=torch.float64)
    ndcg, counted = ndcg_at_k(random_scores, target, 10)
    baseline = float(ndcg[counted].mean())
    assert summary["val_ndcg@10"] > baseline + 0.15, (summary, baseline)


def test_multitask_example_beats_the_baseline_on_every_head(tmp_path: Path) -> None:
    make_data("multitask")
    summary = train(tmp_path, EXAMPLES / "multitask" / "shelter.toml", 150)
    adopted = pq.read_table(EXAMPLES / "multitask" / "shelter.parquet").column("adopted").to_numpy()
    rate = float(adopted.mean())
    # a one-label head's macro-F1 is its positive class's F1: predicting "adopted" for every
    # animal scores 2p/(1+p), predicting "not adopted" 0; a constant score has R² 0
    assert summary["val_adopted_macro_f1"] > 2 * rate / (1 + rate) + 0.15, summary
    assert summary["val_adopted_auc"] > 0.5 + 0.3, summary
    assert summary["val_behaviour_r2"] > 0.6, summary


def test_delta_example_beats_the_majority_class(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from tests.conftest import vatra_in_process

    # Prepare: January and February ingested into a table of this test's own
    month = runpy.run_path(str(EXAMPLES / "delta" / "make_data.py"))["month"]
    lake, failed = tmp_path / "lake", []
    for name, seed in (("jan", 1), ("feb", 2)):
        rows = month(1500, seed)
        failed.extend(rows.column("failed").to_pylist())
        pa_csv.write_csv(rows, tmp_path / f"{name}.csv")
        code, _, err = vatra_in_process(
            capsys, "data", "ingest", str(tmp_path / f"{name}.csv"), "--table", str(lake)
        )
        assert code == 0, err

    # Execute
    summary = train(tmp_path, EXAMPLES / "delta" / "sensors.toml", 60, f'data.path="{lake}"')

    # Assert
    assert summary["val_macro_f1"] > majority_macro_f1(np.asarray(failed)) + 0.2, summary


@pytest.mark.slow(47)  # 21 s of CPU: a 2-layer transformer's 60 steps
def test_gpt_text_example_beats_byte_frequencies(tmp_path: Path) -> None:
    from vatra.data._text import stdlib_corpus

    chars = 300_000
    summary = train(
        tmp_path, EXAMPLES / "gpt_text.toml", 60, f"data.max_chars={chars}", "data.val_windows=64"
    )
    corpus = stdlib_corpus(chars)
    cut = int(len(corpus) * 0.9)  # the text dataset's train share
    counts = np.bincount(corpus[:cut], minlength=256) + 1.0  # add-one: every byte has a probability
    log_p = np.log(counts / counts.sum())
    unigram = math.exp(-float(log_p[corpus[cut:]].mean()))  # a model of byte frequencies alone
    assert summary["val_perplexity"] < 0.8 * unigram, (summary, unigram)


@pytest.mark.parametrize("example", ["fl_digits.toml", "fl_clustered.toml"])
def test_federated_digits_examples_beat_chance(
    example: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from tests.conftest import vatra_in_process

    sets = ["federated.rounds=6", "federated.workers=1", "monitor.report=false", "run.progress=off"]
    args = [a for s in sets for a in ("--set", s)]
    run = tmp_path / "run"
    code, _, err = vatra_in_process(capsys, "federate", str(EXAMPLES / example), *args, "--run-dir", str(run))
    assert code == 0, err[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    # ten digit classes of about equal size: chance is 0.1 for every client and the server
    assert summary["mean_client_accuracy"] > 0.1 + 0.4, summary
    if example == "fl_clustered.toml":  # its point: each cluster's model fits its own owners
        assert summary["mean_client_accuracy"] > summary["server_accuracy"] + 0.2, summary


def test_custom_script_example_beats_the_mean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Execute: `python examples/custom_script.py --steps 100`, the script's one-process form
    monkeypatch.setenv("VATRA_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setattr(sys, "argv", ["custom_script.py", "--steps", "100"])
    runpy.run_path(str(EXAMPLES / "custom_script.py"), run_name="__main__")

    # Assert: predicting the mean kWh scores R² 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 100 and summary["val_r2"] > 0.7, summary
    assert "val MAE" in capsys.readouterr().out

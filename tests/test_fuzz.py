"""The fuzz targets (tests/fuzz) on their seeds, past findings and seeded mutations; one under atheris.

Each target's property: its decoder returns or raises its own error type, nothing else. Here every
target reads its seed corpus, every input that once broke it, and a fixed number of seeded
mutations (a few seconds each); ``bench/fuzz.py`` runs the same targets coverage-guided for minutes.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.fuzz._harness import mutations
from tests.fuzz.targets import MODULES, load

ROOT = Path(__file__).resolve().parents[1]
MUTATIONS = {"wire": 1500, "secagg": 1500, "config": 300, "manifest": 80, "table": 300}  # ≈ 1 s each, quiet
MUTATIONS |= {"ablog": 150}  # the serving logs ab-report reads (tests/fuzz/ab_targets.py)
MUTATIONS |= {"contract": 10000, "notice": 10000}  # a federation contract, a spot notice (remote_targets.py)
MUTATIONS |= {"payload": 1500}  # another rank's compressor payload in 1-bit Adam (payload_targets.py)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_target_holds_on_seeds_findings_and_mutations(name: str) -> None:
    target = load(name)
    seeds = target.seeds()
    assert seeds, "a target needs a seed corpus"
    for data in [*seeds, *target.findings(), *mutations(seeds, target.tokens, MUTATIONS[name])]:
        target.test_one_input(data)


def test_every_target_has_a_mutation_budget() -> None:
    assert set(MUTATIONS) == set(MODULES)


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris (dev extra) not installed")
@pytest.mark.slow(21)
def test_a_target_runs_coverage_guided_under_atheris(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    flags = ["-max_total_time=2", "-rss_limit_mb=2048", "-timeout=10", f"-artifact_prefix={tmp_path}/"]
    proc = subprocess.run(
        [sys.executable, "-m", "tests.fuzz.run", "secagg", str(tmp_path / "corpus"), *flags],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert " cov: " in proc.stderr and "Done " in proc.stderr
    assert len(list((tmp_path / "corpus").iterdir())) >= len(load("secagg").seeds())

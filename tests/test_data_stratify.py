"""The digits data and its stratified split without scikit-learn: the same rows and the same split
as scikit-learn's, so runs keep the data they had."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from vatra.data.stratify import bundled_digits, stratified_split
from vatra.errors import ConfigError

sklearn_datasets = pytest.importorskip("sklearn.datasets")
model_selection = pytest.importorskip("sklearn.model_selection")


def test_bundled_digits_are_sklearns() -> None:
    pixels, target = bundled_digits()
    bunch = sklearn_datasets.load_digits()
    assert np.array_equal(pixels, bunch.data) and np.array_equal(target, bunch.target)


@pytest.mark.parametrize("fraction", [0.1, 0.2, 0.25, 0.33, 0.5])
def test_split_equals_sklearns_for_every_seed(fraction: float) -> None:
    # digits (10 nearly even classes) and an unbalanced 3-class label set with ties in the remainders
    _, digits = bundled_digits()
    skewed = np.repeat([0, 1, 2], [50, 7, 13])
    for y in (digits, skewed):
        x = np.arange(len(y))
        for seed in range(25):
            train, val = stratified_split(y, fraction, seed)
            split = model_selection.train_test_split(x, test_size=fraction, random_state=seed, stratify=y)
            x_tr, x_va = split[:2]
            assert np.array_equal(train, x_tr) and np.array_equal(val, x_va), (fraction, seed)


def test_a_split_that_leaves_a_class_out_is_one_config_error() -> None:
    with pytest.raises(ConfigError, match=r"data.val_fraction = 0.01: .* fewer than one sample per class"):
        stratified_split(np.repeat(np.arange(10), 5), 0.01, 0)


def test_the_digits_dataset_imports_no_sklearn() -> None:
    code = (
        "import sys; from vatra.config import DataConfig; from vatra.data import build_dataset; "
        "build_dataset(DataConfig(name='digits'), 0); "
        "print(sorted(m for m in ('sklearn', 'scipy', 'pandas') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

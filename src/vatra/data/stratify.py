"""A stratified train/validation split and the bundled digits, without importing scikit-learn.

Importing scikit-learn (which imports scipy and pandas) costs a worker process ~1.5 s of CPU before
its first step; the digits example needs neither. :func:`stratified_split` draws the same split as
``sklearn.model_selection.train_test_split(..., stratify=y, random_state=seed)`` — the same indices
for the same seed, so runs keep the data they had (``tests/test_data_stratify.py`` checks it against
scikit-learn over many seeds, fractions and class balances).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np

from vatra.errors import ConfigError


def _apportion(counts: np.ndarray, draws: int, rng: np.random.RandomState) -> np.ndarray:
    """``draws`` samples shared over classes in proportion to ``counts``: each class gets the floor
    of its share, and the draws left over go to the classes with the largest remainders (ties
    broken at random, largest remainder first)."""
    exact = counts / counts.sum() * draws
    taken = np.floor(exact)
    left = int(draws - taken.sum())
    if left > 0:
        remainder = exact - taken
        for value in np.sort(np.unique(remainder))[::-1]:
            (tied,) = np.where(remainder == value)
            now = min(len(tied), left)
            taken[rng.choice(tied, size=now, replace=False)] += 1
            left -= now
            if left == 0:
                break
    return taken.astype(int)


def stratified_split(y: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, validation indices) of labels ``y``: ``ceil(val_fraction · n)`` samples for
    validation, each class kept in proportion, both index lists shuffled."""
    n = len(y)
    n_val = math.ceil(val_fraction * n)
    n_train = n - n_val
    classes, inverse = np.unique(y, return_inverse=True)
    if n_train < len(classes) or n_val < len(classes):
        raise ConfigError(
            f"data.val_fraction = {val_fraction}: a stratified split of {n} samples leaves fewer than "
            f"one sample per class ({len(classes)} classes) on one side; choose a fraction nearer 0.5"
        )
    counts = np.bincount(inverse)
    by_class = np.split(np.argsort(inverse, kind="mergesort"), np.cumsum(counts)[:-1])
    rng = np.random.RandomState(seed)
    train_n = _apportion(counts, n_train, rng)
    val_n = _apportion(counts - train_n, n_val, rng)
    train: list[int] = []
    val: list[int] = []
    for i, members in enumerate(by_class):
        shuffled = members.take(rng.permutation(counts[i]), mode="clip")
        train.extend(shuffled[: train_n[i]])
        val.extend(shuffled[train_n[i] : train_n[i] + val_n[i]])
    return rng.permutation(train), rng.permutation(val)


def bundled_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled 8×8 digits (pixels 0..16 as float64, labels as int), read from the
    file scikit-learn ships, without importing it."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the digits data ships with scikit-learn: pip install scikit-learn")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    table = np.loadtxt(path, delimiter=",")
    return table[:, :-1], table[:, -1].astype(int)

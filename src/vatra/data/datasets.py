"""Built-in datasets (digits, synthetic, text) and the registry ``build_dataset`` reads."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from sklearn.datasets import load_digits, make_classification
from sklearn.model_selection import train_test_split

from vatra.config import DataConfig
from vatra.data._split import DatasetSpec, Split
from vatra.data._text import stdlib_corpus
from vatra.errors import ConfigError

DatasetBuilder = Callable[[DataConfig, int], tuple[Split, Split, DatasetSpec]]

VOCAB_SIZE = 256  # byte-level: every byte value is a token
_TEXT_TRAIN_SHARE = 0.9


def _classification_splits(
    x: np.ndarray, y: np.ndarray, cfg: DataConfig, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Stratified train/val split, so both halves keep the class balance."""
    x_tr, x_va, y_tr, y_va = train_test_split(x, y, test_size=cfg.val_fraction, random_state=seed, stratify=y)
    return x_tr, x_va, y_tr, y_va


def _to_split(x: np.ndarray, y: np.ndarray) -> Split:
    return Split(
        torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), torch.from_numpy(y.astype(np.int64))
    )


def digits(cfg: DataConfig, seed: int) -> tuple[Split, Split, DatasetSpec]:
    """sklearn's bundled 8x8 digits: 1797 samples, 64 pixels scaled to [0, 1], 10 classes."""
    bunch = load_digits()
    x = bunch.data.astype(np.float32) / 16.0  # pixel values are 0..16
    x_tr, x_va, y_tr, y_va = _classification_splits(x, bunch.target, cfg, seed)
    spec = DatasetSpec("classification", (64,), 10, (1, 8, 8))
    return _to_split(x_tr, y_tr), _to_split(x_va, y_va), spec


def synthetic(cfg: DataConfig, seed: int) -> tuple[Split, Split, DatasetSpec]:
    """Gaussian clusters from make_classification, standardised with train statistics."""
    clusters_per_class = 2
    # make_classification places clusters on hypercube vertices: it needs 2**informative of them.
    needed = (cfg.classes * clusters_per_class - 1).bit_length()
    if cfg.informative < needed:
        raise ConfigError(
            f"data.informative: {cfg.informative} informative features cannot separate {cfg.classes} "
            f"classes; raise data.informative to at least {needed}"
        )
    x, y = make_classification(
        n_samples=cfg.samples,
        n_features=cfg.features,
        n_informative=cfg.informative,
        n_redundant=0,
        n_classes=cfg.classes,
        n_clusters_per_class=clusters_per_class,
        flip_y=cfg.noise,
        class_sep=1.0,
        random_state=seed,
    )
    x_tr, x_va, y_tr, y_va = _classification_splits(x, y, cfg, seed)
    # Statistics from train only: the val split must not leak into preprocessing.
    mean, std = x_tr.mean(axis=0), x_tr.std(axis=0) + 1e-8
    spec = DatasetSpec("classification", (cfg.features,), cfg.classes, None)
    return _to_split((x_tr - mean) / std, y_tr), _to_split((x_va - mean) / std, y_va), spec


def text(cfg: DataConfig, seed: int) -> tuple[Split, Split, DatasetSpec]:
    """Byte-level stdlib sources: first 90% train (every window), last 10% val (fixed windows).

    ``seed`` is unused: the corpus and its split are the same for every seed, so runs differ
    only by model init and sampling order.
    """
    del seed
    tokens = torch.from_numpy(stdlib_corpus(cfg.max_chars).astype(np.int64))  # (T,)
    cut = int(len(tokens) * _TEXT_TRAIN_SHARE)
    train_tokens, val_tokens = tokens[:cut], tokens[cut:]
    if len(val_tokens) <= cfg.block_size + 1:
        raise ConfigError(
            f"data.block_size: {cfg.block_size} is too long for the {len(val_tokens)}-byte validation "
            "stream; raise data.max_chars or lower data.block_size"
        )
    # Evenly spread fixed starts keep evaluation finite and identical on every rank and run.
    last_start = len(val_tokens) - cfg.block_size - 1
    starts = torch.from_numpy(np.linspace(0, last_start, cfg.val_windows).round().astype(np.int64))
    spec = DatasetSpec("lm", (cfg.block_size,), VOCAB_SIZE, None)
    train = Split(train_tokens, block_size=cfg.block_size)
    val = Split(val_tokens, block_size=cfg.block_size, starts=starts)
    return train, val, spec


DATASETS: dict[str, DatasetBuilder] = {"digits": digits, "synthetic": synthetic, "text": text}


def build_dataset(cfg: DataConfig, seed: int) -> tuple[Split, Split, DatasetSpec]:
    """(train, val, spec) for ``cfg.name``; deterministic for a given (cfg, seed)."""
    try:
        builder = DATASETS[cfg.name]
    except KeyError:
        raise ConfigError(
            f"data.name: unknown dataset {cfg.name!r}; choose one of: {', '.join(sorted(DATASETS))}"
        ) from None
    return builder(cfg, seed)

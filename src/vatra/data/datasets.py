"""Built-in datasets (digits, synthetic, text) and ``build_dataset``: a built-in name or a user factory."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vatra.config import DataConfig
from vatra.data._base import DataContext, Datasets, DatasetSpec
from vatra.data._split import Split
from vatra.data._text import stdlib_corpus
from vatra.data.infer import user_datasets
from vatra.data.stratify import bundled_digits, stratified_split
from vatra.errors import ConfigError
from vatra.registry import DATASETS, call_with

DIGITS_PIXEL_SCALE = 1.0 / 16.0  # the digits' model inputs: pixel values 0..16 scaled to [0, 1]
VOCAB_SIZE = 256  # byte-level: every byte value is a token
_TEXT_TRAIN_SHARE = 0.9


def _classification_splits(
    x: np.ndarray, y: np.ndarray, cfg: DataConfig, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Stratified train/val split, so both halves keep the class balance."""
    train, val = stratified_split(y, cfg.val_fraction, seed)
    return x[train], x[val], y[train], y[val]


def _to_split(x: np.ndarray, y: np.ndarray) -> Split:
    return Split(
        torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), torch.from_numpy(y.astype(np.int64))
    )


def digits(cfg: DataConfig, ctx: DataContext) -> Datasets:
    """sklearn's bundled 8x8 digits: 1797 samples, 64 pixels scaled to [0, 1], 10 classes."""
    pixels, target = bundled_digits()
    x = pixels.astype(np.float32) * np.float32(DIGITS_PIXEL_SCALE)
    x_tr, x_va, y_tr, y_va = _classification_splits(x, target, cfg, ctx.seed)
    spec = DatasetSpec("classification", (64,), 10, (1, 8, 8))
    return Datasets(_to_split(x_tr, y_tr), _to_split(x_va, y_va), spec)


def synthetic(cfg: DataConfig, ctx: DataContext) -> Datasets:
    """Gaussian clusters from make_classification, standardised with train statistics."""
    from sklearn.datasets import make_classification

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
        n_features=cfg.n_features,
        n_informative=cfg.informative,
        n_redundant=0,
        n_classes=cfg.classes,
        n_clusters_per_class=clusters_per_class,
        flip_y=cfg.noise,
        class_sep=1.0,
        random_state=ctx.seed,
    )
    x_tr, x_va, y_tr, y_va = _classification_splits(x, y, cfg, ctx.seed)
    # Statistics from train only: the val split must not leak into preprocessing.
    mean, std = x_tr.mean(axis=0), x_tr.std(axis=0) + 1e-8
    spec = DatasetSpec("classification", (cfg.n_features,), cfg.classes, None)
    return Datasets(_to_split((x_tr - mean) / std, y_tr), _to_split((x_va - mean) / std, y_va), spec)


def text(cfg: DataConfig, ctx: DataContext) -> Datasets:
    """Byte-level stdlib sources: first 90% train (every window), last 10% val (fixed windows).

    The seed is unused: the corpus and its split are the same for every seed, so runs differ
    only by model init and sampling order.
    """
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
    return Datasets(train, val, spec)


def build_dataset(cfg: DataConfig, ctx: DataContext | int, task: str = "auto") -> Datasets:
    """(train, val, spec) for ``cfg.name``: a built-in source, or a user's factory by import string.

    Built-ins are called as ``builder(cfg, ctx)``. A user factory is called with ``[data.kwargs]``
    plus whichever of ``seed``, ``rank``, ``world_size`` and ``run_dir`` it declares, and returns
    ``(train, val)`` or ``(train, val, spec)``; without a spec one is inferred from the first item.
    Deterministic for a given (cfg, seed).
    """
    if isinstance(ctx, int):
        ctx = DataContext(seed=ctx)
    fn = DATASETS.load_callable(cfg.name)
    if DATASETS.is_builtin(cfg.name):
        out: Any = fn(cfg, ctx)
        return out if isinstance(out, Datasets) else Datasets(*out)
    optional = {"seed": ctx.seed, "rank": ctx.rank, "world_size": ctx.world_size, "run_dir": ctx.run_dir}
    return user_datasets(call_with(fn, dict(cfg.kwargs), optional, "data.kwargs"), cfg.name, task)

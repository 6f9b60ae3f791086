"""``data.name = "npz"``: arrays ``x`` and ``y`` (optionally ``x_val``, ``y_val``) from one ``.npz`` file.

The task follows ``y``: integer 1-D labels are classes (``max + 1`` of them), floats are
regression targets, 2-D 0/1 arrays are labels when ``train.task = "multilabel"``. Float inputs are
standardised per feature with the training split's statistics (saved with the run, reused on
resume), like a table's.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vatra._io import atomic_write
from vatra.config import DataConfig
from vatra.data._base import DataContext, Datasets, DatasetSpec, on_rank0, preprocess_path
from vatra.data._split import Split
from vatra.errors import ConfigError


def _load(path: str) -> dict[str, np.ndarray]:
    if not path:
        raise ConfigError("data.path: set it to an .npz file holding arrays x and y")
    if not Path(path).is_file():
        raise ConfigError(f"data.path: {path!r} does not exist")
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        raise ConfigError(f"data.path: cannot read {path} as .npz: {err}") from None
    held = ", ".join(sorted(arrays)) or "nothing"
    for name in ("x", "y"):
        if name not in arrays:
            raise ConfigError(
                f"data.path: {path} has no array {name!r} (it holds: {held}); save x and y, optionally "
                "x_val and y_val"
            )
    if ("x_val" in arrays) != ("y_val" in arrays):
        raise ConfigError(f"data.path: {path} needs both x_val and y_val or neither (it holds: {held})")
    for xs, ys in (("x", "y"), ("x_val", "y_val")):
        if xs in arrays and len(arrays[xs]) != len(arrays[ys]):
            raise ConfigError(
                f"data.path: {path}: {xs} has {len(arrays[xs])} samples but {ys} has {len(arrays[ys])}"
            )
    return arrays


def _task(y: np.ndarray, ctx: DataContext, path: str) -> str:
    """classification (integer 1-D), multilabel (0/1 2-D when asked), else regression."""
    if ctx.task in ("classification", "regression", "multilabel"):
        task = ctx.task
    elif ctx.task != "auto":
        raise ConfigError(f"train.task = {ctx.task!r} cannot be learned from x and y arrays ({path})")
    else:
        task = "classification" if y.ndim == 1 and y.dtype.kind in "iub" else "regression"
    if task == "classification" and (y.ndim != 1 or (y.dtype.kind == "f" and not np.all(y == np.round(y)))):
        raise ConfigError(
            f"train.task = 'classification' needs 1-D integer labels in y; {path} has {y.dtype} {y.shape}"
        )
    if task == "classification" and y.size and y.min() < 0:
        raise ConfigError(f"{path}: class labels in y must be 0 .. classes - 1, found {y.min()}")
    if task == "multilabel" and (y.ndim != 2 or not np.isin(y, (0, 1)).all()):
        raise ConfigError(
            f"train.task = 'multilabel' needs a 2-D 0/1 array y; {path} has {y.dtype} {y.shape}"
        )
    return task


def _split(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    if n < 2:
        raise ConfigError(f"data.val_fraction: {n} samples cannot be split into train and val")
    perm = np.random.default_rng(seed).permutation(n)
    n_val = min(max(round(n * fraction), 1), n - 1)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def _statistics(x: np.ndarray, ctx: DataContext, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Per-feature mean and std (float64, std 0 → 1) of the training inputs; saved, or reused on resume."""
    path = preprocess_path(ctx)
    if path is not None and path.exists():
        saved = json.loads(path.read_text())
        if list(saved.get("shape", [])) != list(shape):
            raise ConfigError(
                f"data: {path} was fitted for inputs of shape {saved.get('shape')} but x has {list(shape)}; "
                "use a new run folder"
            )
        return np.asarray(saved["mean"]).reshape(shape), np.asarray(saved["std"]).reshape(shape)
    mean, std = x.mean(axis=0, dtype=np.float64), x.std(axis=0, dtype=np.float64)
    std = np.where(std > 0, std, 1.0)
    if path is not None and ctx.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        stats = {"shape": list(shape), "mean": mean.ravel().tolist(), "std": std.ravel().tolist()}
        atomic_write(path, json.dumps(stats), durable=True)  # a resume reads it
    return mean, std


def standardized(x: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """Float inputs ``(x - mean) / std`` with the saved training statistics (float64): training's
    and a loaded model's (:mod:`vatra.serve`) one transformation of new samples."""
    return (x - mean) / std


def build_npz(cfg: DataConfig, ctx: DataContext) -> Datasets:
    """Train and val :class:`~vatra.data.Split` of an ``.npz`` file's arrays."""
    arrays = _load(cfg.path)
    x, y = arrays["x"], arrays["y"]
    if "x_val" in arrays:
        return array_datasets(x, y, arrays["x_val"], arrays["y_val"], cfg, ctx, cfg.path)
    tr, va = _split(len(x), cfg.val_fraction, ctx.seed)
    return array_datasets(x[tr], y[tr], x[va], y[va], cfg, ctx, cfg.path)


def array_datasets(
    x_tr: np.ndarray,
    y_tr: np.ndarray,
    x_va: np.ndarray,
    y_va: np.ndarray,
    cfg: DataConfig,
    ctx: DataContext,
    source: str,
) -> Datasets:
    """Train and val :class:`~vatra.data.Split` of inputs and targets already split (val empty = none):
    the task from the targets, float inputs standardised with the training split's statistics."""
    if x_tr.shape[1:] != x_va.shape[1:]:
        raise ConfigError(f"{source}: x has samples of shape {x_tr.shape[1:]} but x_val {x_va.shape[1:]}")
    task = _task(np.concatenate([y_tr, y_va]), ctx, source)
    shape = tuple(int(d) for d in x_tr.shape[1:])
    if cfg.standardize and x_tr.dtype.kind == "f":
        mean, std = on_rank0(ctx, lambda: _statistics(x_tr, ctx, shape))
        x_tr, x_va = standardized(x_tr, mean, std), standardized(x_va, mean, std)

    def tensors(x: np.ndarray, y: np.ndarray) -> Split:
        y_dtype: Any = np.int64 if task == "classification" else np.float32
        return Split(
            torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)),
            torch.from_numpy(np.ascontiguousarray(y, dtype=y_dtype)),
        )

    if task == "classification":
        width = int(max(y_tr.max(initial=0), y_va.max(initial=0))) + 1
    else:
        width = 1 if y_tr.ndim == 1 else int(np.prod(y_tr.shape[1:]))
    image = shape if len(shape) == 3 else (1, *shape) if len(shape) == 2 else None
    spec = DatasetSpec(task, shape, width, image_shape=image)  # type: ignore[arg-type]
    return Datasets(tensors(x_tr, y_tr), tensors(x_va, y_va) if len(x_va) else None, spec)

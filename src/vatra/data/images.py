"""``data.name = "images"``: a folder of class folders of image files, decoded lazily with PIL.

``data.path`` holds one folder per class (``path/<class>/*.png``), split into train and val by a
seeded ``data.val_fraction`` stratified by class; or ``train/`` and ``val/`` folders that each hold
the class folders (no random split). Classes are the sorted folder names.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

from vatra.config import DataConfig
from vatra.data._base import DataContext, Datasets, DatasetSpec
from vatra.errors import ConfigError

EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")


class ImageFolderDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Image files with class ids: item i is ``(image (C, H, W) float32 in [0, 1], class id)``.

    Decoding happens per item (in the loader workers); ``labels`` needs no decoding.
    """

    def __init__(
        self, files: list[Path], labels: np.ndarray, classes: list[str], size: tuple[int, int], mode: str
    ) -> None:
        self.files = files
        self._labels = labels.astype(np.int64)
        self.classes = classes
        self.num_classes = len(classes)
        self.size = size  # (H, W)
        self.mode = mode  # "L" or "RGB"

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        path = self.files[i]
        try:
            with Image.open(path) as img:
                pixels = np.asarray(img.convert(self.mode).resize(self.size[::-1], Image.Resampling.BILINEAR))
        except (OSError, UnidentifiedImageError, ValueError) as err:
            raise ConfigError(f"data.path: cannot read the image {path}: {err}") from None
        image = torch.from_numpy(pixels.astype(np.float32) / 255.0)  # (H, W) or (H, W, C)
        image = image[None] if image.dim() == 2 else image.permute(2, 0, 1).contiguous()  # (C, H, W)
        return image, torch.tensor(int(self._labels[i]))

    @property
    def labels(self) -> np.ndarray:
        return self._labels


def _class_folders(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def _images(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in EXTENSIONS)


def _listing(root: Path, classes: list[str]) -> tuple[list[Path], np.ndarray]:
    """Every image under ``root/<class>/`` with its class id."""
    files: list[Path] = []
    labels: list[int] = []
    for c, name in enumerate(classes):
        found = _images(root / name) if (root / name).is_dir() else []
        files += found
        labels += [c] * len(found)
    return files, np.array(labels, dtype=np.int64)


def _stratified_val(labels: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """A seeded ``fraction`` of each class (rounded; one at least where a class has two or more)."""
    rng = np.random.default_rng(seed)
    val = np.zeros(len(labels), dtype=bool)
    for c in np.unique(labels):
        members = np.flatnonzero(labels == c)
        n_val = min(max(round(len(members) * fraction), 1), len(members) - 1)
        val[rng.permutation(members)[:n_val]] = True
    return val


def build_images(cfg: DataConfig, ctx: DataContext) -> Datasets:
    """Train and val :class:`ImageFolderDataset` of the class folders under ``data.path``."""
    root = Path(cfg.path)
    if not cfg.path or not root.is_dir():
        raise ConfigError(f"data.path: {cfg.path!r} is not a folder; images need a folder of class folders")
    presplit = (root / "train").is_dir() and (root / "val").is_dir()
    tops = [root / "train", root / "val"] if presplit else [root]
    classes = sorted({p.name for top in tops for p in _class_folders(top)})
    if not classes:
        raise ConfigError(f"data.path: {root} holds no class folders (expected {root}/<class>/*.png)")
    size = (int(cfg.image_size[0]), int(cfg.image_size[1]))
    channels = 1 if cfg.image_mode == "L" else 3

    def dataset(files: list[Path], labels: np.ndarray) -> ImageFolderDataset:
        return ImageFolderDataset(files, labels, classes, size, cfg.image_mode)

    if presplit:
        (train_files, train_labels), (val_files, val_labels) = (_listing(top, classes) for top in tops)
    else:
        files, labels = _listing(root, classes)
        val = _stratified_val(labels, cfg.val_fraction, ctx.seed) if len(files) else np.zeros(0, dtype=bool)
        train_files, train_labels = [f for f, v in zip(files, val, strict=True) if not v], labels[~val]
        val_files, val_labels = [f for f, v in zip(files, val, strict=True) if v], labels[val]
    if not train_files:
        raise ConfigError(
            f"data.path: no training images ({', '.join(EXTENSIONS)}) in the class folders of {tops[0]}"
        )
    shape = (channels, *size)
    spec = DatasetSpec("classification", shape, len(classes), image_shape=shape)
    val_ds = dataset(val_files, val_labels) if val_files else None
    return Datasets(dataset(train_files, train_labels), val_ds, spec)

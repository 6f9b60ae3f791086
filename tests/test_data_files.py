"""``data.name = "npz"`` and ``data.name = "images"``: arrays and image folders, and their errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from vatra.config import DataConfig
from vatra.data import DataContext, ImageFolderDataset, Split
from vatra.data.images import build_images
from vatra.data.npz import build_npz
from vatra.errors import ConfigError

# --- npz ------------------------------------------------------------------------------------


def _npz(path: Path, **arrays: Any) -> Path:
    np.savez(path, **arrays)
    return path


def test_npz_classification_with_seeded_split_and_train_statistics(tmp_path: Path) -> None:
    # Prepare: column 0 is the row index, so the training rows can be read back
    rng = np.random.default_rng(0)
    x = np.column_stack([np.arange(50.0), rng.normal(10.0, 4.0, (50, 2))])
    y = rng.integers(0, 4, 50)
    path = _npz(tmp_path / "d.npz", x=x, y=y)
    run_dir = tmp_path / "run"

    # Execute
    train, val, spec = build_npz(DataConfig(name="npz", path=str(path)), DataContext(seed=1, run_dir=run_dir))
    again = build_npz(DataConfig(name="npz", path=str(path)), DataContext(seed=1))

    # Assert
    assert isinstance(train, Split) and isinstance(val, Split)
    assert spec.kind == "classification" and spec.num_classes == int(y.max()) + 1 and spec.input_shape == (3,)
    assert (len(train), len(val)) == (40, 10)
    assert train.y is not None and train.y.dtype == torch.int64 and train.labels is not None
    torch.testing.assert_close(again.train.x, train.x)  # same seed, same split
    saved = json.loads((run_dir / "data" / "preprocess.json").read_text())
    rows = np.rint(train.x[:, 0].double().numpy() * saved["std"][0] + saved["mean"][0]).astype(int)
    np.testing.assert_array_equal(train.y.numpy(), y[rows])
    np.testing.assert_allclose(saved["mean"], x[rows].mean(axis=0), rtol=1e-10)  # train rows only
    np.testing.assert_allclose(saved["std"], x[rows].std(axis=0), rtol=1e-10)
    assert abs(float(train.x.mean())) < 1e-5


def test_npz_explicit_val_arrays_regression_and_multilabel(tmp_path: Path) -> None:
    # Prepare
    rng = np.random.default_rng(1)
    reg = _npz(
        tmp_path / "r.npz",
        x=rng.normal(size=(20, 2)),
        y=rng.normal(size=20),
        x_val=rng.normal(size=(5, 2)),
        y_val=rng.normal(size=5),
    )
    labels = _npz(tmp_path / "m.npz", x=rng.normal(size=(20, 2)), y=rng.integers(0, 2, (20, 3)))

    # Execute
    r_train, r_val, r_spec = build_npz(
        DataConfig(name="npz", path=str(reg), standardize=False), DataContext()
    )
    _, _, m_spec = build_npz(DataConfig(name="npz", path=str(labels)), DataContext(task="multilabel"))

    # Assert
    assert r_spec.kind == "regression" and r_spec.num_classes == 1
    assert (len(r_train), len(r_val)) == (20, 5) and r_train.labels is None
    assert r_train.y is not None and r_train.y.dtype == torch.float32
    assert m_spec.kind == "multilabel" and m_spec.num_classes == 3


@pytest.mark.parametrize(
    ("arrays", "match"),
    [
        ({"x": np.zeros((4, 2))}, "has no array 'y' \\(it holds: x\\)"),
        ({"inputs": np.zeros(3), "y": np.zeros(3)}, "has no array 'x' \\(it holds: inputs, y\\)"),
        ({"x": np.zeros((4, 2)), "y": np.zeros(3)}, "x has 4 samples but y has 3"),
        ({"x": np.zeros((4, 2)), "y": np.zeros(4), "x_val": np.zeros((2, 2))}, "both x_val and y_val"),
    ],
)
def test_npz_errors_name_the_arrays(tmp_path: Path, arrays: dict[str, np.ndarray], match: str) -> None:
    # Prepare
    path = _npz(tmp_path / "bad.npz", **arrays)

    # Execute
    with pytest.raises(ConfigError, match=match) as err:
        build_npz(DataConfig(name="npz", path=str(path)), DataContext())

    # Assert
    assert "\n" not in str(err.value)


def test_npz_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        build_npz(DataConfig(name="npz", path=str(tmp_path / "none.npz")), DataContext())


# --- images ---------------------------------------------------------------------------------


def _png(path: Path, value: int, size: tuple[int, int] = (6, 4)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (value, value // 2, 255 - value)).save(path)


def test_image_folders_with_stratified_split(tmp_path: Path) -> None:
    # Prepare: 3 classes of 5 images
    for c, name in enumerate(["cat", "dog", "emu"]):
        for i in range(5):
            _png(tmp_path / name / f"{i}.png", 40 * c + i)
    (tmp_path / "dog" / "notes.txt").write_text("not an image")
    cfg = DataConfig(name="images", path=str(tmp_path), image_size=[8, 10], val_fraction=0.2)

    # Execute
    train, val, spec = build_images(cfg, DataContext(seed=0))
    image, label = train[0]

    # Assert
    assert isinstance(train, ImageFolderDataset) and isinstance(val, ImageFolderDataset)
    assert spec.kind == "classification" and spec.num_classes == 3
    assert spec.input_shape == (3, 8, 10) and spec.image_shape == (3, 8, 10)
    assert train.classes == ["cat", "dog", "emu"]
    assert (len(train), len(val)) == (12, 3)
    assert sorted(val.labels.tolist()) == [0, 1, 2]  # one of each class
    assert image.shape == (3, 8, 10) and image.dtype == torch.float32
    assert float(image.min()) >= 0.0 and float(image.max()) <= 1.0
    assert label.dtype == torch.int64 and int(label) == int(train.labels[0])
    torch.testing.assert_close(image[0], torch.full((8, 10), int(label) * 40 / 255.0), atol=0.03, rtol=0)


def test_image_train_and_val_folders_and_grayscale(tmp_path: Path) -> None:
    # Prepare
    for split, count in (("train", 3), ("val", 1)):
        for name in ("a", "b"):
            for i in range(count):
                _png(tmp_path / split / name / f"{i}.jpg", 100)
    cfg = DataConfig(name="images", path=str(tmp_path), image_size=[4, 4], image_mode="L")

    # Execute
    train, val, spec = build_images(cfg, DataContext())

    # Assert
    assert (len(train), len(val)) == (6, 2)
    assert spec.input_shape == (1, 4, 4) and train[0][0].shape == (1, 4, 4)


@pytest.mark.parametrize(
    ("layout", "match"),
    [
        ("missing", "is not a folder"),
        ("empty", "no class folders"),
        ("no_images", "no training images"),
    ],
)
def test_image_folder_errors(tmp_path: Path, layout: str, match: str) -> None:
    # Prepare
    root = tmp_path / "data"
    if layout != "missing":
        root.mkdir()
    if layout == "no_images":
        (root / "cat").mkdir()
        (root / "cat" / "x.txt").write_text("")

    # Execute
    with pytest.raises(ConfigError, match=match) as err:
        build_images(DataConfig(name="images", path=str(root)), DataContext())

    # Assert
    assert "\n" not in str(err.value)


def test_unreadable_image_names_the_file(tmp_path: Path) -> None:
    # Prepare
    _png(tmp_path / "cat" / "good.png", 10)
    (tmp_path / "cat" / "broken.png").write_bytes(b"not a png")
    _png(tmp_path / "dog" / "good.png", 10)
    train, val, _ = build_images(DataConfig(name="images", path=str(tmp_path)), DataContext())
    assert val is not None
    ds = next(d for d in (train, val) if any(f.name == "broken.png" for f in d.files))
    broken = next(i for i, f in enumerate(ds.files) if f.name == "broken.png")

    # Execute
    with pytest.raises(ConfigError, match=r"cannot read the image .*broken\.png") as err:
        ds[broken]

    # Assert
    assert "\n" not in str(err.value)

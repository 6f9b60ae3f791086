"""vatra: distributed PyTorch training that keeps going, sends few bytes and keeps data private.

The public API (``docs/api.md``): ``vatra.fit`` trains a user's model on a user's data, in one
process or under ``vatra run`` / torchrun in many; the batch contract and the dataset base classes
come from :mod:`vatra.data`, losses and metrics from :mod:`vatra.losses`. Names load on first use,
so ``import vatra`` (and the CLI's start-up) does not import torch.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("vatra")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+unknown"

_LAZY = {
    "BatchedDataset": "vatra.data",
    "Config": "vatra.config",
    "DatasetSpec": "vatra.data",
    "FitResult": "vatra.api",
    "Plugin": "vatra.engine",
    "Predictor": "vatra.api",
    "StreamDataset": "vatra.data",
    "TargetSpec": "vatra.data",
    "Trainer": "vatra.engine",
    "fit": "vatra.api",
    "load": "vatra.api",
    "load_config": "vatra.config",
}

__all__ = [
    "BatchedDataset",
    "Config",
    "DatasetSpec",
    "FitResult",
    "Plugin",
    "Predictor",
    "StreamDataset",
    "TargetSpec",
    "Trainer",
    "__version__",
    "fit",
    "load",
    "load_config",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vatra' has no attribute {name!r}")

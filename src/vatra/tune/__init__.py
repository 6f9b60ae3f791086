"""Hyper-parameter studies of vatra runs on optuna: the search space, trial workers, pruning, and the
adaptive sampler (usable in any plain optuna study).

Names load on first use: ``import vatra.tune`` imports neither optuna nor torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "AdaptiveSampler": "vatra.tune.adaptive",
    "Study": "vatra.tune.study",
    "TrialPruner": "vatra.tune.pruning",
    "check_space": "vatra.tune.space",
    "suggest": "vatra.tune.space",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'vatra.tune' has no attribute {name!r}")

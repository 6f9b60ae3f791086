"""Differential privacy for federated learning: the DP upload hook, DP-SGD via opacus, an RDP accountant."""

from __future__ import annotations

from vatra.federated.privacy.accountant import Accountant
from vatra.federated.privacy.hook import (
    EVAL_METRICS_WHITELIST,
    FIT_METRICS_WHITELIST,
    DPExecutor,
    DPUpload,
    filter_eval_metrics,
)

__all__ = [
    "EVAL_METRICS_WHITELIST",
    "FIT_METRICS_WHITELIST",
    "Accountant",
    "DPExecutor",
    "DPUpload",
    "filter_eval_metrics",
]

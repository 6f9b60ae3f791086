"""Differential privacy for federated learning: DP-FedAvg, DP-SGD via opacus, an RDP accountant."""

from __future__ import annotations

from vatra.federated.privacy.accountant import Accountant
from vatra.federated.privacy.hook import PrivateExecutor, PrivateUpload, build_private_hook

__all__ = ["Accountant", "PrivateExecutor", "PrivateUpload", "build_private_hook"]

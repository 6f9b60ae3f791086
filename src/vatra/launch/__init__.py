"""Launching workers: local processes and multi-node jobs through the elastic agent.

The names are loaded on first use, so ``vatra.launch.cluster`` (namespaces, no torch) and the
CLI's start-up do not pay for importing torch.distributed.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["LaunchSpec", "WorkerFailure", "free_port", "launch", "launch_workers", "parse_nnodes"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("vatra.launch.local"), name)
    raise AttributeError(f"module 'vatra.launch' has no attribute {name!r}")

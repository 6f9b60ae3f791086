"""Named phases of a training step in torch.profiler's traces: ``vatra.data_wait``,
``vatra.forward``, ``vatra.backward``, ``vatra.optimizer``, ``vatra.checkpoint``.

``vatra profile`` (:mod:`vatra.monitor.profile`) reads a step's time breakdown off these labels.
Without a profiler running, :func:`phase` returns a shared null context: one C call per phase
(``torch.autograd._profiler_enabled``; with the ``with`` about 1 µs here, five a step), no
``record_function`` op recorded or dispatched.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.autograd.profiler import record_function

PHASES = ("data_wait", "forward", "backward", "optimizer", "checkpoint")
_NULL = contextlib.nullcontext()


def phase(name: str) -> contextlib.AbstractContextManager[Any]:
    """``record_function("vatra.<name>")`` while torch.profiler records, else a null context."""
    if torch.autograd._profiler_enabled():
        return record_function(f"vatra.{name}")
    return _NULL

"""Process and device figures (psutil, NVML where present) and per-module gradient norms."""

from __future__ import annotations

import math
from typing import Any

import psutil
import torch
from torch import nn


class SystemSampler:
    """This process's CPU and memory, and its GPU's utilisation, memory and temperature via NVML.

    NVML comes from the optional ``nvidia-ml-py`` package (module ``pynvml``); without it, or
    without a GPU, the GPU figures are simply absent. A sample costs tens of microseconds, so the
    monitor takes one every ``monitor.system_every`` steps.
    """

    def __init__(self, device: torch.device) -> None:
        self.proc = psutil.Process()
        self.proc.cpu_percent(None)  # the first call only starts the measurement interval
        self.nvml: Any = None
        self.gpu: Any = None
        if device.type == "cuda":
            try:
                import pynvml

                pynvml.nvmlInit()
                self.nvml = pynvml
                self.gpu = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            except Exception:  # no package, no driver or no permission: GPU figures are optional
                self.nvml = None

    def sample(self) -> dict[str, float]:
        out = {
            "cpu_percent": self.proc.cpu_percent(None),
            "rss_mb": self.proc.memory_info().rss / 2**20,
        }
        if self.nvml is not None:
            util = self.nvml.nvmlDeviceGetUtilizationRates(self.gpu)
            mem = self.nvml.nvmlDeviceGetMemoryInfo(self.gpu)
            out["gpu_util_percent"] = float(util.gpu)
            out["gpu_mem_mb"] = mem.used / 2**20
            out["gpu_temp_c"] = float(
                self.nvml.nvmlDeviceGetTemperature(self.gpu, self.nvml.NVML_TEMPERATURE_GPU)
            )
        return out

    def close(self) -> None:
        if self.nvml is not None:
            self.nvml.nvmlShutdown()
            self.nvml = None


def module_grad_norms(model: nn.Module) -> dict[str, float]:
    """L2 norm of the gradients of each top-level module (after clipping, as stepped).

    A wrapper with a single child (``MLP.net``) is looked through, so the names are the layers.
    """
    prefix = ""
    while len(children := list(model.named_children())) == 1:
        prefix += children[0][0] + "."
        model = children[0][1]
    out: dict[str, float] = {}
    for name, child in model.named_children():
        sq = [p.grad.detach().float().pow(2).sum() for p in child.parameters() if p.grad is not None]
        if sq:
            out[f"grad_norm/{prefix}{name}"] = math.sqrt(float(torch.stack(sq).sum()))
    return out

"""Process and device figures (psutil, NVML where present) and per-module gradient norms."""

from __future__ import annotations

import math
import os
import time
from typing import Any

import psutil
import torch
from torch import nn


class SystemSampler:
    """This process's CPU and memory, and its GPU's utilisation, memory and temperature via NVML.

    CPU use is this process's CPU time (all threads) over the wall time since the last sample,
    in percent of one core, from two clock reads; psutil's ``cpu_percent`` parses /proc/self/stat
    and cost ~0.3 ms a sample on a loaded machine. NVML comes from the optional ``nvidia-ml-py``
    package (module ``pynvml``); without it, or without a GPU, the GPU figures are simply absent.
    The monitor takes one sample every ``monitor.system_every`` steps.
    """

    def __init__(self, device: torch.device) -> None:
        self.proc = psutil.Process()
        self.last = (time.perf_counter(), time.process_time())
        # Linux: resident pages from /proc/self/statm through a descriptor kept open (~3 µs a read;
        # psutil opens and parses the file each time, ~50 µs). Elsewhere psutil.
        self.statm: int | None = None
        if os.path.exists("/proc/self/statm"):
            self.statm = os.open("/proc/self/statm", os.O_RDONLY)
            self.page_mb = os.sysconf("SC_PAGE_SIZE") / 2**20
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
        now = (time.perf_counter(), time.process_time())
        wall, cpu = now[0] - self.last[0], now[1] - self.last[1]
        self.last = now
        out = {
            "cpu_percent": 100.0 * cpu / wall if wall > 0 else 0.0,
            "rss_mb": self._rss_mb(),
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

    def _rss_mb(self) -> float:
        if self.statm is not None:
            return int(os.pread(self.statm, 128, 0).split()[1]) * self.page_mb
        return float(self.proc.memory_info().rss / 2**20)

    def close(self) -> None:
        if self.statm is not None:
            os.close(self.statm)
            self.statm = None
        if self.nvml is not None:
            self.nvml.nvmlShutdown()
            self.nvml = None


def module_grad_norms(model: nn.Module) -> dict[str, float]:
    """L2 norm of the gradients of each top-level module (after clipping, as stepped).

    A wrapper with a single child (a ``Sequential`` inside a module) is looked through.
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

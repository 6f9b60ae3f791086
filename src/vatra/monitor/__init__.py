"""Monitoring: metric sinks, progress display."""

from vatra.monitor.progress import ProgressDisplay
from vatra.monitor.writers import JsonlWriter, TensorBoardWriter

__all__ = ["JsonlWriter", "ProgressDisplay", "TensorBoardWriter"]

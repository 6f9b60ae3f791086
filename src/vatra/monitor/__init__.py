"""Monitoring: metric collection, anomaly detectors, exporters, the run report."""

from vatra.monitor._base import Detector, build_detector
from vatra.monitor.autoencoder import AutoencoderDetector
from vatra.monitor.ensemble import FEATURES, Alarm, Ensemble
from vatra.monitor.exporters import PrometheusExporter, StepTracer
from vatra.monitor.iforest import IsolationForestDetector
from vatra.monitor.mlflow_tracking import MlflowTracker
from vatra.monitor.plugin import Monitor
from vatra.monitor.progress import ProgressDisplay
from vatra.monitor.writers import JsonlWriter, TensorBoardWriter
from vatra.monitor.zscore import ZScoreDetector

__all__ = [
    "FEATURES",
    "Alarm",
    "AutoencoderDetector",
    "Detector",
    "Ensemble",
    "IsolationForestDetector",
    "JsonlWriter",
    "MlflowTracker",
    "Monitor",
    "ProgressDisplay",
    "PrometheusExporter",
    "StepTracer",
    "TensorBoardWriter",
    "ZScoreDetector",
    "build_detector",
]

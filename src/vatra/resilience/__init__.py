"""Fault tolerance: full-state checkpoints, the versioned store, erasure coding, recovery, fault injection."""

from vatra.resilience._base import GcAborted, MissingKey, StoreBackend, StoreError, StoreUsageError
from vatra.resilience.chaos import KillInjector, TrainingFaults, corrupt_version, truncate_manifest
from vatra.resilience.checkpoint import CheckpointPlugin, Preempted
from vatra.resilience.erasure import ErasureBackend
from vatra.resilience.fsspec_backend import FsspecBackend
from vatra.resilience.recovery import record_worker_failures
from vatra.resilience.store import LAST_GOOD, LATEST, CheckpointStore, Scan, open_store

__all__ = [
    "LAST_GOOD",
    "LATEST",
    "CheckpointPlugin",
    "CheckpointStore",
    "ErasureBackend",
    "FsspecBackend",
    "GcAborted",
    "KillInjector",
    "MissingKey",
    "Preempted",
    "Scan",
    "StoreBackend",
    "StoreError",
    "StoreUsageError",
    "TrainingFaults",
    "corrupt_version",
    "open_store",
    "record_worker_failures",
    "truncate_manifest",
]

"""Fault tolerance: full-state checkpoints, the versioned store, erasure coding, recovery, fault injection."""

from vatra.resilience._base import StoreBackend, StoreError
from vatra.resilience.checkpoint import CheckpointPlugin, Preempted
from vatra.resilience.erasure import ErasureBackend
from vatra.resilience.faults import KillInjector, corrupt_version
from vatra.resilience.fsspec_backend import FsspecBackend
from vatra.resilience.recovery import record_worker_failures
from vatra.resilience.store import LAST_GOOD, LATEST, CheckpointStore, open_store

__all__ = [
    "LAST_GOOD",
    "LATEST",
    "CheckpointPlugin",
    "CheckpointStore",
    "ErasureBackend",
    "FsspecBackend",
    "KillInjector",
    "Preempted",
    "StoreBackend",
    "StoreError",
    "corrupt_version",
    "open_store",
    "record_worker_failures",
]

"""Data sources, the batch contract, shard partitioning, resumable sampling and loading."""

from __future__ import annotations

from vatra.data._base import (
    Batch,
    BatchedDataset,
    DataContext,
    Datasets,
    DatasetSpec,
    StreamDataset,
    TargetSpec,
    TaskKind,
    batch_size_of,
    to_device,
)
from vatra.data._split import Split
from vatra.data.datasets import build_dataset
from vatra.data.infer import infer_spec, user_datasets
from vatra.data.partition import PARTITIONERS, partition
from vatra.data.sampler import ShardSampler

__all__ = [
    "PARTITIONERS",
    "Batch",
    "BatchedDataset",
    "DataContext",
    "DatasetSpec",
    "Datasets",
    "ShardSampler",
    "Split",
    "StreamDataset",
    "TargetSpec",
    "TaskKind",
    "batch_size_of",
    "build_dataset",
    "infer_spec",
    "partition",
    "to_device",
    "user_datasets",
]

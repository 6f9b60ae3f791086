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
    to_device,
)
from vatra.data._split import Split
from vatra.data.datasets import build_dataset
from vatra.data.images import ImageFolderDataset
from vatra.data.infer import infer_spec, user_datasets
from vatra.data.partition import PARTITIONERS, partition
from vatra.data.sampler import GlobalBatchSampler, ShardSampler, even_split
from vatra.data.tabular import ParquetStream, Preprocess, RankingDataset, TableDataset

__all__ = [
    "PARTITIONERS",
    "Batch",
    "BatchedDataset",
    "DataContext",
    "DatasetSpec",
    "Datasets",
    "GlobalBatchSampler",
    "ImageFolderDataset",
    "ParquetStream",
    "Preprocess",
    "RankingDataset",
    "ShardSampler",
    "Split",
    "StreamDataset",
    "TableDataset",
    "TargetSpec",
    "TaskKind",
    "build_dataset",
    "even_split",
    "infer_spec",
    "partition",
    "to_device",
    "user_datasets",
]

"""Datasets, shard partitioning and resumable sampling."""

from __future__ import annotations

from vatra.data._split import DatasetSpec, Split
from vatra.data.datasets import DATASETS, build_dataset
from vatra.data.partition import PARTITIONERS, partition
from vatra.data.sampler import ShardSampler

__all__ = [
    "DATASETS",
    "PARTITIONERS",
    "DatasetSpec",
    "ShardSampler",
    "Split",
    "build_dataset",
    "partition",
]

"""This rank's training batches: sampled from its shard of a map-style dataset, sliced from one
global order (uneven per-rank batches, ``balance``), or read from its share of a stream."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from vatra.config import BalanceConfig, Config
from vatra.data import GlobalBatchSampler, ShardSampler, StreamDataset, even_split, partition
from vatra.data.loader import Batches, IterBatches, MapBatches, StreamBatches
from vatra.engine.objective import rank_seed
from vatra.errors import ConfigError

Sampler = ShardSampler | GlobalBatchSampler


def balance_sizes(cfg: BalanceConfig, world_size: int, batch_size: int) -> list[int]:
    """The starting per-rank batches of ``balance`` for ``world_size`` ranks (``batch_size``:
    train.batch_size); a ``ValueError`` naming the keys when they do not fit the world."""
    if cfg.batches:
        if len(cfg.batches) != world_size:
            raise ValueError(
                f"balance.batches lists {len(cfg.batches)} batches but the run has {world_size} "
                f"ranks; give one per rank, or [] for an even split"
            )
        return list(cfg.batches)
    total = batch_size * world_size if cfg.global_batch == "auto" else cfg.global_batch
    if total < cfg.min_batch * world_size:
        raise ValueError(
            f"balance.global_batch = {total} cannot give each of {world_size} ranks "
            f"balance.min_batch = {cfg.min_batch} samples; raise it"
        )
    return even_split(total, world_size)


def train_batches(
    cfg: Config, data: Any, sampler: Sampler | None, *, rank: int, world: int, device: torch.device
) -> tuple[Batches, Sampler | None]:
    """The batches of data rank ``rank`` of ``world``, and the sampler they draw from (``sampler``,
    or the one the config asks for; None for streams)."""
    opts: dict[str, Any] = {
        "workers": cfg.data.workers,
        "prefetch_factor": cfg.data.prefetch_factor,
        "device": device,
        "prefetch": cfg.data.prefetch,
    }
    balanced = cfg.balance.method != "off"
    if balanced and isinstance(data, IterableDataset):
        raise ConfigError(
            f"balance.method = {cfg.balance.method!r} splits one global order of a map-style dataset "
            f"among the ranks, but the training data is a stream ({type(data).__name__}); set "
            "balance.method = 'off', or give a map-style dataset (__len__ and __getitem__)"
        )
    if balanced and sampler is None:
        try:
            sizes = balance_sizes(cfg.balance, world, cfg.train.batch_size)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        sampler = GlobalBatchSampler(np.arange(len(data)), sizes, rank, seed=cfg.run.seed)
    if isinstance(data, StreamDataset):
        stream = StreamBatches(
            data, rank=rank, world_size=world, batch_size=cfg.train.batch_size, seed=cfg.run.seed, **opts
        )
        return stream, sampler
    if isinstance(data, IterableDataset):
        return IterBatches(data, cfg.train.batch_size, **opts), sampler
    if sampler is None:
        shards = partition(
            len(data),
            getattr(data, "labels", None),
            world,
            cfg.data.sharding,
            seed=cfg.run.seed,
            alpha=cfg.data.alpha,
            classes_per_shard=cfg.data.classes_per_shard,
        )
        sampler = ShardSampler(shards[rank], cfg.train.batch_size, seed=rank_seed(cfg.run.seed, rank))
    return MapBatches(data, sampler, **opts), sampler

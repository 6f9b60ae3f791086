"""Each client's data: non-IID label partitions (reusing ``vatra.data``), unequal sizes, feature shift."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vatra.config import Config, DataConfig, PartitionConfig
from vatra.data import DatasetSpec, Split, build_dataset, partition
from vatra.errors import ConfigError

ImageTransform = Callable[[np.ndarray], np.ndarray]  # (N, H, W) -> (N, H, W)

SHIFT_TRANSFORMS: dict[str, ImageTransform] = {
    "identity": lambda x: x,
    "rot90": lambda x: np.rot90(x, 1, axes=(1, 2)),
    "rot180": lambda x: np.rot90(x, 2, axes=(1, 2)),
    "rot270": lambda x: np.rot90(x, 3, axes=(1, 2)),
    "invert": lambda x: 1.0 - x,
    "low_contrast": lambda x: 0.25 + 0.5 * x,
    "flip": lambda x: x[:, :, ::-1],
}


def shift_split(split: Split, spec: DatasetSpec, shift: str) -> Split:
    """``split`` with every input passed through the named image transform (labels unchanged)."""
    if shift == "identity":
        return split
    if spec.image_shape is None or split.y is None:
        raise ConfigError("federated.partition.feature_shift: needs image inputs (data.name = digits)")
    c, h, w = spec.image_shape
    x = split.x.numpy().reshape(len(split), c * h, w) if c == 1 else None
    if x is None:
        raise ConfigError("federated.partition.feature_shift: supports single-channel images only")
    shifted = SHIFT_TRANSFORMS[shift](x).reshape(len(split), -1)  # (N, H, W) -> (N, H*W)
    return Split(torch.from_numpy(np.ascontiguousarray(shifted, dtype=np.float32)), split.y)


def client_shards(
    n: int, labels: np.ndarray | None, clients: int, p: PartitionConfig, seed: int
) -> list[np.ndarray]:
    """One sorted index array per client. ``iid`` with ``size_skew`` > 0 draws log-normal sizes."""
    if p.method == "iid" and p.size_skew > 0:
        if clients > n:
            raise ConfigError(f"federated.clients: cannot split {n} samples among {clients} clients")
        rng = np.random.default_rng([seed, 1])
        share = rng.lognormal(0.0, p.size_skew, clients)
        sizes = 1 + np.floor(share / share.sum() * (n - clients)).astype(np.int64)  # ≥ 1 each
        sizes[: n - int(sizes.sum())] += 1  # hand out the rounding remainder
        perm = rng.permutation(n)
        return [np.sort(s) for s in np.split(perm, np.cumsum(sizes)[:-1])]
    method = {"iid": "random"}.get(p.method, p.method)
    try:
        return partition(
            n, labels, clients, method, seed=seed, alpha=p.alpha, classes_per_shard=p.classes_per_client
        )
    except ConfigError as err:  # the message names data.*; these keys live under federated.partition
        raise ConfigError(str(err).replace("data.sharding", "federated.partition.method")) from None


@dataclass
class Federation:
    """Everything about the clients' data that simulation, clients and the server's evaluation use.

    Client ``c`` trains on ``train_for(c)`` rows ``shards[c]``; its test distribution is the held-out
    split under its own transform, with classes weighted as in its training shard (``label_hist``).
    """

    train: Split
    val: Split
    spec: DatasetSpec
    shards: list[np.ndarray]
    shifts: list[str]  # per client
    label_hist: np.ndarray  # (clients, classes) float64, rows sum to 1
    _shifted_train: dict[str, Split]
    _shifted_val: dict[str, Split]

    @property
    def num_clients(self) -> int:
        return len(self.shards)

    @property
    def sizes(self) -> np.ndarray:
        return np.array([len(s) for s in self.shards], dtype=np.int64)

    def train_for(self, client: int) -> Split:
        return self._shifted_train[self.shifts[client]]

    def val_for_shift(self, shift: str) -> Split:
        return self._shifted_val[shift]


def build_federation(cfg: Config) -> Federation:
    """Deterministic for the config: every process (simulation worker, server, client) agrees."""
    fed = cfg.federated
    data_cfg: DataConfig = cfg.data
    train, val, spec = build_dataset(data_cfg, cfg.run.seed)
    if not (isinstance(train, Split) and isinstance(val, Split)) or spec.kind != "classification":
        raise ConfigError(
            "data.name: federated simulation here needs an in-memory classification dataset "
            "(digits, synthetic, npz)"
        )
    if train.y is None or val.y is None:
        raise ConfigError("data.name: federated learning needs labelled data")
    shards = client_shards(len(train), train.labels, fed.clients, fed.partition, cfg.run.seed)
    names = fed.partition.feature_shift or ["identity"]
    shifts = [names[c % len(names)] for c in range(fed.clients)]
    hist = np.zeros((fed.clients, spec.num_classes), dtype=np.float64)
    labels = train.y.numpy()
    for c, idx in enumerate(shards):
        hist[c] = np.bincount(labels[idx], minlength=spec.num_classes) / len(idx)
    used = sorted(set(shifts))
    return Federation(
        train,
        val,
        spec,
        shards,
        shifts,
        hist,
        {s: shift_split(train, spec, s) for s in used},
        {s: shift_split(val, spec, s) for s in used},
    )

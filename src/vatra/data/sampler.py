"""Endless, resumable sampling of index batches over one shard."""

from __future__ import annotations

import numpy as np


class ShardSampler:
    """Endless stream of index batches over one shard; epoch-wise seeded reshuffle; exact resume.

    Epoch ``e`` visits the shard in the order ``default_rng([seed, e]).permutation(size)``, so any
    (epoch, position) can be restored without replaying earlier batches. A batch that crosses an
    epoch boundary continues into the next epoch's order: no short batches, no sample skipped.
    With ``epoch_end`` the last batch of an epoch is short instead (⌈size / batch⌉ batches per
    epoch: a federated client's local epoch).
    """

    def __init__(
        self,
        indices: np.ndarray,
        batch_size: int,
        *,
        seed: int,
        shuffle: bool = True,
        epoch_end: bool = False,
    ) -> None:
        if len(indices) == 0:
            raise ValueError("ShardSampler needs a non-empty shard")
        if batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
        self.indices = np.asarray(indices, dtype=np.int64)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch_end = epoch_end
        self.epoch = 0
        self.position = 0
        self.version = 0  # bumped by load_state_dict: a loader reading ahead must start again from here
        self._order_epoch = -1
        self._order = np.empty(0, dtype=np.int64)

    def __len__(self) -> int:
        """Shard size (samples per epoch)."""
        return len(self.indices)

    def _epoch_order(self) -> np.ndarray:
        """Positions into ``indices`` in this epoch's visiting order (cached per epoch)."""
        if self._order_epoch != self.epoch:
            size = len(self.indices)
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, self.epoch]).permutation(size)
            else:
                self._order = np.arange(size)
            self._order_epoch = self.epoch
        return self._order

    def next_batch(self) -> np.ndarray:
        """The next ``batch_size`` dataset indices."""
        parts: list[np.ndarray] = []
        need = self.batch_size
        if self.epoch_end:
            need = min(need, len(self.indices) - self.position)
        while need > 0:
            take = self._epoch_order()[self.position : self.position + need]
            parts.append(self.indices[take])
            need -= len(take)
            self.position += len(take)
            if self.position == len(self.indices):
                self.epoch += 1
                self.position = 0
        return np.concatenate(parts)

    def advance(self) -> None:
        """Move past one batch without producing its indices (a loader that read ahead consumed it)."""
        size = len(self.indices)
        step = min(self.batch_size, size - self.position) if self.epoch_end else self.batch_size
        self.epoch, self.position = divmod(self.epoch * size + self.position + step, size)

    def remaining_in_epoch(self) -> np.ndarray:
        """The indices this epoch still has to yield, in order."""
        return self.indices[self._epoch_order()[self.position :]]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "size": len(self.indices)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at a saved (epoch, position); the shard and seed must be the ones saved."""
        if state["size"] != len(self.indices):
            raise ValueError(
                f"sampler state is for a shard of {state['size']} samples but this shard has "
                f"{len(self.indices)}; resume with the same dataset, world size and sharding"
            )
        if state["seed"] != self.seed:
            raise ValueError(
                f"sampler state was saved with seed {state['seed']} but this sampler uses {self.seed}; "
                "resume with the same run.seed"
            )
        if not 0 <= state["position"] < len(self.indices) or state["epoch"] < 0:
            raise ValueError(f"sampler state has an invalid epoch/position: {state}")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.version += 1

    def copy(self) -> ShardSampler:
        """A sampler over the same shard at the same position (a loader's look-ahead)."""
        twin = ShardSampler(
            self.indices, self.batch_size, seed=self.seed, shuffle=self.shuffle, epoch_end=self.epoch_end
        )
        twin.epoch, twin.position = self.epoch, self.position
        return twin

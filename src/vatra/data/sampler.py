"""Endless, resumable sampling of index batches over one shard, and its hand-over to another world size."""

from __future__ import annotations

from typing import Any

import numpy as np


def epoch_order(seed: int, epoch: int, size: int, shuffle: bool = True) -> np.ndarray:
    """Positions into a shard of ``size`` in epoch ``epoch``'s visiting order."""
    return np.random.default_rng([seed, epoch]).permutation(size) if shuffle else np.arange(size)


class ShardSampler:
    """Endless stream of index batches over one shard; epoch-wise seeded reshuffle; exact resume.

    Epoch ``e`` visits the shard in the order ``default_rng([seed, e]).permutation(size)``, so any
    (epoch, position) can be restored without replaying earlier batches. A batch that crosses an
    epoch boundary continues into the next epoch's order: no short batches, no sample skipped.
    With ``epoch_end`` the last batch of an epoch is short instead (⌈size / batch⌉ batches per
    epoch: a federated client's local epoch).

    After a world-size change (:meth:`take_over`) the sampler first serves its ``carry``: its part
    of what the old ranks had left of the interrupted epoch; then epoch ``epoch`` of its own shard.
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
        self.carry = np.empty(0, dtype=np.int64)  # dataset indices served before epoch `epoch` starts
        self.version = 0  # bumped by load_state_dict: a loader reading ahead must start again from here
        self._order_epoch = -1
        self._order = np.empty(0, dtype=np.int64)

    def __len__(self) -> int:
        """Shard size (samples per epoch)."""
        return len(self.indices)

    def _epoch_order(self) -> np.ndarray:
        """Positions into ``indices`` in this epoch's visiting order (cached per epoch)."""
        if self._order_epoch != self.epoch:
            self._order = epoch_order(self.seed, self.epoch, len(self.indices), self.shuffle)
            self._order_epoch = self.epoch
        return self._order

    def _batch_len(self) -> int:
        """Samples in the next batch: a full one; with ``epoch_end`` at most what is left of the epoch."""
        if not self.epoch_end:
            return self.batch_size
        left = len(self.carry) or len(self.indices) - self.position
        return min(self.batch_size, left)

    def next_batch(self) -> np.ndarray:
        """The next ``batch_size`` dataset indices."""
        parts: list[np.ndarray] = []
        need = self._batch_len()
        if len(self.carry):
            parts.append(self.carry[:need])
            need -= len(parts[0])
            self.carry = self.carry[len(parts[0]) :]
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
        step = self._batch_len()
        used = min(step, len(self.carry))
        self.carry = self.carry[used:]
        size = len(self.indices)
        self.epoch, self.position = divmod(self.epoch * size + self.position + step - used, size)

    def remaining_in_epoch(self) -> np.ndarray:
        """The indices this epoch still has to yield, in order (the carry, while there is one)."""
        if len(self.carry):
            return self.carry
        return self.indices[self._epoch_order()[self.position :]]

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "size": len(self.indices),
        }
        if len(self.carry):
            state["carry"] = self.carry.tolist()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved (epoch, position, carry); the shard and seed must be the ones saved."""
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
        self.carry = np.asarray(state.get("carry", []), dtype=np.int64)
        self.version += 1

    def take_over(self, old: list[tuple[dict[str, Any], np.ndarray]], rank: int, world_size: int) -> None:
        """Continue, as ``rank`` of ``world_size``, from the saved states of another world size.

        ``old``: every saved rank's ``(state_dict(), shard indices)``, in rank order. The epoch they
        were in is finished first: what the old ranks had left of it (:func:`owed`) is shuffled
        with a seed all new ranks share and split among them by ``np.array_split``, so no sample
        of it is lost or repeated; then each new rank starts the next epoch on its own shard (this
        sampler's ``indices``), the new world size's normal sharding.
        """
        through = max(current_epoch(state) for state, _ in old)
        union = np.concatenate([owed(state, shard, through, self.shuffle) for state, shard in old]).astype(
            np.int64
        )
        if self.shuffle:
            seeds = [int(state["seed"]) for state, _ in old]
            union = union[np.random.default_rng([through, *seeds]).permutation(len(union))]
        self.carry = np.array_split(union, world_size)[rank]
        self.epoch, self.position = through + 1, 0
        self.version += 1

    def copy(self) -> ShardSampler:
        """A sampler over the same shard at the same position (a loader's look-ahead)."""
        twin = ShardSampler(
            self.indices, self.batch_size, seed=self.seed, shuffle=self.shuffle, epoch_end=self.epoch_end
        )
        twin.epoch, twin.position, twin.carry = self.epoch, self.position, self.carry
        return twin


def current_epoch(state: dict[str, Any]) -> int:
    """The epoch a saved sampler is in: at an epoch's first position (or serving a carry, which
    comes before that epoch) it is still in the one before."""
    return int(state["epoch"]) - (1 if int(state["position"]) == 0 else 0)


def owed(state: dict[str, Any], shard: np.ndarray, through: int, shuffle: bool = True) -> np.ndarray:
    """The dataset indices a saved sampler still had to serve to finish epoch ``through``.

    Its carry, the rest of its current epoch, and every whole epoch after it up to ``through`` (a
    rank whose smaller shard put it one epoch behind its peers catches up): after these, each of
    its epochs up to ``through`` has visited its shard exactly once.
    """
    seed, epoch, position = int(state["seed"]), int(state["epoch"]), int(state["position"])
    parts = [np.asarray(state.get("carry", []), dtype=np.int64)]
    for e in range(epoch, through + 1):
        order = epoch_order(seed, e, len(shard), shuffle)
        parts.append(shard[order[position if e == epoch else 0 :]])
    return np.concatenate(parts)


def even_split(total: int, parts: int) -> list[int]:
    """``total`` samples over ``parts`` ranks as evenly as integers allow (the first ones get the extra)."""
    base, extra = divmod(total, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


class GlobalBatchSampler:
    """One seeded order over the whole training set, cut into global batches, each rank its slice.

    Step after step the ranks consume ``sum(sizes)`` samples (the global batch) of epoch ``e``'s
    order ``default_rng([seed, e]).permutation(size)``; rank r takes the ``sizes[r]`` after the
    slices of the ranks before it. So whatever the split, the union of the ranks' batches is the
    same global batch, every sample is visited once per epoch, and a step with per-rank losses
    weighted by ``sizes[r] / sum(sizes)`` equals one step on that batch. The state is global
    (the same on every rank) and holds the split; :meth:`resize` changes the split between steps
    (a balancer's decision), and a world-size change keeps the position and the global batch
    and splits it evenly (:meth:`take_over`). Same interface as :class:`ShardSampler`.
    """

    def __init__(self, indices: np.ndarray, sizes: list[int], rank: int, *, seed: int, shuffle: bool = True):
        if len(indices) == 0:
            raise ValueError("GlobalBatchSampler needs a non-empty dataset")
        if not 0 <= rank < len(sizes) or min(sizes) < 1:
            raise ValueError(f"sizes {sizes} must give each of the ranks (this one: {rank}) ≥ 1 sample")
        self.indices = np.asarray(indices, dtype=np.int64)
        self.sizes = [int(b) for b in sizes]
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self.carry = np.empty(0, dtype=np.int64)  # never used: the interface MapBatches reads
        self.version = 0
        self._order_epoch = -1
        self._order = np.empty(0, dtype=np.int64)

    @property
    def batch_size(self) -> int:
        """This rank's samples per batch."""
        return self.sizes[self.rank]

    @property
    def global_batch(self) -> int:
        return sum(self.sizes)

    def __len__(self) -> int:
        return len(self.indices)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            self._order = epoch_order(self.seed, epoch, len(self.indices), self.shuffle)
            self._order_epoch = epoch
        return self._order

    def _take(self, start: int, count: int) -> np.ndarray:
        """``count`` indices of the endless order from global offset ``start`` (epochs × size + position)."""
        size, parts = len(self.indices), []
        epoch, pos = divmod(start, size)
        while count > 0:
            take = self._epoch_order(epoch)[pos : pos + count]
            parts.append(self.indices[take])
            count -= len(take)
            epoch, pos = epoch + 1, 0
        return np.concatenate(parts)

    def next_batch(self) -> np.ndarray:
        """This rank's slice of the next global batch."""
        offset = self.epoch * len(self.indices) + self.position
        mine = self._take(offset + sum(self.sizes[: self.rank]), self.batch_size)
        self.advance()
        return mine

    def advance(self) -> None:
        """Move past one global batch."""
        size = len(self.indices)
        self.epoch, self.position = divmod(self.epoch * size + self.position + self.global_batch, size)

    def seek(self, epoch: int, position: int) -> None:
        """Back to a position this sampler held (a step that is redone); a loader reading ahead restarts."""
        self.epoch, self.position = epoch, position
        self.version += 1

    def resize(self, sizes: list[int]) -> None:
        """A new split for the next batches (one size per rank, each ≥ 1); a loader reading ahead restarts."""
        if len(sizes) != len(self.sizes) or min(sizes) < 1:
            raise ValueError(f"resize: {sizes} must give each of the {len(self.sizes)} ranks ≥ 1 sample")
        if list(sizes) != self.sizes:
            self.sizes = [int(b) for b in sizes]
            self.version += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "size": len(self.indices),
            "sizes": list(self.sizes),
        }

    def _check_saved(self, state: dict[str, Any]) -> None:
        """A saved position this sampler can continue: global (balance on), same dataset and seed."""
        if "sizes" not in state:
            raise ValueError(
                "the saved data position is per-rank shards (balance off) but this run has balance on; "
                "resume with the balance.method it was saved with"
            )
        if state["size"] != len(self.indices) or state["seed"] != self.seed:
            raise ValueError(
                f"the saved data position is for {state['size']} samples and seed {state['seed']}, this run "
                f"has {len(self.indices)} and {self.seed}; resume with the same dataset and run.seed"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved global position and split (same dataset, seed and world size)."""
        self._check_saved(state)
        if len(state["sizes"]) != len(self.sizes):
            raise ValueError(f"the saved split {state['sizes']} is for another world size")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.sizes = [int(b) for b in state["sizes"]]
        self.version += 1

    def take_over(self, old: list[tuple[dict[str, Any], np.ndarray]], rank: int, world_size: int) -> None:
        """Another world size: the same global position (every saved rank holds it) and global batch,
        split evenly; the balancer sizes it again from its new measurements."""
        state = old[0][0]
        self._check_saved(state)
        total = sum(int(b) for b in state["sizes"])
        if total < world_size:
            raise ValueError(f"its global batch of {total} cannot give each of {world_size} ranks a sample")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.sizes = even_split(total, world_size)
        self.rank = rank
        self.version += 1

    def copy(self) -> GlobalBatchSampler:
        twin = GlobalBatchSampler(self.indices, self.sizes, self.rank, seed=self.seed, shuffle=self.shuffle)
        twin.epoch, twin.position = self.epoch, self.position
        return twin

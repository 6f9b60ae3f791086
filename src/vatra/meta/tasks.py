"""Tasks for meta-learning: N-way k-shot episodes from class splits, one task per value of a column
(a site, a district, a client), or a user's sampler.

Every sampler draws episode ``index`` of split ``"train"``, ``"val"`` or ``"test"`` from its own
generator, seeded by ``(seed, split, index)``: any rank draws any episode without drawing the ones
before it, so ranks share a meta-batch by index and a resumed run draws the episodes it would have.
The class and task splits are disjoint by construction (:attr:`ClassTasks.classes`), so no
meta-test class reaches a meta-training episode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from vatra.errors import ConfigError

Episode = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # support x, y; query x, y
SPLITS = ("train", "val", "test")


class TaskSampler(Protocol):
    """Episodes by split and index. Call order: built once per rank, then :meth:`episode` any
    number of times, in any order, from one thread."""

    def splits(self) -> tuple[str, ...]:
        """The splits that have tasks (``"val"`` may have none)."""
        ...

    def episode(self, split: str, index: int) -> Episode:
        """Episode ``index`` of ``split``: the same tensors on every call and every rank."""
        ...


def episode_rng(seed: int, split: str, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, SPLITS.index(split), index])


def rows_of(dataset: Any) -> tuple[torch.Tensor, np.ndarray]:
    """Every item of a map-style dataset as one input tensor ``(n, ...)`` and its integer labels."""
    n = len(dataset)
    if hasattr(dataset, "get_batch"):
        x, y = dataset.get_batch(np.arange(n))
    else:
        items = [dataset[i] for i in range(n)]
        x = torch.stack([torch.as_tensor(it[0]) for it in items])
        y = torch.as_tensor([int(it[1]) for it in items])
    if not isinstance(x, torch.Tensor):
        raise ConfigError(
            f"meta: episodes need inputs as one tensor per row, but this data gives {type(x).__name__} "
            "(categorical table columns?); one-hot encode them, or give meta.sampler"
        )
    return x, np.asarray(torch.as_tensor(y)).astype(np.int64)


def _split_names(names: np.ndarray, val: int, test: int, seed: int, what: str) -> dict[str, np.ndarray]:
    """Names shuffled by ``seed`` and cut into disjoint test, val and train sets."""
    if val + test >= len(names):
        raise ConfigError(
            f"meta: {len(names)} {what} cannot give {test} to meta-test and {val} to meta-val and keep any "
            f"for meta-training; lower meta.test_{what} or meta.val_{what}"
        )
    perm = np.random.default_rng(seed).permutation(names)
    return {
        "test": np.sort(perm[:test]),
        "val": np.sort(perm[test : test + val]),
        "train": np.sort(perm[test + val :]),
    }


class ClassTasks:
    """N-way k-shot episodes: ``ways`` classes of one split, ``shots`` support and ``queries`` query
    rows each, relabelled 0..ways−1 in the order drawn (the model's first ``ways`` outputs)."""

    def __init__(
        self,
        x: torch.Tensor,
        y: np.ndarray,
        *,
        ways: int,
        shots: int,
        queries: int,
        val: int,
        test: int,
        seed: int,
    ) -> None:
        self.x, self.seed = x, seed
        self.ways, self.shots, self.queries = ways, shots, queries
        self.classes = _split_names(np.unique(y), val, test, seed, "classes")
        self.rows = {int(c): np.flatnonzero(y == c) for c in np.unique(y)}
        for split in self.splits():
            names = self.classes[split]
            if len(names) < ways:
                raise ConfigError(
                    f"meta: the meta-{split} split has {len(names)} classes, fewer than meta.ways = {ways}; "
                    f"lower meta.ways, or give that split more classes (meta.test_classes, meta.val_classes)"
                )
            short = [int(c) for c in names if len(self.rows[int(c)]) < shots + queries]
            if short:
                raise ConfigError(
                    f"meta: class {short[0]} has {len(self.rows[short[0]])} rows, fewer than meta.shots + "
                    f"meta.queries = {shots + queries}; lower meta.shots or meta.queries"
                )

    def splits(self) -> tuple[str, ...]:
        return tuple(s for s in SPLITS if len(self.classes[s]))

    def episode(self, split: str, index: int) -> Episode:
        rng = episode_rng(self.seed, split, index)
        chosen = rng.choice(self.classes[split], self.ways, replace=False)
        picks = [rng.choice(self.rows[int(c)], self.shots + self.queries, replace=False) for c in chosen]
        return _episode(self.x, picks, self.shots, self.queries)


class ColumnTasks:
    """One task per value of a column (a site): an episode is ``shots`` support and ``queries``
    query rows of each class from one site of the split; labels are the data's own classes."""

    def __init__(
        self,
        x: torch.Tensor,
        y: np.ndarray,
        groups: np.ndarray,
        *,
        classes: int,
        shots: int,
        queries: int,
        val: int,
        test: int,
        seed: int,
    ) -> None:
        self.x, self.seed, self.classes_n = x, seed, classes
        self.shots, self.queries = shots, queries
        names = np.unique(groups.astype(str)).tolist()
        self.tasks = _split_names(np.asarray(names), val, test, seed, "tasks")
        keys = groups.astype(str)
        self.rows = {(g, c): np.flatnonzero((keys == g) & (y == c)) for g in names for c in range(classes)}
        for (g, c), rows in self.rows.items():
            if len(rows) < shots + queries:
                raise ConfigError(
                    f"meta: task {str(g)!r} has {len(rows)} rows of class {c}, fewer than meta.shots + "
                    f"meta.queries = {shots + queries}; lower them, or leave that task out of the data"
                )

    def splits(self) -> tuple[str, ...]:
        return tuple(s for s in SPLITS if len(self.tasks[s]))

    def episode(self, split: str, index: int) -> Episode:
        rng = episode_rng(self.seed, split, index)
        site = str(rng.choice(self.tasks[split]))
        picks = [
            rng.choice(self.rows[(site, c)], self.shots + self.queries, replace=False)
            for c in range(self.classes_n)
        ]
        return _episode(self.x, picks, self.shots, self.queries)


def _episode(x: torch.Tensor, picks: list[np.ndarray], shots: int, queries: int) -> Episode:
    """Support and query rows from each class's picked rows (class i = label i): its first ``shots``
    rows support, the rest query."""
    support = np.concatenate([p[:shots] for p in picks])  # (classes·shots,)
    query = np.concatenate([p[shots:] for p in picks])  # (classes·queries,)
    labels = torch.arange(len(picks))
    return x[support], labels.repeat_interleave(shots), x[query], labels.repeat_interleave(queries)


class UserTasks:
    """A user's function ``sample(split, rng) -> (support_x, support_y, query_x, query_y)``, called
    with a generator seeded by ``(seed, split, index)``; ``splits`` are the splits it serves."""

    def __init__(self, sample: Callable[[str, np.random.Generator], Any], seed: int) -> None:
        self.sample, self.seed = sample, seed

    def splits(self) -> tuple[str, ...]:
        return SPLITS

    def episode(self, split: str, index: int) -> Episode:
        out = self.sample(split, episode_rng(self.seed, split, index))
        if not (isinstance(out, tuple | list) and len(out) == 4):
            raise ConfigError(
                "meta.sampler: must return (support_x, support_y, query_x, query_y), got "
                f"{type(out).__name__}"
            )
        sx, sy, qx, qy = (torch.as_tensor(t) for t in out)
        return sx, sy, qx, qy

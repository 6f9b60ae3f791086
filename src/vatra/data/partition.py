"""Split a training set's indices into one shard per rank or client (IID and non-IID)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from vatra.errors import ConfigError

Partitioner = Callable[..., list[np.ndarray]]

_NEEDS_LABELS = frozenset({"stratified", "dirichlet", "label_skew"})


def _by_class(labels: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Indices of each class (classes in sorted order), shuffled within the class."""
    return [rng.permutation(np.flatnonzero(labels == c)) for c in np.unique(labels)]


def random_shards(
    n: int, labels: np.ndarray | None, num_shards: int, *, seed: int, **_: object
) -> list[np.ndarray]:
    """IID: a seeded permutation cut into near-equal parts."""
    perm = np.random.default_rng(seed).permutation(n)
    return np.array_split(perm, num_shards)


def contiguous_shards(n: int, labels: np.ndarray | None, num_shards: int, **_: object) -> list[np.ndarray]:
    """Consecutive blocks in dataset order; for text this keeps each shard one stretch of corpus."""
    return np.array_split(np.arange(n), num_shards)


def stratified_shards(
    n: int, labels: np.ndarray, num_shards: int, *, seed: int, **_: object
) -> list[np.ndarray]:
    """Deal every class round-robin, continuing where the previous class stopped.

    Dealing one global sequence (class after class) keeps both shard sizes and each shard's
    per-class counts within ±1 of the even share.
    """
    dealt = np.concatenate(_by_class(labels, np.random.default_rng(seed)))
    return [dealt[s::num_shards] for s in range(num_shards)]


def dirichlet_shards(
    n: int, labels: np.ndarray, num_shards: int, *, seed: int, alpha: float = 0.5, **_: object
) -> list[np.ndarray]:
    """Per class, shard proportions ~ Dirichlet(alpha); small alpha means strong label skew."""
    rng = np.random.default_rng(seed)
    shards: list[list[np.ndarray]] = [[] for _ in range(num_shards)]
    for idx in _by_class(labels, rng):
        proportions = rng.dirichlet(np.full(num_shards, alpha))
        cuts = (np.cumsum(proportions)[:-1] * len(idx)).astype(np.int64)
        for s, part in enumerate(np.split(idx, cuts)):
            shards[s].append(part)
    out = [np.concatenate(parts) for parts in shards]
    # Tiny alpha can leave a shard empty; moving single samples from the largest shard
    # distorts the drawn skew less than redrawing until every shard is lucky.
    for s in range(num_shards):
        if len(out[s]) == 0:
            donor = int(np.argmax([len(o) for o in out]))
            out[s], out[donor] = out[donor][-1:], out[donor][:-1]
    return out


def label_skew_shards(
    n: int, labels: np.ndarray, num_shards: int, *, seed: int, classes_per_shard: int = 2, **_: object
) -> list[np.ndarray]:
    """Each shard holds ``classes_per_shard`` classes; a class's samples split evenly among its holders.

    Shard s holds classes s*k, s*k+1, ... (mod C), so all C classes are held once num_shards*k >= C.
    """
    by_class = _by_class(labels, np.random.default_rng(seed))
    num_classes = len(by_class)
    k = min(classes_per_shard, num_classes)
    if num_shards * k < num_classes:
        raise ConfigError(
            f"data.classes_per_shard: {num_shards} shards x {k} classes cover only {num_shards * k} of "
            f"{num_classes} classes, so samples would be dropped; raise data.classes_per_shard to at least "
            f"{-(-num_classes // num_shards)}"
        )
    holders: list[list[int]] = [[] for _ in range(num_classes)]
    for s in range(num_shards):
        for j in range(k):
            holders[(s * k + j) % num_classes].append(s)
    shards: list[list[np.ndarray]] = [[] for _ in range(num_shards)]
    for c, idx in enumerate(by_class):
        for s, part in zip(holders[c], np.array_split(idx, len(holders[c])), strict=True):
            shards[s].append(part)
    return [np.concatenate(parts) for parts in shards]


PARTITIONERS: dict[str, Partitioner] = {
    "contiguous": contiguous_shards,
    "dirichlet": dirichlet_shards,
    "label_skew": label_skew_shards,
    "random": random_shards,
    "stratified": stratified_shards,
}


def partition(
    n: int,
    labels: np.ndarray | None,
    num_shards: int,
    strategy: str,
    *,
    seed: int,
    alpha: float = 0.5,
    classes_per_shard: int = 2,
) -> list[np.ndarray]:
    """One sorted int64 index array per shard; every index in [0, n) lands in exactly one shard."""
    if strategy not in PARTITIONERS:
        raise ConfigError(
            f"data.sharding: unknown strategy {strategy!r}; choose one of: {', '.join(sorted(PARTITIONERS))}"
        )
    if strategy in _NEEDS_LABELS and labels is None:
        raise ConfigError(
            f"data.sharding: {strategy!r} needs a labelled dataset; the text dataset has no labels "
            "— use random or contiguous"
        )
    if num_shards < 1 or num_shards > n:
        raise ConfigError(f"data.sharding: cannot split {n} samples into {num_shards} non-empty shards")
    if labels is not None and len(labels) != n:
        raise ValueError(f"labels has {len(labels)} entries for {n} samples")
    shards = PARTITIONERS[strategy](
        n, labels, num_shards, seed=seed, alpha=alpha, classes_per_shard=classes_per_shard
    )
    if any(len(s) == 0 for s in shards):
        raise ConfigError(
            f"data.sharding: {strategy!r} left a shard empty for {num_shards} shards of {n} samples; "
            "use fewer ranks or another strategy"
        )
    # Sorted shards make the result independent of dealing order; the sampler shuffles.
    return [np.sort(s).astype(np.int64) for s in shards]

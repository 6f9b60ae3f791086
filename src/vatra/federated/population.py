"""A simulated population of owners as arrays: whose rows are whose, with no Python object per client.

:class:`Owners` is a CSR layout: client ``c`` owns ``order[offsets[c]:offsets[c + 1]]`` (sorted row
indices). A million clients over a few million rows cost two int64 arrays; a client's
:class:`~vatra.federated.data.ClientData` is built from its slice only when it is selected.

:func:`owner_shards` computes the synthetic splits (iid, iid with size skew, dirichlet, label_skew)
directly in that layout with numpy — the same rows, client for client, as the list partitioners of
:mod:`vatra.data.partition` give for a seed (``tests/test_federated_scale.py`` checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vatra.config import PartitionConfig
from vatra.data.partition import dirichlet_shards
from vatra.errors import ConfigError


@dataclass(frozen=True)
class Owners:
    """Rows grouped by client, sorted within each client; ``offsets`` has ``clients + 1`` entries."""

    order: np.ndarray  # (rows,) int64
    offsets: np.ndarray  # (clients + 1,) int64

    @property
    def clients(self) -> int:
        return len(self.offsets) - 1

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.offsets)

    def rows(self, client: int) -> np.ndarray:
        return self.order[self.offsets[client] : self.offsets[client + 1]]

    def lists(self) -> list[np.ndarray]:
        """One array per client (a Python object per client: for small runs and files only)."""
        return np.split(self.order, self.offsets[1:-1])

    @classmethod
    def of_owner(cls, owner: np.ndarray, clients: int) -> Owners:
        """From each row's owner (``owner[row]``), rows sorted within each client."""
        order = np.lexsort((np.arange(len(owner)), owner)).astype(np.int64)  # by owner, then row
        offsets = np.zeros(clients + 1, dtype=np.int64)
        np.cumsum(np.bincount(owner, minlength=clients), out=offsets[1:])
        return cls(order, offsets)

    @classmethod
    def of_lists(cls, shards: list[np.ndarray]) -> Owners:
        sizes = np.fromiter((len(s) for s in shards), dtype=np.int64, count=len(shards))
        order = np.concatenate(shards).astype(np.int64) if shards else np.empty(0, np.int64)
        offsets = np.zeros(len(shards) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        return cls(order, offsets)


def held_out_counts(sizes: np.ndarray, fraction: float) -> np.ndarray:
    """Rows each client holds out (as :func:`vatra.federated.data.hold_out` picks them, vectorised)."""
    return np.maximum(np.minimum(np.round(fraction * sizes), sizes - 1), 0).astype(np.int64)


def _by_class(labels: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.permutation(np.flatnonzero(labels == c)) for c in np.unique(labels)]


def _equal_cuts(n: int, parts: int) -> np.ndarray:
    """Part of each of ``n`` positions when cut as ``np.array_split`` cuts (the first ones 1 longer)."""
    base, extra = divmod(n, parts)
    sizes = np.full(parts, base, dtype=np.int64)
    sizes[:extra] += 1
    return np.repeat(np.arange(parts, dtype=np.int64), sizes)


def _random(n: int, clients: int, seed: int) -> np.ndarray:
    perm = np.random.default_rng(seed).permutation(n)
    owner = np.empty(n, dtype=np.int64)
    owner[perm] = _equal_cuts(n, clients)
    return owner


def _size_skew(n: int, clients: int, sigma: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, 1])
    share = rng.lognormal(0.0, sigma, clients)
    sizes = 1 + np.floor(share / share.sum() * (n - clients)).astype(np.int64)  # ≥ 1 each
    sizes[: n - int(sizes.sum())] += 1  # hand out the rounding remainder
    perm = rng.permutation(n)
    owner = np.empty(n, dtype=np.int64)
    owner[perm] = np.repeat(np.arange(clients, dtype=np.int64), sizes)
    return owner


def _label_skew(labels: np.ndarray, clients: int, k: int, seed: int) -> np.ndarray:
    by_class = _by_class(labels, np.random.default_rng(seed))
    num_classes = len(by_class)
    k = min(k, num_classes)
    if clients * k < num_classes:  # the list partitioner's message
        raise ConfigError(
            f"federated.partition.classes_per_client: {clients} clients x {k} classes cover only "
            f"{clients * k} of {num_classes} classes; raise it to at least {-(-num_classes // clients)}"
        )
    held = (np.arange(clients)[:, None] * k + np.arange(k)[None, :]) % num_classes  # (clients, k)
    holder = np.repeat(np.arange(clients, dtype=np.int64), k)[np.argsort(held.ravel(), kind="stable")]
    first = np.searchsorted(np.sort(held.ravel()), np.arange(num_classes))  # class c's holders start
    count = np.bincount(held.ravel(), minlength=num_classes)
    owner = np.empty(len(labels), dtype=np.int64)
    for c, idx in enumerate(by_class):  # one step per class: the holders are sorted by client
        owner[idx] = holder[first[c] + _equal_cuts(len(idx), int(count[c]))]
    return owner


def _dirichlet(labels: np.ndarray, clients: int, alpha: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    owner = np.empty(len(labels), dtype=np.int64)
    dealt: list[np.ndarray] = []  # rows in the list partitioner's concatenation order (per client later)
    for idx in _by_class(labels, rng):
        proportions = rng.dirichlet(np.full(clients, alpha))
        cuts = (np.cumsum(proportions)[:-1] * len(idx)).astype(np.int64)
        owner[idx] = np.searchsorted(cuts, np.arange(len(idx)), side="right")
        dealt.append(idx)
    rows = np.concatenate(dealt)
    sizes = np.bincount(owner, minlength=clients)
    empty = np.flatnonzero(sizes == 0)
    if not len(empty):
        return owner
    # The list partitioner fills each empty client (in id order) with the last row of the then
    # largest client (lowest id on ties). Client i gives at sizes S_i, S_i − 1, ...: the gifts are the
    # (size, −id) pairs in decreasing order, cut where the empties run out.
    level = _gift_level(sizes, len(empty))
    if level < 2:  # gifts would reach clients holding one row: the sequential rule, exactly
        return _owner_of(dirichlet_shards(len(labels), labels, clients, seed=seed, alpha=alpha), len(labels))
    givers = np.flatnonzero(sizes >= level)
    gifts = sizes[givers] - level + 1  # levels S_i .. level, each giver
    giver = np.repeat(givers, gifts)
    at = level + np.arange(len(giver)) - np.repeat(np.cumsum(gifts) - gifts, gifts)  # level .. S_i
    pick = np.lexsort((giver, -at))[: len(empty)]  # larger size first, lower id first
    in_order = rows[np.lexsort((np.arange(len(rows)), owner[rows]))]  # each client's rows, dealt order
    start = np.zeros(clients + 1, dtype=np.int64)
    np.cumsum(sizes, out=start[1:])
    owner[in_order[start[giver[pick]] + at[pick] - 1]] = empty
    return owner


def _gift_level(sizes: np.ndarray, gifts: int) -> int:
    """The lowest size a giver gives at when ``gifts`` rows go, one at a time, from the largest client."""
    counts = np.bincount(sizes)[::-1]  # clients of each size, largest size first
    at_least = np.cumsum(counts)  # clients with size ≥ v, for v from the top
    given = np.cumsum(at_least)  # gifts made once every size ≥ v has given once
    top = len(counts) - 1
    return top - int(np.searchsorted(given, gifts))


def _owner_of(shards: list[np.ndarray], n: int) -> np.ndarray:
    owner = np.full(n, -1, dtype=np.int64)
    for c, rows in enumerate(shards):
        owner[rows] = c
    if (owner < 0).any() or any(len(s) == 0 for s in shards):
        raise ConfigError(
            f"federated.partition: the split left a client empty for {len(shards)} clients of {n} rows; "
            "use fewer clients or another method"
        )
    return owner


def owner_shards(n: int, labels: np.ndarray | None, clients: int, p: PartitionConfig, seed: int) -> Owners:
    """The synthetic split of ``n`` training rows among ``clients``, vectorised."""
    if clients > n:
        raise ConfigError(
            f"federated.clients: cannot split {n} training rows among {clients} clients; lower clients "
            "or raise the data"
        )
    if p.method == "iid":
        owner = _size_skew(n, clients, p.size_skew, seed) if p.size_skew > 0 else _random(n, clients, seed)
    else:
        assert labels is not None, "the caller checks that a label split has labels"
        labels = np.asarray(labels)
        if p.method == "dirichlet":
            owner = _dirichlet(labels, clients, p.alpha, seed)
        else:
            owner = _label_skew(labels, clients, p.classes_per_client, seed)
    owners = Owners.of_owner(owner, clients)
    if (owners.sizes == 0).any():
        raise ConfigError(
            f"federated.partition.method = {p.method!r} left a client empty for {clients} clients of {n} "
            "rows; use fewer clients or another method"
        )
    return owners

"""Each client's data: what one owner holds (:class:`ClientData`), and simulated owners (:class:`Federation`).

A deployed client builds its :class:`ClientData` from its own data source (``vatra fl client
--data``: a file, a folder or an import string, any source of :mod:`vatra.data`) with
:func:`own_data`; nothing about it leaves the process except what the protocol sends.

A simulation holds every owner's rows in one process, split from one dataset by
``federated.partition``: synthetic label splits (iid, dirichlet, label_skew, unequal sizes), natural
owners from a table column (``column``), or an exact partition from a JSON file (``file``). Each
simulated client then holds out ``federated.val_fraction`` of its own rows, as a real one would, and
the dataset's validation split is the server's own held-out data.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from vatra.config import Config, PartitionConfig
from vatra.data import DataContext, Datasets, DatasetSpec, Split, TargetSpec, build_dataset, partition
from vatra.errors import ConfigError
from vatra.federated.population import Owners, held_out_counts, owner_shards

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


@dataclass
class ClientData:
    """One owner's data as its client holds it: the rows it trains on and the rows it holds out.

    ``train`` and ``val`` are map-style datasets (``val`` may be ``train`` itself, with disjoint
    rows); ``train_rows`` and ``val_rows`` index into them.
    """

    train: Any
    train_rows: np.ndarray
    val: Any | None
    val_rows: np.ndarray
    spec: DatasetSpec

    @property
    def num_train(self) -> int:
        return len(self.train_rows)

    @property
    def num_val(self) -> int:
        return len(self.val_rows) if self.val is not None else 0


def spec_to_json(spec: DatasetSpec) -> dict[str, Any]:
    """What a client tells the server about its data at join: shapes and sizes, never rows or names."""
    return {
        "kind": spec.kind,
        "input_shape": list(spec.input_shape),
        "num_classes": spec.num_classes,
        "image_shape": list(spec.image_shape) if spec.image_shape else None,
        "heads": {k: [h.kind, h.size] for k, h in spec.heads.items()},
        "categorical": dict(spec.categorical),
    }


def spec_from_json(raw: Any) -> DatasetSpec:
    """The inverse of :func:`spec_to_json`; ValueError when ``raw`` is not one."""
    if not isinstance(raw, dict):
        raise ValueError("the data spec is not an object")
    try:
        image = raw.get("image_shape")
        return DatasetSpec(
            kind=str(raw["kind"]),  # type: ignore[arg-type]
            input_shape=tuple(int(d) for d in raw["input_shape"]),
            num_classes=int(raw["num_classes"]),
            image_shape=tuple(int(d) for d in image) if image else None,  # type: ignore[arg-type]
            heads={str(k): TargetSpec(str(v[0]), int(v[1])) for k, v in dict(raw.get("heads", {})).items()},  # type: ignore[arg-type]
            categorical={str(k): int(v) for k, v in dict(raw.get("categorical", {})).items()},
        )
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise ValueError(f"malformed data spec: {err}") from None


def _map_style(ds: Any, what: str) -> None:
    if ds is not None and (isinstance(ds, IterableDataset) or not hasattr(ds, "__len__")):
        raise ConfigError(
            f"{what}: federated clients need a map-style dataset (with len and indexing); "
            "a stream or iterable cannot be held out and resampled per round — set data.streaming = false"
        )


def own_data(datasets: Datasets, what: str = "--data") -> ClientData:
    """A deployed client's :class:`ClientData`: all of its training split, all of its validation split."""
    train, val, spec = datasets
    _map_style(train, what)
    _map_style(val, what)
    if len(train) == 0:  # type: ignore[arg-type]
        raise ConfigError(f"{what}: the training split is empty")
    n_val = len(val) if val is not None else 0  # type: ignore[arg-type]
    return ClientData(train, np.arange(len(train)), val, np.arange(n_val), spec)  # type: ignore[arg-type]


def source_config(cfg: Config, source: str, what: str = "--data") -> Config:
    """``cfg`` with its data section pointed at ``source``: an import string, or a file or folder.

    A path keeps the config's ``data.name`` when it reads paths (table, npz, images, delta) and is
    otherwise read by its suffix: a folder with a ``_delta_log`` → delta (its latest version unless
    ``data.version`` says), .csv/.tsv/.parquet/.pq → table, .npz → npz, another folder → images.
    ``what`` names the option the source came from in errors (``--data``, ``--eval-data``).
    """
    data = cfg.data
    as_path = Path(source).expanduser()
    if ":" in source and not as_path.exists() and "://" not in source:
        return cfg.model_copy(update={"data": data.model_copy(update={"name": source})})
    if "://" not in source and not as_path.exists():
        raise ConfigError(f"{what} {source}: no such file or folder (or give an import string 'pkg.mod:fn')")
    name = data.name
    if name not in ("table", "npz", "images", "delta"):
        suffix = as_path.suffix.lower()
        if (as_path / "_delta_log").is_dir():
            name = "delta"
        elif suffix in (".csv", ".tsv", ".parquet", ".pq"):
            name = "table"
        elif suffix == ".npz":
            name = "npz"
        elif as_path.is_dir():
            name = "images"
        else:
            raise ConfigError(
                f"{what} {source}: cannot tell the format; use .csv/.parquet, .npz or an image folder, "
                "or set data.name in the config"
            )
    path = source if "://" in source else str(as_path.resolve())
    updated = data.model_copy(update={"name": name, "path": path})
    return cfg.model_copy(update={"data": updated})


def data_context(cfg: Config, run_dir: Path | None = None, keep: tuple[str, ...] = ()) -> DataContext:
    """Where a party reads its data: one process (no ranks), the run's seed and task."""
    return DataContext(
        seed=cfg.run.seed,
        run_dir=run_dir,
        task=cfg.train.task,
        head_tasks={name: h.task for name, h in cfg.train.multitask.heads.items()},
        keep=keep,
    )


def load_source(cfg: Config, source: str, what: str, run_dir: Path | None = None) -> Datasets:
    """The datasets of ``source`` read with the config's data options (target, features, split...)."""
    local = source_config(cfg, source, what)
    try:
        return build_dataset(local.data, data_context(cfg, run_dir))
    except ConfigError as err:
        raise ConfigError(f"{what} {source}: {err}") from None


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


def read_partition_file(path: str, n: int, clients: int) -> list[np.ndarray]:
    """Per-client row lists from a JSON file: a list of ``clients`` disjoint lists of row indices."""
    key = "federated.partition.file"
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as err:
        raise ConfigError(f"{key}: cannot read {path}: {err.strerror or err}") from None
    except ValueError as err:
        raise ConfigError(f"{key}: {path} is not JSON: {err}") from None
    if not isinstance(raw, list) or not all(
        isinstance(rows, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in rows)
        for rows in raw
    ):
        raise ConfigError(f"{key}: {path} must hold a JSON list of per-client lists of row indices")
    if len(raw) != clients:
        raise ConfigError(
            f"{key}: {path} has {len(raw)} client lists but federated.clients = {clients}; "
            f"set clients = {len(raw)}"
        )
    shards = [np.sort(np.asarray(rows, dtype=np.int64)) for rows in raw]
    for c, rows in enumerate(shards):
        if not len(rows):
            raise ConfigError(f"{key}: client {c}'s list in {path} is empty")
        if rows[0] < 0 or rows[-1] >= n:
            raise ConfigError(
                f"{key}: client {c} names row {int(rows[-1] if rows[-1] >= n else rows[0])}, "
                f"outside the {n} training rows"
            )
    flat = np.concatenate(shards)
    uniq, counts = np.unique(flat, return_counts=True)
    if (counts > 1).any():
        row = int(uniq[counts > 1][0])
        owners = [c for c, rows in enumerate(shards) if row in set(rows.tolist())]
        raise ConfigError(f"{key}: row {row} is in the lists of clients {owners}; each row has one owner")
    return shards


def column_shards(train: Any, column: str, clients: int) -> tuple[Owners, list[str]]:
    """One shard per distinct value of ``column`` (sorted), and those values as strings."""
    values = getattr(train, "columns", {}).get(column)
    if values is None:
        raise ConfigError(
            f"federated.partition.column = {column!r}: needs a table data source (data.name = 'table', "
            "not streaming) with that column"
        )
    names, owner = np.unique(values.astype(str), return_inverse=True)
    if len(names) != clients:
        raise ConfigError(
            f"federated.partition.column: {column!r} has {len(names)} distinct values in the training rows "
            f"but federated.clients = {clients}; set clients = {len(names)}"
        )
    return Owners.of_owner(owner.astype(np.int64), len(names)), [str(v) for v in names]


def client_shards(
    n: int, labels: np.ndarray | None, clients: int, p: PartitionConfig, seed: int
) -> list[np.ndarray]:
    """One sorted index array per client (synthetic splits). ``iid`` with ``size_skew`` > 0 draws
    log-normal sizes. The eager reference of :func:`~vatra.federated.population.owner_shards`, which
    simulations use (the same rows, without a Python object per client)."""
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


def hold_out(rows: np.ndarray, fraction: float, seed: int, client: int) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, held-out rows) of one client: a seeded ``fraction`` of its rows held out, at
    least one left to train."""
    k = min(round(fraction * len(rows)), len(rows) - 1)
    if k <= 0:
        return rows, rows[:0]
    perm = np.random.default_rng([seed, 4, client]).permutation(len(rows))
    return np.sort(rows[perm[k:]]), np.sort(rows[perm[:k]])


@dataclass
class Federation:
    """Every simulated owner's data, split from one dataset (a simulation's whole world).

    Client ``c`` owns training rows ``population.rows(c)`` (seen under the input transform
    ``shift_names[c % len(shift_names)]``), holds out a seeded ``val_fraction`` of them and trains on
    the rest. Nothing per client exists until :meth:`client_data` builds it (when the client is
    selected; dropped after), so memory grows with the clients selected, not those registered.
    ``server_val`` is the dataset's validation split: the server's own held-out data.
    """

    train: Any
    spec: DatasetSpec
    population: Owners
    shift_names: list[str]
    val_fraction: float
    seed: int
    _shifted_train: dict[str, Any]
    server_val: Any | None
    owner_names: list[str] | None = None  # a column's values; None: each client is named by its index

    @property
    def num_clients(self) -> int:
        return self.population.clients

    @property
    def val_sizes(self) -> np.ndarray:
        """Rows each client holds out (0: it only trains)."""
        return held_out_counts(self.population.sizes, self.val_fraction)

    @property
    def sizes(self) -> np.ndarray:
        """Rows each client trains on."""
        return self.population.sizes - self.val_sizes

    @property
    def shards(self) -> list[np.ndarray]:
        return self.population.lists()

    @property
    def shifts(self) -> list[str]:
        return [self.shift_names[c % len(self.shift_names)] for c in range(self.num_clients)]

    @property
    def owners(self) -> list[str]:
        return self.owner_names or [str(c) for c in range(self.num_clients)]

    def client_data(self, client: int) -> ClientData:
        """Client ``client``'s rows, materialised now (a few arrays; the dataset itself is shared)."""
        train = self._shifted_train[self.shift_names[client % len(self.shift_names)]]
        rows, held = hold_out(self.population.rows(client), self.val_fraction, self.seed, client)
        return ClientData(train, rows, train, held, self.spec)

    def partition_json(self) -> str | None:
        """The owners' rows as ``federated.partition.file`` reads them."""
        return json.dumps([s.tolist() for s in self.shards])


def _concat(splits: list[Split]) -> Split:
    assert all(s.y is not None for s in splits)
    return Split(torch.cat([s.x for s in splits]), torch.cat([s.y for s in splits]))  # type: ignore[misc]


def build_federation(cfg: Config) -> Federation:
    """Deterministic for the config: every simulation worker builds the same owners."""
    fed = cfg.federated
    p = fed.partition
    ctx = data_context(cfg, keep=(p.column,) if p.method == "column" else ())
    if p.method == "column" and cfg.data.name not in ("table", "delta"):
        raise ConfigError(
            "federated.partition.method = 'column' reads a table: set data.name = 'table' or 'delta'"
        )
    train: Any
    val: Any
    train, val, spec = build_dataset(cfg.data, ctx)
    _map_style(train, "data")
    _map_style(val, "data")
    n = len(train)
    names: list[str] | None = None
    if p.method == "file":
        population = Owners.of_lists(read_partition_file(p.file, n, fed.clients))
    elif p.method == "column":
        population, names = column_shards(train, p.column, fed.clients)
    else:
        labels = getattr(train, "labels", None)
        if p.method in ("dirichlet", "label_skew") and labels is None:
            raise ConfigError(
                f"federated.partition.method = {p.method!r} splits by label; this dataset has no class "
                "labels — use iid, column or file"
            )
        population = owner_shards(n, labels, fed.clients, p, cfg.run.seed)
    shift_names = p.feature_shift or ["identity"]
    used = sorted(set(shift_names[: fed.clients]))
    if used != ["identity"] and not isinstance(train, Split):
        raise ConfigError("federated.partition.feature_shift: needs an in-memory image dataset (digits, npz)")
    shifted = {s: shift_split(train, spec, s) if s != "identity" else train for s in used}
    server_val = val
    if used != ["identity"] and isinstance(val, Split):
        server_val = _concat([shift_split(val, spec, s) for s in used])
    return Federation(
        train, spec, population, shift_names, fed.val_fraction, cfg.run.seed, shifted, server_val, names
    )

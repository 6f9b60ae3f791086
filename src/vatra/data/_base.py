"""The batch contract and the base classes every data source builds on.

**Batch contract.** A dataset item is ``(inputs, target)``: ``inputs`` is a tensor or a dict of
tensors, ``target`` a tensor or a dict of tensors (one per head of a multitask model). A batch is
the same structure with a leading batch dimension (``torch.utils.data.default_collate`` of items).
The model's ``forward`` takes ``inputs`` (a dict is passed as keyword arguments) and the loss takes
``(output, target)``.

Three kinds of dataset feed the trainer:

* any map-style ``torch.utils.data.Dataset`` (``__len__`` + ``__getitem__``): sharded across ranks
  by ``data.sharding``, sampled by :class:`~vatra.data.ShardSampler`, resumed exactly mid-epoch;
* a :class:`BatchedDataset`, a map-style dataset that can also fetch a whole batch in one indexing
  operation (the built-in in-memory sources): the same, without per-item collation;
* a :class:`StreamDataset` (an ``IterableDataset`` that yields whole batches and knows its share):
  each (rank, loader worker) reads its own part, resumable at the saved position. A plain user
  ``IterableDataset`` is read as it is (it must shard itself) and restarts from its beginning on resume.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeVar

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from vatra.errors import ConfigError

TaskKind = Literal["classification", "multilabel", "regression", "ranking", "lm", "multitask"]
T = TypeVar("T")
Batch = tuple[Any, Any]  # (inputs, target): each a tensor or a dict of tensors


@dataclass(frozen=True)
class TargetSpec:
    """One head of a multitask target: what it predicts and how many outputs it needs."""

    kind: Literal["classification", "multilabel", "regression"]
    size: int  # classes, labels, or regression outputs


@dataclass(frozen=True)
class DatasetSpec:
    """What a model and a loss need to know about the data (built-in models are sized from it).

    ``num_classes`` is the width of the model's output: classes (classification), vocabulary size
    (lm), labels (multilabel) or outputs (regression); 0 when unknown (a user's dataset that does not
    say). Ranking items are lists: ``input_shape`` is one list item's features.
    """

    kind: TaskKind
    input_shape: tuple[int, ...]  # per sample: (features,), (block_size,) for lm; of inputs["x"] for dicts
    num_classes: int
    image_shape: tuple[int, int, int] | None = None  # (C, H, W) when inputs can be viewed as images
    heads: Mapping[str, TargetSpec] = field(default_factory=dict)  # multitask targets by name
    categorical: Mapping[str, int] = field(default_factory=dict)  # inputs["ids"] columns -> cardinality
    feature_names: tuple[str, ...] = ()


def _identity(obj: object) -> object:
    return obj


@dataclass(frozen=True)
class DataContext:
    """Where a data source is built: seed, this rank's place, the run folder for fitted preprocessing,
    and the task the run asks for.

    ``broadcast`` sends rank 0's object to every rank (identity in one process): a source that fits
    something on the data (standardisation statistics) computes it once, on rank 0.
    """

    seed: int = 0
    rank: int = 0
    world_size: int = 1
    run_dir: Path | None = None
    broadcast: Callable[[object], object] = _identity
    task: str = "auto"  # train.task: a source that can serve several tasks (a table) follows it
    head_tasks: Mapping[str, str] = field(default_factory=dict)  # multitask: head name -> its task
    keep: tuple[str, ...] = ()  # table columns kept aside, not as features (federated partition.column)


def preprocess_path(ctx: DataContext) -> Path | None:
    """Where a source saves what it fitted, reused on resume: ``<run_dir>/data/preprocess.json``."""
    return ctx.run_dir / "data" / "preprocess.json" if ctx.run_dir is not None else None


def on_rank0(ctx: DataContext, compute: Callable[[], T]) -> T:
    """``compute()`` on rank 0, sent to every rank with ``ctx.broadcast``; rank 0's failure is raised
    on every rank (none is left waiting). A rank whose broadcast returns nothing (one process playing
    that rank, with no real broadcast) computes for itself."""
    sent: tuple[str, Any] | None = None
    failure: BaseException | None = None
    if ctx.rank == 0:
        try:
            sent = ("ok", compute())
        except Exception as err:
            failure = err
            sent = ("error", str(err) if isinstance(err, ConfigError) else f"{type(err).__name__}: {err}")
    got: Any = ctx.broadcast(sent)
    if failure is not None:
        raise failure
    if got is None:
        return compute()
    kind, value = got
    if kind == "error":
        raise ConfigError(f"{value} (on rank 0)")
    return value


class Datasets(NamedTuple):
    """What a data source returns: train and validation datasets (val may be None) and their spec."""

    train: Dataset[Any]
    val: Dataset[Any] | None
    spec: DatasetSpec


class BatchedDataset(Dataset[Batch]):
    """A map-style dataset that can fetch many items with one indexing operation.

    ``get_batch(idx)`` must equal ``default_collate([self[i] for i in idx])``; the trainer's loader
    calls it once per batch instead of collating items. ``labels`` (one int per item, or None) lets
    label-aware sharding (stratified, dirichlet, label_skew) split the dataset.
    """

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitem__(self, i: int) -> Batch:
        inputs, target = self.get_batch(np.array([i], dtype=np.int64))
        return _first(inputs), _first(target)

    def get_batch(self, idx: np.ndarray) -> Batch:
        raise NotImplementedError

    @property
    def labels(self) -> np.ndarray | None:
        return None


def _first(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: v[0] for k, v in obj.items()}
    return obj[0]


class StreamDataset(IterableDataset[tuple[Any, Any, list[dict[str, Any]]]]):
    """A stream of whole batches, split among readers, resumable at a saved position.

    Call order (the trainer's loader does this): ``configure`` once; optionally ``resume`` with the
    positions the loader saved; then ``iter()`` in each DataLoader worker (or in the trainer's process
    when ``data.workers = 0``). A fresh copy of the dataset is used per worker, so ``__iter__`` must
    read the worker id from ``torch.utils.data.get_worker_info()``.

    There are ``readers = world_size × max(workers, 1)`` readers; reader ``rank × max(workers, 1) + s``
    is logical slot ``s`` of rank ``rank``. Physical loader worker ``p`` serves logical slot
    ``(p + rotate) % max(workers, 1)`` (``rotate`` from ``resume``), so that the DataLoader's
    round-robin continues after a resume exactly where it stopped.

    Each item is a block of one or more consecutive batches of one slot, ``(inputs, target,
    positions)``: the tensors hold the block's batches one after the other (``batch_size`` rows each),
    and ``positions`` has one small dict of plain values per batch, with the keys ``"slot"`` (the
    logical slot), ``"left"`` (batches of this block after this one) and whatever the stream needs
    to continue *after* that batch. A loader worker sends large blocks: each item that crosses to
    the trainer's process costs about a millisecond. The loader keeps the newest position per slot;
    a resumed slot whose block was cut short sends the ``left`` batches first, as one block, so the
    DataLoader's round-robin continues exactly. Training streams are endless (epoch after epoch,
    each epoch visiting each of the reader's rows once; a batch may span an epoch boundary);
    evaluation streams (``endless=False``) visit each of the reader's rows once and stop, the last
    batch possibly short.
    """

    def configure(
        self,
        *,
        rank: int,
        world_size: int,
        workers: int,
        batch_size: int,
        seed: int,
        shuffle: bool,
        endless: bool,
    ) -> None:
        raise NotImplementedError

    def resume(self, positions: Mapping[int, dict[str, Any]], rotate: int) -> None:
        """Continue each logical slot after its saved position; physical worker p serves (p + rotate) % W."""
        raise NotImplementedError

    def rows_per_epoch(self) -> int:
        """Rows this rank's readers visit per epoch (all its slots together)."""
        raise NotImplementedError


def to_device(obj: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """A batch (tensor or dict of tensors, possibly nested in a tuple) on ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, dict):
        return {k: to_device(v, device, non_blocking) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(to_device(v, device, non_blocking) for v in obj)
    return obj

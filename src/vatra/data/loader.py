"""The trainer's batches: a torch DataLoader over this rank's share, resumable exactly, with prefetch.

:func:`train_batches` picks the reader for the dataset kind (see :mod:`vatra.data._base`):

* map-style: a ``ShardSampler`` over this rank's shard decides the order; the DataLoader reads
  ahead from a copy of it, and the sampler itself advances one batch per batch *consumed*, so its
  state (what a checkpoint saves) is exact however far the loader's workers have read;
* a :class:`StreamDataset`: each batch comes with its reader's position; the newest position per
  reader and the next reader the DataLoader will serve are the state;
* any other ``IterableDataset``: read as it is, epoch after epoch; resuming skips the batches of
  the current epoch already consumed (exact for a deterministic iterable).

Repositioning (``load_state_dict``: a resume or a rollback) drops what was read ahead and starts
the DataLoader again at the new position. Only a map-style position can move to another world size
(``take_over``): a stream's reader positions and an iterable's batch count belong to the ranks that
read them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from vatra.data._base import Batch, BatchedDataset, StreamDataset, to_device
from vatra.data.prefetch import Pooled, ReadAhead
from vatra.data.sampler import GlobalBatchSampler, ShardSampler
from vatra.errors import ConfigError

AnySampler = ShardSampler | GlobalBatchSampler


def _keep(batch: Any) -> Any:
    """collate_fn for loaders whose dataset already returns whole batches."""
    return batch


class _BatchView(torch.utils.data.Dataset[Batch]):
    """Indexing with an index array fetches the whole batch (``BatchedDataset.get_batch``)."""

    def __init__(self, dataset: BatchedDataset) -> None:
        self.dataset = dataset

    def __getitem__(self, idx: np.ndarray) -> Batch:
        return self.dataset.get_batch(idx)

    def __len__(self) -> int:
        return len(self.dataset)


class _Endless(Sampler[Any]):
    """The batches of a (look-ahead copy of a) ShardSampler, forever: index arrays or lists."""

    def __init__(self, sampler: AnySampler, as_list: bool) -> None:
        self.sampler = sampler
        self.as_list = as_list

    def __iter__(self) -> Iterator[Any]:
        while True:
            idx = self.sampler.next_batch()
            yield idx.tolist() if self.as_list else idx


class Batches:
    """Endless training batches of one rank, on the trainer's device.

    Call order: ``next()`` any number of times; ``state_dict()`` at a step boundary (what a checkpoint
    saves); ``load_state_dict()`` repositions; ``prefetch(depth)`` reads further ahead (loader workers
    prepare ``depth`` batches each; without workers a background thread keeps ``depth`` ready);
    ``close()`` stops workers and threads. Used from the training thread only.
    """

    kind = "base"

    def __init__(
        self, *, workers: int, prefetch_factor: int, device: torch.device, prefetch: int = 0
    ) -> None:
        self.workers = workers
        self.prefetch_factor = prefetch_factor
        self.device = device
        self.depth = prefetch  # extra read-ahead (data.prefetch, then prefetch()); 0 = the loader's own
        # Without workers on the CPU a DataLoader adds only its per-batch bookkeeping (~50 us here):
        # batches are then read in this process directly, in the same order.
        self.in_process = workers == 0 and device.type == "cpu"
        self._it: Iterator[Any] | None = None

    # subclasses: the raw batch iterator from the current position, and bookkeeping per batch
    def _make_iter(self) -> Iterator[Any]:
        raise NotImplementedError

    def _consume(self, item: Any) -> Batch:
        raise NotImplementedError

    def _stale(self) -> bool:
        return self._it is None

    def position_key(self) -> list[int]:
        """Integers naming the current position (seeds the loader's own generator)."""
        return []

    def loader_options(self) -> dict[str, Any]:
        # An own generator: a DataLoader iterator otherwise draws its workers' base seed from the
        # global RNG, so restarting one (after a resume) would shift dropout's random stream.
        generator = torch.Generator().manual_seed(
            int(np.random.default_rng(self.position_key()).integers(2**62))
        )
        opts: dict[str, Any] = {
            "num_workers": self.workers,
            "pin_memory": self.device.type == "cuda",
            "generator": generator,
        }
        if self.workers:
            opts["prefetch_factor"] = max(self.prefetch_factor, self.depth)
        return opts

    def next(self) -> Batch:
        if self._stale():
            self._restart()
        assert self._it is not None
        batch = self._consume(next(self._it))
        return batch if self.device.type == "cpu" else to_device(batch, self.device)

    def _restart(self) -> None:
        self._stop()
        self._it = self._make_iter()

    def _stop(self) -> None:
        close = getattr(
            self._it, "close", None
        )  # read-ahead threads; a DataLoader's workers stop when dropped
        if close is not None:
            close()
        self._it = None

    def prefetch(self, depth: int) -> None:
        """Read ``depth`` batches ahead from now on (0 = the loader's default); exact order kept."""
        self.depth = depth
        self._stop()

    def close(self) -> None:
        self._stop()

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def shard(self) -> np.ndarray | None:
        """The dataset indices this rank samples from (what ``take_over`` needs of every saved rank),
        or None when the reader has no shard of indices (streams, iterables)."""
        return None

    def take_over(self, old: list[tuple[dict[str, Any], np.ndarray]], rank: int, world_size: int) -> None:
        """Continue as ``rank`` of ``world_size`` from the saved positions of another world size."""
        raise ValueError(
            f"a {self.kind!r} dataset resumes only with the world size that read it (its positions "
            "belong to those ranks' readers)"
        )

    def _check_kind(self, state: dict[str, Any]) -> None:
        if state.get("kind") != self.kind:
            raise ValueError(
                f"the saved data position is for a {state.get('kind')!r} dataset but this run reads a "
                f"{self.kind!r} one; resume with the same data source"
            )


class MapBatches(Batches):
    """A map-style dataset in ``ShardSampler`` order (batched fetch for a :class:`BatchedDataset`)."""

    kind = "map"

    def __init__(self, dataset: Any, sampler: AnySampler, **opts: Any) -> None:
        super().__init__(**opts)
        self.dataset = dataset
        self.sampler = sampler
        self._version = -1

    def _stale(self) -> bool:
        return self._it is None or self._version != self.sampler.version

    def position_key(self) -> list[int]:
        return [self.sampler.seed, self.sampler.epoch, self.sampler.position, len(self.sampler.carry)]

    def _make_iter(self) -> Iterator[Any]:
        self._version = self.sampler.version
        ahead = self.sampler.copy()
        if self.depth and not self.workers:  # healing's prefetch without loader workers: threads
            return Pooled(ahead, self._fetch, self.depth)
        if self.in_process:
            return map(self._fetch, _Endless(ahead, as_list=False))
        if isinstance(self.dataset, BatchedDataset):
            loader: DataLoader[Any] = DataLoader(
                _BatchView(self.dataset),
                sampler=_Endless(ahead, as_list=False),
                batch_size=None,
                collate_fn=_keep,
                **self.loader_options(),
            )
        else:
            loader = DataLoader(
                self.dataset, batch_sampler=_Endless(ahead, as_list=True), **self.loader_options()
            )
        return iter(loader)

    def _fetch(self, idx: np.ndarray) -> Any:
        if isinstance(self.dataset, BatchedDataset):
            return self.dataset.get_batch(idx)
        return torch.utils.data.default_collate([self.dataset[int(i)] for i in idx])

    def _consume(self, item: Any) -> Batch:
        self.sampler.advance()  # the consumed position: what a checkpoint saves
        return _pair(item)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_kind(state)
        self.sampler.load_state_dict({k: v for k, v in state.items() if k != "kind"})

    def shard(self) -> np.ndarray:
        return self.sampler.indices

    def take_over(self, old: list[tuple[dict[str, Any], np.ndarray]], rank: int, world_size: int) -> None:
        for state, _ in old:
            self._check_kind(state)
        self.sampler.take_over(
            [({k: v for k, v in state.items() if k != "kind"}, shard) for state, shard in old],
            rank,
            world_size,
        )


class StreamBatches(Batches):
    """A :class:`StreamDataset`: newest position per reader slot, and the slot served next."""

    kind = "stream"

    def __init__(
        self, stream: StreamDataset, *, rank: int, world_size: int, batch_size: int, seed: int, **opts: Any
    ) -> None:
        super().__init__(**opts)
        self.stream = stream
        self.slots = max(self.workers, 1)
        stream.configure(
            rank=rank,
            world_size=world_size,
            workers=self.workers,
            batch_size=batch_size,
            seed=seed,
            shuffle=True,
            endless=True,
        )
        self.positions: dict[int, dict[str, Any]] = {}
        self.next_slot = 0
        self.seed = seed
        self.batch_size = batch_size
        self._pending: deque[tuple[Any, Any, dict[str, Any]]] = deque()  # the block being used

    def position_key(self) -> list[int]:
        return [self.seed, self.next_slot, *(int(v) for p in self.positions.values() for v in p.values())]

    def _make_iter(self) -> Iterator[Any]:
        self.stream.resume(dict(self.positions), self.next_slot)
        if self.in_process:
            it: Iterator[Any] = iter(self.stream)
        else:
            it = iter(DataLoader(self.stream, batch_size=None, collate_fn=_keep, **self.loader_options()))
        return ReadAhead(it, self.depth) if self.depth and not self.workers else it

    def next(self) -> Batch:
        if self._stale():
            self._restart()
        assert self._it is not None
        while not self._pending:  # a block of one or more batches
            inputs, target, positions = next(self._it)
            self._pending.extend(
                zip(
                    split_rows(inputs, len(positions), self.batch_size),
                    split_rows(target, len(positions), self.batch_size),
                    positions,
                    strict=True,
                )
            )
        inputs, target, position = self._pending.popleft()
        slot = int(position["slot"])
        self.positions[slot] = dict(position)
        # the DataLoader serves the next worker once this slot's block is used up
        self.next_slot = slot if position.get("left", 0) else (slot + 1) % self.slots
        batch = (inputs, target)
        return batch if self.device.type == "cpu" else to_device(batch, self.device)

    def _stop(self) -> None:
        super()._stop()
        self._pending.clear()

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "slots": self.slots,
            "next_slot": self.next_slot,
            "positions": {s: dict(p) for s, p in self.positions.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_kind(state)
        if int(state["slots"]) != self.slots:
            raise ValueError(
                f"the stream was saved with data.workers = {state['slots'] if state['slots'] > 1 else 0} "
                f"but this run has data.workers = {self.workers}; a stream resumes with the same data.workers"
            )
        self.positions = {int(s): dict(p) for s, p in state["positions"].items()}
        self.next_slot = int(state["next_slot"])
        self._stop()


class IterBatches(Batches):
    """Any other ``IterableDataset``, batched by the DataLoader, epoch after epoch."""

    kind = "iterable"

    def __init__(self, dataset: IterableDataset[Any], batch_size: int, **opts: Any) -> None:
        super().__init__(**opts)
        self.dataset = dataset
        self.batch_size = batch_size
        self.epoch = 0
        self.batch = 0  # batches of this epoch consumed

    def position_key(self) -> list[int]:
        return [self.epoch, self.batch]

    def _epoch_iter(self) -> Iterator[Any]:
        loader: DataLoader[Any] = DataLoader(
            self.dataset, batch_size=self.batch_size, drop_last=True, **self.loader_options()
        )
        return iter(loader)

    def _make_iter(self) -> Iterator[Any]:
        def epochs() -> Iterator[Any]:
            skip = self.batch
            while True:
                got = False
                for i, item in enumerate(self._epoch_iter()):
                    got = True
                    if i >= skip:
                        yield item
                skip = 0
                if not got:
                    raise ConfigError(
                        f"the training dataset yielded no full batch of {self.batch_size}; "
                        "give it more items or lower train.batch_size"
                    )
                yield _EPOCH_END

        return ReadAhead(epochs(), self.depth) if self.depth and not self.workers else epochs()

    def next(self) -> Batch:
        if self._stale():
            self._restart()
        assert self._it is not None
        item = next(self._it)
        if item is _EPOCH_END:
            self.epoch, self.batch = self.epoch + 1, 0
            item = next(self._it)
        self.batch += 1
        return to_device(_pair(item), self.device)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_kind(state)
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])
        self._stop()


_EPOCH_END = object()


def split_rows(obj: Any, parts: int, rows: int) -> list[Any]:
    """A block's tensor (or dict of tensors) as ``parts`` consecutive batches of ``rows`` rows (the
    last may be shorter): views, no copy."""
    if parts == 1:
        return [obj]
    if isinstance(obj, dict):
        pieces = {k: split_rows(v, parts, rows) for k, v in obj.items()}
        return [{k: pieces[k][i] for k in obj} for i in range(parts)]
    return list(obj.split(rows))


def _pair(item: Any) -> Batch:
    if not isinstance(item, tuple | list) or len(item) != 2:
        raise ConfigError(
            f"a batch is a {type(item).__name__}; a dataset item must be (inputs, target), "
            "each a tensor or a dict of tensors"
        )
    return item[0], item[1]


def eval_batches(
    dataset: Any, *, rank: int, world_size: int, batch_size: int, workers: int, device: torch.device
) -> Iterator[Batch]:
    """One pass over this rank's share of an evaluation dataset: a strided share of a map-style one,
    the rank's readers of a stream, an iterable as it is (it must shard itself across ranks).

    The loaders have their own generators, so evaluating does not advance the global RNG.
    """
    if isinstance(dataset, StreamDataset):
        dataset.configure(
            rank=rank,
            world_size=world_size,
            workers=workers,
            batch_size=batch_size,
            seed=0,
            shuffle=False,
            endless=False,
        )
        dataset.resume({}, 0)
        loader: DataLoader[Any] = DataLoader(
            dataset, batch_size=None, collate_fn=_keep, num_workers=workers, generator=torch.Generator()
        )
        for inputs, target, positions in loader:
            for batch in zip(
                split_rows(inputs, len(positions), batch_size),
                split_rows(target, len(positions), batch_size),
                strict=True,
            ):
                yield to_device(batch, device)
        return
    if isinstance(dataset, IterableDataset):
        for item in DataLoader(
            dataset, batch_size=batch_size, num_workers=workers, generator=torch.Generator()
        ):
            yield to_device(_pair(item), device)
        return
    idx = np.arange(rank, len(dataset), world_size)
    chunks = [idx[s : s + batch_size] for s in range(0, len(idx), batch_size)]
    if isinstance(dataset, BatchedDataset):
        for chunk in chunks:
            yield to_device(dataset.get_batch(chunk), device)
        return
    batch_sampler = [c.tolist() for c in chunks]
    for item in DataLoader(
        dataset, batch_sampler=batch_sampler, num_workers=workers, generator=torch.Generator()
    ):
        yield to_device(_pair(item), device)

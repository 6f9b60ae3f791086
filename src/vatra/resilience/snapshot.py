"""What a full checkpoint holds, and how it is taken from and put back into a ``Trainer``.

One version is a folder of files:

* ``.metadata``, ``__<rank>_0.distcp`` — model and optimizer through ``torch.distributed.checkpoint``
  (DCP). Replicated (DDP) tensors are written once across ranks; sharded state would work the same.
* ``rank<r>.pt`` — what differs per rank: RNG states (python, numpy, torch CPU, CUDA), the data
  position (sampler, or stream readers); plus LR scheduler, grad scaler and ``TrainState`` counters
  (identical on every rank, kept per rank so each rank reads only its own small file).
"""

from __future__ import annotations

import contextlib
import io
import random
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from vatra.errors import ConfigError

if TYPE_CHECKING:
    from vatra.engine import Trainer

StateDict = dict[str, Any]


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def rng_state() -> StateDict:
    """Every RNG a training step may draw from, as tensors and plain values (weights_only-loadable)."""
    version, mt, gauss = random.getstate()
    kind, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: StateDict = {
        "python": [version, list(mt), gauss],
        "numpy": [kind, torch.from_numpy(np.asarray(key, dtype=np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: StateDict) -> None:
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    kind, key, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, key.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rank_state(trainer: Trainer) -> bytes:
    """This rank's own state, serialized: RNG, data position, scheduler, scaler, counters, and what plugins
    registered in ``trainer.state.rank_states`` (the comm plugin's error-feedback residuals)."""
    st = trainer.state
    blob = {
        "rng": rng_state(),
        "data": trainer.batches.state_dict(),
        "scheduler": trainer.scheduler.state_dict(),
        "scaler": trainer.scaler.state_dict(),
        "train_state": {"step": st.step, "samples_seen": st.samples_seen, "train_time_s": st.train_time_s},
        "world_size": trainer.dist.world_size,
        "plugins": {name: obj.state_dict() for name, obj in st.rank_states.items()},
    }
    buf = io.BytesIO()
    torch.save(blob, buf)
    return buf.getvalue()


def load_rank_state(trainer: Trainer, data: bytes) -> None:
    blob = torch.load(io.BytesIO(data), weights_only=True)
    set_rng_state(blob["rng"])
    try:
        trainer.batches.load_state_dict(blob["data"])
    except ValueError as err:
        raise ConfigError(f"checkpoint does not fit this run: {err}") from None
    trainer.scheduler.load_state_dict(blob["scheduler"])
    if blob["scaler"]:
        trainer.scaler.load_state_dict(blob["scaler"])
    saved = blob.get("plugins", {})  # absent in checkpoints written before plugins could add state
    for name, obj in trainer.state.rank_states.items():
        if name in saved:
            obj.load_state_dict(saved[name])
    ts = blob["train_state"]
    trainer.state.step = int(ts["step"])
    trainer.state.samples_seen = int(ts["samples_seen"])
    trainer.state.train_time_s = float(ts["train_time_s"])


def model_optim_state(trainer: Trainer) -> StateDict:
    """Model (with a loss's learned parameters) and optimizer state keyed by parameter names (FQNs),
    views of the live tensors."""
    msd, osd = get_state_dict(trainer.trainable, trainer.optimizer)
    return {"model": msd, "optim": osd}


def host_copy(obj: Any, into: Any = None) -> Any:
    """A copy in host memory that later training steps cannot change (the async save's only blocking work).

    ``into``: the previous copy of the same structure, whose buffers are reused (no allocation,
    no page faults) — only safe once the save that used it has finished.
    """
    if isinstance(obj, torch.Tensor):
        if isinstance(into, torch.Tensor) and into.shape == obj.shape and into.dtype == obj.dtype:
            return into.copy_(obj.detach())
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        old = into if isinstance(into, dict) else {}
        return {k: host_copy(v, old.get(k)) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        old_seq = into if isinstance(into, list | tuple) and len(into) == len(obj) else [None] * len(obj)
        return type(obj)(host_copy(v, o) for v, o in zip(obj, old_seq, strict=True))
    return obj


@contextlib.contextmanager
def _single_process_ok() -> Iterator[None]:
    """DCP warns when it runs without a process group; for a one-process run that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch.distributed is disabled, unavailable or uninit")
        yield


def dcp_save(state: StateDict, folder: Path, group: dist.ProcessGroup | None) -> None:
    """Collective over ``group`` (every rank calls it): each rank writes its share of ``state``."""
    writer = dcp.FileSystemWriter(str(folder), sync_files=True)
    with _single_process_ok():
        dcp.save(state, storage_writer=writer, process_group=group, no_dist=group is None)


def dcp_load(trainer: Trainer, folder: Path, group: dist.ProcessGroup | None) -> None:
    """Collective: read model and optimizer state from ``folder`` into the live trainer."""
    state = model_optim_state(trainer)
    reader = dcp.FileSystemReader(str(folder))
    with _single_process_ok():
        dcp.load(state, storage_reader=reader, process_group=group, no_dist=group is None)
    set_state_dict(
        trainer.trainable, trainer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )

"""What a full checkpoint holds, and how it is taken from and put back into a ``Trainer``.

One version is a folder of files:

* ``.metadata``, ``__<rank>_0.distcp`` — model and optimizer through ``torch.distributed.checkpoint``
  (DCP). Replicated (DDP) tensors are written once across ranks; sharded state would work the same.
* ``rank<r>.pt`` — what differs per rank: RNG states (python, numpy, torch CPU, CUDA), the data
  position (sampler, or stream readers); plus LR scheduler, grad scaler and ``TrainState`` counters
  (identical on every rank, kept per rank so each rank reads only its own small file).
* ``shard<r>.npy`` — map-style data: the dataset indices of rank r's shard. Unchanged from save to
  save, so stored once (content addresses); read only when the world size changes, to hand the
  interrupted epoch's remaining samples to the new ranks (:meth:`ShardSampler.take_over`).

Each rank writes and uploads its own files; on resume each reads only what its load needs.
"""

from __future__ import annotations

import contextlib
import copy
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
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from vatra.engine.trainer import seed_everything
from vatra.errors import ConfigError

if TYPE_CHECKING:
    from vatra.engine import DistContext, Trainer

StateDict = dict[str, Any]
DCP_METADATA = ".metadata"  # DCP's index of every item: which file, offset and length holds it


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def shard_file(rank: int) -> str:
    return f"shard{rank:05d}.npy"


def rank_files(trainer: Trainer) -> dict[str, bytes]:
    """This rank's own small files of a version: its state and (map-style data) its shard's indices."""
    rank = trainer.dist.rank
    files = {rank_file(rank): rank_state(trainer)}
    shard = trainer.batches.shard()
    # one copy per data share: tensor-parallel and pipeline peers hold the same indices, and two ranks
    # writing one content-addressed object at once would mix its erasure-coded pieces
    if shard is not None and _share_writer(trainer, rank):
        buf = io.BytesIO()
        np.save(buf, np.asarray(shard, dtype=np.int64), allow_pickle=False)
        files[shard_file(rank)] = buf.getvalue()
    return files


def _place_now(trainer: Trainer, rank: int) -> int:
    """The data share global ``rank`` reads under this run's layout."""
    return trainer.parallel.mesh.cfg.data_rank(rank) if trainer.parallel is not None else rank


def _share_writer(trainer: Trainer, rank: int) -> bool:
    """Whether ``rank`` is the lowest rank reading its data share (the one that saves the shard)."""
    mine = _place_now(trainer, rank)
    return all(_place_now(trainer, r) != mine for r in range(rank))


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
        # which share of the data it read: under tp or pp several ranks read the same one
        "data_rank": trainer.data_rank,
        "data_world": trainer.data_world,
        "plugins": {name: obj.state_dict() for name, obj in st.rank_states.items()},
    }
    buf = io.BytesIO()
    torch.save(blob, buf)
    return buf.getvalue()


def _read(data: bytes) -> StateDict:
    return dict(torch.load(io.BytesIO(data), weights_only=True))


def _data_place(blob: StateDict, rank: int) -> tuple[int, int]:
    """(data rank, data world) a rank file was saved at; files from before parallel layouts: its rank."""
    if "data_rank" not in blob:
        return rank, int(blob["world_size"])
    return int(blob["data_rank"]), int(blob["data_world"])


def load_rank_state(trainer: Trainer, data: bytes) -> None:
    """Same world size: this rank's own state, exactly as saved. Its data position must be the one
    this rank reads now: another parallel layout can place the same rank at another data share."""
    blob = _read(data)
    saved, mine = _data_place(blob, trainer.dist.rank), (trainer.data_rank, trainer.data_world)
    if saved != mine:
        raise ConfigError(
            f"checkpoint does not fit this run: rank {trainer.dist.rank} saved the data position of "
            f"data-parallel rank {saved[0]} of {saved[1]} but reads share {mine[0]} of {mine[1]} under "
            f"this layout; resume with the layout it was saved with (a run without a parallel layout "
            f"reads only its own rank file, so its data positions do not map), or set "
            f"checkpoint.resume=false"
        )
    set_rng_state(blob["rng"])
    try:
        trainer.batches.load_state_dict(blob["data"])
    except ValueError as err:
        raise ConfigError(f"checkpoint does not fit this run: {err}") from None
    saved = blob.get("plugins", {})  # absent in checkpoints written before plugins could add state
    for name, obj in trainer.state.rank_states.items():
        if name in saved:
            obj.load_state_dict(saved[name])
    _load_shared(trainer, blob)


def rank_names(manifest: dict[str, Any], ctx: DistContext, parallel: bool = False) -> list[str]:
    """The rank files this rank reads of a version: its own, or after a world-size change, or under
    a parallel layout (which may place this rank at another data share than the saved one), every
    saved rank's state and shard."""
    saved = int(manifest["world_size"])
    if saved == ctx.world_size and not parallel:
        return [rank_file(ctx.rank)]
    names = [rank_file(r) for r in range(saved)]
    return names + [n for r in range(saved) if (n := shard_file(r)) in manifest["files"]]


def load_rank_files(trainer: Trainer, manifest: dict[str, Any], folder: Path) -> list[str]:
    """Put the fetched rank files of ``manifest`` (in ``folder``) into the trainer; returns the
    plugins whose per-rank state was dropped. A world-size change that cannot be resumed (a stream,
    a checkpoint without shard files) is a :class:`ConfigError` naming the world size to use."""
    saved, ctx, version = int(manifest["world_size"]), trainer.dist, manifest["version"]
    files = [folder / rank_file(r) for r in range(saved)]
    if saved == ctx.world_size:
        own = files[ctx.rank].read_bytes()
        others = all(f.exists() for f in files)  # fetched under a parallel layout only
        blobs = [_read(f.read_bytes()) for f in files] if others else []
        if not others or not _moved(trainer, blobs):
            load_rank_state(trainer, own)  # every rank at its saved data share: exact (or refused)
            return []
        # another parallel layout of the same world size (every rank decides alike from every file)
        refuse = f"checkpoint {version} was written under another parallel layout"
        fix = "resume with the layout it was saved with, or set checkpoint.resume=false"
    else:
        blobs = [_read(f.read_bytes()) for f in files]
        refuse = f"checkpoint {version} was written by {saved} rank(s) but this run has {ctx.world_size}"
        fix = f"resume with {saved} ranks in all (e.g. --nproc {saved}) or set checkpoint.resume=false"
    kind = str(blobs[0]["data"].get("kind"))
    if kind != "map":
        raise ConfigError(
            f"{refuse}: a {kind!r} dataset's reader positions belong to the ranks that read them, "
            f"so it resumes only with the same world size; {fix}"
        )
    shards = {r: folder / shard_file(r) for r in _share_firsts(blobs)}
    if not all(p.exists() for p in shards.values()):
        raise ConfigError(f"{refuse}, and it does not record their data shards (an older vatra); {fix}")
    try:
        return take_over_rank_state(trainer, blobs, {r: p.read_bytes() for r, p in shards.items()})
    except ValueError as err:
        raise ConfigError(f"{refuse}: {err}; {fix}") from None


def _moved(trainer: Trainer, blobs: list[StateDict]) -> bool:
    """Whether any saved rank reads another data share under this run's layout than it saved."""
    world = trainer.data_world
    return any(_data_place(blob, r) != (_place_now(trainer, r), world) for r, blob in enumerate(blobs))


def _share_firsts(blobs: list[StateDict]) -> list[int]:
    """The lowest saved rank of each data share, by share (the ranks that saved the shards)."""
    first: dict[int, int] = {}
    for r, blob in enumerate(blobs):
        first.setdefault(_data_place(blob, r)[0], r)
    return [r for _, r in sorted(first.items())]


def take_over_rank_state(trainer: Trainer, saved: list[StateDict], shards: dict[int, bytes]) -> list[str]:
    """Another world size: this rank's state derived from every saved rank's; returns the plugins
    whose per-rank state was dropped.

    * data: the interrupted epoch's remaining samples are split among the new ranks
      (:meth:`ShardSampler.take_over`); a stream or iterable cannot be split (``ConfigError``);
    * RNG: per-rank streams cannot map from one world size to another, so every rank reseeds from
      ``(run.seed, step, rank)`` — deterministic, so two resumes at the same step agree;
    * scheduler, grad scaler and counters: the same on every saved rank, taken from rank 0's;
    * plugins' per-rank state (error-feedback residuals, PowerSGD's factors) belongs to the old
      ranks' gradients: dropped, so the plugins start it afresh, as at step 0.
    """
    # ``shards``: the lowest saved rank of each data share → its indices, in share order (tensor-parallel
    # and pipeline peers read the same share)
    old = [(saved[r]["data"], np.load(io.BytesIO(shard), allow_pickle=False)) for r, shard in shards.items()]
    trainer.batches.take_over(old, trainer.data_rank, trainer.data_world)
    _load_shared(trainer, saved[0])
    # tensor-parallel and pipeline peers draw alike (dropout): seeded by the data share
    seed = np.random.default_rng([trainer.cfg.run.seed, trainer.state.step, trainer.data_rank]).integers(
        2**62
    )
    seed_everything(int(seed))
    kept = set(trainer.state.rank_states)
    return sorted({name for s in saved for name in s.get("plugins", {}) if s["plugins"][name]} & kept)


def _load_shared(trainer: Trainer, blob: StateDict) -> None:
    """What every rank saved alike: the LR schedule, the grad scaler, the step counters."""
    trainer.scheduler.load_state_dict(blob["scheduler"])
    if blob["scaler"]:
        trainer.scaler.load_state_dict(blob["scaler"])
    ts = blob["train_state"]
    trainer.state.step = int(ts["step"])
    trainer.state.samples_seen = int(ts["samples_seen"])
    trainer.state.train_time_s = float(ts["train_time_s"])


def _options(trainer: Trainer) -> StateDictOptions:
    """Under ``parallel`` (fsdp, tp, pp) the optimizer's param groups are flattened into one key per
    parameter: pipeline stages hold different parameters, and DCP would keep only one rank's copy
    of a nested ``param_groups``. Plain DDP runs keep the nested form their checkpoints have."""
    return StateDictOptions(flatten_optimizer_state_dict=getattr(trainer, "parallel", None) is not None)


def model_optim_state(trainer: Trainer) -> StateDict:
    """Model (with a loss's learned parameters) and optimizer state keyed by parameter names (FQNs),
    views of the live tensors."""
    msd, osd = get_state_dict(trainer.trainable, trainer.optimizer, options=_options(trainer))
    return {"model": msd, "optim": osd}


@torch.no_grad()
def copy_state(obj: Any, into: Any = None, *, device: torch.device | str | None = None) -> Any:
    """A copy of a nested state (dicts, lists and tuples of tensors and plain values) that later
    training steps cannot change: the async checkpoint save's host copy (``device="cpu"``; the only
    part of that save the loop waits for), and healing's in-memory snapshots (each tensor's own device).

    ``into``: an earlier copy of the same structure, whose tensors of the same shape and dtype are
    reused (no allocation, no page faults; only safe once nothing reads that copy any more), all
    copied into in one ``torch._foreach_copy_``: separate ``copy_`` calls cost more than the copying
    itself on a small model. Immutable values are shared, other objects deep-copied.
    """
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    out = _copy(obj, into, device, pairs)
    if pairs:
        dst, src = zip(*pairs, strict=True)
        torch._foreach_copy_(list(dst), list(src))
    return out


_PLAIN = (int, float, str, bytes, type(None), torch.dtype, torch.device)  # immutable: shared (bool is an int)


def _copy(obj: Any, into: Any, device: torch.device | str | None, pairs: list[Any]) -> Any:
    # runs under no_grad: a tensor copied into a reused buffer needs no detach
    if isinstance(obj, torch.Tensor):
        if isinstance(into, torch.Tensor) and into.shape == obj.shape and into.dtype == obj.dtype:
            pairs.append((into, obj))
            return into
        return obj.detach().to(obj.device if device is None else device, copy=True)
    if isinstance(obj, dict):
        old = into if isinstance(into, dict) else {}
        return {
            k: v if isinstance(v, _PLAIN) else _copy(v, old.get(k), device, pairs) for k, v in obj.items()
        }
    if isinstance(obj, list | tuple):
        old_seq = into if isinstance(into, list | tuple) and len(into) == len(obj) else [None] * len(obj)
        items = [
            v if isinstance(v, _PLAIN) else _copy(v, o, device, pairs)
            for v, o in zip(obj, old_seq, strict=True)
        ]
        return items if type(obj) is list else type(obj)(items)
    return obj if isinstance(obj, _PLAIN) else copy.deepcopy(obj)


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


def dcp_files(trainer: Trainer, folder: Path) -> list[str]:
    """The DCP data files this rank's load reads, from ``folder``'s ``.metadata`` and the plan DCP
    itself would make (no collective): with replicated (DDP) state every rank reads every item,
    with sharded state only the files holding chunks that overlap its own."""
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    planner = DefaultLoadPlanner()
    planner.set_up_planner(model_optim_state(trainer), metadata, False)
    plan = planner.create_local_plan()
    return sorted({metadata.storage_data[item.storage_index].relative_path for item in plan.items})


def dcp_load(trainer: Trainer, folder: Path, group: dist.ProcessGroup | None) -> None:
    """Collective: read model and optimizer state from ``folder`` into the live trainer (any world
    size: DCP reshards; a failure on any rank raises on every rank)."""
    state = model_optim_state(trainer)
    reader = dcp.FileSystemReader(str(folder))
    with _single_process_ok():
        dcp.load(state, storage_reader=reader, process_group=group, no_dist=group is None)
    set_state_dict(
        trainer.trainable,
        trainer.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=_options(trainer),
    )

"""The federated server's state as versions of the run's checkpoint store (``[store]``).

Each round is one version holding one file, ``server.safetensors`` (the wire format of
:mod:`vatra.federated.wire`), with ``step`` = the round, ``parent`` = the previous round's version
and ``world_size`` = 1, tagged ``latest``: so ``[store]`` (S3 via fsspec, erasure coding, signing)
and ``vatra ckpt`` cover a federated run as they do a training run. A resume reads ``latest``,
falling back down its parents past a version whose object is missing or corrupt (logged as
``checkpoint_corrupt``), as the training loader does (:mod:`vatra.resilience.checkpoint.one_file`).
"""

from __future__ import annotations

from typing import Any

from vatra.config import Config, load_config
from vatra.errors import VatraError
from vatra.resilience.checkpoint.one_file import OneFileVersions
from vatra.resilience.store import Manifest, open_store
from vatra.rundir import RunDir

CHECKPOINT = "server.safetensors"
# the figures a version's manifest carries for ``vatra ckpt list`` (the whole row is in metrics.jsonl)
_LISTED = {"train_loss": "loss", "global_accuracy": "global_accuracy"}


class ServerCheckpoints(OneFileVersions):
    """Writes a version per round and finds the newest intact one on resume."""

    def __init__(self, cfg: Config, run_dir: RunDir) -> None:
        super().__init__(
            open_store(cfg.store, run_dir.checkpoints),
            CHECKPOINT,
            run_dir.log_event,
            keep_last=cfg.checkpoint.keep_last,
            legacy=run_dir.checkpoints / CHECKPOINT,  # where servers before the store wrote their file
            what="server checkpoint",
        )

    def save_round(self, rnd: int, blob: bytes, metrics: dict[str, Any]) -> Manifest:
        """Round ``rnd``'s state as a new version after the previous one; then prune to ``keep_last``."""
        listed = {
            name: float(metrics[key]) for key, name in _LISTED.items() if isinstance(metrics.get(key), float)
        }
        return self.save(rnd, blob, reason="round", metrics=listed)


def server_state(run_dir: RunDir) -> bytes:
    """The newest intact round's ``server.safetensors`` of a finished or stopped federated run, read
    through the store its ``config.toml`` names (decode it with :func:`vatra.federated.wire.decode`)."""
    found = ServerCheckpoints(load_config(run_dir.config), run_dir).newest()
    if found is None:
        raise VatraError(f"{run_dir.path}: no server checkpoint (the run saved no round)")
    return found[1]

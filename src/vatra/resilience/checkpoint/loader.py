"""Loading a version with fallback: the newest intact one from a start version down its parents.

Rank 0 proposes versions in order (the start, its parents, then the others newest first); each rank
fetches and verifies what its own load needs; all agree before anything is loaded, so a version
damaged for one rank is skipped by all. On resume each rank fetches only what its own load reads,
on any world size (:mod:`vatra.resilience.snapshot`).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint.api import CheckpointException

from vatra.errors import ConfigError
from vatra.monitor.rca import event_cause
from vatra.resilience import snapshot
from vatra.resilience.checkpoint.ranks import RankGroups, first_failure
from vatra.resilience.store import CheckpointStore, Manifest, StoreError

if TYPE_CHECKING:
    from vatra.engine import Trainer


class VersionLoader:
    """Finds, fetches and loads the newest intact version; records the damaged ones it passes in
    ``damaged`` (a set shared with the writer, whose gc keeps them aside)."""

    def __init__(self, store: CheckpointStore, ranks: RankGroups, damaged: set[str]) -> None:
        self.store = store
        self.ranks = ranks
        self.damaged = damaged

    def load(self, trainer: Trainer, start: str, dest: Path) -> Manifest | None:
        """Collective: the newest intact version from ``start`` on, into the trainer, fetched under
        ``dest`` (removed afterwards); None when none is intact."""
        proposals = self._candidates(trainer, start) if trainer.dist.is_main else None
        manifest: Manifest | None = None
        problem: str | None = None
        # Planning a load (snapshot.dcp_files) makes DCP initialise an empty optimizer state with a
        # zero-gradient step (Adam's step count becomes 1): undone when nothing gets loaded, so a
        # run that finds no intact version starts exactly as a fresh one.
        fresh = not trainer.optimizer.state

        def propose() -> Manifest | None:  # rank 0, inside an agreement: its errors reach every rank
            assert proposals is not None
            if manifest is not None and problem is not None:
                self.damaged.add(manifest["version"])
                version = manifest["version"]
                trainer.log_event("checkpoint_corrupt", version=version, problem=problem,
                                  action="fall back to parent", cause=_cause(version, problem))  # fmt: skip
            return next(proposals, None)

        while True:
            manifest = self.ranks.on_main(propose)
            if manifest is None:
                if fresh:
                    trainer.optimizer.state.clear()
                return None
            shutil.rmtree(dest, ignore_errors=True)
            found = self.ranks.agree(self._fetch(trainer, manifest, dest))
            if found is None:
                break
            damaged, problem = found
            if not damaged:
                raise ConfigError(f"checkpoint {manifest['version']} does not fit this run: {problem}")
        try:
            self._apply(trainer, manifest, dest)
        finally:
            shutil.rmtree(dest, ignore_errors=True)
        return manifest

    def _candidates(self, trainer: Trainer, start: str) -> Iterator[Manifest]:
        """Rank 0: :func:`fallback_candidates` from ``start``."""
        return fallback_candidates(self.store, start, trainer.log_event)

    def _fetch(self, trainer: Trainer, manifest: Manifest, dest: Path) -> tuple[bool, str] | None:
        """This rank's files of ``manifest`` under ``dest``, checksums verified; else (damaged, why):
        a missing or corrupt file (fall back to an older version) or a version this model cannot
        load (stop).

        The DCP metadata first, then the data files this rank's load plan reads, then its own
        rank file — or, after a world-size change, every old rank's rank and shard files.
        """
        try:
            self.store.fetch(manifest, [snapshot.DCP_METADATA], dest)
            names = snapshot.dcp_files(trainer, dest) + snapshot.rank_names(
                manifest, trainer.dist, trainer.parallel is not None
            )
            self.store.fetch(manifest, names, dest)
        except StoreError as err:
            return True, str(err)
        except Exception as err:  # DCP's planner: keys or shapes this model does not have
            return False, f"{type(err).__name__}: {err}"
        return None

    def _apply(self, trainer: Trainer, manifest: Manifest, folder: Path) -> None:
        """Collective: load the fetched version; a load that does not fit stops every rank alike."""
        ctx, version = trainer.dist, manifest["version"]
        saved = int(manifest["world_size"])
        try:
            snapshot.dcp_load(trainer, folder, self.ranks.data)
        except CheckpointException as err:  # raised on every rank: DCP gathers the failures
            raise ConfigError(f"checkpoint {version} does not fit this model: {first_failure(err)}") from None
        problem: str | None = None
        dropped: list[str] = []
        try:
            dropped = snapshot.load_rank_files(trainer, manifest, folder)
        except ConfigError as err:
            problem = str(err)
        problem = self.ranks.agree(problem)
        if problem is not None:
            raise ConfigError(problem)
        if saved != ctx.world_size:
            self.ranks.on_main(lambda: trainer.log_event(
                "resharded", version=version, from_world_size=saved, to_world_size=ctx.world_size,
                dropped=dropped,
            ))  # fmt: skip


def fallback_candidates(
    store: CheckpointStore, start: str, log_event: Callable[..., None]
) -> Iterator[Manifest]:
    """Readable manifests from ``start`` down its parents, then the rest newest first; an
    unreadable one is logged as ``checkpoint_corrupt`` and passed over. The order every resume
    tries versions in (training ranks and the federated server alike)."""
    by_id = {m["version"]: m for m in store.versions()}
    try:
        ref: str | None = store.resolve(start)
    except StoreError as err:  # with versions present: a damaged or deleted tag
        if by_id:
            log_event("checkpoint_corrupt", version=start, problem=str(err), action="try older versions",
                      cause=_cause(start, str(err)))  # fmt: skip
        ref = None
    chain: list[str] = []
    while ref is not None and ref not in chain:
        chain.append(ref)
        ref = by_id.get(ref, {}).get("parent")
    chain += [v for v in reversed(list(by_id)) if v not in chain]
    for version in chain:
        if version in by_id:
            yield by_id[version]
            continue
        try:
            yield store.manifest(version)
        except StoreError as err:
            log_event("checkpoint_corrupt", version=version, problem=str(err), action="fall back to parent",
                      cause=_cause(version, str(err)))  # fmt: skip


def _cause(version: str, problem: str) -> dict[str, Any]:
    """The ``cause`` of a ``checkpoint_corrupt`` event (:mod:`vatra.monitor.rca`)."""
    fields = {"version": version, "problem": problem}
    return event_cause(
        "checkpoint_corrupt", fields, f"passed over {version}: resuming from an older intact version"
    )

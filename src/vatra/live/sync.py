"""One replica group's side of live recovery: a torchft ``Manager`` around vatra's step.

Call order per optimizer step (:class:`LiveSteps`, the trainer's micro-steps strategy):

1. ``start_quorum``: ask the lighthouse who takes part in this step. A group that is behind (a
   restarted one) receives a live peer's state here, over torchft's HTTP checkpoint transport, and
   loads it with :meth:`LiveSync.load_state` before it computes anything.
2. seek this group's sampler to the step (see below), then forward and backward as usual;
3. average every gradient over the participating groups (``Manager.allreduce``, one per fused bucket
   of ``comm.bucket_mb``: :func:`average_gradients`);
4. ``should_commit``: every group agrees whether the step's collectives all succeeded. If not (a peer
   died mid-step) the gradients are dropped and the same step is tried again with the new quorum, so
   vatra's step counter is always torchft's count of committed steps.

Data rule: group ``g`` of ``G`` reads shard ``g`` of ``G`` fixed shards, and at step ``s`` it reads that
shard's batches ``s·accum … (s+1)·accum − 1``, whoever else takes part. A retried step rereads the same
batches; the steps a dead group misses are skipped for its shard (counted as ``samples_skipped``).
"""

from __future__ import annotations

import hashlib
import statistics
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from vatra.comm.batching import fuse_groups
from vatra.config import ResilienceConfig
from vatra.data import ShardSampler
from vatra.engine import Plugin
from vatra.engine.steps import StepWork, micro_steps
from vatra.errors import VatraError
from vatra.resilience.recovery import ProgressFile, read_progress

if TYPE_CHECKING:
    from torch import nn

    from vatra.engine.trainer import Trainer


MAX_TRIES = 1000  # tries of one step before the group gives up (at least 100 s of quorum ticks)


class LiveFailure(VatraError):
    """One step cannot commit: every try's collectives fail."""


class LiveSync(Plugin):
    """This process's torchft ``Manager`` (one replica group of one process) and what it records."""

    def __init__(
        self, cfg: ResilienceConfig, *, group: int, groups: int, lighthouse: str, attempt: int
    ) -> None:
        self.cfg, self.group, self.groups, self.lighthouse = cfg, group, groups, lighthouse
        self.attempt = attempt
        self.manager: Any = None
        self.store: Any = None
        self.trainer: Trainer | None = None
        self.participants = 0
        self.quorum_id = -1  # torchft's id of the latest quorum: a new one when its members change
        self.retries = 0  # steps tried again after a failed commit (this process)
        self.samples_skipped = 0  # samples of this group's shard never read (steps it missed)
        self.step_times: list[float] = []
        self.stall_from: float | None = None  # start of a failed attempt: the stall runs until a commit
        self.stall_cause = ""
        self.started = time.time()
        self.progress: ProgressFile | None = None
        self.last_step = 0  # the last step this group committed before a restart
        self.attempt_start = 0.0  # perf_counter at the start of the current try of a step
        self.previous = 0  # groups in the quorum before the latest change
        self.committed = False  # whether this process has committed a step
        self.stall_s = 0.0  # the current step's stall, for its metrics line

    # ------------------------------------------------------------ lifecycle
    def micro_steps(self, trainer: Trainer) -> LiveSteps:
        return LiveSteps(self)

    def on_fit_start(self, trainer: Trainer) -> None:
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo

        self.trainer = trainer
        timeout = timedelta(seconds=self.cfg.live_timeout_s)
        # torchft's Manager joins its replica group's own store: this group is one process, so it hosts it
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=self.load_state,
            state_dict=self.state,
            min_replica_size=self.cfg.live_min_replicas,
            use_async_quorum=False,  # heal before the step computes, so every step is a whole one
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            rank=0,
            world_size=1,
            store_addr="127.0.0.1",
            store_port=self.store.port,
            lighthouse_addr=self.lighthouse,
            replica_id=f"vatra_group{self.group}",
        )
        # a group that resumed from vatra's checkpoint starts at that step, not at 0
        self.manager.load_state_dict({"step": trainer.state.step, "batches_committed": 0})
        if self.attempt == 0:
            # The run's first step waits for every group, so a run repeats exactly however fast each
            # process starts; after it, live_min_replicas. (torchft reads its minimum per commit.)
            self.manager._min_replica_size = self.groups
        if trainer.run_dir is None:
            return
        # where this group's previous process died: the steps it misses count from there
        last = read_progress(trainer.run_dir.path, self.group) if self.attempt else None
        self.last_step = int(last["step"]) if last else trainer.state.step
        if trainer.state.checkpointer is None:  # the checkpoint plugin keeps the progress file itself
            self.progress = ProgressFile(trainer.run_dir.path, self.group, self.attempt)

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        metrics["replicas"] = self.participants
        if self.stall_s:  # waiting for the quorum to change is not training: ETTR counts it apart
            metrics["live_stall_s"] = self.stall_s
            metrics["step_time_s"] = max(0.0, float(metrics["step_time_s"]) - self.stall_s)
            self.stall_s = 0.0
        if self.progress is not None:
            self.progress.update(trainer.state.step)

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        summary.update(
            live_group=self.group,
            live_groups=self.groups,
            live_retries=self.retries,
            samples_skipped=self.samples_skipped,
        )
        trainer.log_event(
            "live_done", group=self.group, weights_sha256=weights_digest(trainer.model), retries=self.retries
        )
        self._close()

    def on_failure(self, trainer: Trainer, exc: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None

    # ------------------------------------------------------------ state a healing peer receives
    def state(self) -> dict[str, Any]:
        """What a restarted group needs to continue from this one's step (read on torchft's thread
        while this group waits in its quorum: the step is between updates)."""
        t = self._trainer()
        return {
            "model": t.model.state_dict(),
            "optimizer": t.optimizer.state_dict(),
            "scheduler": t.scheduler.state_dict(),
            "scaler": t.scaler.state_dict(),
            "step": t.state.step,
            "train_time_s": t.state.train_time_s,
            "samples_seen": t.state.samples_seen,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        t = self._trainer()
        before = max(t.state.step, self.last_step)
        t.model.load_state_dict(state["model"])
        t.optimizer.load_state_dict(state["optimizer"])
        t.scheduler.load_state_dict(state["scheduler"])
        t.scaler.load_state_dict(state["scaler"])
        t.state.step = int(state["step"])
        t.state.samples_seen = int(state["samples_seen"])
        missed = max(0, t.state.step - before)
        self.samples_skipped += missed * t.cfg.train.batch_size * t.cfg.train.grad_accum
        if self.attempt == 0:  # the groups' first quorum makes them agree: no recovery
            return
        print(f"vatra: group {self.group} healed from a live peer at step {t.state.step}", flush=True)
        t.log_event(
            "recovered",
            group=self.group,
            source="live peer",
            from_step=before,
            steps_lost=0,
            steps_skipped=missed,
            samples_skipped=missed * t.cfg.train.batch_size * t.cfg.train.grad_accum,
            seconds=round(time.time() - self.started, 3),  # from this process's start to healed
        )

    def _trainer(self) -> Trainer:
        assert self.trainer is not None, "LiveSync is used before on_fit_start"
        return self.trainer

    # ------------------------------------------------------------ the quorum's view of a step
    def begin(self) -> None:
        """Start this step's quorum (heals a group that is behind) and note a change of members."""
        t = self._trainer()
        self.manager.start_quorum()
        now = self.manager.num_participants()
        # torchft's quorum id changes with the members: a peer that died and came back between two of
        # this group's quorums (while it saved a checkpoint, say) leaves the count as it was
        quorum = self.manager._quorum_id
        if self.committed and (now != self.participants or quorum != self.quorum_id):  # else start-up
            more = "peer_joined" if now > self.participants else "peer_replaced"
            self.stall_cause = self.stall_cause or ("peer_lost" if now < self.participants else more)
            self.stall_from = self.stall_from or self.attempt_start
        self.previous, self.participants, self.quorum_id = self.participants, now, quorum
        seek(t)

    def end(self, committed: bool, step_time: float) -> None:
        """After ``should_commit``: log the survivors' stall once a step commits again (the wait
        for every group before the run's first step is start-up, not a stall)."""
        if not committed and not self.committed:
            return
        if not committed:
            self.retries += 1
            self.stall_from = self.stall_from or self.attempt_start
            self.stall_cause = self.stall_cause or "peer_lost"
            return
        self.manager._min_replica_size = self.cfg.live_min_replicas
        self.committed = True
        if self.stall_from is not None:
            usual = statistics.median(self.step_times) if self.step_times else 0.0
            stall = max(0.0, time.perf_counter() - self.stall_from - usual)
            self._trainer().log_event(
                "quorum_changed",
                group=self.group,
                cause=self.stall_cause,
                replicas=self.participants,
                previous=self.previous,
                stall_s=round(stall, 3),
            )
            self.stall_from, self.stall_cause, self.stall_s = None, "", stall
        else:
            self.step_times = [*self.step_times[-49:], step_time]


class LiveSteps:
    """The step as torchft wants it (see the module): quorum, compute, average, commit or retry."""

    def __init__(self, sync: LiveSync) -> None:
        self.sync = sync

    def forward_module(self, trainer: Trainer) -> nn.Module:
        return trainer.module

    def run(self, trainer: Trainer, accum: int) -> StepWork:
        sync, tries = self.sync, 0
        while True:
            sync.attempt_start = time.perf_counter()
            sync.begin()
            if sync.manager.num_participants() < sync.manager._min_replica_size:
                sync.manager.should_commit()  # too few groups: every one agrees not to commit
                sync.end(False, 0.0)
                time.sleep(sync.cfg.live_quorum_tick_ms / 1000)
                continue
            trainer.optimizer.zero_grad(set_to_none=False)
            work = micro_steps(trainer, accum, trainer.module)
            tc = time.perf_counter()
            grads = [p.grad for p in trainer.trainable.parameters() if p.grad is not None]
            average_gradients(sync.manager, grads, int(trainer.cfg.comm.bucket_mb * 2**20))
            work.fwd_bwd_time += time.perf_counter() - tc
            if sync.manager.should_commit():
                sync.end(True, time.perf_counter() - sync.attempt_start)
                return work
            sync.end(False, 0.0)
            tries += 1
            if tries >= MAX_TRIES:
                raise LiveFailure(
                    f"step {trainer.state.step + 1} failed to commit {tries} times in a row (every try's "
                    "collectives failed); see events.jsonl for the groups that died"
                )


def average_gradients(manager: Any, grads: list[torch.Tensor], bucket_bytes: int) -> None:
    """Average ``grads`` in place over the quorum's groups: one ``Manager.allreduce`` per fused bucket
    of at most ``bucket_bytes`` (``comm.bucket_mb``, per dtype), not one per tensor.

    Every all-reduce is a gloo round trip plus torchft's bookkeeping (quorum check, error tracking, a
    future), so a model of many small tensors paid that per tensor. The buckets are all started
    before the first wait, then copied back. Every group fuses the same tensors alike (same model),
    so the sums pair up and every group gets the same bits."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    pending: list[tuple[Any, list[torch.Tensor], torch.Tensor]] = []
    for same in by_dtype.values():
        for group in fuse_groups(same, bucket_bytes):
            members = [same[i] for i in group]
            flat = torch.cat([m.reshape(-1) for m in members])  # (Σ numel,)
            pending.append((manager.allreduce(flat), members, flat))
    for work, members, flat in pending:
        work.wait()  # the sum divided by the participants (torchft's callback) is in ``flat`` now
        for m, part in zip(members, flat.split([m.numel() for m in members]), strict=True):
            m.copy_(part.view_as(m))


def seek(trainer: Trainer) -> None:
    """Put this group's sampler where step ``trainer.state.step`` starts in its shard (a no-op in the
    usual case, where it is already there); other samplers (streams) read on."""
    sampler = trainer.sampler
    if not isinstance(sampler, ShardSampler) or sampler.epoch_end or len(sampler.carry):
        return
    size = len(sampler.indices)
    done = trainer.state.step * trainer.cfg.train.grad_accum * sampler.batch_size
    epoch, position = divmod(done, size)
    if (sampler.epoch, sampler.position) != (epoch, position):
        sampler.load_state_dict({"epoch": epoch, "position": position, "seed": sampler.seed, "size": size})


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter and buffer's bytes, in name order: equal digests, equal bits."""
    h = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

"""A parameter-server worker: the plugin that pushes each step's gradient to the servers and loads
the fresh parameters of their replies."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from vatra._io import atomic_write
from vatra.asyncdp.ps.codec import Piece, PushEncoder, split_even
from vatra.asyncdp.ps.link import BYE, HELLO, PUSH, Link, Wire, publish_incarnation
from vatra.config import Config
from vatra.engine import Plugin
from vatra.resilience.snapshot import load_rank_state, rank_state
from vatra.rundir import RunDir

if TYPE_CHECKING:
    from vatra.engine import Trainer


class AsyncWorker(Plugin):
    """A worker's side: after backward it pushes each shard's gradient to its server and loads the
    fresh parameters of the reply (its own optimizer then has no gradient to step on); after the
    last step it says goodbye and trains on to nothing, holding the final parameters.

    Metrics: ``staleness`` (the largest over shards), ``refused`` (shards that refused this step's
    gradient), ``comm_bytes`` (what this worker sent), ``pulled_bytes``. Worker 0's run folder is the
    run's; worker w ≥ 1 keeps its own, ``<run>/workers/worker-<w>/`` (metrics, events, summary). Every
    ``checkpoint.every_steps`` steps it saves its own state (data position, RNG, schedule) to its
    folder's ``checkpoints/async/worker-<w>.pt``, which a restart resumes from.
    """

    def __init__(
        self, cfg: Config, store: dist.Store, servers: int, run_dir: RunDir, incarnation: int
    ) -> None:
        self.cfg, self.store, self.servers = cfg, store, servers
        self.run_dir, self.incarnation = run_dir, incarnation
        self.timeout = timedelta(seconds=cfg.dist.timeout_s)
        self.links: list[Link] = []
        self.shards: list[list[Piece]] = []
        self.wires: list[Wire] = []
        self.encoders: list[PushEncoder] = []
        self.copies: list[torch.Tensor] = []  # each shard as this worker holds it
        self.params: list[torch.Tensor] = []
        self.versions: list[int] = []
        self.histogram: Counter[int] = Counter()
        self.step_stats: dict[str, Any] = {}
        self.total_sent = 0
        self.total_refused = 0
        self.index = 0
        self.own: Path | None = None

    def on_fit_start(self, trainer: Trainer) -> None:
        self.index = w = trainer.dist.rank
        self.params = [p for p in trainer.trainable.parameters() if p.requires_grad]
        self.shards = split_even([p.numel() for p in self.params], self.servers)
        bucket = int(self.cfg.comm.bucket_mb * 2**20)
        wire, comm = self.cfg.dist.ps_wire, self.cfg.comm
        self.wires = [Wire([b - a for _, a, b in s], bucket, wire, comm) for s in self.shards]
        self.encoders = [PushEncoder(w.codec) for w in self.wires]
        self.copies = [torch.zeros(sum(w.numels)) for w in self.wires]
        self.own = self.run_dir.checkpoints / "async" / f"worker-{w}.pt"
        if self.own.exists():  # a restart: this worker's own position; the parameters come from the servers
            load_rank_state(trainer, self.own.read_bytes())
            self.run_dir.log_event(
                "async_worker_resumed", worker=w, step=trainer.state.step, incarnation=self.incarnation
            )
        if w != 0:
            trainer.val_data = None  # worker 0 evaluates the servers' parameters, on the whole set
        publish_incarnation(self.store, f"worker{w}", self.incarnation)
        self.links = [
            Link(self.store, s, w, is_server=False, timeout=self.timeout) for s in range(self.servers)
        ]
        self.versions = [0] * self.servers
        for s, link in enumerate(self.links):
            link.connect()
            self._hello(s)

    def _flat(self, s: int, grads: bool) -> torch.Tensor:
        """Shard s of the gradients (a missing one as zeros) or of the parameters, flat."""
        out = []
        for i, a, b in self.shards[s]:
            p = self.params[i]
            t = p.grad if grads else p.detach()
            out.append(torch.zeros(b - a) if t is None else t.reshape(-1)[a:b])
        return torch.cat(out)

    def _load(self, s: int, flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for i, a, b in self.shards[s]:
                self.params[i].view(-1)[a:b].copy_(flat[offset : offset + b - a])
                offset += b - a

    def _hello(self, s: int) -> None:
        """Open a session with server s: the shard's layout, worker 0's starting values if the server
        has none, then the shard's current parameters."""
        link, wire = self.links[s], self.wires[s]
        link.send(torch.tensor([HELLO, float(self.index), 0.0, 0.0], dtype=torch.float64))
        link.send(torch.tensor([len(wire.numels)], dtype=torch.int64))
        link.send(torch.tensor(wire.numels, dtype=torch.int64))
        state = link.recv(torch.zeros(2, dtype=torch.float64))
        if not state[0] and self.index == 0:
            wire.send(link, wire.exact.encode(self._flat(s, grads=False))[0], wire.exact)
        self._take_reply(s, exact=True)

    def _take_reply(self, s: int, exact: bool = False) -> tuple[bool, int]:
        """The reply's header and the shard: exact, or the change since this worker's copy."""
        link, wire = self.links[s], self.wires[s]
        head = link.recv(torch.zeros(3, dtype=torch.float64))
        if exact or wire.codec.exact:
            self.copies[s] = wire.recv(link, wire.exact)
        else:
            self.copies[s] += wire.recv(link, wire.codec)
        self._load(s, self.copies[s])
        self.versions[s] = int(head[2])
        return bool(head[0]), int(head[1])

    def _exchange(self, s: int, kind: float, trainer: Trainer) -> tuple[bool, int]:
        """One request to server s and its reply; a broken link is re-made with the server's next
        incarnation (the gradient in flight is dropped: the worker starts again from the fresh shard)."""
        lr = float(trainer.scheduler.get_last_lr()[0])
        link = self.links[s]
        try:
            head = [kind, float(self.versions[s]), float(trainer.state.step), lr]
            link.send(torch.tensor(head, dtype=torch.float64))
            if kind == PUSH:
                wire = self.wires[s]
                wire.send(link, self.encoders[s].encode(self._flat(s, grads=True)), wire.codec)
            return self._take_reply(s, exact=kind == BYE)
        except (RuntimeError, dist.DistError) as exc:
            trainer.log_event("async_link_lost", server=s, worker=self.index, error=str(exc)[:200])
            self.encoders[s].forget()
            link.reconnect()
            self._hello(s)
            if kind == BYE:
                return self._exchange(s, BYE, trainer)
            return False, -1

    def after_backward(self, trainer: Trainer) -> None:
        before = sum(link.sent for link in self.links)
        staleness, refused = 0, 0
        for s in range(self.servers):
            accepted, tau = self._exchange(s, PUSH, trainer)
            if accepted:
                self.histogram[tau] += 1
                staleness = max(staleness, tau)
            else:
                refused += 1
        for p in self.params:
            p.grad = None  # the servers applied the update: the local optimizer has nothing to step
        sent = sum(link.sent for link in self.links) - before
        self.total_sent += sent
        self.total_refused += refused
        pulled = sum(w.codec.nbytes for w in self.wires)
        self.step_stats = {
            "staleness": staleness,
            "refused": refused,
            "comm_bytes": sent,
            "pulled_bytes": pulled,
        }

    def after_update(self, trainer: Trainer) -> None:
        step = trainer.state.step
        every = self.cfg.checkpoint.every_steps
        if self.cfg.checkpoint.enabled and isinstance(every, int) and every and step % every == 0:
            self._save_own(trainer)
        if step >= self.cfg.train.steps:
            for s in range(self.servers):  # goodbye: the reply comes once every worker has said it
                self._exchange(s, BYE, trainer)

    def _save_own(self, trainer: Trainer) -> None:
        assert self.own is not None
        self.own.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self.own, rank_state(trainer), durable=True)  # a restarted worker resumes from it

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        metrics.update(self.step_stats)

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        summary["dist_mode"] = "async"
        summary["comm_bytes"] = self.total_sent
        summary["async_refused"] = self.total_refused
        summary["async_staleness"] = {str(k): v for k, v in sorted(self.histogram.items())}

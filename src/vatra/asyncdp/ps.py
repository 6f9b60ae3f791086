"""``dist.mode = "async"``: parameter servers that apply each worker's gradient when it arrives.

The parameters are split by size over the servers (contiguous runs of tensors); server s holds its
shard as one flat fp32 vector with its own optimizer (``optim.*``) and a version counter, the number
of updates it applied. A worker computes a gradient on the parameters it last received, pushes each
shard's part to its server with the version it was computed on, and the reply carries the shard's
fresh parameters: one round trip per step and no barrier across workers, so a slow worker delays
only its own updates. Server s applies a gradient with staleness τ = version now − version seen at
``lr · scale(τ)`` (:func:`staleness_scale`), and refuses one staler than ``async.max_staleness``:
the reply then only carries the fresh parameters (the worker pulls before it pushes again).

Transport: torch.distributed point to point, on one 2-rank gloo group per (server, worker) pair,
created through the job's TCP store under the two processes' incarnation numbers. A process that
dies breaks only its own pairs; its peers wait for its next incarnation and connect to it, so a
restarted worker rejoins and a restarted server (from its last saved shard) is found again.
:class:`ShardServer` is the transport-free state machine the tests script.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from vatra.asyncdp.diloco import split_fragments
from vatra.comm.batching import fuse_groups
from vatra.config import AsyncConfig, Config, OptimConfig
from vatra.engine import Plugin
from vatra.engine.optim import build_optimizer
from vatra.rundir import RunDir, append_jsonl

if TYPE_CHECKING:
    from vatra.engine import Trainer

HELLO, PUSH, BYE = 1.0, 2.0, 3.0
HEADER = 4  # float64: kind, version seen (or worker index), step, lr
WIRE = {"none": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def staleness_scale(rule: str, staleness: int, alpha: float) -> float:
    """The factor on a gradient's learning rate for staleness τ: 1, 1/(1+τ), or e^(−ατ)."""
    if rule == "inverse":
        return 1.0 / (1.0 + staleness)
    if rule == "exp":
        return math.exp(-alpha * staleness)
    return 1.0


@dataclass
class Reply:
    accepted: bool  # the gradient was applied (False: refused as too stale, or a pull)
    staleness: int
    version: int
    params: torch.Tensor  # the shard after the update (a copy)


class ShardServer:
    """One server's shard: flat fp32 parameters, their optimizer, the version counter and counts.

    Thread-safe: one thread per worker calls :meth:`push` as its gradients arrive.
    """

    def __init__(self, numel: int, optim: OptimConfig, cfg: AsyncConfig) -> None:
        self.cfg = cfg
        self.param = torch.nn.Parameter(torch.zeros(numel), requires_grad=False)
        self.optimizer = build_optimizer([self.param], optim)
        self.version = 0
        self.initialized = False
        self.lock = threading.Condition()
        self.histogram: Counter[int] = Counter()  # staleness of applied gradients
        self.refused = 0
        self.waiting = 0  # pushes that arrived and wait for the lock: the queue depth
        self.busy_s = 0.0  # time spent applying updates

    def init(self, values: torch.Tensor) -> None:
        """The shard's starting values (worker 0's parameters); ignored once the shard has them."""
        with self.lock:
            if not self.initialized:
                self.param.data.copy_(values)
                self.initialized = True
                self.lock.notify_all()

    def wait_initialized(self, timeout: float) -> None:
        with self.lock:
            if not self.lock.wait_for(lambda: self.initialized, timeout):
                raise TimeoutError(f"the shard got no starting values from worker 0 in {timeout:.0f} s")

    def push(self, grad: torch.Tensor, seen: int, lr: float) -> Reply:
        """Apply ``grad`` (computed on version ``seen``) at the staleness-scaled ``lr``, or refuse it."""
        self.waiting += 1
        with self.lock:
            self.waiting -= 1
            t0 = time.perf_counter()
            tau = self.version - seen
            limit = self.cfg.max_staleness
            if tau < 0 or (limit and tau > limit):
                self.refused += 1
                return Reply(False, tau, self.version, self.param.detach().clone())
            for group in self.optimizer.param_groups:
                group["lr"] = lr * staleness_scale(self.cfg.staleness, tau, self.cfg.staleness_alpha)
            self.param.grad = grad.to(torch.float32)
            self.optimizer.step()
            self.param.grad = None
            self.version += 1
            self.histogram[tau] += 1
            self.busy_s += time.perf_counter() - t0
            return Reply(True, tau, self.version, self.param.detach().clone())

    def pull(self) -> Reply:
        with self.lock:
            return Reply(False, 0, self.version, self.param.detach().clone())

    def state_dict(self) -> dict[str, Any]:
        with self.lock:
            return {
                "param": self.param.detach().clone(),
                "optimizer": self.optimizer.state_dict(),
                "version": self.version,
                "histogram": dict(self.histogram),
                "refused": self.refused,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self.lock:
            self.param.data.copy_(state["param"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.version = int(state["version"])
            self.histogram = Counter({int(k): int(v) for k, v in state["histogram"].items()})
            self.refused = int(state["refused"])
            self.initialized = True
            self.lock.notify_all()


# ---------------------------------------------------------------------------------------- links
class PeerGone(RuntimeError):
    """The peer of a link did not come back within the timeout."""


class Link:
    """This process's connection to one peer: a 2-rank gloo group (server rank 0, worker rank 1),
    made through ``store`` for the two processes' current incarnations; :meth:`reconnect` waits for
    the peer's next incarnation after a failure. Every message is one tensor; ``sent`` counts bytes."""

    def __init__(
        self, store: dist.Store, server: int, worker: int, *, is_server: bool, timeout: timedelta
    ) -> None:
        self.store, self.server, self.worker = store, server, worker
        self.is_server = is_server
        self.timeout = timeout
        self.peer_key = f"inc/worker{worker}" if is_server else f"inc/server{server}"
        self.my_key = f"inc/server{server}" if is_server else f"inc/worker{worker}"
        self.peer_inc = -1
        self.group: Any = None  # a dist.ProcessGroupGloo backend (its send/recv are not in torch's stubs)
        self.sent = 0

    def connect(self, newer_than: int = -1) -> None:
        """Wait until the peer runs an incarnation newer than ``newer_than``, then pair with it."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        while True:
            if self.store.check([self.peer_key]):
                inc = int(self.store.get(self.peer_key))
                if inc > newer_than:
                    break
            if time.monotonic() > deadline:
                raise PeerGone(f"{self.peer_key.split('/')[1]} did not come back in {self.timeout}")
            time.sleep(0.05)
        mine = int(self.store.get(self.my_key))
        sinc, winc = (mine, inc) if self.is_server else (inc, mine)
        prefix = f"pair/s{self.server}.{sinc}/w{self.worker}.{winc}"
        self.peer_inc = inc  # also when pairing fails: the caller then waits for a newer one
        self.group = dist.ProcessGroupGloo(
            dist.PrefixStore(prefix, self.store), 0 if self.is_server else 1, 2, self.timeout
        )

    def reconnect(self) -> None:
        self.group = None
        self.connect(newer_than=self.peer_inc)

    def send(self, t: torch.Tensor) -> None:
        assert self.group is not None
        t = t.contiguous()
        self.group.send([_raw(t)], 1 - self._me, 0).wait()
        self.sent += t.numel() * t.element_size()

    def recv(self, t: torch.Tensor) -> torch.Tensor:
        assert self.group is not None
        self.group.recv([_raw(t)], 1 - self._me, 0).wait()
        return t

    @property
    def _me(self) -> int:
        return 0 if self.is_server else 1


def _raw(t: torch.Tensor) -> torch.Tensor:
    """Half-precision payloads travel as int16 (gloo's own bf16 handling is unreliable)."""
    return t.view(torch.int16) if t.dtype in (torch.float16, torch.bfloat16) else t


def publish_incarnation(store: dist.Store, name: str, incarnation: int) -> None:
    store.set(f"inc/{name}", str(incarnation))


class Wire:
    """How a shard travels: its tensors fused into messages of at most ``bucket_bytes`` (a tensor
    larger than that alone; a bucket size below the smallest tensor = one message per tensor)."""

    def __init__(self, numels: list[int], bucket_bytes: int, dtype: torch.dtype) -> None:
        self.numels = numels
        self.dtype = dtype
        probe = [torch.empty(n, dtype=dtype) for n in numels]
        groups = fuse_groups(probe, bucket_bytes)
        bounds = [0]
        for n in numels:
            bounds.append(bounds[-1] + n)
        self.chunks = [(bounds[g[0]], bounds[g[-1] + 1]) for g in groups]  # element ranges of the shard

    def send(self, link: Link, flat: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        flat = flat.to(dtype or self.dtype)
        for a, b in self.chunks:
            link.send(flat[a:b])

    def recv(self, link: Link, out: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        buf = torch.empty(out.numel(), dtype=dtype or self.dtype)
        for a, b in self.chunks:
            link.recv(buf[a:b])
        return out.copy_(buf)


# --------------------------------------------------------------------------------------- server
class Server:
    """Server ``index``: one thread per worker serving its link, saving the shard to
    ``<run>/checkpoints/async/server-<index>.pt`` every ``checkpoint.every_steps`` × workers updates
    and at the end, and writing its load to ``<run>/servers/server-<index>.jsonl`` every second."""

    def __init__(
        self, cfg: Config, index: int, workers: int, store: dist.Store, run_dir: RunDir, incarnation: int
    ) -> None:
        self.cfg, self.index, self.workers = cfg, index, workers
        self.store, self.run_dir, self.incarnation = store, run_dir, incarnation
        self.timeout = timedelta(seconds=cfg.dist.timeout_s)
        self.shard: ShardServer | None = None
        self.wire: Wire | None = None
        self.layout_lock = threading.Lock()
        self.done: set[int] = set()
        self.finished = threading.Condition()
        self.path = run_dir.checkpoints / "async" / f"server-{index}.pt"
        self.log = run_dir.path / "servers" / f"server-{index}.jsonl"
        every = cfg.checkpoint.every_steps if isinstance(cfg.checkpoint.every_steps, int) else 25
        self.save_every = every * workers if cfg.checkpoint.enabled else 0
        self.saved_version = 0
        self.save_lock = threading.Lock()
        self.kill_at = set(cfg.chaos.kill_at_steps) if cfg.chaos.kill_rank == workers + index else set()
        self.errors: list[str] = []

    def run(self) -> None:
        saved = torch.load(self.path, weights_only=True) if self.path.exists() else None
        if saved is not None:
            self._layout(list(saved["numels"]))
            assert self.shard is not None
            self.shard.load_state_dict(saved["shard"])
            self.saved_version = self.shard.version
            self.run_dir.log_event(
                "async_server_resumed",
                server=self.index,
                version=self.shard.version,
                incarnation=self.incarnation,
            )
        if self.kill_at:
            from vatra.resilience.chaos import fired_steps

            self.kill_at -= fired_steps(self.run_dir, "chaos_kill")
        publish_incarnation(self.store, f"server{self.index}", self.incarnation)
        # every worker, also one that said goodbye before a restart: it says it again on its new link
        threads = [
            threading.Thread(target=self._serve, args=(w,), name=f"ps{self.index}-w{w}", daemon=True)
            for w in range(self.workers)
        ]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            for t in threads:
                t.join(timeout=1.0 / len(threads))
            if self.errors:  # a worker's thread failed: restart from the last saved shard
                raise RuntimeError(self.errors[0])
            self._log_load()
        self._save()
        self._log_load(final=True)

    def _layout(self, numels: list[int]) -> None:
        with self.layout_lock:
            if self.shard is None:
                self.shard = ShardServer(sum(numels), self.cfg.optim, self.cfg.async_)
                bucket = int(self.cfg.comm.bucket_mb * 2**20)
                self.wire = Wire(numels, bucket, WIRE[self.cfg.comm.method])
                self.numels = numels
            elif numels != self.numels:
                raise ValueError(f"a worker's shard layout {numels[:4]}... differs from {self.numels[:4]}...")

    def _serve(self, worker: int) -> None:
        link = Link(self.store, self.index, worker, is_server=True, timeout=self.timeout)
        try:
            newer = -1
            while True:
                try:
                    link.connect(newer_than=newer)
                except PeerGone:
                    raise
                except (RuntimeError, dist.DistError) as exc:
                    # the worker died (or gave up) before pairing: its restart pairs with its next
                    # incarnation; a worker that is alive times out on its side and restarts too
                    self.run_dir.log_event(
                        "async_link_lost", server=self.index, worker=worker, error=str(exc)[:200]
                    )
                    newer = link.peer_inc
                    continue
                if self._session(link, worker):
                    return
                newer = link.peer_inc  # the worker died: wait for its next incarnation
        except Exception as exc:  # a worker that never came back, or a fault of this server's
            self.errors.append(f"server {self.index}, worker {worker}: {type(exc).__name__}: {exc}")
            self.run_dir.log_event(
                "async_server_error", server=self.index, worker=worker, error=self.errors[-1]
            )

    def _session(self, link: Link, worker: int) -> bool:
        """Serve one connection until the worker says goodbye (True) or the link breaks (False)."""
        header = torch.zeros(HEADER, dtype=torch.float64)
        try:
            link.recv(header)
            if header[0] != HELLO:
                raise ValueError(f"worker {worker} opened with message kind {header[0]}")
            count = torch.zeros(1, dtype=torch.int64)
            link.recv(count)
            numels = link.recv(torch.zeros(int(count), dtype=torch.int64)).tolist()
            self._layout(numels)
            shard, wire = self.shard, self.wire
            assert shard is not None and wire is not None
            link.send(torch.tensor([float(shard.initialized), float(shard.version)], dtype=torch.float64))
            if not shard.initialized:
                if worker == 0:
                    shard.init(wire.recv(link, torch.empty(sum(numels)), torch.float32))
                shard.wait_initialized(self.timeout.total_seconds())
            self._reply(link, shard.pull())
            grad = torch.empty(sum(numels))
            while True:
                link.recv(header)
                if header[0] == BYE:
                    self._finish(worker)
                    self._reply(link, shard.pull())
                    return True
                reply = shard.push(wire.recv(link, grad), int(header[1]), float(header[3]))
                self._reply(link, reply)
                if reply.accepted:
                    self._after_update(shard, reply.version)
        except (RuntimeError, dist.DistError) as exc:
            self.run_dir.log_event("async_link_lost", server=self.index, worker=worker, error=str(exc)[:200])
            return False

    def _reply(self, link: Link, reply: Reply) -> None:
        assert self.wire is not None
        head = torch.tensor([float(reply.accepted), float(reply.staleness), float(reply.version)])
        link.send(head.to(torch.float64))
        self.wire.send(link, reply.params, torch.float32)

    def _after_update(self, shard: ShardServer, version: int) -> None:
        if self.save_every and version - self.saved_version >= self.save_every:
            with self.save_lock:  # one thread saves; the others' updates wait for the next save
                if version - self.saved_version >= self.save_every:
                    self._save()
        if version in self.kill_at:
            self.run_dir.log_event(
                "chaos_kill", rank=self.cfg.chaos.kill_rank, step=version, signal="SIGKILL"
            )
            os.kill(os.getpid(), signal.SIGKILL)

    def _finish(self, worker: int) -> None:
        """BYE: wait until every worker has said it, so all leave with the final parameters."""
        with self.finished:
            self.done.add(worker)
            self.finished.notify_all()
            self.finished.wait_for(lambda: len(self.done) == self.workers)

    def _save(self) -> None:
        if self.shard is None or not self.cfg.checkpoint.enabled:
            return
        shard = self.shard.state_dict()
        state = {"numels": self.numels, "shard": shard}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        torch.save(state, tmp)
        os.replace(tmp, self.path)
        self.saved_version = int(shard["version"])

    def _log_load(self, final: bool = False) -> None:
        shard = self.shard
        if shard is None:
            return
        record = {
            "time": time.time(),
            "server": self.index,
            "version": shard.version,
            "refused": shard.refused,
            "queue": shard.waiting,
            "busy_s": shard.busy_s,
            "staleness": {str(k): v for k, v in sorted(shard.histogram.items())},
            "final": final,
        }
        self.log.parent.mkdir(parents=True, exist_ok=True)
        append_jsonl(self.log, record)


# --------------------------------------------------------------------------------------- worker
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
        self.shards: list[list[int]] = []
        self.wires: list[Wire] = []
        self.params: list[torch.Tensor] = []
        self.versions: list[int] = []
        self.histogram: Counter[int] = Counter()
        self.step_stats: dict[str, Any] = {}
        self.total_sent = 0
        self.total_refused = 0
        self.index = 0
        self.own: Path | None = None

    def on_fit_start(self, trainer: Trainer) -> None:
        from vatra.resilience.snapshot import load_rank_state

        self.index = w = trainer.dist.rank
        self.params = [p for p in trainer.trainable.parameters() if p.requires_grad]
        self.shards = split_fragments([p.numel() for p in self.params], self.servers)
        bucket = int(self.cfg.comm.bucket_mb * 2**20)
        dtype = WIRE[self.cfg.comm.method]
        self.wires = [Wire([self.params[i].numel() for i in s], bucket, dtype) for s in self.shards]
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
        ts = [self.params[i].grad if grads else self.params[i].detach() for i in self.shards[s]]
        return torch.cat([torch.zeros_like(self.params[i]).reshape(-1) if t is None else t.reshape(-1)
                          for i, t in zip(self.shards[s], ts, strict=True)])  # fmt: skip

    def _load(self, s: int, flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for i in self.shards[s]:
                p = self.params[i]
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def _hello(self, s: int) -> None:
        """Open a session with server s: the shard's layout, worker 0's starting values if the server
        has none, then the shard's current parameters."""
        link, wire = self.links[s], self.wires[s]
        link.send(torch.tensor([HELLO, float(self.index), 0.0, 0.0], dtype=torch.float64))
        link.send(torch.tensor([len(wire.numels)], dtype=torch.int64))
        link.send(torch.tensor(wire.numels, dtype=torch.int64))
        state = link.recv(torch.zeros(2, dtype=torch.float64))
        if not state[0] and self.index == 0:
            wire.send(link, self._flat(s, grads=False), torch.float32)
        self._take_reply(s)

    def _take_reply(self, s: int) -> tuple[bool, int]:
        link, wire = self.links[s], self.wires[s]
        head = link.recv(torch.zeros(3, dtype=torch.float64))
        flat = wire.recv(link, torch.empty(sum(wire.numels)), torch.float32)
        self._load(s, flat)
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
                self.wires[s].send(link, self._flat(s, grads=True))
            return self._take_reply(s)
        except (RuntimeError, dist.DistError) as exc:
            trainer.log_event("async_link_lost", server=s, worker=self.index, error=str(exc)[:200])
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
        pulled = sum(sum(w.numels) * 4 for w in self.wires)
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
        from vatra.resilience.snapshot import rank_state

        assert self.own is not None
        self.own.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.own.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(rank_state(trainer))
        os.replace(tmp, self.own)

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        metrics.update(self.step_stats)

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        summary["dist_mode"] = "async"
        summary["comm_bytes"] = self.total_sent
        summary["async_refused"] = self.total_refused
        summary["async_staleness"] = {str(k): v for k, v in sorted(self.histogram.items())}

"""A parameter server process: one thread per worker serving its link, the shard saved as versions
of its own checkpoint store and its load logged."""

from __future__ import annotations

import io
import threading
import time
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist

from vatra.asyncdp.ps.link import BYE, HEADER, HELLO, Link, PeerGone, Wire, publish_incarnation
from vatra.asyncdp.ps.shard import Reply, ShardServer
from vatra.config import Config
from vatra.errors import VatraError
from vatra.resilience.chaos import StepKill
from vatra.resilience.checkpoint.one_file import OneFileVersions
from vatra.resilience.store import open_store
from vatra.rundir import RunDir, append_jsonl

SHARD = "shard.pt"  # a version's one file: ``torch.save`` of {"numels", "shard"}


def shard_store(index: int) -> str:
    """Server ``index``'s own store, this folder of the run's ``[store]``: servers must not share
    one (each save moves ``latest`` and prunes what the server's own versions do not reference)."""
    return f"async/server-{index}"


class Server:
    """Server ``index``: one thread per worker serving its link, saving the shard as a version of
    its own store (:func:`shard_store`; step = the shard's version) every ``checkpoint.every_steps``
    × workers updates and at the end, and writing its load to ``<run>/servers/server-<index>.jsonl``
    every second."""

    def __init__(
        self, cfg: Config, index: int, workers: int, store: dist.Store, run_dir: RunDir, incarnation: int
    ) -> None:
        self.cfg, self.index, self.workers = cfg, index, workers
        self.store, self.run_dir, self.incarnation = store, run_dir, incarnation
        self.timeout = timedelta(seconds=cfg.dist.timeout_s)
        self.shard: ShardServer | None = None
        self.wire: Wire | None = None
        # per worker: the shard as that worker holds it (pulls send the change since; not on fp32)
        self.copies: dict[int, torch.Tensor] = {}
        self.layout_lock = threading.Lock()
        self.done: set[int] = set()
        self.finished = threading.Condition()
        sub = shard_store(index)
        self.checkpoints = OneFileVersions(
            open_store(cfg.store, run_dir.checkpoints, sub=sub),
            SHARD,
            partial(run_dir.log_event, server=index),
            keep_last=cfg.checkpoint.keep_last,
            legacy=run_dir.checkpoints / "async" / f"server-{index}.pt",  # before the store: read once
            what=f"parameter server {index}'s shard",
            verify_hint=f"vatra ckpt verify RUN --sub {sub}",
        )
        self.log = run_dir.path / "servers" / f"server-{index}.jsonl"
        every = cfg.checkpoint.every_steps if isinstance(cfg.checkpoint.every_steps, int) else 25
        self.save_every = every * workers if cfg.checkpoint.enabled else 0
        self.saved_version = 0
        self.save_lock = threading.Lock()
        mine = cfg.chaos.kill_rank == workers + index  # the job's ranks: the workers, then the servers
        self.kill = StepKill(cfg.chaos.kill_at_steps if mine else (), run_dir, rank=cfg.chaos.kill_rank)
        self.errors: list[str] = []

    def run(self) -> None:
        self.resume()
        self.kill.skip_fired()
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
        self.save()
        self._log_load(final=True)

    def resume(self) -> bool:
        """Load the newest intact saved shard (parameters, optimizer state, version); False when
        there is none (a fresh start). A version whose manifest or object is damaged is passed over
        for its parent (logged as ``checkpoint_corrupt``)."""
        found = self.checkpoints.newest()
        if found is None:
            return False
        where, blob = found
        try:
            saved = torch.load(io.BytesIO(blob), weights_only=True)
            self._layout(list(saved["numels"]))
            assert self.shard is not None
            self.shard.load_state_dict(saved["shard"])
        except (RuntimeError, KeyError, TypeError, EOFError) as err:
            raise VatraError(
                f"parameter server {self.index}'s shard {where} is unreadable ({type(err).__name__}: "
                f"{err}); restore it, or move the run's checkpoints away to start this run folder over"
            ) from None
        self.saved_version = self.shard.version
        self.run_dir.log_event(
            "async_server_resumed",
            server=self.index,
            version=self.shard.version,
            incarnation=self.incarnation,
        )
        return True

    def _layout(self, numels: list[int]) -> None:
        with self.layout_lock:
            if self.shard is None:
                self.shard = ShardServer(sum(numels), self.cfg.optim, self.cfg.async_)
                bucket = int(self.cfg.comm.bucket_mb * 2**20)
                self.wire = Wire(numels, bucket, self.cfg.dist.ps_wire, self.cfg.comm)
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
                    shard.init(wire.recv(link, wire.exact))
                shard.wait_initialized(self.timeout.total_seconds())
            self._reply(link, shard.pull(), worker, exact=True)
            while True:
                link.recv(header)
                if header[0] == BYE:
                    self._finish(worker)
                    self._reply(link, shard.pull(), worker, exact=True)
                    return True
                reply = shard.push(wire.recv(link, wire.codec), int(header[1]), float(header[3]))
                self._reply(link, reply, worker)
                if reply.accepted:
                    self._after_update(shard, reply.version)
        except (RuntimeError, dist.DistError) as exc:
            self.run_dir.log_event("async_link_lost", server=self.index, worker=worker, error=str(exc)[:200])
            return False

    def _reply(self, link: Link, reply: Reply, worker: int, exact: bool = False) -> None:
        """The reply's header and the shard: exact (fp32, and the worker's copy starts over), or the
        change since the worker's copy through ``dist.ps_wire`` (what it drops goes with the next)."""
        wire = self.wire
        assert wire is not None
        head = torch.tensor([float(reply.accepted), float(reply.staleness), float(reply.version)])
        link.send(head.to(torch.float64))
        if exact or wire.codec.exact:
            wire.send(link, wire.exact.encode(reply.params)[0], wire.exact)
            if not wire.codec.exact:
                self.copies[worker] = reply.params.clone()
            return
        copy = self.copies[worker]
        buf, seen = wire.codec.encode(reply.params - copy)
        copy += seen
        wire.send(link, buf, wire.codec)

    def _after_update(self, shard: ShardServer, version: int) -> None:
        if self.save_every and version - self.saved_version >= self.save_every:
            with self.save_lock:  # one thread saves; the others' updates wait for the next save
                if version - self.saved_version >= self.save_every:
                    self.save()
        self.kill.at(version)  # chaos.kill_at_steps, counted in this shard's updates

    def _finish(self, worker: int) -> None:
        """BYE: wait until every worker has said it, so all leave with the final parameters."""
        with self.finished:
            self.done.add(worker)
            self.finished.notify_all()
            self.finished.wait_for(lambda: len(self.done) == self.workers)

    def save(self) -> None:
        """The shard as a new version of this server's store (step = its version); then pruned."""
        if self.shard is None or not self.cfg.checkpoint.enabled:
            return
        shard = self.shard.state_dict()
        blob = io.BytesIO()
        torch.save({"numels": self.numels, "shard": shard}, blob)
        # a restarted server resumes from this version (the shards are the async run's checkpoint)
        self.checkpoints.save(int(shard["version"]), blob.getvalue(), reason="shard")
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

"""The parameter server's wire: one 2-rank gloo group per (server, worker) pair made through the
job's TCP store under the two processes' incarnations, the message kinds, and how a shard's encoded
bytes are cut into messages."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from vatra.asyncdp.ps.codec import Codec
from vatra.comm.batching import fuse_groups
from vatra.config import CommConfig

HELLO, PUSH, BYE = 1.0, 2.0, 3.0
HEADER = 4  # float64: kind, version seen (or worker index), step, lr


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
    """How a shard travels: :attr:`exact` (fp32: the starting values, a session's first pull and the
    last) and :attr:`codec` (``dist.ps_wire``: pushes and the other pulls), each encoding cut into
    messages of at most ``bucket_bytes`` between tensors (a tensor larger than that alone; a bucket
    size below the smallest tensor = one message per tensor)."""

    def __init__(
        self, numels: list[int], bucket_bytes: int, wire: str, comm: CommConfig | None = None
    ) -> None:
        self.numels = numels
        self.exact = Codec(numels, "fp32")
        self.codec = self.exact if wire == "fp32" else Codec(numels, wire, comm)
        self.chunks = {id(c): self._chunks(c, bucket_bytes) for c in (self.exact, self.codec)}

    @staticmethod
    def _chunks(codec: Codec, bucket_bytes: int) -> list[tuple[int, int]]:
        """Byte ranges of the messages: whole tensors' encodings fused up to ``bucket_bytes``."""
        starts = [0, *codec.bounds[:-1]]
        probe = [torch.empty(b - a, dtype=torch.uint8) for a, b in zip(starts, codec.bounds, strict=True)]
        return [(starts[g[0]], codec.bounds[g[-1]]) for g in fuse_groups(probe, bucket_bytes)]

    def send(self, link: Link, buf: torch.Tensor, codec: Codec) -> None:
        for a, b in self.chunks[id(codec)]:
            link.send(buf[a:b])

    def recv(self, link: Link, codec: Codec) -> torch.Tensor:
        """The flat fp32 values the next message(s) of ``codec``'s encoding carry."""
        buf = torch.empty(codec.nbytes, dtype=torch.uint8)
        for a, b in self.chunks[id(codec)]:
            link.recv(buf[a:b])
        return codec.decode(buf)

"""``dist.mode = "async"``: parameter servers that apply each worker's gradient when it arrives.

The parameters' elements are split evenly over the servers (:func:`split_even`); server s holds its
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

Modules: ``shard`` (:class:`ShardServer`, the staleness rule), ``link`` (:class:`Link`, :class:`Wire`,
the message kinds), ``server`` (:class:`Server`, a server process), ``worker`` (:class:`AsyncWorker`,
the worker's plugin).
"""

from __future__ import annotations

from vatra.asyncdp.ps.codec import Codec, PushEncoder, split_even
from vatra.asyncdp.ps.link import BYE, HEADER, HELLO, PUSH, Link, PeerGone, Wire, publish_incarnation
from vatra.asyncdp.ps.server import Server
from vatra.asyncdp.ps.shard import Reply, ShardServer, staleness_scale
from vatra.asyncdp.ps.worker import AsyncWorker

__all__ = [
    "BYE",
    "HEADER",
    "HELLO",
    "PUSH",
    "AsyncWorker",
    "Codec",
    "Link",
    "PeerGone",
    "PushEncoder",
    "Reply",
    "Server",
    "ShardServer",
    "Wire",
    "publish_incarnation",
    "split_even",
    "staleness_scale",
]

"""Secure aggregation over the gRPC deployment: the stages ride the hub's long poll.

The server posts one packed request per client (``Hub.stage_tasks``); a client's ``Poll``
returns it, the client answers with the ``SecAgg`` method, and :class:`HubChannel` waits for
every client, a drop-out (silent for ``heartbeat_s × heartbeat_misses``) or the round deadline.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import grpc

from vatra.federated.secagg.channel import CountingChannel
from vatra.federated.secagg.messages import unpack
from vatra.federated.wire import WireError

if TYPE_CHECKING:
    from vatra.federated.transport import Hub


class HubChannel(CountingChannel):
    def __init__(self, hub: Hub) -> None:
        super().__init__()
        self.hub = hub

    def deliver(self, stage: str, rnd: int, blobs: dict[int, bytes]) -> dict[int, bytes | str]:
        out: dict[int, bytes | str]
        hub, cfg = self.hub, self.hub.cfg
        with hub.cond:
            hub.stage_replies = {}
            hub.stage_tasks = dict(blobs)
            hub.cond.notify_all()
            deadline = time.monotonic() + cfg.round_deadline_s
            limit = cfg.heartbeat_s * cfg.heartbeat_misses
            while True:
                now = time.monotonic()
                pending = [c for c in hub.stage_tasks if c not in hub.stage_replies]
                for c in pending:
                    silent = now - hub.last_seen.get(c, 0.0)
                    if silent > limit or now > deadline:
                        hub.stage_replies[c] = f"no {stage} reply (silent {silent:.1f} s)"
                        hub.run_dir.log_event("secagg_dropout", round=rnd, stage=stage, client=c)
                if all(c in hub.stage_replies for c in hub.stage_tasks):
                    break
                hub.cond.wait(0.2)
            out = {c: r for c, r in hub.stage_replies.items() if isinstance(r, bytes)}  # drop-outs: absent
            hub.stage_tasks, hub.stage_replies = {}, {}
        return out


def secagg_reply(hub: Hub, cid: int, request: bytes, context: grpc.ServicerContext) -> None:
    """The ``SecAgg`` method: a client's answer to the stage request it was given."""
    try:
        unpack(request)
    except WireError as err:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
    with hub.cond:
        if cid not in hub.stage_tasks or cid in hub.stage_replies:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"client {cid} has no pending secure-aggregation stage"
            )
        hub.stage_replies[cid] = request
        hub.cond.notify_all()

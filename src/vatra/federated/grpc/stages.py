"""Protocol stages over the gRPC deployment (secure aggregation's): they ride the hub's long poll.

The hub (a :class:`~vatra.federated._base.StageRunner`) posts one packed request per client
(``Hub.stage_tasks``); a client's ``Poll`` returns it, the client answers with the ``SecAgg``
method (:func:`secagg_reply`), and :class:`HubStages` waits for
every client, a drop-out (silent for ``heartbeat_s × heartbeat_misses``) or the round's
deadline — one for the whole round (``hub.round_deadline``, set when training starts), so a
client that heartbeats but never answers costs it once, not once per stage. A reply that does
not unpack, or lacks the stage's fields, drops its sender for the round with a logged reason.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import grpc

from vatra.federated.secagg.messages import unpack
from vatra.federated.secagg.protocol import REPLY_FIELDS
from vatra.federated.wire import WireError

if TYPE_CHECKING:
    from vatra.federated.grpc.hub import Hub


class HubStages:
    """The hub's side of :meth:`Hub.run_stage`: post one stage, wait for its replies."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.deadline = 0.0  # without hub.round_deadline: round_deadline_s from the advertise stage

    def deliver(self, stage: str, rnd: int, blobs: dict[int, bytes]) -> dict[int, bytes | str]:
        """Packed replies, or why a reply was refused (malformed); silent clients are absent."""
        hub, cfg = self.hub, self.hub.cfg
        if stage == "advertise":
            self.deadline = time.monotonic() + cfg.round_deadline_s
        deadline = getattr(hub, "round_deadline", None) or self.deadline  # 0.0: not set yet
        limit = cfg.heartbeat_s * cfg.heartbeat_misses
        silent_ones: set[int] = set()
        with hub.cond:
            hub.stage_replies = {}
            hub.stage_tasks = dict(blobs)
            hub.cond.notify_all()
            while True:
                now = time.monotonic()
                pending = [c for c in hub.stage_tasks if c not in hub.stage_replies]
                for c in pending:
                    silent = now - hub.last_seen.get(c, 0.0)
                    if silent > limit or now > deadline:
                        why = "past the round deadline" if now > deadline else f"silent {silent:.1f} s"
                        hub.stage_replies[c] = f"no {stage} reply ({why})"
                        silent_ones.add(c)
                        hub.run_dir.log_event("secagg_dropout", round=rnd, stage=stage, client=c, reason=why)
                if all(c in hub.stage_replies for c in hub.stage_tasks):
                    break
                hub.cond.wait(0.2)
            out = {c: r for c, r in hub.stage_replies.items() if c not in silent_ones}  # drop-outs: absent
            hub.stage_tasks, hub.stage_replies = {}, {}
        return out


def secagg_reply(hub: Hub, cid: int, request: bytes, context: grpc.ServicerContext) -> None:
    """The ``SecAgg`` method: a client's answer to the stage request it was given.

    A malformed answer is recorded as that client's drop-out for the stage (logged), and the
    client is told with INVALID_ARGUMENT; the server carries on with the others.
    """
    try:
        stage, _, body = unpack(request)
        if not isinstance(body, dict):
            raise WireError(f"the body is a {type(body).__name__}, not a dict")
        fields = REPLY_FIELDS.get(stage)
        if fields is None:
            raise WireError(f"unknown stage {stage!r}")
        if "error" not in body and not all(f in body for f in fields):
            raise WireError(f"a {stage} reply needs {', '.join(fields)}")
        problem = ""
    except WireError as err:
        problem = f"malformed secure-aggregation reply: {err}"
    with hub.cond:
        if cid not in hub.stage_tasks or cid in hub.stage_replies:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"client {cid} has no pending secure-aggregation stage"
            )
        hub.stage_replies[cid] = problem or request
        hub.cond.notify_all()
    if problem:
        hub.run_dir.log_event("secagg_malformed_reply", client=cid, reason=problem)
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)

"""The deployed server's state between the gRPC handler threads and the round loop (:class:`Hub`).

The hub is the round loop's :class:`~vatra.federated._base.Executor` over the network, and a
:class:`~vatra.federated._base.StageRunner`: secure aggregation's stages ride its long poll.

The round loop posts one task per client for one *(round, phase)* — a fit task, or an evaluate
task of the same round — and waits; handler threads hand each client its task (``Poll``) and take
its answer (``Submit``). What a client can make the server do is bounded here:

- ``Join``: the first joiner's data spec sizes the model (no ``--eval-data``), so it is checked
  first (:func:`~vatra.federated.model_spec.spec_problem`); a bad one is refused with
  ``INVALID_ARGUMENT`` and a ``join_refused`` event, and the server waits for another client.
  Its data contract (:mod:`~vatra.federated.contract`, bounded and type-checked) becomes the
  federation's when the server has none; a later joiner whose contract differs is refused with
  ``FAILED_PRECONDITION`` and the line naming the column.
- ``Contract``: the federation's data contract (or none yet), which a client reads before it joins.
- ``Poll``: a task is logged (``task_sent``) and counted in ``bytes_down`` once, when first
  handed out. The same task again (its answer lost) at most once per :data:`REFETCH_S`; a
  faster poll is held like any long poll, so a flood costs neither log lines nor bandwidth.
- ``Submit``: a result is for the (round, phase) posted when it arrived; it must be that phase's
  type (a fit task takes only a ``FitRes``, an evaluate task only an ``EvalRes``), come from a
  client that was handed that task, and be its first answer: one evaluation report per client per
  round. One that finds another phase posted once it is read is refused and changes nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import torch

from vatra.config import Config
from vatra.data import DatasetSpec
from vatra.errors import VatraError
from vatra.federated._base import EvalRes, Failure, FitIns, FitRes, UploadHook
from vatra.federated.certs import ServerCredentials
from vatra.federated.contract import DataContract, conform_problem, pins_problem
from vatra.federated.data import spec_from_json, spec_to_json
from vatra.federated.edgesync import EdgeSync
from vatra.federated.grpc.guard import metadata_client
from vatra.federated.grpc.remote import SERVICE
from vatra.federated.grpc.stages import HubStages, secagg_reply
from vatra.federated.model_spec import check_spec, spec_problem
from vatra.federated.params import ParamLayout
from vatra.federated.wire import (
    WireError,
    check_update,
    decode_eval_res,
    decode_res,
    decode_views,
    encode,
    encode_ins,
)
from vatra.models import build_model
from vatra.rundir import RunDir

POLL_WAIT_S = 2.0  # a Poll with nothing new for its client answers "wait" after this long
REFETCH_S = 1.0  # a client may fetch the task it already holds again once per this long


class Hub:
    """State shared by the gRPC handler threads and the round loop (guarded by one condition)."""

    def __init__(
        self,
        cfg: Config,
        creds: ServerCredentials,
        run_dir: RunDir,
        hook: UploadHook,
        spec: DatasetSpec | None = None,
        contract: DataContract | None = None,
    ) -> None:
        self.config = cfg
        self.cfg = cfg.federated
        self.creds = creds
        self.run_dir = run_dir
        self.hook = hook
        self.cond = threading.Condition()
        self.spec = spec  # the model's data spec: the server's eval data, else the first client's
        self.contract = contract  # the federation's data contract: the same, for tables
        self.declared: dict[int, int] = {}  # training rows each client declared at join
        self.last_seen: dict[int, float] = {}
        self.round = 0  # (round, phase): the task set posted now; a result is only ever for it
        self.phase = "fit"
        self.round_deadline = 0.0  # monotonic: the whole round (training and secure aggregation)
        self.tasks: dict[int, bytes] = {}
        self.sent: set[int] = set()  # clients handed this (round, phase)'s task
        self.expected = 0
        self.results: dict[int, FitRes | EvalRes] = {}
        self.failures: dict[int, str] = {}
        self.bytes_down = 0
        self.bytes_up = 0
        self.done = False
        self.payload_ok: Callable[[str], bool] | None = None  # payload tensors a fit result may carry
        self.stage_tasks: dict[int, bytes] = {}  # secure aggregation: this stage's request per client
        self.stage_replies: dict[int, bytes | str] = {}
        self.handed: dict[int, tuple[object, float]] = {}  # client → (what it was last handed, when)
        self.stages = HubStages(self)
        self.sync: EdgeSync | None = None  # cloud-edge sync: fp32 or int8 per declared device profile

    # ------------------------------------------------------------ handlers
    def _auth(self, context: grpc.ServicerContext) -> int:
        """The caller's id; the interceptor (:class:`~vatra.federated.grpc.guard.TokenAuth`) has checked
        its token before any body was read (checked again here: cheap, and handlers stay safe alone)."""
        cid, token = metadata_client(context.invocation_metadata())
        if cid < 0 or not self.creds.check(cid, token):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "unknown client id or wrong token")
        with self.cond:
            self.last_seen[cid] = time.monotonic()
        return cid

    def _refuse_join(
        self, context: grpc.ServicerContext, cid: int, code: grpc.StatusCode, reason: str
    ) -> None:
        self.run_dir.log_event("join_refused", client=cid, reason=reason)
        context.abort(code, reason)

    def join(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        cid = self._auth(context)
        try:
            meta, _ = decode_views(request)
            spec = spec_from_json(meta.get("spec"))
            check_spec(spec)
            given = meta.get("num_train")
            if not isinstance(given, int) or isinstance(given, bool) or not 0 < given < 2**53:
                raise ValueError(f"num_train must be a positive integer, got {given!r}")
            rows = given
            raw = meta.get("contract")
            contract = None if raw is None else DataContract.from_json(raw)
        except (WireError, ValueError, TypeError) as err:
            reason = f"client {cid}: a join must say the shape of its data ({err})"
            self._refuse_join(context, cid, grpc.StatusCode.INVALID_ARGUMENT, reason)
        with self.cond:
            first = self.spec is None
        problem = spec_problem(self.config, spec) if first else None  # outside the lock: builds on meta
        if problem is None and contract is not None and self.contract is None:
            problem = pins_problem(self.config, contract)
        if problem is not None:
            reason = f"client {cid}: the server cannot build its model from this join: {problem}"
            self._refuse_join(context, cid, grpc.StatusCode.INVALID_ARGUMENT, reason)
        with self.cond:
            if self.spec is None:
                self.spec = spec
                self.run_dir.log_event("model_spec", client=cid, spec=spec_to_json(spec))
                self.cond.notify_all()
            mine, theirs = spec_to_json(self.spec), spec_to_json(spec)
            if self.contract is None and contract is not None and mine == theirs:  # the first to publish
                self.contract = contract
                self.run_dir.log_event("data_contract", client=cid, contract=contract.to_json())
            federation = self.contract
        if federation is not None and contract != federation:
            if contract is None:
                differs = "it sends none (its data is no table)"
            else:
                differs = conform_problem(contract, federation) or (
                    "its columns, categories or classes are not yet in the federation's order "
                    "(the client reads the contract and conforms when it joins again)"
                )
            reason = f"client {cid}'s data does not follow the federation's data contract: {differs}"
            self._refuse_join(context, cid, grpc.StatusCode.FAILED_PRECONDITION, reason)
        if mine != theirs:
            diff = {k: (theirs[k], mine[k]) for k in mine if mine[k] != theirs.get(k)}
            reason = f"client {cid}'s data does not fit the server's model: (client, server) = {diff}"
            self._refuse_join(context, cid, grpc.StatusCode.FAILED_PRECONDITION, reason)
        profile = meta.get("device_profile")
        if profile is not None:
            with self.cond:
                refused = self._edge_sync().declare(cid, profile)
            if refused is not None:
                self._refuse_join(
                    context, cid, grpc.StatusCode.FAILED_PRECONDITION, f"client {cid}: {refused}"
                )
        with self.cond:
            self.declared[cid] = rows
        self.run_dir.log_event("joined", client=cid, peer=context.peer(), rows=rows)
        return encode({"kind": "joined", "rounds": self.cfg.rounds, "heartbeat_s": self.cfg.heartbeat_s})

    def _edge_sync(self) -> EdgeSync:
        """What each client is sent (fp32, or int8 for a device that declared a small profile); built
        once the model's spec is known, without touching the global RNG the server draws from."""
        if self.sync is None:
            assert self.spec is not None, "the model's spec is known before a join or a task"
            # on the meta device: shapes only, no draw from the RNG the server's own thread draws from
            # (fork_rng here raced with it: its restore undid the server's draws made meanwhile)
            with torch.device("meta"):
                shapes = ParamLayout.of(build_model(self.config.model, self.spec)).shapes
            self.sync = EdgeSync(self.config, shapes, simulated=False)
        return self.sync

    def wait_spec(self) -> DatasetSpec:
        """The model's data spec: known already, or the first joining client's."""
        deadline = time.monotonic() + self.cfg.join_timeout_s
        with self.cond:
            while self.spec is None:
                if time.monotonic() > deadline:
                    raise VatraError(
                        f"no client joined within federated.join_timeout_s = {self.cfg.join_timeout_s:g} s "
                        "(the server learns the model's input shape from the first client, or from "
                        "--eval-data)"
                    )
                self.cond.wait(0.2)
            return self.spec

    def data_contract(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """The federation's data contract, or none while no party has published one."""
        self._auth(context)
        with self.cond:
            contract = self.contract
        return encode({"kind": "contract", "contract": None if contract is None else contract.to_json()})

    def heartbeat(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self._auth(context)
        return encode({"kind": "ok"})

    def _pending(self, cid: int) -> tuple[object, bytes] | None:
        """(what, request) the client should be handed now: a secure-aggregation stage, else its task."""
        if cid in self.stage_tasks and cid not in self.stage_replies:
            blob = self.stage_tasks[cid]
            return ("stage", blob), blob
        if cid in self.tasks and cid not in self.results and cid not in self.failures:
            return (self.round, self.phase), self.tasks[cid]
        return None

    def poll(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        cid = self._auth(context)
        deadline = time.monotonic() + POLL_WAIT_S
        with self.cond:
            while True:
                now = time.monotonic()
                wake = deadline
                pending = self._pending(cid)
                if pending is not None:
                    what, blob = pending
                    last, at = self.handed.get(cid, (None, 0.0))
                    if last != what or now - at >= REFETCH_S:
                        self.handed[cid] = (what, now)
                        if what == (self.round, self.phase) and cid not in self.sent:  # first hand-out
                            self.sent.add(cid)
                            self.bytes_down += len(blob)
                            self.run_dir.log_event(
                                "task_sent", client=cid, round=self.round, phase=self.phase, bytes=len(blob)
                            )
                        return blob
                    wake = min(deadline, at + REFETCH_S)  # fetched again too soon: held like a long poll
                elif self.done:
                    return encode({"kind": "done"})
                if deadline - now <= 0:
                    return encode({"kind": "wait"})
                self.cond.wait(max(wake - now, 0.0))

    def _check(self, cid: int, res: FitRes | EvalRes) -> str | None:
        """Why ``res`` from ``cid`` may not be the answer to the posted task (lock held), or None."""
        rnd, phase = self.round, self.phase
        kind = EvalRes if phase == "eval" else FitRes
        if not isinstance(res, kind):
            return f"a {type(res).__name__} answers no {phase} task"
        if res.client_id != cid:
            return f"update names client {res.client_id} but the token is client {cid}'s"
        if res.round != rnd or cid not in self.tasks:
            return f"update for round {res.round}, but client {cid} has no {phase} task in round {rnd}"
        if cid not in self.sent:
            return f"client {cid} answered round {rnd}'s {phase} task before it was handed the task"
        if cid in self.results:
            return f"client {cid} already returned round {rnd}'s {phase} task"
        if cid in self.failures:
            return f"round {rnd} was already closed for client {cid} ({self.failures[cid]})"
        return check_update(res, self.expected) if isinstance(res, FitRes) else None

    def submit(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        cid = self._auth(context)
        with self.cond:
            rnd, phase = self.round, self.phase  # the only task this result may answer
            self.bytes_up += len(request)
        reason = None
        res: FitRes | EvalRes | None = None
        try:
            if phase == "eval":
                res = decode_eval_res(request)
            else:
                res = self.hook.decode(decode_res(request, allowed_payload=self.payload_ok))
        except WireError as err:
            reason = str(err)
        with self.cond:
            if (self.round, self.phase) != (rnd, phase):  # the next task was posted while it was read
                reason = f"round {rnd}'s {phase} phase ended before this result was read; nothing taken"
            else:
                if res is not None:
                    reason = self._check(cid, res)
                if reason is None and res is not None:
                    self.results[cid] = res
                elif cid in self.tasks and cid not in self.results:
                    self.failures.setdefault(cid, f"rejected: {reason}")
                self.cond.notify_all()
        if reason is not None:
            self.run_dir.log_event("update_rejected", client=cid, round=rnd, phase=phase, reason=reason)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, reason)
        return encode({"kind": "accepted"})

    def secagg(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        secagg_reply(self, self._auth(context), request, context)
        return encode({"kind": "accepted"})

    def handler(self) -> grpc.GenericRpcHandler:
        methods: dict[str, Callable[[bytes, grpc.ServicerContext], bytes]] = {
            "Join": self.join,
            "Contract": self.data_contract,
            "Heartbeat": self.heartbeat,
            "Poll": self.poll,
            "Submit": self.submit,
            "SecAgg": self.secagg,
        }
        return grpc.method_handlers_generic_handler(
            SERVICE, {name: grpc.unary_unary_rpc_method_handler(fn) for name, fn in methods.items()}
        )

    # ---------------------------------------------------------- round loop
    def _alive(self, now: float) -> set[int]:
        """Clients that joined and were heard from lately. Only a join counts: any authenticated call
        refreshes ``last_seen``, and a refused join (a device too small, data that does not fit) must
        not start a round for a client whose accepted join, and its device profile, are yet to come."""
        limit = self.cfg.heartbeat_s * self.cfg.heartbeat_misses
        return {c for c, t in self.last_seen.items() if c in self.declared and now - t <= limit}

    def available(self) -> list[int]:
        """Alive clients once all configured ones are, or ``min_clients`` after a short grace."""
        start = time.monotonic()
        grace = self.cfg.heartbeat_s * self.cfg.heartbeat_misses
        with self.cond:
            while True:
                now = time.monotonic()
                alive = self._alive(now)
                if len(alive) >= self.cfg.clients or (
                    len(alive) >= self.cfg.min_clients and now - start >= grace
                ):
                    return sorted(alive)
                if now - start > self.cfg.join_timeout_s:
                    raise VatraError(
                        f"only {len(alive)} client(s) connected within federated.join_timeout_s = "
                        f"{self.cfg.join_timeout_s:g} s; federated.min_clients is {self.cfg.min_clients}"
                    )
                self.cond.wait(0.2)

    def _phase(
        self, phase: str, rnd: int, ins: dict[int, FitIns], expected: int, deadline: float
    ) -> tuple[list[Any], list[Failure], int, int]:
        """Post one task per client and wait for each: a result, a rejection, a drop-out or ``deadline``."""
        with self.cond:
            self.round, self.expected, self.phase = rnd, expected, phase
            sync = self._edge_sync()
            self.tasks = {c: encode_ins(i, sync.download(c)) for c, i in ins.items()}
            self.sent = set()
            self.results, self.failures = {}, {}
            self.bytes_down = self.bytes_up = 0
            self.cond.notify_all()
            limit = self.cfg.heartbeat_s * self.cfg.heartbeat_misses
            while True:
                now = time.monotonic()
                pending = [c for c in self.tasks if c not in self.results and c not in self.failures]
                if not pending:
                    break
                for c in pending:
                    silent = now - self.last_seen.get(c, 0.0)
                    if silent > limit:
                        self.failures[c] = f"dropped out: no heartbeat for {silent:.1f} s"
                    elif now > deadline:
                        self.failures[c] = f"missed the round deadline ({self.cfg.round_deadline_s:g} s)"
                self.cond.wait(0.2)
            self.tasks = {}
            results = list(self.results.values())
            failures = [Failure(c, r) for c, r in sorted(self.failures.items())]
            return results, failures, self.bytes_down, self.bytes_up

    def fit(
        self, rnd: int, ins: dict[int, FitIns], expected: int
    ) -> tuple[list[FitRes], list[Failure], int, int]:
        self.round_deadline = time.monotonic() + self.cfg.round_deadline_s
        return self._phase("fit", rnd, ins, expected, self.round_deadline)

    def evaluate(self, rnd: int, ins: dict[int, FitIns]) -> tuple[list[EvalRes], list[Failure]]:
        for i in ins.values():
            i.config = {**i.config, "phase": "evaluate"}
        deadline = time.monotonic() + self.cfg.round_deadline_s
        reports, failures, _, _ = self._phase("eval", rnd, ins, 0, deadline)
        return reports, failures

    def run_stage(self, stage: str, rnd: int, requests: dict[int, bytes]) -> dict[int, bytes | str]:
        """One protocol stage over the long poll (:class:`~vatra.federated.grpc.stages.HubStages`)."""
        return self.stages.deliver(stage, rnd, requests)

    def finish(self) -> None:
        with self.cond:
            self.done = True
            self.cond.notify_all()

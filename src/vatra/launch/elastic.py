"""The elastic agent's view of a preemption: the node that got the notice leaves, the others go on.

Workers stopped by a preemption notice have all saved the same step and exit with one of two codes
(:mod:`vatra.resilience.checkpoint.preemption`): 143 where the notice was seen (that machine is going
away), 75 on every other node (those machines stay). torch's agent counts either as a failure of
the worker group: it restarts the workers on the same machine, using up one of ``--max-restarts``,
or ends the job when none are left. :class:`PreemptionAgent` instead:

- **143 among this node's workers** (or a SIGTERM to the launcher itself, which torch forwards to
  them): the node leaves. It takes itself out of the rendezvous at
  once (the others need not wait ~15 s for its heartbeat to expire) and stops as an agent told to
  stop by a signal does, which leaves the rendezvous open: torch closes it for good on any other
  exit of an agent, and the nodes left could not re-form.
- **a re-forming group while this node's workers are still saving** (they marked the node as
  leaving when they saw the notice, :func:`~vatra.resilience.checkpoint.preemption.mark_node_leaving`):
  torch's agent would restart them for the membership change and the node would join the new
  round, see the notice again and save twice; this agent waits for them to exit and leaves.
- **only 75**: the node re-joins the rendezvous at once, without counting a restart (as torch does
  when a node joins). The new round has the nodes left (at least ``MIN`` of ``--nnodes MIN:MAX``)
  and the workers resume from the notice's checkpoint on that world size.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.elastic.agent.server.api import DEFAULT_ROLE, RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dynamic
from torch.distributed.launcher import api as launcher_api

from vatra import _child
from vatra.resilience.checkpoint.preemption import PeerPreempted, Preempted, node_leaving
from vatra.rundir import ERRORS_ENV

log = logging.getLogger("vatra.launch")
LEAVE_WAIT_S = 120.0  # how long a leaving node waits for its workers' save (a notice's usual window)


class PreemptionAgent(LocalElasticAgent):
    """torchrun's agent, but a preemption notice is not a failure of the job (see the module)."""

    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        try:
            return super().run(role)
        except SignalException:  # workers stopped (and saved, on a SIGTERM) by torch's handler
            _leave_rendezvous(self._worker_group.spec.rdzv_handler)
            raise

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.state not in (WorkerState.FAILED, WorkerState.UNHEALTHY) or not result.failures:
            return result
        codes = {failure.exitcode for failure in result.failures.values()}
        if Preempted.exit_code in codes:
            # the launcher's own SIGTERM path (see run): the node leaves, the rendezvous stays open
            raise SignalException("this node got a preemption notice", sigval=signal.SIGTERM)
        if codes == {PeerPreempted.exit_code}:
            errors = os.environ.get(ERRORS_ENV)
            if errors:  # the workers' "another node's notice" lines: no failure to report later
                _child.take_errors(Path(errors))
            log.info("another node was preempted: re-forming the group on the nodes left")
            self._restart_workers(worker_group)  # a new rendezvous round; _remaining_restarts untouched
            return RunResult(state=worker_group.state)
        return result

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        if node_leaving():  # the others re-form while this node's workers save before leaving
            deadline = time.monotonic() + LEAVE_WAIT_S
            while time.monotonic() < deadline:  # _monitor_workers raises once a worker exits 143
                if self._monitor_workers(worker_group).state != WorkerState.HEALTHY:
                    break
                time.sleep(worker_group.spec.monitor_interval)
            raise SignalException("this node got a preemption notice", sigval=signal.SIGTERM)
        super()._restart_workers(worker_group)


def _leave_rendezvous(handler: object) -> None:
    """Take this node out of the c10d/etcd-v2 rendezvous now (torch's own exit step of a new round).

    Uses the dynamic handler's private parts; should they change, the node's heartbeat expires and
    the others drop it by themselves (keep-alive interval × attempts, 15 s by default)."""
    if not isinstance(handler, dynamic.DynamicRendezvousHandler):
        return
    try:
        handler._stop_heartbeats()
        deadline = handler._get_deadline(handler._settings.timeout.close)
        handler._op_executor.run(dynamic._RendezvousExitOp(), deadline)
    except Exception as err:  # leaving early is a courtesy: the heartbeat's expiry does it anyway
        log.warning("could not leave the rendezvous at once (%s); the others drop this node later", err)


@contextmanager
def preemption_agent() -> Iterator[None]:
    """While the block runs, torch's launcher builds a :class:`PreemptionAgent` for its node."""
    before = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = PreemptionAgent  # type: ignore[misc]
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = before  # type: ignore[misc]

"""The incident history of a cluster's hosts, and the policy it sets for the next launch.

Where: one JSON file per cluster, ``$VATRA_INCIDENTS_DIR/<cluster>.json`` (default
``~/.vatra/incidents/``), the cluster named by ``$VATRA_CLUSTER`` (``vatra cluster run`` sets it to
the cluster's name) or ``local``. A host is named by its launcher's ``--local-addr`` (each host of
a network-namespace cluster has its own), else the machine's hostname.

What: every launcher appends, when its launch ends, one incident per worker failure of its own
ranks whose cause (:mod:`vatra.monitor.rca`) is the host's doing — a dead node, out of memory, a
full disk, a communication timeout, a slow node — with the time, run folder, rank and cause.
Failures that are not the machine's fault (user code, data, NaN, a preemption notice, a corrupt
checkpoint) are not held against it.

Policy: a host with ``MAX_INCIDENTS`` (2) or more incidents in the last ``WINDOW_S`` (an hour) is
**excluded** from the next launch when other hosts remain to carry the job (``vatra cluster run``
starts the job on the others); a host that cannot be excluded (the only one) launches as asked,
and the console says so. The file is rewritten atomically and keeps the last day of incidents.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vatra._io import atomic_write
from vatra.rundir import read_jsonl

DIR_ENV = "VATRA_INCIDENTS_DIR"
CLUSTER_ENV = "VATRA_CLUSTER"
WINDOW_S = 3600.0
MAX_INCIDENTS = 2
KEEP_S = 86400.0
HOST_FAULTS = ("dead_node", "oom", "disk_full", "comm_timeout", "slow_node")


def history_path(cluster: str | None = None) -> Path:
    folder = Path(os.environ.get(DIR_ENV) or Path.home() / ".vatra" / "incidents")
    return folder / f"{cluster or os.environ.get(CLUSTER_ENV) or 'local'}.json"


def host_name(local_addr: str | None = None) -> str:
    return local_addr or socket.gethostname()


def load(path: Path) -> dict[str, list[dict[str, Any]]]:
    """host → its incidents ({} for a missing or unreadable file: a history is advice, not state)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    hosts = data.get("hosts") if isinstance(data, dict) else None
    return {
        str(h): [i for i in v if isinstance(i, dict)] for h, v in (hosts or {}).items() if isinstance(v, list)
    }


def record_launch(run: Path, host: str, since: float, path: Path | None = None) -> int:
    """Append this launch's host faults (``worker_failed`` events after ``since`` whose cause is one
    of ``HOST_FAULTS``) to the history; returns how many. Never raises."""
    try:
        events = read_jsonl(run / "events.jsonl")
    except (OSError, ValueError):
        return 0
    found = [
        {
            "time": e["time"],
            "run": str(run),
            "rank": e.get("rank"),
            "cause": e["cause"]["kind"],
            "exit_code": e.get("exit_code"),
        }
        for e in events
        if e.get("event") == "worker_failed"
        and float(e.get("time", 0)) >= since
        and isinstance(e.get("cause"), dict)
        and e["cause"].get("kind") in HOST_FAULTS
    ]
    if not found:
        return 0
    path = path or history_path()
    with contextlib.suppress(OSError):
        hosts = load(path)
        now = time.time()
        kept = {h: [i for i in v if now - float(i.get("time", 0)) < KEEP_S] for h, v in hosts.items()}
        kept.setdefault(host, []).extend(found)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps({"hosts": kept}, indent=1) + "\n")
        return len(found)
    return 0


@dataclass(frozen=True)
class Decision:
    host: str
    incidents: list[dict[str, Any]]  # in the window
    excluded: bool

    def line(self) -> str:
        counts = Counter(str(i.get("cause")).replace("_", " ") for i in self.incidents)
        causes = ", ".join(f"{cause} ×{n}" if n > 1 else cause for cause, n in counts.most_common())
        said = f"incidents: host {self.host} failed {len(self.incidents)} times in the last hour ({causes})"
        if self.excluded:
            return f"{said}: excluded from this launch"
        return f"{said}: no other host to move its work to, launching on it as asked"


def review(hosts: list[str], path: Path | None = None, now: float | None = None) -> list[Decision]:
    """The policy for a launch on ``hosts``: a decision for each host with ``MAX_INCIDENTS`` or
    more incidents in the last ``WINDOW_S``; such hosts are excluded while at least one host stays."""
    history = load(path or history_path())
    now = time.time() if now is None else now
    flagged = {
        h: recent
        for h in hosts
        if len(recent := [i for i in history.get(h, []) if now - float(i.get("time", 0)) < WINDOW_S])
        >= MAX_INCIDENTS
    }
    can_exclude = len(flagged) < len(hosts)
    return [Decision(h, flagged[h], can_exclude) for h in hosts if h in flagged]

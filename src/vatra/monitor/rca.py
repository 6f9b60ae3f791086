"""Root-cause analysis: why a run failed or misbehaved, read from the run's own evidence.

A small set of explicit rules, each a pattern over one kind of evidence, gives a cause with a
confidence; the most confident match wins (ties: the earlier rule). No model is learned: a rule
either holds on the evidence or it does not, and the evidence it matched is kept with the cause.

=================  ==========  ===============================================================
cause              confidence  rule (evidence that fires it)
=================  ==========  ===============================================================
disk_full          0.95        the error says ENOSPC ("No space left on device", vatra's
                               ``DiskFull``); 0.7 when only the run folder's disk is < 1 % free
oom                0.9         the error is an out-of-memory one (``torch.OutOfMemoryError``,
                               ``MemoryError``, "CUDA out of memory", ENOMEM); 0.7: a SIGKILL
                               with the machine's available memory under 5 % (the OOM killer)
corrupt_checkpoint 0.95        a ``checkpoint_corrupt`` event, or the error names a checksum /
                               manifest / checkpoint that does not read back
preemption         0.9         SIGTERM (exit 143, or the launcher's own SIGTERM), a preemption
                               notice, or the workers' "SIGTERM at step ..." line; 0.6 for a
                               ``KeyboardInterrupt`` (stopped from outside)
nan                0.85        the error or a healing action says non-finite, or the last
                               steps' loss or gradient norm is NaN/inf; 0.7 for a loss spike
                               (divergence) that healing rolled back or the detectors alarmed on
comm_timeout       0.85        a collective's error says it timed out (gloo, NCCL watchdog,
                               the store's wait, ``DistBackendError`` ... timeout)
data_error         0.8         the error is raised by the data path: a decoding or file-format
                               error, or a traceback through a dataset / DataLoader frame
slow_node          ratio-based the collective-wait straggler detector's evidence (see
                               :mod:`vatra.monitor.straggler`): min(0.9, 0.5 + (ratio − 1)/4)
user_error         0.75        a Python exception raised in the user's own code (the
                               innermost frame outside vatra, torch and the standard library),
                               or a config error (exit code 2)
dead_node          0.6         a rank killed by SIGKILL (or SIGSEGV, SIGBUS, ...) without an
                               error of its own and with memory to spare; 0.5 for a rank that
                               only lost a peer (the dead one's cause is the one to read)
unknown            0.2         nothing above fits
=================  ==========  ===============================================================
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

KINDS = (
    "oom",
    "comm_timeout",
    "dead_node",
    "slow_node",
    "nan",
    "data_error",
    "disk_full",
    "corrupt_checkpoint",
    "preemption",
    "user_error",
    "unknown",
)

ACTIONS = {  # recommended when nothing was done about it (a caller names what it did instead)
    "oom": "lower train.batch_size (or raise train.grad_accum); balance.method = 'adaptive' caps batches "
    "by memory",
    "comm_timeout": "check the link between the ranks (GLOO_SOCKET_IFNAME, firewall); raise dist.timeout_s "
    "if a peer is only slow",
    "dead_node": "restart the group from the last checkpoint (--max-restarts); a host that fails twice "
    "in an hour gets a smaller share",
    "slow_node": "move work off the slow rank (balance.method = 'proportional') or exclude its host",
    "nan": "heal.enabled rolls back and skips the faulty data; lower optim.lr or set train.clip_grad_norm",
    "data_error": "fix or drop the bad records the error names; a resume starts at the same batch",
    "disk_full": "free space on the run folder's disk (or lower checkpoint.keep_last), then run the same "
    "command again",
    "corrupt_checkpoint": "resumed from the newest intact ancestor; `vatra ckpt verify RUN` lists the damage",
    "preemption": "run the same command with the same --run-dir: it resumes from the notice's checkpoint",
    "user_error": "fix the user code at the innermost frame of the traceback",
    "unknown": "read the workers' output above; nothing in the run's evidence names a cause",
}

WORDS = {
    "oom": "out of memory",
    "comm_timeout": "communication timeout",
    "dead_node": "dead node",
    "slow_node": "slow node",
    "nan": "NaN / divergence",
    "data_error": "data error",
    "disk_full": "disk full",
    "corrupt_checkpoint": "corrupt checkpoint",
    "preemption": "preemption",
    "user_error": "user code error",
    "unknown": "unknown cause",
}

_DISK = re.compile(r"No space left on device|ENOSPC|Disk quota exceeded|DiskFull|no space left", re.I)
_OOM = re.compile(
    r"OutOfMemoryError|out of memory|MemoryError|Cannot allocate memory|ENOMEM|"
    r"DefaultCPUAllocator: can't allocate",
    re.I,
)
_CORRUPT = re.compile(
    r"sha256|checksum|manifest|checkpoint.*(damaged|corrupt|unreadable)|(damaged|corrupt).*checkpoint", re.I
)
_PREEMPT = re.compile(r"SIGTERM|preemption notice|Preempted", re.I)
_NAN = re.compile(r"non-finite|\bnan\b|\binf\b|diverg", re.I)
_TIMEOUT = re.compile(
    r"timed out|timeout|Watchdog caught collective operation|wait timeout|DistStoreError", re.I
)
_DATA = re.compile(
    r"DataLoader worker|UnicodeDecodeError|ArrowInvalid|ParquetError|cannot identify image|decode|"
    r"malformed|bad record|corrupt(ed)? (record|row|file|image)|invalid (literal|value) .* column",
    re.I,
)
_DATA_FRAMES = re.compile(r"torch/utils/data/|vatra/data/|__getitem__|__iter__|collate", re.I)
_PEER = re.compile(r"lost a peer|Connection (closed|reset) by peer|Broken pipe|Connection refused", re.I)
_FRAME = re.compile(r'File "([^"]+)", line \d+')
_LIBRARY = re.compile(r"/(vatra|torch|site-packages|dist-packages|lib/python3\.\d+)/")
_FATAL_SIGNALS = ("SIGKILL", "SIGSEGV", "SIGBUS", "SIGABRT", "SIGILL", "SIGHUP")


@dataclass
class Evidence:
    """What is known about one failure or anomaly; every field may be missing.

    ``exit_code``: the process's (negative: killed by that signal); ``error``: its own one-line
    error or exception (``"OutOfMemoryError: ..."``); ``traceback``: the exception's traceback or
    a log tail; ``recent``: the last metrics records before the event; ``events``: events of the
    run since the attempt began (a notice, a corrupt checkpoint, a healing action, a straggler);
    ``disk_free_frac`` / ``mem_available_frac``: the run folder's disk and the machine's memory.
    """

    rank: int | None = None
    exit_code: int | None = None
    signal: str | None = None
    error: str = ""
    traceback: str = ""
    recent: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    disk_free_frac: float | None = None
    mem_available_frac: float | None = None
    straggler: dict[str, Any] | None = None


Rule = Callable[[Evidence], tuple[float, list[str]] | None]


def _said(ev: Evidence) -> str:
    return f"{ev.error}\n{ev.traceback}"


def _quote(text: str, pattern: re.Pattern[str]) -> str:
    """The line of ``text`` the pattern matched, cut short."""
    for line in text.splitlines():
        if pattern.search(line):
            line = line.strip()
            return line if len(line) <= 160 else line[:157] + "..."
    return ""


def _disk(ev: Evidence) -> tuple[float, list[str]] | None:
    if _DISK.search(_said(ev)):
        return 0.95, [f"error: {_quote(_said(ev), _DISK)}"]
    if ev.disk_free_frac is not None and ev.disk_free_frac < 0.01:
        return 0.7, [f"run folder's disk {ev.disk_free_frac:.2%} free"]
    return None


def _oom(ev: Evidence) -> tuple[float, list[str]] | None:
    if _OOM.search(_said(ev)):
        return 0.9, [f"error: {_quote(_said(ev), _OOM)}"]
    low = ev.mem_available_frac is not None and ev.mem_available_frac < 0.05
    if ev.signal == "SIGKILL" and low:
        return 0.7, ["killed by SIGKILL", f"machine memory {ev.mem_available_frac:.1%} available"]
    return None


def _corrupt(ev: Evidence) -> tuple[float, list[str]] | None:
    seen = [e for e in ev.events if e.get("event") == "checkpoint_corrupt"]
    if seen:
        first = seen[0]
        return 0.95, [f"checkpoint {first.get('version')}: {str(first.get('problem'))[:160]}"]
    if _CORRUPT.search(ev.error):
        return 0.8, [f"error: {_quote(ev.error, _CORRUPT)}"]
    return None


def _preemption(ev: Evidence) -> tuple[float, list[str]] | None:
    notices = [e for e in ev.events if e.get("event") == "preemption_notice"]
    if notices:
        return 0.9, [f"preemption notice ({notices[0].get('detail') or notices[0].get('source')})"]
    if ev.signal == "SIGTERM" or ev.exit_code == 143:
        return 0.9, [f"stopped by SIGTERM (exit code {ev.exit_code})"]
    if _PREEMPT.search(ev.error):
        return 0.85, [f"error: {_quote(ev.error, _PREEMPT)}"]
    if ev.error.startswith("KeyboardInterrupt"):  # SIGINT, or the agent passing on a stop
        return 0.6, ["interrupted from outside (KeyboardInterrupt): an operator or a stop signal"]
    return None


def _nan(ev: Evidence) -> tuple[float, list[str]] | None:
    if _NAN.search(ev.error):
        return 0.85, [f"error: {_quote(ev.error, _NAN)}"]
    if ev.signal in _FATAL_SIGNALS:  # killed from outside: a NaN skipped just before did not send the signal
        return None
    bad = [
        m["step"]
        for m in ev.recent
        if any((isinstance(m.get(k), float) and m[k] != m[k]) or m.get(k) in (float("inf"), float("-inf"))
               for k in ("loss", "grad_norm"))
    ]  # fmt: skip
    if bad:
        return 0.85, [f"non-finite loss or gradient norm at step(s) {bad[:5]}"]
    heals = [
        e for e in ev.events if e.get("event") == "heal" and e.get("action") in ("rollback", "skip_update")
    ]
    for e in heals:
        if _NAN.search(str(e.get("reason", ""))):
            return 0.85, [f"healing: {e.get('action')} ({e.get('reason')}) at step {e.get('step')}"]
    if heals:
        e = heals[0]
        return 0.7, [f"healing: {e.get('action')} ({e.get('reason')}) at step {e.get('step')}"]
    for e in (e for e in ev.events if e.get("event") == "anomaly"):
        values = json.dumps(e.get("values"), default=str)
        streams = ", ".join(map(str, e.get("streams") or [])) or "the training streams"
        if re.search(r"NaN|Infinity|\bnan\b|\binf\b", values):
            return 0.85, [f"anomaly on {streams} at step {e.get('step')}: non-finite values"]
        return 0.7, [f"anomaly on {streams} at step {e.get('step')} (detectors {e.get('detectors')})"]
    return None


def _timeout(ev: Evidence) -> tuple[float, list[str]] | None:
    said = _said(ev)
    if _TIMEOUT.search(said) and not _DATA_FRAMES.search(ev.traceback):
        return 0.85, [f"error: {_quote(said, _TIMEOUT)}"]
    return None


def _data(ev: Evidence) -> tuple[float, list[str]] | None:
    if _DATA.search(ev.error):
        return 0.8, [f"error: {_quote(ev.error, _DATA)}"]
    frames = _FRAME.findall(ev.traceback)
    if ev.error and frames and _DATA_FRAMES.search(" ".join(frames[-3:]) + ev.traceback[-400:]):
        return 0.75, [f"error: {ev.error[:160]}", "raised while reading a batch (dataset / DataLoader frame)"]
    return None


def _slow(ev: Evidence) -> tuple[float, list[str]] | None:
    s = ev.straggler
    if not s:
        return None
    ratio = float(s.get("ratio_to_median", 1.0))
    return min(0.9, 0.5 + (ratio - 1.0) / 4), [str(x) for x in s.get("evidence", [])]


def _user(ev: Evidence) -> tuple[float, list[str]] | None:
    if ev.exit_code == 2:
        return 0.75, [f"config error: {ev.error[:160]}" if ev.error else "exit code 2 (a config error)"]
    frames = _FRAME.findall(ev.traceback)
    if ev.error and frames and not _LIBRARY.search(frames[-1]) and not _PEER.search(ev.error):
        return 0.75, [f"error: {ev.error[:160]}", f"raised in {frames[-1]}"]
    return None


def _dead(ev: Evidence) -> tuple[float, list[str]] | None:
    if ev.signal in _FATAL_SIGNALS and not ev.error:
        said = [f"rank {ev.rank} killed by {ev.signal}, no error of its own"]
        if ev.mem_available_frac is not None:
            said.append(f"machine memory {ev.mem_available_frac:.0%} available (not the OOM killer)")
        return 0.6, said
    if _PEER.search(ev.error):
        return 0.5, [f"error: {_quote(ev.error, _PEER)}"]
    return None


RULES: tuple[tuple[str, Rule], ...] = (
    ("disk_full", _disk),
    ("oom", _oom),
    ("corrupt_checkpoint", _corrupt),
    ("preemption", _preemption),
    ("nan", _nan),
    ("comm_timeout", _timeout),
    ("data_error", _data),
    ("slow_node", _slow),
    ("user_error", _user),
    ("dead_node", _dead),
)


def classify(ev: Evidence, action: str | None = None) -> dict[str, Any]:
    """The cause ``{"kind", "confidence", "evidence", "action"}`` the rules give for ``ev``;
    ``action``: what was done about it (default: the kind's recommendation)."""
    best: tuple[float, str, list[str]] = (0.2, "unknown", [])
    for kind, rule in RULES:
        found = rule(ev)
        if found is not None and found[0] > best[0]:
            best = (found[0], kind, found[1])
    confidence, kind, evidence = best
    if kind == "unknown":
        evidence = [x for x in (ev.error[:160], f"exit code {ev.exit_code}" if ev.exit_code else "") if x]
    return {
        "kind": kind,
        "confidence": round(confidence, 2),
        "evidence": evidence,
        "action": action or ACTIONS[kind],
    }


def line(cause: dict[str, Any], rank: int | None = None) -> str:
    """The console's line: ``cause: out of memory on rank 1 (confidence 0.9): <evidence> → <action>``."""
    where = f" on rank {rank}" if rank is not None else ""
    said = "; ".join(cause.get("evidence") or []) or "no evidence"
    words = WORDS.get(cause["kind"], cause["kind"])
    return f"cause: {words}{where} (confidence {cause['confidence']:.2g}): {said} → {cause['action']}"


def event_cause(kind: str, fields: dict[str, Any], action: str | None = None) -> dict[str, Any]:
    """The cause of an anomaly event (a healing action, a corrupt checkpoint), from the event itself."""
    return classify(Evidence(events=[{"event": kind, **fields}]), action)


# A run's verdict weighs what stopped or restarted it above what bent its training (NaN, a loss spike)
# above what only slowed it (a straggler): a busy machine's slow rank is real, but not why a rank died.
TIERS = {
    "failure": 0,
    "worker_failed": 0,
    "checkpoint_corrupt": 0,
    "launch_end": 0,
    "heal": 1,
    "anomaly": 1,
    "straggler": 2,
}


def diagnosis(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A run's verdict: among its events with a ``cause``, those of the highest tier (``TIERS``:
    failures, then training anomalies, then stragglers), the most confident (the earliest on a
    tie), with the event it came from; None when no event carries one."""
    best: dict[str, Any] | None = None
    for e in events:
        cause = e.get("cause")
        if not isinstance(cause, dict):
            continue
        key = (-TIERS.get(str(e.get("event")), 1), cause["confidence"])
        if best is None or key > best["_key"]:
            best = {
                **cause,
                "event": e.get("event"),
                "rank": e.get("rank"),
                "step": e.get("step"),
                "_key": key,
            }
    if best is not None:
        del best["_key"]
    return best

"""Fault campaign on the digits example: N runs, each meeting one random fault, against undisturbed runs.

Each run is ``vatra train examples/digits.toml --nproc 2 --max-restarts 2`` with one fault drawn
(seeded) from the kinds below; the kinds are dealt in shuffled rounds, so every kind gets
⌊N/8⌋ or ⌈N/8⌉ runs. Faults come from outside the run wherever one can, timed by watching the run
folder (``.ranks/rank<r>.json``: each rank's last completed step and pid): at the drawn step the
harness SIGSTOPs the workers, records which checkpoint versions are intact, does the damage,
SIGKILLs a rank where the kind says so, and lets the run go on.

    kill9              SIGKILL of a random rank at a random step; the elastic agent restarts the group
    sigterm            spot preemption: SIGTERM to the launcher's process group and every worker; the
                       run saves and exits 143; the harness reruns the same command (same --run-dir)
    corrupt_object     bytes flipped in an object only the latest version holds, then kill -9: the
                       resume must detect it (sha256) and fall back to the parent
    truncate_manifest  the latest version's manifest cut in half, then kill -9
    lost_node          erasure-coded store (k=2, m=3, three folders): one node's folder deleted, then
                       kill -9: the resume reads from the two survivors
    disk_full          the run folder on a 32 MiB tmpfs, filled mid-run: the run must stop with one
                       line; the space is freed and the same command resumes (needs root, else skipped)
    nan_burst          chaos.inject_nan_at three consecutive steps (in-run: a loss cannot be reached
                       from outside)
    lr_spike           chaos.lr_spike_at one step (×100 for 10 steps)

Reported per kind: runs; faults injected (the run was still at the drawn step's attempt); runs that
ended with the undisturbed run's weights — bitwise, model tensors from the final version's DCP
files, compared with the undisturbed run on the same store backend — or, for NaN and LR faults,
with its final validation accuracy within 1 point; runs that stopped (some launch exited non-zero)
and whether every stop was one clear line (the last stderr line ``error: ...``, the only one, and no
Python traceback); data lost (versions intact at fault time that end damaged, or gone while fewer
than ``checkpoint.keep_last`` newer versions exist, which is the only deletion retention makes;
target 0); and the effective-training-time ratio (ETTR, :func:`vatra.monitor.ettr.ettr_of_run`): the final
trajectory's summed ``step_time_s`` over the wall time of every launch the run folder records,
restarts and reruns included. On this machine start-up (imports, spawning, the report) dwarfs 300 steps of a
small MLP, so the undisturbed runs' own ratio is printed with it, and ``vs clean`` divides by it.

Why ``--nproc 2`` and not the example's 4: on this 2-core machine a clean 4-rank run took 52 s
(8.0 s of it training), a 2-rank run 23 s (3.3 s): 4 ranks oversubscribe the cores, and 50 runs
with restarts would take well over an hour. Every rank count exercises the same code paths.

    .venv/bin/python bench/fault_campaign.py [--runs 50] [--seed 0] [--kinds kill9,sigterm,...]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import _faults as F
from _campaign_report import Reference, print_runs, report
from _common import write_result
from vatra.config import Config, load_config
from vatra.errors import VatraError
from vatra.monitor.ettr import ettr_of_run
from vatra.resilience.recovery import read_progress
from vatra.resilience.store import CheckpointStore

KINDS = (
    "kill9",
    "sigterm",
    "corrupt_object",
    "truncate_manifest",
    "lost_node",
    "disk_full",
    "nan_burst",
    "lr_spike",
)
ACCURACY_KINDS = ("nan_burst", "lr_spike")  # healing changes the trajectory: judged on accuracy
KILL_AFTER = ("kill9", "corrupt_object", "truncate_manifest", "lost_node")
STORE_KINDS = ("corrupt_object", "truncate_manifest", "lost_node", "disk_full")  # need a saved version
ERASURE = {"k": 2, "m": 3}
NAN_BURST = 3  # consecutive NaN steps
TMPFS_MB = 32  # a run folder holds ~4 MB: checkpoints (keep_last 5 × 0.4 MB), metrics, report
ACCURACY_POINTS = 0.01
MAX_LAUNCHES = 3  # the first, a rerun after SIGTERM or a freed disk, one more
POLL_S = 0.005  # a digits step takes ~10 ms here


@dataclass(frozen=True)
class Fault:
    index: int
    kind: str
    step: int  # the fault fires once a rank has completed this step
    rank: int  # the rank SIGKILLed (kinds in KILL_AFTER)
    node: int  # the erasure node lost (lost_node)
    seed: int  # for the byte flips and the object chosen

    @property
    def name(self) -> str:
        return f"{self.index:03d}-{self.kind}"


@dataclass
class Setup:
    """What every run shares: the config (with overrides), ranks, restarts, limits, a work folder."""

    config: Path
    overrides: list[str]
    nproc: int
    max_restarts: int
    timeout_s: float
    work: Path
    cfg: Config = field(init=False)

    def __post_init__(self) -> None:
        self.cfg = load_config(self.config, self.overrides)

    def command(self, run: Path, extra: list[str]) -> list[str]:
        sets = ["run.tensorboard=false", "run.progress=off", *self.overrides, *extra]
        return [
            sys.executable,
            "-m",
            "vatra",
            "train",
            str(self.config),
            "--nproc",
            str(self.nproc),
            "--run-dir",
            str(run),
            "--max-restarts",
            str(self.max_restarts),
            *[a for s in sets for a in ("--set", s)],
        ]


def draw_plan(runs: int, kinds: list[str], seed: int, cfg: Config, nproc: int) -> list[Fault]:
    """``runs`` faults: kinds dealt in shuffled rounds (balanced), steps, ranks and nodes drawn per run."""
    rng = random.Random(seed)
    steps = cfg.train.steps
    every = cfg.checkpoint.every_steps if isinstance(cfg.checkpoint.every_steps, int) else 10
    order: list[str] = []
    while len(order) < runs:
        block = list(kinds)
        rng.shuffle(block)
        order += block
    plan = []
    for i, kind in enumerate(order[:runs]):
        if kind in STORE_KINDS:
            lo = every + 5  # at least one version saved
        elif kind in ACCURACY_KINDS:
            lo = 20
        else:
            lo = 5
        hi = steps - (20 if kind in ACCURACY_KINDS else 10)
        step = rng.randint(min(lo, hi), max(lo, hi))
        plan.append(
            Fault(i, kind, step, rng.randrange(nproc), rng.randrange(ERASURE["m"]), rng.getrandbits(32))
        )
    return plan


# -------------------------------------------------------------- one run
def erasure_sets(nodes: Path) -> list[str]:
    paths = ", ".join(f'"{nodes / f"node{i}"}"' for i in range(ERASURE["m"]))
    return [
        f"store.erasure.k={ERASURE['k']}",
        f"store.erasure.m={ERASURE['m']}",
        f"store.erasure.nodes=[{paths}]",
    ]


def chaos_sets(fault: Fault) -> list[str]:
    if fault.kind == "nan_burst":
        burst = ", ".join(str(fault.step + i) for i in range(NAN_BURST))
        return [f"chaos.inject_nan_at=[{burst}]"]
    if fault.kind == "lr_spike":
        return [f"chaos.lr_spike_at=[{fault.step}]"]
    return []


@dataclass
class Injection:
    detail: dict[str, Any]
    intact: dict[str, dict[str, Any]]  # versions intact at fault time (minus the one damaged on purpose)


def inject(job: F.Job, fault: Fault, run: Path, base: Path, store: CheckpointStore, nproc: int) -> Injection:
    """Workers stopped: note the intact versions, do the damage, kill -9 the rank where the kind says."""
    rng = random.Random(fault.seed)
    with F.frozen(job) as workers:
        detail: dict[str, Any] = {"at_step": F.progress_step(run, nproc), "at_time": time.time()}
        intact = F.intact_versions(store)
        version = F.latest_version(store)
        if fault.kind == "sigterm":
            job.terminate()
        elif fault.kind == "corrupt_object" and version is not None:
            manifest = F.read_manifest(store, version)
            others = [m for v, m in F.manifests(store).items() if m is not None and v != version]
            names = F.unique_objects(manifest, others) or {
                n: e["sha256"] for n, e in manifest["files"].items()
            }
            name = rng.choice(sorted(names))
            path = run / "checkpoints" / CheckpointStore.object_key(names[name])
            detail.update(version=version, file=name, offset=F.flip_bytes(path, rng))
            intact.pop(version, None)
        elif fault.kind == "truncate_manifest" and version is not None:
            path = run / "checkpoints" / "versions" / f"{version}.json"
            size = path.stat().st_size
            os.truncate(path, size // 2)
            detail.update(version=version, bytes=size, kept=size // 2)
            intact.pop(version, None)
        elif fault.kind == "lost_node":
            F.remove_node(base / "nodes" / f"node{fault.node}")
            detail.update(node=fault.node)
        elif fault.kind == "disk_full":
            detail.update(filled_bytes=F.fill_disk(run.parent))
        if fault.kind in KILL_AFTER:
            victim = F.rank_pid(workers, read_progress(run, fault.rank))
            detail.update(victim_rank=fault.rank, victim_pid=victim)
            if victim is not None:
                os.kill(victim, signal.SIGKILL)
    return Injection(detail, intact)


@dataclass
class Launches:
    attempts: list[F.Attempt] = field(default_factory=list)
    injection: Injection | None = None
    freed_bytes: int = 0


def launch_until_done(setup: Setup, cmd: list[str], run: Path, base: Path, fault: Fault | None) -> Launches:
    """Launch, inject the fault during the first launch, rerun after a preemption or a freed disk."""
    out = Launches()
    store: CheckpointStore | None = None
    for launch in range(MAX_LAUNCHES):
        job = F.Job(cmd, base / f"launch{launch}", setup.timeout_s)
        try:
            while job.running():
                if fault is not None and out.injection is None and launch == 0:
                    store = store or F.try_open_store(run)
                    if store is not None and ready(fault, run, store, setup.nproc):
                        try:
                            out.injection = inject(job, fault, run, base, store, setup.nproc)
                        except (OSError, VatraError, ValueError, KeyError) as err:  # the run goes on
                            out.injection = Injection({"error": f"{type(err).__name__}: {err}"}, {})
                time.sleep(POLL_S)
        finally:
            if job.proc.poll() is None:
                job.kill()
            attempt = job.finish()
        out.attempts.append(attempt)
        filler = run.parent / "filler"
        if attempt.rc == 0 or attempt.timed_out:
            break
        if fault is not None and fault.kind == "disk_full" and filler.exists():
            out.freed_bytes = filler.stat().st_size
            filler.unlink()  # the operator frees the space, then runs the same command again
        elif attempt.rc != 128 + signal.SIGTERM:  # only a preempted run says "run the same command"
            break
    return out


def injected(fault: Fault, injection: Injection | None) -> bool:
    """The whole fault happened: no error doing the damage, and the rank to kill was found and killed."""
    if injection is None or "error" in injection.detail:
        return False
    return fault.kind not in KILL_AFTER or injection.detail.get("victim_pid") is not None


def ready(fault: Fault, run: Path, store: CheckpointStore, nproc: int) -> bool:
    if F.progress_step(run, nproc) < fault.step:
        return False
    return fault.kind not in STORE_KINDS or F.latest_version(store) is not None


def analyse(setup: Setup, run: Path, launches: Launches) -> dict[str, Any]:
    """What the run folder and the store say once every launch has ended."""
    summary = F.read_json(run / "summary.json")
    finished = bool(launches.attempts) and launches.attempts[-1].rc == 0
    finished = finished and summary.get("steps") == setup.cfg.train.steps
    problems: list[str] = []
    store: CheckpointStore | None = None
    try:
        store = F.open_run_store(run)
    except VatraError as err:
        problems.append(f"store: {err}")
    after = F.intact_versions(store) if store is not None else {}
    latest = F.latest_version(store) if store is not None else None
    final: dict[str, Any] | None = None
    if finished and store is not None and latest is not None:
        try:
            final = F.weights(F.read_version(store, F.read_manifest(store, latest)))
        except (VatraError, ValueError, KeyError) as err:
            problems.append(f"final version {latest}: {err}")
    before = launches.injection.intact if launches.injection else {}
    keep = setup.cfg.checkpoint.keep_last
    return {
        "finished": finished,
        "problems": problems,
        "val_accuracy": summary.get("val_accuracy"),
        "final_version": latest,
        "final": final,
        "lost": F.lost_versions(before, after, keep),
        "intact_at_fault": sorted(before),
        "intact_at_end": sorted(after),
        "verify": F.ckpt_verify(run) if store is not None else (None, "no store"),
        **ettr_of_run(run),  # ettr, ettr_parts: every launch's wall time, from the run folder
        "events": asdict(F.EventDigest.of(F.read_lines(run / "events.jsonl"))),
    }


def run_reference(setup: Setup, variant: str) -> Reference:
    base = setup.work / f"clean-{variant}"
    base.mkdir(parents=True)
    run = base / "run"
    extra = erasure_sets(base / "nodes") if variant == "erasure" else []
    launches = launch_until_done(setup, setup.command(run, extra), run, base, None)
    result = analyse(setup, run, launches)
    if not result["finished"] or result["final"] is None:
        raise SystemExit(
            f"error: the undisturbed {variant} run failed: "
            f"{launches.attempts[-1].last_line or 'no final checkpoint'} (keep its folder with --keep DIR)"
        )
    parts = result["ettr_parts"]
    return Reference(variant, result["final"], result["val_accuracy"], parts["wall"], parts["productive"])


def run_fault(setup: Setup, fault: Fault, refs: dict[str, Reference]) -> dict[str, Any]:
    """One campaign run: launch(es) with the fault, then the verdict against the matching reference."""
    base = setup.work / fault.name
    base.mkdir(parents=True)
    variant = "erasure" if fault.kind == "lost_node" else "local"
    extra = [*chaos_sets(fault), *(erasure_sets(base / "nodes") if variant == "erasure" else [])]
    mount = F.tmpfs(base / "mnt", TMPFS_MB) if fault.kind == "disk_full" else contextlib.nullcontext(base)
    with mount as where:
        run = where / "run"
        launches = launch_until_done(setup, setup.command(run, extra), run, base, fault)
        result = analyse(setup, run, launches)
        if run.parent != base:  # on the tmpfs: keep the run folder for --keep once it is unmounted
            shutil.copytree(run, base / "run", symlinks=True, ignore_dangling_symlinks=True)
    ref = refs[variant]
    final = result.pop("final")
    difference = F.first_difference(final["model"], ref.weights["model"]) if final is not None else "no final"
    optim_difference = F.first_difference(final["optim"], ref.weights["optim"]) if final is not None else None
    acc = result["val_accuracy"]
    if fault.kind in ACCURACY_KINDS:
        ok = result["finished"] and acc is not None and abs(acc - ref.val_accuracy) <= ACCURACY_POINTS
    else:
        ok = result["finished"] and difference is None
    stops = [a for a in launches.attempts if a.rc != 0]
    wall = sum(a.wall_s for a in launches.attempts)
    return {
        **asdict(fault),
        "variant": variant,
        "injected": injected(fault, launches.injection),
        "injection": launches.injection.detail if launches.injection else None,
        "attempts": [a.record() for a in launches.attempts],
        "freed_bytes": launches.freed_bytes,
        "ok": ok,
        "weights_equal": difference is None,
        "first_difference": difference,
        "optim_equal": final is not None and optim_difference is None,
        "accuracy_delta": acc - ref.val_accuracy if acc is not None else None,
        "stopped": bool(stops),
        "clear_stops": bool(stops) and all(a.clear_stop for a in stops),
        "wall_s": wall,
        **result,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default=",".join(KINDS), help="Comma-separated subset of: " + ", ".join(KINDS))
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--max-restarts", type=int, default=2)
    ap.add_argument(
        "--timeout", type=float, default=600.0, help="Seconds one launch may take before it is killed."
    )
    ap.add_argument("--config", type=Path, default=F.ROOT / "examples" / "digits.toml")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--keep", type=Path, default=None, help="Keep the run folders here (default: removed).")
    args = ap.parse_args()
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds or args.runs < 1:
        ap.error(
            f"--kinds: unknown {unknown}; choose from {', '.join(KINDS)}"
            if unknown
            else "need --runs ≥ 1 and a kind"
        )
    skipped = {}
    if "disk_full" in kinds and (why := F.can_mount()) is not None:
        skipped["disk_full"] = why
        kinds.remove("disk_full")
        print(f"skipping disk_full: {why}")
    if not kinds:
        raise SystemExit("error: no fault kind left to run")
    t0 = time.perf_counter()
    work = args.keep or Path(tempfile.mkdtemp(prefix="vatra-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        setup = Setup(args.config, args.overrides, args.nproc, args.max_restarts, args.timeout, work)
        plan = draw_plan(args.runs, kinds, args.seed, setup.cfg, args.nproc)
        variants = ["local", *(["erasure"] if "lost_node" in kinds else [])]
        refs = {v: run_reference(setup, v) for v in variants}
        records = []
        for fault in plan:
            record = run_fault(setup, fault, refs)
            records.append(record)
            print(
                f"[{fault.index + 1}/{len(plan)}] {fault.kind} at step {fault.step}: "
                f"{'ok' if record['ok'] else 'NOT ok'}, exit codes {[a['rc'] for a in record['attempts']]}, "
                f"{record['wall_s']:.0f} s",
                flush=True,
            )
            if args.keep is None:
                shutil.rmtree(work / fault.name, ignore_errors=True)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print_runs(records)
    rows, totals = report(records, refs, KINDS)
    equal_refs = None
    if "erasure" in refs:
        equal_refs = F.first_difference(refs["erasure"].weights, refs["local"].weights) is None
        print(f"undisturbed erasure run equal to the local one: {equal_refs}")
    wall = time.perf_counter() - t0
    print(f"campaign wall time {wall:.0f} s")
    write_result(
        "fault_campaign",
        {
            "command": "bench/fault_campaign.py " + " ".join(sys.argv[1:]),
            "config": str(
                args.config.relative_to(F.ROOT) if args.config.is_relative_to(F.ROOT) else args.config
            ),
            "overrides": args.overrides,
            "runs": args.runs,
            "seed": args.seed,
            "nproc": args.nproc,
            "max_restarts": args.max_restarts,
            "kinds": kinds,
            "skipped_kinds": skipped,
            "references": {
                v: {
                    "wall_s": r.wall_s,
                    "productive_s": r.productive_s,
                    "ratio": r.productive_s / r.wall_s,
                    "val_accuracy": r.val_accuracy,
                }
                for v, r in refs.items()
            },
            "erasure_reference_equals_local": equal_refs,
            "per_kind": rows,
            "totals": totals,
            "campaign_wall_s": wall,
            "run_records": records,
        },
    )


if __name__ == "__main__":
    main()

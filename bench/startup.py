"""Start-up: the whole ``vatra train`` command against ``torchrun`` of a plain script (issue 36 item 10).

    python bench/startup.py [--repeats 3] [--steps 60] [--nproc 2]

Side by side, alternating run by run so machine noise hits both alike:

- vatra: ``vatra train examples/digits.toml --nproc 2 --set train.steps=60 --set run.progress=off
  --run-dir TMP`` — everything a user gets (run folder, checkpoints, TensorBoard, report, summary);
- torchrun: ``torchrun --nproc-per-node 2 --standalone bench/_startup_plain.py`` — the same MLP on
  the same digits with DDP on gloo, the same steps and per-rank batch size, nothing else.

Wall time is the command's, from before it is started to its exit. Time to first step is from the
same start to the end of rank 0's first optimizer step: the plain script writes that time itself;
for vatra it is the ``attempt_start`` event's time (logged as the training loop begins) plus step 1's
``step_time_s`` from metrics.jsonl. Prints medians and the vatra/torchrun ratio; writes
bench/results/startup.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import print_table, write_result

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def run_vatra(tmp: Path, steps: int, nproc: int) -> tuple[float, float]:
    run_dir = tmp / "run"
    cmd = [sys.executable, "-m", "vatra", "train", str(ROOT / "examples/digits.toml"), "--nproc", str(nproc)]
    cmd += ["--set", f"train.steps={steps}", "--set", "run.progress=off", "--run-dir", str(run_dir)]
    start = time.time()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=_env())
    wall = time.time() - start
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    begun = next(e["time"] for e in events if e["event"] == "attempt_start")
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    return wall, begun + first["step_time_s"] - start


def run_torchrun(tmp: Path, steps: int, nproc: int) -> tuple[float, float]:
    mark = tmp / "first_step"
    torchrun = shutil.which("torchrun", path=str(BIN)) or "torchrun"
    cmd = [torchrun, "--nproc-per-node", str(nproc), "--standalone", str(ROOT / "bench/_startup_plain.py")]
    cmd += ["--steps", str(steps), "--first-step", str(mark)]
    start = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env())  # torchrun's OMP banner
    wall = time.time() - start
    if done.returncode:
        sys.exit(f"torchrun failed:\n{done.stderr}")
    return wall, float(mark.read_text()) - start


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each command (alternating)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()

    sides = {"vatra train": run_vatra, "torchrun plain": run_torchrun}
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    for rep in range(args.repeats):
        order = list(sides) if rep % 2 == 0 else list(sides)[::-1]
        for name in order:
            with tempfile.TemporaryDirectory() as tmp:
                wall, first = sides[name](Path(tmp), args.steps, args.nproc)
            runs[name].append((wall, first))
            print(f"rep {rep} {name}: wall {wall:.2f} s, first step at {first:.2f} s", flush=True)

    med = {
        name: (statistics.median(w for w, _ in r), statistics.median(f for _, f in r))
        for name, r in runs.items()
    }
    base_wall, base_first = med["torchrun plain"]
    rows = [
        [name, f"{wall:.2f}", f"{first:.2f}", f"{wall / base_wall:.2f}x", f"{first / base_first:.2f}x"]
        for name, (wall, first) in med.items()
    ]
    load = os.getloadavg()[0]
    print(f"\nmedians of {args.repeats} runs, {args.nproc} ranks, {args.steps} steps, 1-min load {load:.2f}")
    print_table(["command", "wall s", "first step s", "wall ratio", "first-step ratio"], rows)
    write_result(
        "startup",
        {
            "repeats": args.repeats,
            "steps": args.steps,
            "nproc": args.nproc,
            "load_avg_1m_end": load,
            "runs": {name: [{"wall_s": w, "first_step_s": f} for w, f in r] for name, r in runs.items()},
            "median": {name: {"wall_s": w, "first_step_s": f} for name, (w, f) in med.items()},
            "wall_ratio": med["vatra train"][0] / base_wall,
            "first_step_ratio": med["vatra train"][1] / base_first,
        },
    )


if __name__ == "__main__":
    main()

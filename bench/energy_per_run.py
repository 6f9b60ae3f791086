"""Energy per run of shipped examples, with its source, and what measuring it costs.

  python bench/energy_per_run.py [--reps 2] [--nproc 2]

Per example (``examples/digits.toml``, ``examples/tabular/tabular.toml``, their own steps): one plain
process (``vatra.fit``), the ``[energy]`` plugin on (the default) and off (the baseline), alternated
``--reps`` times; then the digits example as a user starts it, ``vatra train --nproc N``, where the
sum runs over N ranks. Reported: energy_kwh and its source from summary.json, joules per step and per
1,000 samples, the CO₂ at the default constant intensity, and samples/s with the plugin on against
off (its overhead). On a machine without NVML or a readable RAPL (this machine) the figure is
the labelled estimate: 4 W per logical CPU × the CPU seconds of the run's processes. CodeCarbon, the
peer a user would pick, measures the same way there (its fallback for an unknown CPU); it is not
installed in this environment, so it is not run side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from _common import print_table, write_result

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = {
    "digits": ROOT / "examples" / "digits.toml",
    "tabular": ROOT / "examples" / "tabular" / "tabular.toml",
}
QUIET = ["run.progress=off", "run.tensorboard=false", "monitor.report=false", "checkpoint.enabled=false"]


def fit_once(config: Path, energy: bool, out: Path) -> dict[str, Any]:
    import vatra
    from vatra.config import load_config

    cfg = load_config(config, [*QUIET, f"energy.enabled={str(energy).lower()}"], run="train")
    return dict(vatra.fit(cfg, run_dir=out).summary)


def launched(config: Path, nproc: int, out: Path) -> dict[str, Any]:
    sets = [a for s in QUIET for a in ("--set", s)]
    cmd = [sys.executable, "-m", "vatra", "train", str(config), "--nproc", str(nproc), "--run-dir", str(out)]
    subprocess.run([*cmd, *sets], check=True, capture_output=True, cwd=ROOT)
    return dict(json.loads((out / "summary.json").read_text()))


def row(name: str, s: dict[str, Any], on_vs_off: float | None) -> list[Any]:
    joules = s["energy_kwh"] * 3.6e6
    overhead = f"{on_vs_off:.3f}" if on_vs_off else "-"
    per_step, per_1k = joules / s["steps"], joules / s["samples_seen"] * 1000
    wh, co2_mg = s["energy_kwh"] * 1000, s["co2_kg"] * 1e6
    return [name, s["world_size"], s["energy_source"], f"{wh:.4f}", f"{per_step:.4f}", f"{per_1k:.2f}",
            f"{co2_mg:.2f}", f"{s['wall_s']:.1f}", overhead]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2, help="ranks of the launched digits run (0: skip it)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not (ROOT / "examples" / "tabular" / "cancer.parquet").exists():
        subprocess.run([sys.executable, str(ROOT / "examples" / "tabular" / "make_data.py")], check=True)
    results: dict[str, Any] = {}
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in EXAMPLES.items():
            on, off = [], []
            for rep in range(args.reps):
                on.append(fit_once(config, True, Path(tmp) / f"{name}-on-{rep}"))
                off.append(fit_once(config, False, Path(tmp) / f"{name}-off-{rep}"))
            off_sps = statistics.median(s["samples_per_s"] for s in off)
            best = sorted(on, key=lambda s: s["energy_kwh"])[len(on) // 2]  # the median run
            ratio = statistics.median(s["samples_per_s"] for s in on) / off_sps
            results[name] = {
                "on": on,
                "off_samples_per_s": [s["samples_per_s"] for s in off],
                "on_vs_off": ratio,
            }
            table.append(row(f"{name} (vatra.fit)", best, ratio))
        if args.nproc:
            s = launched(EXAMPLES["digits"], args.nproc, Path(tmp) / "digits-launched")
            results["digits_launched"] = s
            table.append(row(f"digits (vatra train --nproc {args.nproc})", s, None))
    print_table(
        ["run", "ranks", "source", "Wh", "J/step", "J/1k samples", "CO2 mg", "wall s", "samples/s on÷off"],
        table,
    )
    write_result("energy_per_run", results)


if __name__ == "__main__":
    main()

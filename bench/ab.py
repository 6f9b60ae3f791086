"""Sequential A/B test (mSPRT) against fixed-horizon z-tests: false positives and sample size to a
decision, on simulated conversion experiments.

  python bench/ab.py [--experiments 1000] [--max-n 10000] [--peek-every 100] [--base 0.10]
                     [--lifts 0,0.01,0.02,0.03] [--alpha 0.05] [--seed 0]

Each experiment streams up to ``--max-n`` outcomes split 50/50 (champion converts at ``--base``,
the challenger at base + lift) and is looked at after every ``--peek-every`` outcomes. Four ways to
decide, on the same streams:

- ``msprt``: vatra's always-valid test (``vatra.serve.ab.sequential_test``, horizon = max-n),
  stopped at the first peek where its p-value is below alpha;
- ``z fixed``: a z-test looked at once, at max-n (valid, but no early stop);
- ``z peeked``: the same z-test at every peek, stopped at the first p < alpha (what a dashboard
  that shows a p-value invites; not valid);
- ``z bonferroni``: the z-test at every peek at alpha / peeks (valid, the naive fix).

"rejects" is the share of experiments that declared a difference (the false-positive rate when
lift = 0, the power otherwise); "mean n" is the average outcomes seen when the experiment stopped
(max-n when it never did). Prints a table and writes ``bench/results/ab.json``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from _common import print_table, write_result
from vatra.serve.ab import sequential_test

CHUNK = 100  # experiments per batch: keeps the (CHUNK, max_n) arrays at a few tens of MB


def run(lift: float, args: argparse.Namespace, rng: np.random.Generator) -> dict[str, dict[str, float]]:
    peeks = np.arange(args.peek_every, args.max_n + 1, args.peek_every)
    k = len(peeks)
    stops: dict[str, list[np.ndarray]] = {m: [] for m in ("msprt", "z fixed", "z peeked", "z bonferroni")}
    for start in range(0, args.experiments, CHUNK):
        e = min(CHUNK, args.experiments - start)
        is_b = rng.random((e, args.max_n)) < 0.5
        rate = np.where(is_b, args.base + lift, args.base)
        values = (rng.random((e, args.max_n)) < rate).astype(np.float64)
        s = sequential_test(values, is_b, metric="binary", alpha=args.alpha, horizon=args.max_n, at=peeks)
        for name, hit in (
            ("msprt", s.p < args.alpha),
            ("z fixed", np.zeros_like(s.z_p, dtype=bool)),
            ("z peeked", s.z_p < args.alpha),
            ("z bonferroni", s.z_p < args.alpha / k),
        ):
            if name == "z fixed":
                hit[:, -1] = s.z_p[:, -1] < args.alpha
            first = np.where(hit.any(axis=-1), np.argmax(hit, axis=-1), -1)
            stops[name].append(first)
    out: dict[str, dict[str, float]] = {}
    for name, parts in stops.items():
        first = np.concatenate(parts)
        n_stop = np.where(first >= 0, peeks[first], args.max_n)
        out[name] = {"rejects": float((first >= 0).mean()), "mean_n": float(n_stop.mean())}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experiments", type=int, default=1000)
    ap.add_argument("--max-n", type=int, default=10_000)
    ap.add_argument("--peek-every", type=int, default=100)
    ap.add_argument("--base", type=float, default=0.10)
    ap.add_argument("--lifts", default="0,0.01,0.02,0.03")
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    results: list[dict[str, Any]] = []
    rows = []
    for lift in (float(x) for x in args.lifts.split(",")):
        res = run(lift, args, rng)
        results.append({"lift": lift, **res})
        for name, r in res.items():
            rows.append([f"{lift:+.3f}", name, f"{r['rejects']:.3f}", f"{r['mean_n']:.0f}"])
    print_table(["lift", "test", "rejects", "mean n"], rows)
    wall = time.perf_counter() - t0
    print(f"{args.experiments} experiments per lift, up to {args.max_n} outcomes, in {wall:.1f} s")
    write_result("ab", {"args": vars(args), "results": results, "wall_s": wall})


if __name__ == "__main__":
    main()

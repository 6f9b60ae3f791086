"""Write shelter.parquet beside this file: animals in shelters, the seed report's multi-task example.

    python examples/multitask/make_data.py

Each row is an animal: age, weight, days in the shelter, a behaviour assessment's inputs, its
shelter ("site", a category) and how full that shelter is (``occupancy``, 1.0 = at capacity).
Two targets: ``adopted`` (0/1, within 30 days) and ``behaviour`` (a compatibility score). A
model that only chased adoption would favour animals in crowded shelters, where demand is high;
the penalty in ``model.py`` discourages that, so adoptions spread to less crowded sites.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROWS, SITES, SEED = 4000, 6, 11


def main() -> Path:
    rng = np.random.default_rng(SEED)
    site = rng.integers(0, SITES, ROWS)
    site_occupancy = rng.uniform(0.6, 1.4, SITES)
    occupancy = site_occupancy[site] + rng.normal(0, 0.03, ROWS)
    age = rng.gamma(2.0, 2.0, ROWS)
    weight = rng.normal(18, 6, ROWS).clip(2, 60)
    days = rng.exponential(20, ROWS)
    calm, social = rng.normal(size=ROWS), rng.normal(size=ROWS)
    behaviour = 0.8 * calm + 0.6 * social - 0.1 * age + rng.normal(0, 0.3, ROWS)
    # behaviour drives adoption strongly enough to be learnt from calm/social/age: at 1.2 × behaviour
    # the labels were mostly noise (a logistic regression on these very inputs: F1 0.43, AUC 0.81);
    # about a third are adopted
    logit = 4.0 * behaviour - 0.25 * age - 0.02 * days + 1.5 * (occupancy - 1.0) + 1.0
    adopted = (rng.random(ROWS) < 1 / (1 + np.exp(-logit))).astype(np.float64)
    table = pa.table(
        {
            "site": [f"site-{s}" for s in site],
            "occupancy": occupancy,
            "age": age,
            "weight": weight,
            "days": days,
            "calm": calm,
            "social": social,
            "adopted": adopted,
            "behaviour": behaviour,
        }
    )
    out = Path(__file__).with_name("shelter.parquet")
    pq.write_table(table, out)
    print(f"wrote {out} ({ROWS} rows, {SITES} sites)")
    return out


if __name__ == "__main__":
    main()

"""The export report's comparisons: each variant's stage (fp32 → PTQ → QAT → pruned + QAT), the share
of the PTQ accuracy drop that QAT recovers, and a plot of size and latency against the score.

"Recovered" is torchao's measure of QAT (its QAT docs and README): ``(QAT − PTQ) / (fp32 − PTQ)``,
the PTQ variant quantized the same way from a float-trained run, fp32 that run unquantized, QAT the
QAT-trained run quantized; 100 % = QAT lost nothing, 0 % = no better than PTQ. It is undefined when
PTQ lost nothing (the denominator is 0): ``None`` with the reason. The same formula holds for RMSE
(both differences change sign).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PLOT = "edge-plot.png"
QAT_MATCHES = {"int8": ("dynamic", "static"), "int4w": ("int4w",)}  # the PTQ modes a QAT run trained for


def stage(trained: dict[str, Any], quant: str, prune: str) -> str:
    """What a variant is on the way fp32 → PTQ → QAT → pruned + QAT."""
    qat = trained["qat"] != "none"
    pruned = trained["prune"] != "none" or prune != "none"
    if quant == "none":
        base = "QAT (float)" if qat else "fp32"
    else:
        base = "QAT" if qat and quant in QAT_MATCHES.get(trained["qat"], ()) else "PTQ"
    if not pruned:
        return base
    return "pruned" if base == "fp32" else f"pruned + {base}"


def metric(row: dict[str, Any]) -> str:
    return "accuracy" if "accuracy" in row else "rmse"


def recovered(variants: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each QAT variant, the share of the PTQ drop it recovers against the float-trained run's
    PTQ variant of the same target and quantization (and its fp32 variant)."""
    out: list[dict[str, Any]] = []
    fp32 = next((v for v in variants if v["stage"] == "fp32"), None)
    for v in variants:
        if v["stage"] not in ("QAT", "pruned + QAT"):
            continue
        key = metric(v)
        ptq = next((p for p in variants if p["stage"] == "PTQ" and p["quant"] == v["quant"]), None)
        entry: dict[str, Any] = {"variant": v["variant"], "metric": key, "qat": v[key], "recovered_pct": None}
        if fp32 is None or ptq is None:
            entry["why_none"] = "no float-trained run to compare with: add --compare <float run>"
        else:
            entry |= {"ptq_variant": ptq["variant"], "ptq": ptq[key], "fp32": fp32[key]}
            drop = fp32[key] - ptq[key]
            if drop == 0:
                entry["why_none"] = "PTQ lost nothing on these rows"
            else:
                entry["recovered_pct"] = 100.0 * (v[key] - ptq[key]) / drop
        v["recovered_pct"] = entry["recovered_pct"]
        out.append(entry)
    return out


def write_plot(report: dict[str, Any], path: Path) -> bool:
    """Size and batch-1 p50 latency against the score, one point per variant, as a PNG; False (and
    a log line) when matplotlib is missing or drawing fails: the export never fails for a plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("vatra edge: no plot (matplotlib is not installed: pip install 'vatra[report]')")
        return False
    try:
        variants = report["variants"]
        key = metric(variants[0])
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for ax, x_of, label in (
            (axes[0], lambda v: v["size_mb"], "size (MB)"),
            (axes[1], lambda v: v["latency_ms_batch1"]["p50"], "p50 latency, batch 1, 1 thread (ms)"),
        ):
            for v in variants:
                mark = "*" if v["variant"] == report["chosen"] else "o"
                ax.scatter(x_of(v), v[key], marker=mark, s=90 if mark == "*" else 30)
                name = f"{v['stage']}: {v['variant'].rsplit('/', 1)[-1]}"  # a compared run's: prefixed
                ax.annotate(name, (x_of(v), v[key]), fontsize=7, xytext=(3, 3), textcoords="offset points")
            ax.set_xscale("log")
            ax.set_xlabel(label)
            ax.set_ylabel(f"validation {key}")
            ax.grid(alpha=0.3)
        fig.suptitle(f"vatra edge export --target {report['target']}: {len(variants)} variants (* chosen)")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return True
    except Exception as err:  # a plot is a courtesy: the model and its report are written regardless
        log.warning("vatra edge: the plot was not drawn: %s: %s", type(err).__name__, err)
        return False

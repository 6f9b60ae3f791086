"""``vatra edge export``: a run's model quantized and pruned for a CPU or a phone, each variant measured."""

from __future__ import annotations

import contextlib
import tomllib
from pathlib import Path
from typing import Any

import typer

from vatra.cli.app import app

edge_app = typer.Typer(
    rich_markup_mode=None,
    help="Edge models: int8 quantization, pruning and export measured for CPUs and phones.",
    no_args_is_help=True,
)
app.add_typer(edge_app, name="edge")


@edge_app.command("export")
def export(
    run: Path = typer.Argument(..., help="Run folder (runs/<run-id>)."),
    out: Path = typer.Option(..., "--out", help="Model folder to write (new or empty)."),
    target: str = typer.Option(
        "onnx",
        "--target",
        help="onnx (ONNX Runtime), pt2 (torch.export + torchao), torchscript or executorch.",
    ),
    quant: str | None = typer.Option(
        None,
        "--quant",
        help="Post-training quantization: none, dynamic (int8), static (int8, calibrated) or int4w (int4 "
        "weights, pt2 and executorch); default dynamic (none for torchscript).",
    ),
    prune: str | None = typer.Option(
        None,
        "--prune",
        help="none, magnitude (zeros) or structured (neurons removed); default: what the run pruned in "
        "training (its edge.prune), else none.",
    ),
    sparsity: float | None = typer.Option(
        None,
        "--sparsity",
        help="Fraction of weights or hidden neurons --prune cuts; default: the run's edge.sparsity when "
        "--prune is what it trained with, else 0.5.",
    ),
    max_mb: float | None = typer.Option(
        None,
        "--max-mb",
        help="Try every quantization mode; keep the smallest variant of at most this many MB.",
    ),
    max_ms: float | None = typer.Option(
        None, "--max-ms", help="Try every quantization mode; keep the fastest with a batch-1 p50 within this."
    ),
    batch: int = typer.Option(32, "--batch", help="The second batch size latency is measured at."),
    calls: int = typer.Option(200, "--calls", help="Timed calls per latency figure."),
    version: str | None = typer.Option(
        None, "--version", help="Checkpoint version, tag or unique prefix (default: latest)."
    ),
    compare: list[Path] = typer.Option(
        [],
        "--compare",
        help="Another run on the same data (repeatable; a float run beside a QAT one): its variants are "
        "measured beside, and the report says what QAT recovers of the PTQ drop.",
    ),
) -> None:
    """Write the run's model as a model folder for the target (vatra.load reads it), quantized and
    pruned as asked, with edge-report.json: size, p50/p95 latency at batch 1 on one thread and at
    --batch, and validation score, for fp32 and each variant, the share of the PTQ drop QAT
    recovers, and a plot (edge-plot.png)."""
    from vatra.edge import Recipe, edge_export

    quant = quant or ("none" if target == "torchscript" else "dynamic")
    prune, sparsity = trained_pruning(run, prune, sparsity)
    recipe = Recipe(quant=quant, prune=prune, sparsity=sparsity if prune != "none" else 0.0)
    folder, report = edge_export(
        run,
        out,
        target,
        recipe,
        max_mb=max_mb,
        max_ms=max_ms,
        batch=batch,
        calls=calls,
        version=version,
        compare=compare,
    )
    batched = f"b{batch} ms"
    head = f"{'variant':<30} {'stage':<14} {'MB':>8} {'x fp32':>7} {'p50 ms':>8} {'p95 ms':>8} {batched:>9}"
    print(f"{head}  score")
    for v in report["variants"]:
        print(_row(v, batch, chosen=v["variant"] == report["chosen"]))
    for r in report["recovered"]:
        got = f"{r['recovered_pct']:.0f} %" if r["recovered_pct"] is not None else f"n/a ({r['why_none']})"
        print(f"vatra: QAT {r['variant']} recovers {got} of the PTQ {r['metric']} drop")
    report_file = folder / "edge-report.json"
    plot = f", the plot in {folder / report['plot']}" if report["plot"] else ""
    print(f"vatra: {report['chosen']} ({target}) written to {folder}; the report is in {report_file}{plot}")


def _row(v: dict[str, Any], batch: int, chosen: bool) -> str:
    one, many = v["latency_ms_batch1"], v[f"latency_ms_batch{batch}"]
    metric = f"accuracy {v['accuracy']:.4f}" if "accuracy" in v else f"rmse {v['rmse']:.4g}"
    name = ("* " if chosen else "  ") + v["variant"]
    return (
        f"{name:<30} {v['stage']:<14} {v['size_mb']:>8.3f} {v['size_vs_fp32']:>7.2f} "
        f"{one['p50']:>8.3f} {one['p95']:>8.3f} {many['p50']:>9.3f}  {metric}"
    )


def trained_pruning(run: Path, prune: str | None, sparsity: float | None) -> tuple[str, float]:
    """``--prune`` and ``--sparsity``, each defaulting to what the run pruned in training (``[edge]``
    in its config.toml): a run whose neurons were cut in training exports with them removed
    without the flags repeated. A run folder without a readable config gives none / 0.5."""
    trained: dict[str, Any] = {}
    with contextlib.suppress(OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        edge = tomllib.loads((run / "config.toml").read_text()).get("edge")
        trained = edge if isinstance(edge, dict) else {}
    if prune is None:
        prune = str(trained.get("prune", "none"))
    if sparsity is None:
        said = trained.get("sparsity")
        same = trained.get("prune") == prune and isinstance(said, int | float)
        sparsity = float(said) if same else 0.5  # type: ignore[arg-type]
    return prune, sparsity
